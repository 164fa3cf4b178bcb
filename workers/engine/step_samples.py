"""The tokens and logprobs a step computes beyond the batched argmax, left on the device until the
step's one read-back.

    sampled tokens   requests whose token is not the raw argmax (temperature > 0, penalties,
                     min_tokens): `Sampler.sample_on_device` on the chunk's one sampling row (their
                     own seeded generator, so a request's tokens do not depend on its batch)
    logprobs         every sampling row of a chunk that asked: one log_softmax over all of them, the
                     chosen token's value gathered (the row's argmax for greedy requests, whose every
                     emitted token is the argmax of its row, verified drafts included; else the sampled
                     token) and one top-k per distinct k

`StepLogits.read_back` copies `device_parts()` to the host with the argmax rows and the pending
drafts in one `.tolist()` and hands each part back through `deliver`.
"""

from __future__ import annotations

import torch

from workers.engine.sampling import TokenLogprobs


class StepSamples:
    def __init__(self, scheduled, spans: list[tuple[int, int] | None], rows: torch.Tensor | None,
                 argmax: torch.Tensor | None) -> None:
        """`scheduled`: the step's chunks; `spans`, `rows`, `argmax`: StepLogits' (argmax on the device).
        Computes on the device only; `tokens_of` / `logprobs_of` (by chunk index) fill at `deliver`."""
        self._token_chunks: list[int] = []  # chunks sampled by their own sampler
        self._tokens: torch.Tensor | None = None  # int64 [len(_token_chunks)]
        self._lp_rows: dict[int, int] = {}  # chunk asking for logprobs -> its number of sampling rows
        self._lp_parts: list[torch.Tensor] = []  # chosen logprobs [R], then (values, ids) per top-k group
        self._lp_top: list[tuple[int, int, int]] = []  # per logprob row: (group number or -1, position, k)
        self.tokens_of: dict[int, int] = {}
        self.logprobs_of: dict[int, list[TokenLogprobs]] = {}
        if rows is None:
            return
        sampled = []
        for i, item in enumerate(scheduled):
            req, span = item.req, spans[i]
            if span is None:
                continue
            if not req.sampler.is_argmax:  # one sampling row: a sampled request never verifies drafts
                sampled.append(req.sampler.sample_on_device(rows[span[0]], req.prompt_token_ids, req.output_token_ids))
                self._token_chunks.append(i)
            if req.params.logprobs is not None:
                self._lp_rows[i] = span[1] - span[0]
        if sampled:
            self._tokens = torch.cat(sampled)
        if self._lp_rows:
            self._logprobs_on_device(scheduled, spans, rows, argmax)

    def _logprobs_on_device(self, scheduled, spans, rows: torch.Tensor, argmax: torch.Tensor) -> None:
        device = rows.device
        picks = [r for i in self._lp_rows for r in range(*spans[i])]
        idx = torch.tensor(picks, device=device)
        logp = torch.log_softmax(rows.index_select(0, idx).float(), dim=-1)  # [R, vocab]
        chosen = argmax.index_select(0, idx)  # [R]: greedy rows emit their argmax
        sampled_at = {c: n for n, c in enumerate(self._token_chunks)}
        fix_rows, fix_from, ks, start = [], [], [], 0
        for i, num_rows in self._lp_rows.items():
            if i in sampled_at:  # its one row emits the sampled token
                fix_rows.append(start)
                fix_from.append(sampled_at[i])
            ks += [scheduled[i].req.params.logprobs] * num_rows
            start += num_rows
        if fix_rows:
            chosen = chosen.index_copy(0, torch.tensor(fix_rows, device=device),
                                       self._tokens.index_select(0, torch.tensor(fix_from, device=device)))
        self._lp_parts = [logp.gather(1, chosen[:, None])[:, 0]]  # [R]
        top = [(-1, 0, 0)] * len(ks)
        for group, k in enumerate(sorted(set(ks) - {0})):
            members = [r for r, rk in enumerate(ks) if rk == k]
            width = min(k, logp.shape[1])
            values, ids = torch.topk(logp.index_select(0, torch.tensor(members, device=device)), width)  # [m, width]
            self._lp_parts += [values.flatten(), ids.flatten()]
            for pos, r in enumerate(members):
                top[r] = (group, pos, width)
        self._lp_top = top

    def device_parts(self) -> list[torch.Tensor]:
        """The tensors to read back, in the order `deliver` expects them."""
        return ([self._tokens] if self._tokens is not None else []) + self._lp_parts

    def deliver(self, parts: list[list]) -> None:
        """`parts`: device_parts() read back, each as a list (token ids may come back as floats)."""
        if self._tokens is not None:
            self.tokens_of = {c: int(t) for c, t in zip(self._token_chunks, parts[0])}
            parts = parts[1:]
        if not self._lp_rows:
            return
        chosen, groups = parts[0], parts[1:]
        row = 0
        for i, num_rows in self._lp_rows.items():
            out = []
            for _ in range(num_rows):
                group, pos, width = self._lp_top[row]
                top: tuple[tuple[int, float], ...] = ()
                if group >= 0:
                    values, ids = groups[2 * group], groups[2 * group + 1]
                    span = slice(pos * width, (pos + 1) * width)
                    top = tuple((int(t), float(v)) for t, v in zip(ids[span], values[span]))
                out.append(TokenLogprobs(float(chosen[row]), top))
                row += 1
            self.logprobs_of[i] = out
