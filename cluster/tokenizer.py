"""Tokenizers the front end can use to accept text and return it, and incremental detokenizing.

A tokenizer is any object with `encode(text) -> list[int]` and `decode(ids) -> str`; one that
also has `decode_bytes(ids) -> bytes` (byte-level) gets an exact streaming decoder. Streaming
text must not split a multi-byte character across chunks, so `IncrementalDecoder` holds back
incomplete UTF-8 sequences until their last byte arrives; whatever is still incomplete when the
request finishes becomes U+FFFD, exactly as the one-shot `decode` renders it.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Protocol

from workers.train import byte_tokenizer


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """The trained tiny checkpoint's tokenizer (`byte_tokenizer.json`): id = UTF-8 byte + offset;
    special and unused ids decode to nothing."""

    def __init__(self, byte_offset: int = byte_tokenizer.BYTE_OFFSET, eos_token_id: int = byte_tokenizer.EOS_ID):
        self.byte_offset = byte_offset
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return [b + self.byte_offset for b in text.encode("utf-8")]

    def decode_bytes(self, ids: list[int]) -> bytes:
        lo = self.byte_offset
        return bytes(i - lo for i in ids if lo <= i < lo + 256)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """The tokenizer shipped next to the weights, or None when the checkpoint has none."""
    path = Path(model_dir) / byte_tokenizer.FILE_NAME
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    if spec.get("type") != "byte-level":
        raise ValueError(f"{path}: unsupported tokenizer type {spec.get('type')!r}")
    return ByteTokenizer(int(spec["byte_offset"]), int(spec["special_tokens"]["eos"]))


class IncrementalDecoder:
    """Turns a stream of token-id chunks into text chunks whose concatenation equals
    `tokenizer.decode(all_ids)`."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes = hasattr(tokenizer, "decode_bytes")
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._num_emitted_chars = 0

    def feed(self, new_ids: list[int], final: bool = False) -> str:
        if self._bytes:
            return self._utf8.decode(self.tokenizer.decode_bytes(new_ids), final=final)
        # generic tokenizers: re-decode everything, hold back a trailing replacement char
        # (usually an incomplete character) until more ids arrive or the request ends
        self._ids += new_ids
        text = self.tokenizer.decode(self._ids)
        end = len(text) if final else len(text.rstrip("\ufffd"))
        out = text[self._num_emitted_chars:end]
        self._num_emitted_chars = max(self._num_emitted_chars, end)
        return out
