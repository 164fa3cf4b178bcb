"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from cache_service.checkpoint_grid import parse_grid
from cache_service.coordinator import EagleMode
from cache_service.eviction import EvictionConfig, EvictionError
from cache_service.hit_finders import DropRule
from cache_service.retention import make_retention
from cache_service.specs import SpecError
from workers.engine.errors import EngineConfigError


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 8192
    kv_block_size: int = 16  # attention KV block (target and draft pools)
    # grid mamba: the Mamba checkpoint granularity (alignment = lcm with kv_block_size); grid
    # attention: an upper bound on the spacing of states, which sit on the KV block grid
    mamba_block_size: int = 64
    # where Mamba states may sit: mamba (on mamba_block_size) | attention (on kv_block_size, as
    # vLLM 0.33: the Mamba page only sets bytes; cache_service/checkpoint_grid.py)
    checkpoint_grid: str = "mamba"
    cache_memory_bytes: int = 256 * 2**20  # KV + draft KV + Mamba state pools together
    mamba_memory_fraction: float = 0.25  # share of the budget for Mamba state pages
    # host tier (cache_service/host_tier.py): bytes of host memory for pages the device evicts, split
    # between KV and Mamba pages as the device budget is; 0: evicted pages are dropped
    host_cache_bytes: int = 0
    max_num_seqs: int = 8
    chunk_size: int = 512  # prefill chunks end on multiples of this (and at checkpoints)
    # tokens per step, decodes first, then prefill chunks; None: max(2048, max(chunk_size, A) +
    # max_num_seqs * (k + 1)): vLLM's serving default (2048), raised so a full step of decodes still
    # leaves room for one chunk
    max_num_batched_tokens: int | None = None
    # byte budget of retained Mamba checkpoints, as a share of cache_memory_bytes (working states
    # are never counted nor evicted); beyond it the checkpoint of least expected value goes
    checkpoint_memory_fraction: float = 0.125
    num_spec_tokens: int = 3  # MTP draft tokens per step; 0 disables speculation
    eagle_mode: EagleMode = EagleMode.LOSSLESS  # drop | lossless (ignored without speculation)
    # how a dropping draft group proves the successor token: lookahead (the block starting at the
    # hit is cached) | alignment (older engines: one alignment unit lost per hit)
    drop_rule: str = "lookahead"
    # latest | dense | interval in tokens | value:BYTES (up to BYTES of states per request, placed
    # where later lookups are expected to land: cache_service/placement.py)
    retention: str = "latest"
    # which retained Mamba checkpoint goes under pressure: value | lru | marconi[:ALPHA]
    # (cache_service/eviction.py; the trace simulator's --eviction runs the same objects)
    eviction: str = "value"
    enable_prefix_caching: bool = True
    kernels: str = "auto"  # auto | torch | cuda
    model_fingerprint: str = ""  # filled from the checkpoint when empty
    dtype: str = "float32"  # weights, activations and KV (cluster: set from model.dtype); float32 | bfloat16 | float16
    device: str = "cpu"  # where weights and every cache pool live: cpu | cuda | cuda:N
    # on: decode steps replay CUDA graphs per batch-size bucket (workers/model/decode_graphs.py; needs a
    # CUDA device, the torch kernel set, no MoE layers, tp_size 1); off: every step eager (vLLM's
    # --enforce-eager). Off by default until measured on a GPU
    cuda_graphs: str = "off"

    def __post_init__(self) -> None:
        for name in ("max_model_len", "kv_block_size", "mamba_block_size", "cache_memory_bytes",
                     "max_num_seqs", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.host_cache_bytes, int) or self.host_cache_bytes < 0:
            raise EngineConfigError(f"host_cache_bytes must be a non-negative integer, got {self.host_cache_bytes!r}")
        if not isinstance(self.num_spec_tokens, int) or not 0 <= self.num_spec_tokens <= 16:
            raise EngineConfigError(f"num_spec_tokens must be an integer in 0..16, got {self.num_spec_tokens!r}")
        if self.max_num_batched_tokens is not None and (
                not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens <= 0):
            raise EngineConfigError(
                f"max_num_batched_tokens must be a positive integer, got {self.max_num_batched_tokens!r}")
        if not isinstance(self.checkpoint_memory_fraction, (int, float)) or not (
                0.0 < self.checkpoint_memory_fraction <= 1.0):
            raise EngineConfigError(
                f"checkpoint_memory_fraction must be in (0, 1], got {self.checkpoint_memory_fraction!r}")
        if not 0.0 < self.mamba_memory_fraction < 1.0:
            raise EngineConfigError(f"mamba_memory_fraction must be in (0, 1), got {self.mamba_memory_fraction}")
        try:
            object.__setattr__(self, "eagle_mode", EagleMode(self.eagle_mode))
        except ValueError:
            raise EngineConfigError(f"eagle_mode must be drop or lossless, got {self.eagle_mode!r}") from None
        if self.eagle_mode is EagleMode.OFF and self.num_spec_tokens:
            raise EngineConfigError("eagle_mode off cannot be combined with speculation; use drop or lossless")
        try:
            DropRule(self.drop_rule)
        except ValueError:
            raise EngineConfigError(f"drop_rule must be lookahead or alignment, got {self.drop_rule!r}") from None
        try:
            parse_grid(self.checkpoint_grid)
        except SpecError as exc:
            raise EngineConfigError(str(exc)) from None
        try:  # state_bytes 1: the real page size is known once the model is loaded
            make_retention(self.retention, self.alignment, state_bytes=1)
        except SpecError as exc:
            raise EngineConfigError(f"retention: {exc}") from None
        try:
            EvictionConfig(self.eviction)
        except EvictionError as exc:
            raise EngineConfigError(str(exc)) from None
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise EngineConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device in ("cpu", "cuda") or (
                self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise EngineConfigError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.cuda_graphs not in ("on", "off"):
            raise EngineConfigError(f"cuda_graphs must be on or off, got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and not self.device.startswith("cuda"):
            raise EngineConfigError(f"cuda_graphs: on needs a CUDA device, not {self.device!r}")
        if self.kernels not in ("auto", "torch", "cuda"):
            raise EngineConfigError(f"kernels must be auto, torch or cuda, got {self.kernels!r}")

    @property
    def alignment(self) -> int:
        """Every hit and every Mamba state is a multiple of this: the KV block on the attention grid."""
        if self.checkpoint_grid.strip().lower() == "attention":
            return self.kv_block_size
        return math.lcm(self.kv_block_size, self.mamba_block_size)

    @property
    def checkpoint_spacing(self) -> int:
        """On the attention grid: the upper bound on the spacing of states (0: none)."""
        spacing = math.lcm(self.kv_block_size, self.mamba_block_size)
        return spacing if self.checkpoint_grid.strip().lower() == "attention" and spacing > self.kv_block_size else 0

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def replace(self, **changes) -> EngineConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return EngineConfig(**values)
