"""The engine's host tier pages: host-memory mirrors of the cache pools' pages, one row per host slot.

    group kind   device rows (ModelCaches)                    host rows (this)
    full         kv[layer] (k, v) [blocks, block, heads, dim]  kv[layer] (k, v) [slots, ...] + sidecar
    draft        draft_kv[layer] (k, v)                        draft_kv[layer] (k, v) [slots, ...]
    mamba        conv[layer], ssm[layer] [slots, ...]          conv[layer], ssm[layer] [slots, ...]

`cache_service.host_tier.HostTier` decides which page goes where; this copies the bytes. On a
CUDA device the host rows are pinned and every copy is issued non-blocking on the current stream:
it is ordered with the forward passes that read or overwrite the device page, and the host never
waits on it (the host never reads these rows itself). On the CPU a copy is a memcpy.

Copies back to the device are measured where the host can time them (`host_copy_price.py`): a
probe of one page per group when the rows are made, then each admission that promotes (on the CPU).
"""

from __future__ import annotations

import time

import torch

from cache_service.specs import CacheLayout
from workers.engine.errors import EngineConfigError
from workers.engine.host_copy_price import HostCopyMeter

PROBE_ROUNDS = 3


def _mirror(t: torch.Tensor, rows: int, pin: bool) -> torch.Tensor:
    return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)


class HostPages:
    """Host rows for `num_slots[g]` pages of each group (0: that group has no host tier)."""

    def __init__(self, caches, layout: CacheLayout, num_slots: tuple[int, ...], sidecar: torch.Tensor | None) -> None:
        try:
            kv, draft_kv, conv, ssm = caches.kv, caches.draft_kv, caches.conv, caches.ssm
        except NotImplementedError:
            raise EngineConfigError("host_cache_bytes: the host tier copies whole pages, which a TP rank does "
                                    "not hold; it needs tp_size 1") from None
        self.layout = layout
        self.num_slots = num_slots
        pin = torch.cuda.is_available() and any(t.is_cuda for t, _ in kv.values())
        self._non_blocking = pin
        self.device_kv, self.device_draft, self.device_conv, self.device_ssm = kv, draft_kv, conv, ssm
        self.device_sidecar = sidecar
        kinds = {spec.kind: n for spec, n in zip(layout.groups, num_slots)}
        n_kv, n_draft, n_state = kinds.get("full", 0), kinds.get("draft", 0), kinds.get("mamba", 0)
        self.kv = {i: (_mirror(k, n_kv, pin), _mirror(v, n_kv, pin)) for i, (k, v) in kv.items()} if n_kv else {}
        self.sidecar = _mirror(sidecar, n_kv, pin) if n_kv and sidecar is not None else None
        self.draft_kv = ({i: (_mirror(k, n_draft, pin), _mirror(v, n_draft, pin)) for i, (k, v) in draft_kv.items()}
                         if n_draft else {})
        self.conv = {i: _mirror(t, n_state, pin) for i, t in conv.items()} if n_state else {}
        self.ssm = {i: _mirror(t, n_state, pin) for i, t in ssm.items()} if n_state else {}
        self.meter = HostCopyMeter(*self.hit_bytes())
        self.probe()

    @property
    def nbytes(self) -> int:
        tensors = [*(t for pair in (*self.kv.values(), *self.draft_kv.values()) for t in pair),
                   *self.conv.values(), *self.ssm.values()]
        if self.sidecar is not None:
            tensors.append(self.sidecar)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _pairs(self, group_id: int):
        """(device tensor, host tensor) pairs holding group `group_id`'s pages."""
        kind = self.layout.groups[group_id].kind
        if kind == "mamba":
            return [(self.device_conv[i], self.conv[i]) for i in self.conv] + \
                   [(self.device_ssm[i], self.ssm[i]) for i in self.ssm]
        device, host = (self.device_draft, self.draft_kv) if kind == "draft" else (self.device_kv, self.kv)
        pairs = [(device[i][j], host[i][j]) for i in host for j in (0, 1)]
        if kind == "full" and self.sidecar is not None:
            pairs.append((self.device_sidecar, self.sidecar))
        return pairs

    def page_bytes(self, group_id: int) -> int:
        """The bytes one page of group `group_id` copies (0: no host rows for it)."""
        if not self.num_slots[group_id]:
            return 0
        return sum(host[0].numel() * host.element_size() for _, host in self._pairs(group_id))

    def hit_bytes(self) -> tuple[int, float]:
        """(bytes a hit's host part copies whatever its length: one state page per Mamba group,
        bytes per token of it: every attention group's page over its block size)."""
        fixed, per_token = 0, 0.0
        for g, spec in enumerate(self.layout.groups):
            if spec.kind == "mamba":
                fixed += self.page_bytes(g)
            else:
                per_token += self.page_bytes(g) / spec.block_size
        return fixed, per_token

    def probe(self) -> None:
        """Time copying one page of every group host -> device scratch (`PROBE_ROUNDS` times,
        synchronised): the copy speed before any promotion is seen."""
        groups = [g for g, n in enumerate(self.num_slots) if n]
        pairs = [pair for g in groups for pair in self._pairs(g)]
        if not pairs:
            return
        scratch = [torch.empty_like(device[0]) for device, _ in pairs]
        num_bytes = sum(self.page_bytes(g) for g in groups) * PROBE_ROUNDS
        cuda = self._non_blocking
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(PROBE_ROUNDS):
            for out, (_, host) in zip(scratch, pairs):
                out.copy_(host[0], non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        self.meter.observe_copy(num_bytes, time.perf_counter() - start)

    def save_page(self, group_id: int, block_id: int, slot: int) -> None:
        for device, host in self._pairs(group_id):
            host[slot].copy_(device[block_id], non_blocking=self._non_blocking)

    def load_page(self, group_id: int, slot: int, block_id: int) -> None:
        for device, host in self._pairs(group_id):
            device[block_id].copy_(host[slot], non_blocking=self._non_blocking)

    def observe_promotion(self, num_pages: tuple[int, ...], seconds: float) -> None:
        """An admission that promoted `num_pages` per group took `seconds` (its copies, the
        demotions that made room, the bookkeeping): a sample of what a host hit costs here. On
        CUDA the copies run on the stream after the host returns: only the probe's figure stands."""
        if not self._non_blocking:
            self.meter.observe_copy(sum(n * self.page_bytes(g) for g, n in enumerate(num_pages)), seconds)
