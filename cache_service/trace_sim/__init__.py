"""Trace-driven cluster simulation: replays a Mooncake-format trace in simulated time through
R replicas, each with a real `LocalPrefixCache` (block pools, eviction, retention, junctions),
routed by the real `GlobalIndex` + `Router`, with a simple prefill/decode cost model.

    trace.py     Mooncake JSONL -> requests; deterministic tokens per hash id
    config.py    layouts (group specs + page bytes) and cost models from configs/sim/*.yaml
    replica.py   one simulated replica: its cache, its event feed, its prefill queue
    policies.py  routing policies (the real Router plus power_of_two, Ray Serve affinity, oracle)
    engine.py    the simulated-time loop and per-request records
    summary.py   the summary JSON of one run
    value_retention.py  byte-budgeted retention by expected value (value:BYTES)
    plots.py     hit rate, TTFT CDF and memory split per policy
    cli.py       `hybridserve simulate`
"""
