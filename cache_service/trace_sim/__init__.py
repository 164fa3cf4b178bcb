"""Trace-driven cluster simulation: replays a Mooncake-format trace in simulated time through
R replicas, each with a real `LocalPrefixCache` (block pools, eviction, retention, junctions),
routed by the real `GlobalIndex` + `Router`, with a simple prefill/decode cost model.

    trace.py     Mooncake JSONL -> requests; deterministic tokens per hash id
    config.py    layouts (group specs + page bytes) and cost models from configs/sim/*.yaml
    replica.py   one simulated replica: its cache, its event feed, its prefill queue
    policies.py  routing policies (the real Router plus power_of_two, Ray Serve affinity, oracle)
    engine.py    the simulated-time loop, per-request records and the summary
    cli.py       `hybridserve simulate`
"""
