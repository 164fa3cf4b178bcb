"""The CPU cost model derived from a bench.engine report."""

import json

import pytest


def test_cost_model_calibrated_from_a_bench_engine_report(tmp_path, capsys):
    from cache_service.trace_sim.calibrate import CalibrationError, cost_from_bench, main

    # cold 2048 tokens in 1.05 s, warm hits 1984 of them in 0.058 s: rate = 1984 / 0.992 = 2000
    # tokens/s, overhead = 1.05 - 2048 / 2000 = 0.026 s; MTP decode 500 tok/s -> 2 ms per token
    report = {"resend": {"prompt_len": 2048, "hit_tokens": 1984, "cold_ttft_s": 1.05, "warm_ttft_s": 0.058,
                         "num_spec_tokens": 3},
              "decode": {"no_spec_tokens_per_s": 400.0, "mtp_k3_tokens_per_s": 500.0}}
    assert cost_from_bench(report, 1e9) == {"prefill_tokens_per_s": 2000.0, "prefill_overhead_s": 0.026,
                                            "decode_step_s": 0.002, "transfer_bytes_per_s": 1e9}
    with pytest.raises(CalibrationError):
        cost_from_bench({"resend": {}}, 1e9)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    assert main([str(path), "--name", "cpu-test"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == ["cpu-test:", "  prefill_tokens_per_s: 2000.0"]
