"""A cost model calibrated from a `python -m bench.engine` report (its JSON on stdout):

    python -m bench.engine > runs/bench-engine.json
    python -m cache_service.trace_sim.calibrate runs/bench-engine.json --name cpu   # prints a YAML entry

From the identical-resend measurement (cold TTFT of P prompt tokens, warm TTFT with h of them hit)
    cold = overhead + P / rate,  warm = overhead + (P - h) / rate
so rate = h / (cold - warm) and overhead = cold - P / rate (at least 0); decode_step_s is one
token of greedy decode with MTP k=3 (the speculation the shipped configs run). Transfers are not
in bench.engine: `--transfer-bytes-per-s` (README: streamed transfer 3.4 GB/s on loopback gloo).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class CalibrationError(ValueError):
    """The bench.engine report lacks a field or its numbers cannot give a cost model."""


def cost_from_bench(report: dict, transfer_bytes_per_s: float) -> dict:
    try:
        resend, decode = report["resend"], report["decode"]
        prompt, hit = int(resend["prompt_len"]), int(resend["hit_tokens"])
        cold, warm = float(resend["cold_ttft_s"]), float(resend["warm_ttft_s"])
        k = int(resend.get("num_spec_tokens", 3))
        decode_tps = float(decode.get(f"mtp_k{k}_tokens_per_s") or decode["no_spec_tokens_per_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CalibrationError(f"not a bench.engine report: {exc!r}") from None
    if hit <= 0 or cold <= warm or decode_tps <= 0:
        raise CalibrationError(f"cannot calibrate from hit={hit}, cold={cold}, warm={warm}, decode={decode_tps}")
    rate = hit / (cold - warm)
    return {"prefill_tokens_per_s": round(rate, 1), "prefill_overhead_s": round(max(0.0, cold - prompt / rate), 4),
            "decode_step_s": round(1.0 / decode_tps, 5), "transfer_bytes_per_s": transfer_bytes_per_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cache_service.trace_sim.calibrate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="bench.engine JSON")
    p.add_argument("--name", default="cpu")
    p.add_argument("--transfer-bytes-per-s", type=float, default=3.4e9)
    args = p.parse_args(argv)
    try:
        report = json.loads(Path(args.report).read_text())
        cost = cost_from_bench(report, args.transfer_bytes_per_s)
    except (OSError, json.JSONDecodeError, CalibrationError) as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    print(f"{args.name}:")
    for key, value in cost.items():
        print(f"  {key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
