"""`python -m bench.chaos --minutes M`: a chaos soak over the multi-host bed (`bench.netbed`).

A 3-host bed; the cluster (2 replicas spread over the hosts, controller and cache service on
host 0), front door A in a driver inside host 0 and front door B beside it (`bench.chaos_driver`);
steady greedy traffic over HTTP from a few clients that retry on the other front door as a
client behind a load balancer would (`bench.chaos_traffic`). A seeded schedule injects one fault
at a time, waits until the cluster is clean again (every replica serving, the index equal to the
replicas' caches, both doors answering), lets traffic run a few quiet seconds, then the next:

    kill_replica, kill_cache_service, kill_controller, kill_frontdoor,    (from the driver)
    drop_events, reorder_events, corrupt_transfer
    slow_link        a replica's host link cut to 8 Mbit/s (tbf) for 15 s     (from the bed)
    node_loss        every process of a replica's host (not the head) killed; the host's Ray
                     node started again once the cluster has replaced the replica
    gcs_restart      the head's GCS process killed and started again 4 s later; its tables are
                     in a redis-server on host 0 (GCS fault tolerance, `bench.netbed_gcs`)
    kill_tp_rank     rank 1 of a TP=2 replica killed: run last, on a second cluster of TP=2
                     replicas (their pages do not move between replicas yet)

Each round runs every fault once in a seeded order; rounds repeat until M minutes have passed
(at least one round); then kill_tp_rank once on the TP=2 cluster. Report per fault: requests
that started while it was in force, completed, finished after a retry, lost, outputs differing
from cold, seconds to a clean cluster; a JSON report, availability per second as Parquet and a
plot under `--out`. Exit 1 on any loss, difference or fault not recovered; 2 when no bed can be
made here (with the reason).
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.chaos_driver import DRIVER_FAULTS
from bench.chaos_report import FaultWindow, availability, by_fault, format_table, score, write_outputs
from bench.netbed_driver import BedDriver
from bench.reports import default_report

TINY_TRAINED = str(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny-trained")
BED_FAULTS = ("slow_link", "node_loss", "gcs_restart")
FAULTS = DRIVER_FAULTS + BED_FAULTS
TP_FAULTS = ("kill_tp_rank",)  # run on a second cluster, of TP=2 replicas
SLOW_LINK_BIT, SLOW_LINK_S = 8_000_000, 15.0
GCS_DOWN_S = 4.0  # the GCS is away this long before it is started again (a pod restart is seconds)
REDIS_PORT = 6390
ANSWER_TIMEOUT_S = 600.0  # the driver answers every command within this (cluster start, recover, stop)


class Soak:
    def __init__(self, bed, model_dir: str, seed: int, concurrency: int, tp_size: int, log_path: Path) -> None:
        self.bed = bed
        argv = [sys.executable, "-m", "bench.chaos_driver", bed.head_address, bed.hosts[0].address, model_dir,
                str(seed), str(concurrency), str(tp_size)]
        self._log = open(log_path, "w+")
        proc = bed.popen_in(0, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.driver = BedDriver(proc, self._log, timeout_s=ANSWER_TIMEOUT_S)
        self.ready = self.driver.read()

    def ask(self, **cmd) -> dict:
        return self.driver.ask(**cmd)

    def replica_hosts(self) -> dict[str, str]:
        return self.ask(cmd="where")["replicas"]

    def inject(self, name: str, rng: random.Random) -> dict:
        """Inject `name`; returns {"fired": time, ...detail}."""
        if name in DRIVER_FAULTS:
            return self.ask(cmd="fault", name=name)
        by_address = {h.address: h for h in self.bed.hosts}
        hosts = sorted({by_address[a].index for a in self.replica_hosts().values() if a in by_address})
        if name == "slow_link":
            host = hosts[rng.randrange(len(hosts))]
            fired = time.time()
            self.bed.slow_link(host, SLOW_LINK_BIT)
            time.sleep(SLOW_LINK_S)
            self.bed.restore_link(host)
            return {"fired": fired, "host": host}
        if name == "node_loss":
            workers = [h for h in hosts if h != 0] or [h for h in range(1, len(self.bed.hosts))]
            host = workers[rng.randrange(len(workers))]
            fired = time.time()
            kill_host(self.bed, host)
            return {"fired": fired, "host": host, "rejoin": host}
        if name == "gcs_restart":  # the head's GCS killed, started again from its tables in Redis
            fired = time.time()
            killed = self.bed.kill_gcs()
            time.sleep(GCS_DOWN_S)
            self.bed.restart_gcs(killed)
            return {"fired": fired, "down_s": GCS_DOWN_S}
        raise ValueError(f"unknown fault {name!r}")

    def stop(self) -> dict:
        out = self.ask(cmd="stop")
        self.driver.proc.wait(timeout=120)
        return out

    def close(self) -> None:
        if self.driver.proc.poll() is None:
            self.driver.proc.kill()
            self.driver.proc.wait()
        self._log.close()


def kill_host(bed, host: int) -> None:
    """Every process of the host's namespace killed (its Ray node, its replicas' workers)."""
    from bench import netbed_net

    netbed_net.kill_netns_processes(bed.hosts[host].netns)


def rejoin_host(bed, host: int, timeout_s: float = 90.0) -> None:
    """The host's Ray node started again (a rebooted machine rejoining the cluster)."""
    h = bed.hosts[host]
    deadline = time.monotonic() + timeout_s
    bed._await_start(h, bed._ray_start(h, head=False), deadline)
    bed.wait_for_nodes(len(bed.hosts), deadline)


