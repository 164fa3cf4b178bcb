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
