import json

from bench.engine import main


def test_engine_benchmark_small(tiny_dir, capsys):
    assert main(["--model", tiny_dir, "--prompt-len", "600", "--repeats", "1", "--decode-tokens", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["resend"]["hit_tokens"] == 576
    assert report["resend"]["warm_equals_cold"] is True
    assert report["resend"]["warm_ttft_s"] < report["resend"]["cold_ttft_s"]
    assert report["decode"]["outputs_equal"] is True