COUNTED = ("retries", "replica_deaths", "replica_restarts", "transfer_failures", "service_resyncs",
           "transfers_skipped_slow_link")


def _deltas(before: dict, after: dict) -> dict:
    """Front door A's counts that moved during a window (its own retries onto another replica...)."""
    return {k: after[k] - before.get(k, 0) for k in COUNTED if k in after and after[k] != before.get(k, 0)}


def schedule(faults: list[str], seed: int, round_index: int) -> list[str]:
    order = list(faults)
    random.Random(seed * 7919 + round_index).shuffle(order)
    return order


def run(minutes: float, faults: list[str], seed: int, concurrency: int, model_dir: str, out_dir: Path,
        gap_s: float, recover_timeout_s: float) -> int:
    """The soak: TP=1 replicas for every fault but kill_tp_rank over `minutes`, then (when asked) a
    cluster of TP=2 replicas for one kill_tp_rank (pages of TP > 1 replicas do not move yet, so the
    transfer faults need TP=1)."""
    from bench.netbed import BedError, BedSpec, NetBed, unavailable_reason
    from bench.netbed_gcs import redis_reason

    if reason := unavailable_reason():
        print(f"bench.chaos: no multi-host bed here: {reason}", file=sys.stderr)
        return 2
    if "gcs_restart" in faults and (reason := redis_reason()):
        print(f"bench.chaos: gcs_restart needs Redis: {reason} (or leave gcs_restart out of --faults)",
              file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    windows: list[FaultWindow] = []
    records: list[dict] = []
    counters: dict = {}
    phases = [(1, [f for f in faults if f not in TP_FAULTS], minutes),
              (2, [f for f in faults if f in TP_FAULTS], 0.0)]
    try:
        bed = NetBed(BedSpec(num_hosts=3, redis_port=REDIS_PORT if "gcs_restart" in faults else None)).up()
    except BedError as exc:
        print(f"bench.chaos: {exc}", file=sys.stderr)
        return 2
    t_start = time.time()
    try:
        for tp_size, names, phase_minutes in phases:
            if names:
                result = _phase(bed, names, phase_minutes, tp_size, seed, concurrency, model_dir, out_dir, gap_s,
                                recover_timeout_s, rng, windows, t_start)
                records += result["records"]
                counters = {k: counters.get(k, 0) + v for k, v in result["counters"].items()
                            if isinstance(v, int | float)}
        t_end = time.time()
    finally:
        bed.down()
    left = bed.leftovers()  # namespaces, veths, the bridge, processes, the bed's folder
    totals = score(windows, records, t_end)
    print(format_table(windows, t_start))
    print(f"all requests: {totals}")
    report = {"minutes": minutes, "seed": seed, "concurrency": concurrency, "faults": faults, "totals": totals,
              "by_fault": by_fault(windows), "counters": counters, "wall_s": round(t_end - t_start, 1),
              "bed_leftovers": left}
    write_outputs(out_dir, report, availability(records, windows, t_start, t_end), windows, t_start)
    print(f"report: {out_dir}/chaos.json, availability.parquet, availability.png")
    if left:
        print(f"the bed left behind: {', '.join(left)}", file=sys.stderr)
    ok = totals["lost"] == 0 and totals["differing"] == 0 and all(w.ok for w in windows) and not left
    return 0 if ok else 1


def _phase(bed, faults: list[str], minutes: float, tp_size: int, seed: int, concurrency: int, model_dir: str,
           out_dir: Path, gap_s: float, recover_timeout_s: float, rng: random.Random, windows: list[FaultWindow],
           t0: float) -> dict:
    """One cluster (replicas of `tp_size`) under traffic; rounds of `faults` until `minutes` have
    passed (at least one round); its windows appended to `windows`. The driver's records and counters."""
    soak = Soak(bed, model_dir, seed, concurrency, tp_size, out_dir / f"driver_tp{tp_size}.log")
    try:
        print(f"cluster up (tp_size {tp_size}): replicas {soak.ready['replicas']}; traffic running", flush=True)
        t_phase = time.time()
        counters = soak.ready["counters"]
        time.sleep(gap_s)
        round_index = 0
        while round_index == 0 or time.time() - t_phase < minutes * 60:
            for name in schedule(faults, seed, round_index):
                if round_index > 0 and time.time() - t_phase >= minutes * 60:
                    break
                detail = soak.inject(name, rng)
                w = FaultWindow(name, detail.pop("fired"), detail={"tp_size": tp_size, **detail})
                windows.append(w)
                rejoin = w.detail.pop("rejoin", None)
                recovered = soak.ask(cmd="recover", timeout_s=recover_timeout_s)
                w.recovery_s = recovered.get("recovered")
                if w.detail.pop("not_fired", False):
                    w.recovery_s, recovered["problems"] = None, ["the fault never took effect"]
                w.detail.update(_deltas(counters, recovered["counters"]))
                counters = recovered["counters"]
                if w.recovery_s is None:
                    w.detail["problems"] = recovered.get("problems")
                if rejoin is not None:  # the lost host comes back once the cluster has recovered without it
                    rejoin_host(bed, rejoin)
                print(f"{time.time() - t0:7.1f}s  {name:<20} recovered in "
                      f"{'never' if w.recovery_s is None else f'{w.recovery_s:.1f} s'}", flush=True)
                time.sleep(gap_s)
            round_index += 1
        result = soak.stop()
        if windows:
            windows[-1].until = time.time()  # the phase's traffic ends here, not at the next phase's fault
        return result
    finally:
        soak.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="soak length (at least one round of every fault)")
    p.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=2, help="client threads")
    p.add_argument("--gap-s", type=float, default=5.0, help="quiet seconds after each recovery")
    p.add_argument("--recover-timeout-s", type=float, default=120.0)
    p.add_argument("--model", default=TINY_TRAINED)
    p.add_argument("--out", default=None, help="report folder (default: under out/)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the bed's teardown
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown or not faults:
        p.error(f"unknown fault(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(FAULTS)}")
    if args.minutes <= 0 or args.concurrency < 1:
        p.error("--minutes must be > 0 and --concurrency >= 1")
    out = Path(args.out or str(Path(default_report("chaos")).with_suffix("")))
    return run(args.minutes, faults, args.seed, args.concurrency, args.model, out, args.gap_s,
               args.recover_timeout_s)


if __name__ == "__main__":
    sys.exit(main())
