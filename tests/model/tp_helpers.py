"""Shared by the tensor-parallel tests: the shipped trained tiny checkpoint (its MTP head accepts
drafts, so speculative verify and rollback really run) and code prompts it continues."""

from __future__ import annotations

from pathlib import Path

from workers.train import byte_tokenizer

TRAINED = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny-trained"

CODE = '''import os


def read_lines(path):
    with open(path) as f:
        return [line.rstrip("\\n") for line in f]


def write_lines(path, lines):
    with open(path, "w") as f:
        for line in lines:
            f.write(line + "\\n")


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1

    def '''


def code_prompts() -> list[list[int]]:
    """Token ids of 19, 90 and 387 bytes of code (the last one spans six 64-token Mamba pages)."""
    return [byte_tokenizer.encode(text) for text in ("def __init__(self, ", CODE[:90], CODE)]
