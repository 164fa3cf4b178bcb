"""`hybridserve loadtest`: seeded workloads over HTTP, TTFT cold vs warm, hit rates, variant comparisons.

    workloads.py  WorkloadConfig -> Workload (RequestSpecs: resend, chat, tenants, mixed)
    client.py     run_workload(url, config) -> LoadTestResult (streaming, bounded concurrency)
    prometheus.py /metrics counters diffed over a run
    report.py     percentiles, WorkloadSummary, the printed table
    outputs.py    records.parquet and loadtest.png
    server.py     spawn_server(config, overrides): a `cluster.serve` subprocess on a free port
    compare.py    variants (policy / EAGLE / retention), run_compare, ratio table
    __main__.py   the CLI
"""

from cluster.loadtest.client import ServerUnreachableError, run_workload
from cluster.loadtest.compare import Variant, make_variants, run_compare
from cluster.loadtest.records import LoadTestResult, RequestRecord
from cluster.loadtest.report import WorkloadSummary, summarize
from cluster.loadtest.server import ServerStartError, spawn_server
from cluster.loadtest.workloads import WorkloadConfig, build_workload

__all__ = [
    "LoadTestResult", "RequestRecord", "ServerStartError", "ServerUnreachableError", "Variant", "WorkloadConfig",
    "WorkloadSummary", "build_workload", "make_variants", "run_compare", "run_workload", "spawn_server", "summarize",
]


def main(argv: list[str] | None = None) -> int:
    from cluster.loadtest.__main__ import main as cli_main

    return cli_main(argv)
