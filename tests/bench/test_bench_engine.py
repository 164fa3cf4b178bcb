import json
from pathlib import Path

import pytest

from bench.engine import main

TRAINED = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny-trained"


def test_engine_benchmark_small(tiny_dir, capsys):
    assert main(["--model", tiny_dir, "--prompt-len", "600", "--repeats", "1", "--decode-tokens", "8",
                 "--decode-prompts", "1", "--decode-repeats", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["resend"]["hit_tokens"] == 576
    assert report["resend"]["warm_equals_cold"] is True
    assert report["resend"]["warm_ttft_s"] > 0 and report["resend"]["cold_ttft_s"] > 0  # ratios: README, not CI
    assert report["decode"]["outputs_equal"] is True


@pytest.mark.skipif(not (TRAINED / "model.safetensors").exists(), reason="no shipped checkpoint")
def test_engine_benchmark_trained_speculation_is_real(capsys):
    """On the shipped checkpoint the MTP drafts are accepted (random weights: ~0) and outputs stay equal."""
    assert main(["--model", str(TRAINED), "--prompt-len", "128", "--repeats", "1", "--decode-tokens", "32",
                 "--decode-prompts", "2", "--decode-repeats", "1"]) == 0
    decode = json.loads(capsys.readouterr().out)["decode"]
    assert decode["outputs_equal"] is True
    assert decode["mtp_acceptance"] >= 0.3


def test_engine_benchmark_concurrency_small(tiny_dir, capsys):
    """--concurrency: one report per level, ratios against the first, outputs independent of batching."""
    assert main(["--model", tiny_dir, "--concurrency", "1,3", "--decode-tokens", "6", "--decode-prompt-len", "40",
                 "--decode-repeats", "1", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch_threads"] == 1 and "resend" not in report
    levels = report["concurrency"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    assert levels[0]["ratio_vs_1"] == 1.0 and levels[1]["output_tokens_per_s"] > 0  # speed: README, not CI
    assert report["concurrency"]["outputs_equal_across_levels"] is True


def test_engine_benchmark_rejects_bad_levels(tiny_dir):
    with pytest.raises(SystemExit):
        main(["--model", tiny_dir, "--concurrency", "1,x"])
    with pytest.raises(SystemExit):
        main(["--model", tiny_dir, "--concurrency", "0,4"])
