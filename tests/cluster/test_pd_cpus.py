"""Pinning P/D replicas to CPUs (`cluster.pd.prefill_cpus` / `decode_cpus`, `workers/cpu_affinity.py`)
and the control plane away from them (`cluster.control_cpus`, `replica_cpus`): the CPU-list syntax,
the config's errors, pinning every thread of a process (a spawned one here), the serving process
moving before it starts Ray, the load test's flags; the Ray paths are tests/cluster/test_pd_ray.py
and (the control plane) tests/cluster/test_loadtest.py."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from cluster.config import ConfigError
from cluster.config_loader import load_config
from cluster.loadtest.__main__ import _parser as build_parser
from cluster.loadtest.compare import make_variants
from workers.cpu_affinity import CpuListError, parse_cpu_list, pin_this_process


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpu_list("0") == (0,) and parse_cpu_list(3) == (3,)
    assert parse_cpu_list("0-3,8, 5") == (0, 1, 2, 3, 5, 8)
    for bad in ("", "a", "3-1", "-1", "1,,2", "0-"):
        with pytest.raises(CpuListError, match="not a CPU list"):
            parse_cpu_list(bad)


def _load(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(path)


def test_pd_cpus_in_the_config(tmp_path):
    # catches: a CPU list accepted unparsed (the replica would fail at start), pinning keys taken
    # without pd (nothing to pin them to), a plain int refused (YAML reads `0` as one)
    pd = "cluster:\n  num_replicas: 2\n  pd:\n    num_prefill: 1\n    num_decode: 1\n"
    config = _load(tmp_path, pd + "    prefill_cpus: 0\n    decode_cpus: '1-2'\n").cluster.pd
    assert (config.cpus("prefill"), config.cpus("decode"), config.cpus("mixed")) == ((0,), (1, 2), None)
    assert _load(tmp_path, pd).cluster.pd.cpus("decode") is None
    with pytest.raises(ConfigError, match="cluster.pd: decode_cpus: not a CPU list: '1-x'"):
        _load(tmp_path, pd + "    decode_cpus: '1-x'\n")
    with pytest.raises(ConfigError, match="prefill_cpus=0 needs num_prefill and num_decode"):
        _load(tmp_path, "cluster:\n  pd:\n    prefill_cpus: '0'\n")


def _child(cpus, out) -> None:
    started = threading.Event()
    thread = threading.Thread(target=started.wait, daemon=True)  # a thread that exists before the pin
    thread.start()
    try:
        pinned = pin_this_process(cpus)
        tasks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
        out.put(("ok", pinned, sorted({tuple(sorted(v)) for v in tasks.values()}), len(tasks)))
    except CpuListError as exc:
        out.put(("error", str(exc)))
    started.set()


def _in_child(target, *args):
    """What `target(*args, out)` puts, run in a spawned process (pinning it leaves pytest's alone)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    got = out.get(timeout=60)
    proc.join(timeout=30)
    return got


def _pin_in_child(cpus):
    return _in_child(_child, cpus)


def test_every_thread_of_the_process_is_pinned():
    # catches: only the main thread pinned (Linux affinity is per thread: the engine loop, a thread,
    # would keep running anywhere), and CPUs the host does not have accepted silently
    cpu = min(os.sched_getaffinity(0))
    status, pinned, sets, num_threads = _pin_in_child((cpu,))
    assert status == "ok" and pinned == (cpu,) and num_threads >= 2 and sets == [(cpu,)]
    status, message = _pin_in_child((4096,))
    assert status == "error" and "4096" in message


def test_the_load_test_pins_only_the_split():
    # catches: the flag's lists landing on the mixed baseline too (pd keys without pd: refused)
    args = build_parser().parse_args(["interference", "--compare", "--axes", "pd", "--pd", "1:1", "--pd-cpus", "0:1"])
    assert args.pd_cpus == ("0", "1")
    base, split = make_variants(args.config, (), ("pd",), pd=args.pd, pd_cpus=args.pd_cpus)
    assert not any("cpus" in o for o in base.overrides)
    assert "cluster.pd.prefill_cpus='0'" in split.overrides and split.name.endswith("pd1:1@0:1")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["interference", "--pd-cpus", "0-x:1"])


