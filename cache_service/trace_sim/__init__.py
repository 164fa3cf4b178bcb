"""Trace-driven cluster simulation: replays a Mooncake-format trace in simulated time through
R replicas, each with a real `LocalPrefixCache` (block pools, eviction, retention, junctions),
routed by the real `GlobalIndex` + `Router`, with a simple prefill/decode cost model.

    trace.py     Mooncake JSONL -> requests; deterministic tokens per hash id; scaled slices
    hashing.py   block hashes of trace requests, memoised per (parent hash, block id)
    config.py    layouts (group specs + page bytes) and cost models from configs/sim/*.yaml
    calibrate.py a cost model from a bench.engine report
    replica.py   one simulated replica: its cache (and host tier) and its event feed into the global index
    prefill_queue.py  a replica's compute in simulated time and the load it reports
    policies.py  routing policies (the real Router plus power_of_two, Ray Serve affinity, oracle)
    engine.py    the simulated-time loop and per-request records
    step_timeline.py  the stepped decode model: a replica's steps (decodes + prefill chunks), ITLs
    pd_split.py  prefill/decode roles: the split, hand-off bytes, the decode replica's choice
    stepped_engine.py the loop under the stepped model (mixed or split), records at the end
    summary.py   the summary JSON of one run
    plots.py     hit rate, TTFT CDF and memory split per policy
    cli.py       `hybridserve simulate`
"""
