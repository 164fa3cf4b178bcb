"""Byte-level tokenizer of the tiny trained checkpoint: id = byte + 3; 0 pad, 1 bos, 2 eos; 259..511 unused."""

from __future__ import annotations

import json
from pathlib import Path

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
FILE_NAME = "byte_tokenizer.json"


def encode(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode("utf-8")]


def decode(ids: list[int]) -> str:
    data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
    return data.decode("utf-8", errors="replace")


def write_tokenizer(out_dir: str | Path) -> None:
    """Writes the documented mapping next to the weights."""
    spec = {
        "type": "byte-level",
        "byte_offset": BYTE_OFFSET,
        "special_tokens": {"pad": PAD_ID, "bos": BOS_ID, "eos": EOS_ID},
        "rule": "token id = utf-8 byte value + byte_offset; ids >= 259 are unused",
    }
    (Path(out_dir) / FILE_NAME).write_text(json.dumps(spec, indent=2) + "\n")