def test_control_and_replica_cpus_in_the_config(tmp_path):
    # catches: a list accepted unparsed, a role list not taking precedence over replica_cpus (a
    # decoder placed with the mixed replicas), replica_cpus accepted where no replica exists
    pd = "cluster:\n  num_replicas: 2\n  replica_cpus: '0-1'\n  control_cpus: 0\n  pd:\n    num_prefill: 1\n" \
         "    num_decode: 1\n    decode_cpus: '1'\n"
    c = _load(tmp_path, pd).cluster
    assert c.control_cpu_list == (0,)
    assert [c.replica_cpu_list(r) for r in ("decode", "prefill", "mixed")] == [(1,), (0, 1), (0, 1)]
    plain = _load(tmp_path, "cluster:\n  num_replicas: 2\n").cluster
    assert plain.control_cpu_list is None and plain.replica_cpu_list("mixed") is None
    with pytest.raises(ConfigError, match="cluster.control_cpus: not a CPU list: '0-x'"):
        _load(tmp_path, "cluster:\n  control_cpus: '0-x'\n")
    with pytest.raises(ConfigError, match="cluster.replica_cpus needs cluster.backend ray"):
        _load(tmp_path, "cluster:\n  backend: inprocess\n  replica_cpus: '0'\n")


def _move_in_child(control: str, replica: str | None, out) -> None:
    from cluster.config import ClusterConfig, ConfigError
    from cluster.serve import move_control

    before = tuple(sorted(os.sched_getaffinity(0)))
    try:
        moved = move_control(ClusterConfig(name=None, control_cpus=control, replica_cpus=replica))
        out.put(("ok", before, tuple(sorted(os.sched_getaffinity(0))), moved.replica_cpu_list("mixed")))
    except ConfigError as exc:
        out.put(("error", str(exc)))


def _move(control: str, replica: str | None = None):
    return _in_child(_move_in_child, control, replica)


def test_the_serving_process_moves_and_replicas_stay_where_it_was():
    # catches: the process not pinned (Ray started after it would run anywhere), replicas left to
    # inherit the control CPUs, a replica_cpus the operator gave overwritten, a CPU the host lacks
    # accepted (or a traceback instead of the key's error); the Ray path: tests/cluster/test_loadtest.py
    cpu = min(os.sched_getaffinity(0))
    status, before, after, replicas = _move(str(cpu))
    assert status == "ok" and after == (cpu,) and replicas == before
    assert _move(str(cpu), str(cpu))[3] == (cpu,)
    status, message = _move("4096")
    assert status == "error" and message.startswith("cluster.control_cpus:") and "4096" in message


class _Spawning(Exception):
    """Raised where the load test would start spawning servers: what it would spawn them with."""


def _place_in_child(argv: list[str], out) -> None:
    import cluster.loadtest.__main__ as loadtest

    def spawn(args, configs, out_dir):  # the servers start here: the client must have moved already
        raise _Spawning(args.overrides, sorted(os.sched_getaffinity(0)))

    loadtest._run = spawn
    before = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    try:
        loadtest.main(argv)
    except _Spawning as seen:
        out.put((before, *seen.args))
        return
    out.put((before, None, None))


def test_the_load_test_moves_itself_and_each_servers_control_plane(capsys):
    # catches: the client left on the replicas' cores (or moved only after its servers started),
    # the servers' replicas pinned to the control CPUs (the client's affinity, inherited), the
    # flag parsed but never applied by `main`, the flag reaching a server it does not spawn
    cpu = min(os.sched_getaffinity(0))
    before, overrides, after = _in_child(_place_in_child,
                                         ["interference", "--set", "a.b=1", "--control-cpus", str(cpu)])
    assert after == [cpu]
    assert overrides == ["a.b=1", f"cluster.control_cpus='{cpu}'", f"cluster.replica_cpus='{before}'"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["interference", "--control-cpus", "0-x"])
    from cluster.loadtest.__main__ import main

    assert main(["resend", "--url", "http://127.0.0.1:9", "--control-cpus", str(cpu)]) == 2
    assert "--control-cpus places the servers it spawns" in capsys.readouterr().err
