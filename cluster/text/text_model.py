"""What the front ends need from a checkpoint besides its weights: the tokenizer, the chat
template and `generation_config.json`.

`generation_config.json` gives (as vLLM reads it with `--generation-config auto`) the EOS ids
(an int or a list: every one stops a request, on top of config.json's `eos_token_id`) and the
default sampling values a request falls back to when it leaves a field out: `temperature`,
`top_p`, `top_k`, `repetition_penalty`, and `max_new_tokens` (the default `max_tokens`).
Where a field is in neither, the OpenAI/vLLM default applies (temperature 1.0: requests sample
unless they send `temperature: 0`). `--generation-config` chooses the file as vLLM's flag does:
`auto` the checkpoint's, `vllm` none of its sampling defaults (its EOS ids still stop requests),
or a folder holding a generation_config.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cluster.text.chat import DEFAULT_TEMPLATE, ChatTemplate, load_chat_template
from cluster.text.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, load_tokenizer, read_json

SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, float | int] = field(default_factory=dict)  # SamplingParams field -> default
    max_new_tokens: int | None = None

    @classmethod
    def for_flag(cls, model_dir: str | Path, generation_config: str = "auto") -> GenerationDefaults:
        """vLLM's `--generation-config`: `auto`, `vllm` or a folder (a missing one is an error)."""
        if generation_config == "auto":
            return cls.load(model_dir)
        if generation_config == "vllm":
            return cls(eos_token_ids=cls.load(model_dir).eos_token_ids)
        folder = Path(generation_config)
        if not (folder / "generation_config.json").is_file():
            what = "does not exist" if not folder.exists() else "has no generation_config.json"
            raise TokenizerError(f"--generation-config {generation_config!r} {what} (expected auto, vllm or a "
                                 "folder with a generation_config.json)")
        return cls.load(folder)

    @classmethod
    def load(cls, model_dir: str | Path) -> GenerationDefaults:
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        data = read_json(path)
        eos = data.get("eos_token_id")
        eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos_ids):
            raise TokenizerError(f"{path}: eos_token_id must be an id or a list of ids, got {eos!r}")
        sampling = {}
        for name in SAMPLING_DEFAULT_FIELDS:
            value = data.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TokenizerError(f"{path}: {name} must be a number, got {value!r}")
            sampling[name] = int(value) if name == "top_k" else float(value)
        max_new = data.get("max_new_tokens")
        if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1):
            raise TokenizerError(f"{path}: max_new_tokens must be an integer >= 1, got {max_new!r}")
        return cls(eos_ids, sampling, max_new)


@dataclass(frozen=True)
class TextModel:
    """A checkpoint's text side. `tokenizer` None: prompts are token ids only, no chat."""

    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    generation: GenerationDefaults

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """EOS ids beyond the model's own (generation_config's list and the tokenizer's eos)."""
        ids = list(self.generation.eos_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and eos not in ids:
            ids.append(eos)
        return tuple(ids)


def load_text_model(model_dir: str | Path, chat_template: str | None = None,
                    generation_config: str = "auto") -> TextModel:
    """Raises `TokenizerError` / `ChatTemplateError` (ValueErrors) with the file that is wrong."""
    tokenizer = load_tokenizer(model_dir)
    default = DEFAULT_TEMPLATE if isinstance(tokenizer, ByteTokenizer) else None
    template = load_chat_template(model_dir, chat_template, getattr(tokenizer, "special_tokens", {}), default)
    return TextModel(tokenizer, template, GenerationDefaults.for_flag(model_dir, generation_config))
