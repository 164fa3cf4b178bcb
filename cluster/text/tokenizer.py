"""Tokenizers the front end can use to accept text and return it.

A tokenizer has `encode(text, add_special_tokens=True) -> list[int]`, `decode(ids,
skip_special_tokens=True) -> str`, `token_text(id)` (one token as shown in logprobs),
`eos_token_id` and `special_tokens` (the `bos_token` / `eos_token` / ... strings a chat template
sees). Two kinds:

- `HFTokenizer`: a Hugging Face `tokenizer.json` through the `tokenizers` library, with the
  special-token names of `tokenizer_config.json` (as transformers reads them);
- `ByteTokenizer`: the trained tiny checkpoint's `byte_tokenizer.json` (id = UTF-8 byte +
  offset); it also has `decode_bytes`, which gives it an exact streaming decoder.

Incremental (streaming) decoding lives in `cluster.text.detokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from workers.train import byte_tokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are unreadable or inconsistent."""


class Tokenizer(Protocol):
    eos_token_id: int | None
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str: ...


class ByteTokenizer:
    """The trained tiny checkpoint's tokenizer (`byte_tokenizer.json`): id = UTF-8 byte + offset;
    special and unused ids decode to nothing."""

    def __init__(self, byte_offset: int = byte_tokenizer.BYTE_OFFSET, eos_token_id: int = byte_tokenizer.EOS_ID):
        self.byte_offset = byte_offset
        self.eos_token_id = eos_token_id
        self.special_tokens: dict[str, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self.byte_offset for b in text.encode("utf-8")]

    def decode_bytes(self, ids: list[int]) -> bytes:
        lo = self.byte_offset
        return bytes(i - lo for i in ids if lo <= i < lo + 256)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])


def _token_string(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """`tokenizer.json` (any model type the `tokenizers` library reads) plus the special-token
    strings of `tokenizer_config.json`. `encode` runs the file's normalizer, pre-tokenizer, model
    and post-processor (so BOS is added where the file says so, and only with
    `add_special_tokens`); `decode` skips special tokens by default, as vLLM does."""

    def __init__(self, tokenizer_json: Path, tokenizer_config: dict | None = None) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tok = RustTokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise TokenizerError(f"{tokenizer_json}: cannot load: {exc}") from None
        config = tokenizer_config or {}
        self.special_tokens = {name: tok for name in SPECIAL_TOKEN_NAMES
                               if (tok := _token_string(config.get(name))) is not None}
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"), "eos_token")
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"), "bos_token")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _id_of(self, token: str | None, name: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"tokenizer_config.json: {name} {token!r} is not in tokenizer.json's vocabulary")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer shipped next to the weights (`tokenizer.json` first, then the tiny
    checkpoint's `byte_tokenizer.json`), or None when the checkpoint has none."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        config_path = model_dir / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        return HFTokenizer(model_dir / "tokenizer.json", config)
    path = model_dir / byte_tokenizer.FILE_NAME
    if not path.is_file():
        return None
    spec = read_json(path)
    if spec.get("type") != "byte-level":
        raise TokenizerError(f"{path}: unsupported tokenizer type {spec.get('type')!r}")
    return ByteTokenizer(int(spec["byte_offset"]), int(spec["special_tokens"]["eos"]))
