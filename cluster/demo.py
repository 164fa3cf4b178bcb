"""`make demo`: what exists so far, end to end on this machine.

Today: the cache core's answer to the seed bug (DESIGN.md section 1), as a table built by the
same simulation `hybridserve explain` runs, the lookup benchmark, and the single-replica engine
on the bundled tiny model (random weights): cold vs warm TTFT on an identical resend. Later
issues grow this into the served cluster and the warm-vs-cold load test.
"""

from __future__ import annotations

import json
import sys

from bench.lookup import DEFAULT_GROUPS, measure
from cache_service.coordinator import EagleMode
from cache_service.explain import explain
from cache_service.simulate import Scenario
from cache_service.specs import parse_group_spec

GLM = ["full:64", "mamba:2304", "mamba:2304", "mamba:2304"]
NATIVE = ["full:64", "mamba:64", "mamba:64", "mamba:64"]

ROWS = [
    ("seed bug: vLLM before the fix", GLM, EagleMode.DROP, False),
    ("vLLM after the fix (drop + unit-below retention)", GLM, EagleMode.DROP, True),
    ("hybridserve lossless EAGLE, seed layout", GLM, EagleMode.LOSSLESS, True),
    ("hybridserve lossless EAGLE, native 64-token layout", NATIVE, EagleMode.LOSSLESS, True),
]


def main(argv: list[str] | None = None) -> int:
    print("Identical 8,901-token resend, MTP k=3, latest-only retention\n")
    print(f"{'configuration':<52} {'per-group hits':<28} {'hit':>6}")
    for label, groups, eagle, aware in ROWS:
        scenario = Scenario(
            groups=tuple(parse_group_spec(g) for g in groups), prompt_len=8901, eagle=eagle,
            num_spec_tokens=3, eagle_aware_retention=aware,
        )
        report = explain(scenario)
        print(f"{label:<52} {str(report['per_group_hits']):<28} {report['hit_tokens']:>6}")
    print("\nLookup benchmark (hash + reconciled lookup, 32K tokens, 4 groups):")
    print(json.dumps(measure(DEFAULT_GROUPS, 32_768, EagleMode.DROP, "latest", 100), indent=2))
    print("\nEngine: identical 2,048-token resend on the tiny model (MTP k=3, lossless EAGLE):")
    import tempfile

    from bench.engine import measure_ttft
    from workers.model.init_model import main as init_model
    from workers.model.loader import load_model

    with tempfile.TemporaryDirectory(prefix="hybridserve-demo-") as model_dir:
        init_model(["--config", "configs/models/tiny-nemotron-h.yaml", "--out", model_dir])
        model = load_model(model_dir)
        print(json.dumps(measure_ttft(model, 2048, 1, "lossless", 3, 4096), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
