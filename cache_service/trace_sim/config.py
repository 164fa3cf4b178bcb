"""Simulation configs: a model's cache layout with page bytes, and a cost model, both loaded
from YAML (`configs/sim/layouts.yaml`, `configs/sim/cost.yaml`) and validated on load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from cache_service.specs import CacheLayout, SpecError, parse_group_spec

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "sim"


class SimConfigError(ValueError):
    """A simulation layout or cost model is missing or invalid."""


@dataclass(frozen=True)
class SimLayout:
    name: str
    layout: CacheLayout
    page_bytes: tuple[int, ...]  # per group: one block / one state page
    # context length at which attention's quadratic FLOPs equal the linear ones (eviction.py)
    attention_crossover_tokens: float = float("inf")

    def _split(self, budget_bytes: int, mamba_fraction: float, minimum: int, what: str, unit: str,
               remedy: str = "") -> tuple[int, ...]:
        """Pages per group from `budget_bytes`: attention groups share (1 - mamba_fraction) with one
        page each per token range; state groups the rest (all of it to attention without states).
        Fewer than `minimum` in any group is an error naming `what` memory and the page `unit`."""
        groups = self.layout.groups
        attn = [i for i, g in enumerate(groups) if g.is_attention]
        state = [i for i, g in enumerate(groups) if not g.is_attention]
        attn_bytes = budget_bytes * (1.0 - mamba_fraction if state else 1.0)
        state_bytes = budget_bytes - attn_bytes
        num_attn = int(attn_bytes // sum(self.page_bytes[i] for i in attn)) if attn else 0
        num_state = int(state_bytes // sum(self.page_bytes[i] for i in state)) if state else 0
        out = tuple(num_attn if g.is_attention else num_state for g in groups)
        if min(out) < minimum:
            raise SimConfigError(
                f"layout {self.name}: {budget_bytes} bytes{what} with mamba_fraction {mamba_fraction} "
                f"gives {out} {unit} per group; every group needs at least {minimum}{remedy}"
            )
        return out

    def pool_blocks(self, budget_bytes: int, mamba_fraction: float) -> tuple[int, ...]:
        """Blocks per group for a replica with `budget_bytes` of device cache memory (`_split`)."""
        return self._split(budget_bytes, mamba_fraction, 2, "", "blocks")

    def host_pages(self, host_bytes: int, mamba_fraction: float) -> tuple[int, ...]:
        """Host-tier pages per group for `host_bytes` of host memory, split as the device budget
        is (`_split`); () for 0 bytes (no host tier)."""
        if host_bytes == 0:
            return ()
        return self._split(host_bytes, mamba_fraction, 1, " of host memory", "host pages",
                           " (or 0 bytes: no host tier)")


@dataclass(frozen=True)
class CostModel:
    name: str
    prefill_tokens_per_s: float
    prefill_overhead_s: float
    decode_step_s: float
    transfer_bytes_per_s: float
    # host tier -> device copies (promotion); None: not in the YAML, so no host tier can be simulated
    host_to_device_bytes_per_s: float | None = None
    # the stepped decode model (step_timeline.py; `--decode-model stepped`, `--pd-split`): a step
    # with D decoding sequences costs decode_step_s + D * decode_per_seq_s, and carries at most
    # step_token_budget tokens (one per decoding sequence first, prefill chunks in the rest: the
    # engine's max_num_batched_tokens); None: not in the YAML, so the stepped model is refused
    decode_per_seq_s: float = 0.0
    step_token_budget: int | None = None

    def prefill_s(self, num_tokens: int) -> float:
        return self.prefill_overhead_s + num_tokens / self.prefill_tokens_per_s

    def decode_s(self, num_output_tokens: int) -> float:
        return num_output_tokens * self.decode_step_s

    def promote_s(self, num_bytes: int) -> float:
        """Seconds to copy `num_bytes` of host-tier pages back to the device."""
        if not num_bytes:
            return 0.0
        if self.host_to_device_bytes_per_s is None:
            raise SimConfigError(f"cost model {self.name!r} has no host_to_device_bytes_per_s")
        return num_bytes / self.host_to_device_bytes_per_s


def _read(path: Path) -> dict:
    if not path.is_file():
        raise SimConfigError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise SimConfigError(f"{path}: expected a mapping of names")
    return data


def load_layout(name: str, path: Path | None = None) -> SimLayout:
    path = path or CONFIG_DIR / "layouts.yaml"
    data = _read(path)
    if name not in data:
        raise SimConfigError(f"unknown layout {name!r}; {path} has {sorted(data)}")
    try:
        groups = data[name]["groups"]
        specs = tuple(parse_group_spec(g["spec"]) for g in groups)
        pages = tuple(int(g["page_bytes"]) for g in groups)
    except (KeyError, TypeError, SpecError) as exc:
        raise SimConfigError(f"{path}: layout {name!r}: {exc}") from None
    if any(p <= 0 for p in pages):
        raise SimConfigError(f"{path}: layout {name!r}: page_bytes must be positive")
    try:
        crossover = float(data[name].get("attention_crossover_tokens", float("inf")))
    except (TypeError, ValueError):
        crossover = -1.0
    if not crossover > 0:
        raise SimConfigError(f"{path}: layout {name!r}: attention_crossover_tokens must be a positive number")
    return SimLayout(name, CacheLayout(specs), pages, crossover)


def load_cost_model(name: str, path: Path | None = None) -> CostModel:
    path = path or CONFIG_DIR / "cost.yaml"
    data = _read(path)
    if name not in data:
        raise SimConfigError(f"unknown cost model {name!r}; {path} has {sorted(data)}")
    entry = data[name]
    fields = ("prefill_tokens_per_s", "prefill_overhead_s", "decode_step_s", "transfer_bytes_per_s")
    try:
        values = {f: float(entry[f]) for f in fields}
        # optional: files written before the host tier still load; a host-tier run then refuses
        # them (SimSettings) instead of assuming a bandwidth
        if entry.get("host_to_device_bytes_per_s") is not None:
            values["host_to_device_bytes_per_s"] = float(entry["host_to_device_bytes_per_s"])
        if entry.get("decode_per_seq_s") is not None:  # optional as well (the stepped model)
            values["decode_per_seq_s"] = float(entry["decode_per_seq_s"])
        if entry.get("step_token_budget") is not None:
            values["step_token_budget"] = int(entry["step_token_budget"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SimConfigError(f"{path}: cost model {name!r}: missing or bad field {exc}") from None
    throughputs = [values[f] for f in ("prefill_tokens_per_s", "transfer_bytes_per_s", "host_to_device_bytes_per_s")
                   if f in values]
    if any(v <= 0 for v in throughputs):
        raise SimConfigError(f"{path}: cost model {name!r}: throughputs must be positive")
    if values["prefill_overhead_s"] < 0 or values["decode_step_s"] < 0 or values.get("decode_per_seq_s", 0.0) < 0:
        raise SimConfigError(f"{path}: cost model {name!r}: times must be >= 0")
    if values.get("step_token_budget", 1) < 1:
        raise SimConfigError(f"{path}: cost model {name!r}: step_token_budget must be >= 1")
    return CostModel(name, **values)
