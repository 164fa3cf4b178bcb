"""`hybridserve explain` end to end through the console script and `python -m cache_service`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.explain import main

GLM = ["--group", "full:64"] + ["--group", "mamba:2304"] * 3


def run_cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_glm_seed_table(capsys):
    """The README's seed table: seed bug 0, seed fix 4,608, lookahead drop 6,912, lossless 6,912,
    native layout 8,896."""
    drop = GLM + ["--eagle", "drop", "--prompt-len", "8901", "--num-spec-tokens", "3"]
    rows = {
        "seed bug": (drop + ["--drop-rule", "alignment", "--no-eagle-aware-retention"], 0),
        "seed fix": (drop + ["--drop-rule", "alignment"], 4608),
        "lookahead drop": (drop, 6912),
        "lossless": (GLM + ["--eagle", "lossless", "--prompt-len", "8901"], 6912),
        "native": (["--group", "full:64"] + ["--group", "mamba:64"] * 3 + ["--eagle", "lossless", "--prompt-len",
                                                                          "8901"], 8896),
    }
    for name, (args, expected) in rows.items():
        code, out, _ = run_cli(args, capsys)
        assert code == 0 and json.loads(out)["hit_tokens"] == expected, name
    code, out, _ = run_cli(drop + ["--drop-rule", "alignment"], capsys)
    assert json.loads(out)["per_group_hits"] == [4608, 6912, 6912, 6912]


def test_verbose_says_why_each_group_stopped(capsys):
    args = GLM + ["--eagle", "drop", "--drop-rule", "alignment", "--prompt-len", "8901",
                  "--no-eagle-aware-retention", "--verbose"]
    code, out, err = run_cli(args, capsys)
    report = json.loads(out)
    assert report["hit_tokens"] == 0
    assert len(report["explanation"]) == 6  # a line per group, the reconciliation, the miss reason
    assert report["explanation"][5].startswith("reason: eagle_drop: without the EAGLE drop the hit would be 6912")
    assert "EAGLE drop (alignment rule) removes one alignment unit" in report["explanation"][0]
    assert "snapshots held at <= cap: [6912]" in report["explanation"][1]
    assert "candidates 6912 -> 0" in err


def test_verbose_names_the_lookahead_block(capsys):
    code, out, err = run_cli(GLM + ["--eagle", "drop", "--prompt-len", "8901", "--verbose"], capsys)
    report = json.loads(out)
    assert report["hit_tokens"] == 6912 and report["drop_rule"] == "lookahead"
    assert report["lookahead_blocks"] == {"0": [6912, 6976]}
    assert "lookahead block [6912, 6976) cached -> 6912" in report["explanation"][0]
    # 127 tokens at block 32: the block [96, 128) would run past the prompt
    args = ["--group", "full:32", "--group", "mamba:32", "--eagle", "drop", "--prompt-len", "127", "--verbose"]
    code, out, _ = run_cli(args, capsys)
    report = json.loads(out)
    assert report["hit_tokens"] == 64 and report["lookahead_blocks"] == {"0": [64, 96]}
    assert "lookahead block [96, 128) runs past the prompt's full blocks" in report["explanation"][0]
    # computed vs cached: the cold request computes all 127, the resend the 127 - 64 past its hit
    assert report["cold"]["num_computed_prompt_tokens"] == 127
    assert (report["num_cached_tokens"], report["num_computed_prompt_tokens"]) == (64, 63)


def test_extended_resend_and_draft_groups(capsys):
    args = ["--group", "full:32", "--group", "draft:32", "--group", "mamba:32", "--eagle", "drop",
            "--draft-groups", "0", "--prompt-len", "127", "--resend-len", "300"]
    code, out, _ = run_cli(args, capsys)
    report = json.loads(out)
    assert report["dropping_groups"] == [0, 1] and report["annotated_groups"] == [0, 1]
    assert report["hit_tokens"] == 64  # F = 96 is one unit above what the dropping lookup reaches


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-len", "10"], "at least one --group"),
        (["--group", "fll:64", "--prompt-len", "10"], "unknown group kind"),
        (["--group", "full:abc", "--prompt-len", "10"], "must be integers"),
        (["--group", "full:0", "--prompt-len", "10"], "positive integer"),
        (["--group", "sliding_window:16", "--prompt-len", "10"], "sliding_window:BLOCK:WINDOW"),
        (["--group", "full:64", "--eagle", "maybe", "--prompt-len", "10"], "--eagle must be"),
        (["--group", "full:64", "--drop-rule", "maybe", "--prompt-len", "10"], "--drop-rule must be"),
        (["--group", "full:64", "--draft-groups", "3", "--prompt-len", "10"], "out of range"),
        (["--group", "full:64", "--retention", "100", "--prompt-len", "10"], "multiple of the alignment"),
        (["--group", "full:64", "--prompt-len", "0"], "--prompt-len must be >= 1"),
        (["--group", "full:64", "--prompt-len", "x"], "must be an integer"),
        (["--group", "full:64", "--eagle", "drop", "--num-spec-tokens", "0", "--prompt-len", "9"], "needs"),
        (["--group", "full:64"], "required"),
        (["--group", "full:64", "--prompt-len", "9", "--bogus"], "unrecognized"),
    ],
)
def test_bad_values_give_one_line_and_exit_2(args, message, capsys):
    code, out, err = run_cli(args, capsys)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_console_script_and_module_entry_points():
    args = ["explain", "--group", "full:32", "--group", "mamba:32", "--eagle", "drop", "--prompt-len", "127"]
    console_script = str(Path(sys.executable).parent / "hybridserve")
    for cmd in ([console_script], [sys.executable, "-m", "cache_service"]):
        done = subprocess.run(cmd + args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["hit_tokens"] == 64
    bad = subprocess.run([console_script, "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown command" in bad.stderr
