"""Counting a step's host work without a GPU: operator calls and would-be device synchronisations.

`HostCounter` is a context manager stacking a `TorchFunctionMode` (sees Python-level tensor methods:
`tolist`, `item`, `bool(t)` ...) over a `TorchDispatchMode` (sees every aten operator after autograd):

    num_ops    every aten operator call (what becomes one or more kernel launches on a GPU, or a host
               op on a CPU tensor); factory and view ops included
    num_syncs  every point where the host waits for a tensor's VALUES, which on a GPU blocks until the
               device has caught up:
               - a read into Python: Tensor.tolist / item / numpy / bool(t) / int(t) / float(t) /
                 index(t) (one count per call, whatever it dispatches underneath)
               - any other aten._local_scalar_dense (a scalar read inside an op, e.g. torch.multinomial
                 over a Python-read count)
               - ops whose output SHAPE depends on values: nonzero, masked_select, unique,
                 repeat_interleave without output_size, boolean-mask indexing and index_put

What counts is decided by the operator, not by where the tensor lives: on the CPU every tensor is
"host", so a read of a tensor that a GPU engine would keep on the host (a block table built from a
Python list) counts too. The count is therefore an upper bound on a GPU's real syncs, and it is
deterministic: a regression shows on every machine. Host -> device copies are not counted as syncs
(they do not wait for the device on the issuing stream).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# Python-level reads of a tensor's values (one sync each)
_READ_METHODS = frozenset({
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
})
# operators whose output shape depends on tensor values (a sync to size the output)
_DATA_DEPENDENT = frozenset({
    _aten.nonzero.default, _aten.nonzero_static.default, _aten.masked_select.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor,
})


@dataclass(frozen=True)
class HostCounts:
    """What ran inside one `HostCounter` block. `sync_sites`: (what, count), most frequent first."""

    num_ops: int
    num_syncs: int
    sync_sites: tuple[tuple[str, int], ...]
    top_ops: tuple[tuple[str, int], ...]


def _is_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        if o.num_paused:
            return func(*args, **kwargs)
        o.ops[str(func.overloadpacket.__name__)] += 1
        if not o.in_read:
            if func is _aten._local_scalar_dense.default:
                o.syncs["_local_scalar_dense"] += 1
            elif func in _DATA_DEPENDENT:
                if not (func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
                    o.syncs[func.overloadpacket.__name__] += 1
            elif func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) and \
                    _is_bool_index(args):
                o.syncs[f"{func.overloadpacket.__name__}[bool mask]"] += 1
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        if func in _READ_METHODS and not o.in_read and not o.num_paused:
            o.syncs[f"Tensor.{func.__name__}"] += 1
            o.in_read = True
            try:
                return func(*args, **kwargs)
            finally:
                o.in_read = False
        return func(*args, **kwargs)


class HostCounter:
    """`with HostCounter() as c: ...` then `c.counts()`. Not re-entrant; slows the block down (count
    with it, time without it)."""

    active: HostCounter | None = None  # the innermost counter now counting (for `as_one_call`)

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.in_read = False
        self.num_paused = 0
        self._modes = (_Function(self), _Dispatch(self))
        self._outer: HostCounter | None = None

    def __enter__(self) -> HostCounter:
        for mode in self._modes:
            mode.__enter__()
        self._outer, HostCounter.active = HostCounter.active, self
        return self

    def __exit__(self, *exc) -> None:
        HostCounter.active = self._outer
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    @contextmanager
    def as_one_call(self, name: str):
        """Count everything inside as ONE operator call `name` and no sync: what the host issues for a
        CUDA graph replay (the graph's kernels run on the device without host dispatch)."""
        self.ops[name] += 1
        self.num_paused += 1
        try:
            yield
        finally:
            self.num_paused -= 1

    def counts(self) -> HostCounts:
        return HostCounts(sum(self.ops.values()), sum(self.syncs.values()),
                          tuple(self.syncs.most_common()), tuple(self.ops.most_common(12)))
