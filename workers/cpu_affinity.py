"""Pinning a replica's process to CPUs (`cluster.pd.prefill_cpus` / `decode_cpus`): on hosts where
replicas share CPU cores (CPU serving, or the cores that feed GPUs), a prefill replica's long
prompts would otherwise take the cores its decode replicas need, the very interference
disaggregation removes.

`parse_cpu_list("0-3,8")` reads the Linux cpulist syntax; `pin_this_process(cpus)` sets the
affinity of every thread of the calling process (Linux sets it per thread: a thread started later
inherits its creator's) and returns what the kernel reports for the main thread.
"""

from __future__ import annotations

import os


class CpuListError(ValueError):
    """A CPU list that does not parse, or names CPUs this host does not let the process use."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Sorted CPU ids of a cpulist ("0", "0-3", "0,2,4-5"). Raises `CpuListError`."""
    cpus: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                cpus.update(range(lo, hi + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise CpuListError(f"not a CPU list: {text!r} (e.g. \"0\", \"0-3\", \"0,2,4-5\")") from None
    if not cpus or min(cpus) < 0:
        raise CpuListError(f"not a CPU list: {text!r} (CPU ids are >= 0)")
    return tuple(sorted(cpus))


def pin_this_process(cpus: tuple[int, ...]) -> tuple[int, ...]:
    """Every thread of this process onto `cpus`. Raises `CpuListError` when the kernel refuses
    them (offline, outside this container's set), naming them."""
    online = _online()
    missing = sorted(set(cpus) - set(online)) if online else []
    if missing:
        raise CpuListError(f"CPUs {missing} are not online on this host (online: {online})")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except OSError as exc:
            raise CpuListError(f"cannot pin to CPUs {list(cpus)}: {exc}") from None
    return tuple(sorted(os.sched_getaffinity(0)))


def allowed_cpus() -> str:
    """The CPUs this process may run on now, as a CPU list a config key takes ("0,1,3")."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def _online() -> list[int]:
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return list(parse_cpu_list(f.read().strip()))
    except (OSError, CpuListError):
        return []
