"""OpenAI request fields -> `SamplingParams`, and engine logprobs -> OpenAI's two logprobs shapes.

Defaults a request leaves out come from the checkpoint's generation_config.json (as vLLM does),
else OpenAI's and vLLM's: temperature 1.0 (sampling; send 0 for greedy), top_p 1, top_k off,
repetition_penalty 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.http.protocol import SamplingFields
from cluster.text.tokenizer import Tokenizer
from workers.engine.sampling import TokenLogprobs
from workers.engine.sampling_params import SamplingParams


def sampling_params(body: SamplingFields, max_tokens: int, logprobs: int | None,
                    sampling_defaults: dict, eos_token_ids: Sequence[int]) -> SamplingParams:
    """Raises `InvalidRequestError` for combinations the schema cannot see (min_tokens > max_tokens)."""
    def pick(name: str, fallback):
        value = getattr(body, name)
        return value if value is not None else sampling_defaults.get(name, fallback)

    return SamplingParams(
        max_tokens=max_tokens, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0), seed=body.seed, stop=tuple(body.stop_strings),
        stop_token_ids=tuple(body.stop_token_ids or ()), include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=pick("repetition_penalty", 1.0),
        logprobs=logprobs, skip_special_tokens=body.skip_special_tokens).stopping_at(eos_token_ids)


def _token_bytes(tokenizer: Tokenizer | None, token_id: int) -> list[int]:
    if tokenizer is None:
        return []
    if hasattr(tokenizer, "decode_bytes"):
        return list(tokenizer.decode_bytes([token_id]))
    return list(tokenizer.token_text(token_id).encode("utf-8"))


def _token(tokenizer: Tokenizer | None, token_id: int) -> str:
    return tokenizer.token_text(token_id) if tokenizer is not None else f"token_id:{token_id}"


def completion_logprobs(tokenizer: Tokenizer | None, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                        text_offset: int = 0) -> dict:
    """The legacy completions shape: parallel lists, `top_logprobs` as {token: logprob}."""
    tokens = [_token(tokenizer, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    tops = []
    for lp in logprobs:  # two ids can share a text (partial UTF-8 bytes): keep the better one
        top: dict[str, float] = {}
        for t, v in lp.top:
            top.setdefault(_token(tokenizer, t), v)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer | None, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> dict:
    """The chat shape: one entry per token with its bytes and top alternatives."""
    def entry(token_id: int, value: float) -> dict:
        return {"token": _token(tokenizer, token_id), "logprob": value, "bytes": _token_bytes(tokenizer, token_id)}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for t, lp in zip(token_ids, logprobs)]}
