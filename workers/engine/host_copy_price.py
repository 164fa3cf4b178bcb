"""What a host hit costs on this engine, measured: host-to-device copy time against recompute time.

    copy speed       bytes/s of host-to-device page copies: a probe when the host tier is made (one
                     page of every group copied into device scratch, synchronised), then every
                     promotion the host can time (`HostPages.load_page` on the CPU; on CUDA the copies
                     are asynchronous on the compute stream, so the probe's figure stands)
    recompute speed  seconds per token of the engine's own prefill-heavy steps (at least
                     `MIN_STEP_TOKENS` tokens, half or more of them prompt tokens): what computing
                     a hit's tokens instead would cost here
    price            `messages.HostCopyPrice`: copying an n-token host part costs fixed +
                     per_token * n recomputed tokens (fixed: the Mamba state pages; per_token: one
                     token's KV pages), reported to the cache service with every load report

Both speeds are averaged as time per unit (byte, token), as `link_costs.LinkCosts` does, so one
fast sample cannot hide a copy path or a model that became slow. The router prices a replica's
host tokens by its own price (`router.Router.decide`); before both speeds exist the report
carries no price and the router's configured `host_cost_per_token` stands in.
"""

from __future__ import annotations

from cache_service.messages import HostCopyPrice

MIN_STEP_TOKENS = 16  # shorter steps are dominated by per-step overhead, not by the tokens


class HostCopyMeter:
    """`fixed_bytes`: what one hit's host part copies whatever its length (its Mamba state pages);
    `bytes_per_token`: what each of its tokens adds (KV pages); `HostPages.hit_bytes` gives both."""

    def __init__(self, fixed_bytes: int, bytes_per_token: float, smoothing: float = 0.25) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.fixed_bytes = fixed_bytes
        self.bytes_per_token = bytes_per_token
        self.smoothing = smoothing
        self.s_per_byte: float | None = None
        self.s_per_token: float | None = None
        self.num_copies = 0  # copy samples taken (the probe included)
        self.num_steps = 0  # step samples taken

    def _blend(self, old: float | None, sample: float) -> float:
        return sample if old is None else self.smoothing * sample + (1 - self.smoothing) * old

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        """`num_bytes` copied host -> device in `seconds` (ignored when either is 0)."""
        if num_bytes > 0 and seconds > 0:
            self.s_per_byte = self._blend(self.s_per_byte, seconds / num_bytes)
            self.num_copies += 1

    def observe_step(self, num_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """One engine step: `num_tokens` through the model, `num_prompt_tokens` of them prompt
        tokens, in `seconds` (only prefill-heavy steps count)."""
        if num_tokens >= MIN_STEP_TOKENS and 2 * num_prompt_tokens >= num_tokens and seconds > 0:
            self.s_per_token = self._blend(self.s_per_token, seconds / num_tokens)
            self.num_steps += 1

    def price(self) -> HostCopyPrice | None:
        """The price in recomputed tokens; None until both speeds are measured."""
        if self.s_per_byte is None or self.s_per_token is None:
            return None
        scale = self.s_per_byte / self.s_per_token
        return HostCopyPrice(self.fixed_bytes * scale, self.bytes_per_token * scale, 1.0 / self.s_per_byte)
