"""`LLM`: generate offline from a checkpoint, in the shape of vLLM's `LLM`.

At `tensor_parallel_size=1` the engine runs in this process (no Ray); above that, rank 0 runs
here and ranks 1..n-1 are Ray actors (`workers.tp_worker`), joining $RAY_ADDRESS or starting a
local Ray bound to 127.0.0.1. Prompts are text (tokenized with the checkpoint's tokenizer, as
`/v1/completions` does) or token ids; `chat` renders messages with the checkpoint's chat
template exactly as the HTTP server does, so both give the same tokens. Stop strings, logprobs
and special-token skipping go through the same `CompletionState` as the server's responses.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from cluster.text.completion_state import CompletionState
from cluster.text.text_model import TextModel, load_text_model
from hybridserve.outputs import CompletionOutput, RequestOutput, logprob_dicts
from hybridserve.sampling_params import SamplingParams
from workers.engine.config import EngineConfig
from workers.model.loader import resolve_dtype


class LLM:
    def __init__(self, model: str, *, dtype: str | torch.dtype | None = "auto", tensor_parallel_size: int = 1,
                 num_speculative_tokens: int | None = None, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, chat_template: str | None = None, kernels: str = "auto",
                 seed: int | None = None, **engine_kwargs) -> None:
        """`engine_kwargs`: further `EngineConfig` fields (cache_memory_bytes, kv_block_size, ...)."""
        model_dir = Path(model)
        if not (model_dir / "config.json").is_file():
            what = "does not exist" if not model_dir.exists() else "has no config.json"
            raise FileNotFoundError(f"model {model!r} {what}")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        self.model_dir = str(model_dir)
        self.text: TextModel = load_text_model(model_dir, chat_template)
        torch_dtype = resolve_dtype(model_dir, dtype)
        settings = dict(engine_kwargs, kernels=kernels, enable_prefix_caching=enable_prefix_caching)
        if max_model_len is not None:
            settings["max_model_len"] = max_model_len
        if num_speculative_tokens is not None:
            settings["num_spec_tokens"] = num_speculative_tokens
        config = EngineConfig(**settings)
        self._embedded_ray = False  # set when TP > 1 started a local Ray here (close() stops it)
        self.engine = self._build_engine(config, tensor_parallel_size, torch_dtype)
        self.tensor_parallel_size = tensor_parallel_size
        self.seed = seed
        self._ids = itertools.count()

    def _build_engine(self, config: EngineConfig, tp_size: int, dtype: torch.dtype):
        from workers.engine.engine import LLMEngine
        from workers.model.loader import load_model, model_fingerprint

        if not config.model_fingerprint:
            config = config.replace(model_fingerprint=model_fingerprint(self.model_dir))
        if tp_size == 1:
            return LLMEngine(load_model(self.model_dir, dtype=dtype, kernels=config.kernels), config)
        from cluster.control.ray_cluster import connect_ray
        from workers.tp_worker import create_tp_engine

        self._embedded_ray = connect_ray(None) == "embedded"
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        return create_tp_engine(self.model_dir, config, tp_size, backend, dtype=dtype)

    @property
    def tokenizer(self):
        return self.text.tokenizer

    def get_tokenizer(self):
        return self.text.tokenizer

    def close(self) -> None:
        """Stops the TP actors (TP > 1) and a Ray this LLM started; the in-process engine needs nothing."""
        close = getattr(self.engine.model, "close", None)
        if close is not None:
            close()
        if self._embedded_ray:
            import ray

            ray.shutdown()
            self._embedded_ray = False

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """`prompts`: a string, a list of token ids, {"prompt": ...} / {"prompt_token_ids": ...}, or
        a list of those. One `RequestOutput` per prompt, in order."""
        items = [prompts] if isinstance(prompts, (str, dict)) or _is_ids(prompts) else list(prompts)
        encoded = [self._encode(p) for p in items]
        return self._run(encoded, sampling_params)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """`messages`: one conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.text.tokenizer is None or self.text.chat_template is None:
            raise ValueError(f"{self.model_dir} has no tokenizer and chat template: chat is not possible")
        encoded = []
        for conversation in conversations:
            prompt = self.text.chat_template.render(conversation, add_generation_prompt,
                                                    **(chat_template_kwargs or {}))
            encoded.append((prompt, self.text.tokenizer.encode(prompt, add_special_tokens=False)))
        return self._run(encoded, sampling_params)

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.text.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer: pass token ids")
            return prompt, self.text.tokenizer.encode(prompt)
        if _is_ids(prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _run(self, encoded: list[tuple[str | None, list[int]]], sampling_params) -> list[RequestOutput]:
        params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params or SamplingParams()] * len(encoded)
        if len(params_list) != len(encoded):
            raise ValueError(f"{len(params_list)} sampling params for {len(encoded)} prompts")
        limit = self.engine.config.max_model_len
        states: dict[str, tuple[int, CompletionState]] = {}
        for n, ((_, ids), params) in enumerate(zip(encoded, params_list)):
            if params.stop and self.text.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer: stop strings need text; use stop_token_ids")
            max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
            if len(ids) + max_tokens > limit:
                raise ValueError(f"prompt {n}: {len(ids)} prompt tokens + max_tokens {max_tokens} is over "
                                 f"max_model_len {limit}")
            seeded = params if params.seed is not None or self.seed is None else \
                _with_seed(params, self.seed + n)
            engine_params = seeded.with_max_tokens(max(1, max_tokens)).stopping_at(self.text.stop_token_ids)
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(ids, engine_params, request_id=rid)
            states[rid] = n, CompletionState(self.text.tokenizer, list(params.stop), params.stop_token_ids,
                                             params.include_stop_str_in_output, params.skip_special_tokens)
        pending = set(states)
        while pending:
            outputs = self.engine.step()
            if not outputs and not self.engine.has_unfinished():
                raise RuntimeError("engine stalled with unfinished requests")
            for out in outputs:
                if out.request_id not in pending:
                    continue
                state = states[out.request_id][1]
                state.update(out)
                if state.finished:
                    pending.discard(out.request_id)
                    if not out.finished:  # a stop string matched: end the engine request there
                        self.engine.abort(out.request_id)
        results: list[RequestOutput | None] = [None] * len(encoded)
        for rid, (n, state) in states.items():
            logprobs = logprob_dicts(state.logprobs, state.token_ids)
            cumulative = sum(lp.logprob for lp in state.logprobs) if state.logprobs is not None else None
            output = CompletionOutput(0, state.text, list(state.token_ids), state.finish_reason, state.stop_reason,
                                      logprobs, cumulative)
            results[n] = RequestOutput(rid, encoded[n][0], encoded[n][1], [output], state.num_cached_tokens,
                                       num_computed_prompt_tokens=state.num_computed_prompt_tokens)
        return results


def _is_ids(value) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
