"""Chained 128-bit block hashes.

Tokens are hashed in blocks of `hash_block_size` tokens (gcd of the group block sizes):

    root  = H("hybridserve/v1", model_fingerprint, cache_salt)
    h_i   = H(h_{i-1}, tokens[i*h : (i+1)*h], extra_keys)

so `hashes[i]` names the whole prefix [0, (i+1)*h). A prefix of L tokens (L a multiple of h)
is named by `hashes[L // h - 1]`; this one key serves attention blocks of any size that is a
multiple of h and Mamba snapshots at L. The salt is folded into the root, so two tenants never
share a key and cannot probe each other's prefixes. H is xxh3-128, never Python's `hash()`.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", bytes)

_ROOT_TAG = b"hybridserve/v1"


def _field(value: str | bytes | None) -> bytes:
    raw = b"" if value is None else (value.encode() if isinstance(value, str) else value)
    return len(raw).to_bytes(4, "little") + raw


def root_hash(model_fingerprint: str = "", cache_salt: str | None = None) -> BlockHash:
    """The chain's root: covers the model and the tenant (cache_salt)."""
    return BlockHash(xxhash.xxh3_128_digest(_ROOT_TAG + _field(model_fingerprint) + _field(cache_salt)))


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        return array.array("Q", tokens).tobytes()
    except OverflowError:
        raise ValueError("token ids must be non-negative 64-bit integers") from None


class RequestBlockHashes:
    """The block hashes of one request, computed once and extended as tokens are appended.

    `extra_keys` (e.g. a LoRA adapter name) are mixed into every block, so the same tokens under
    another adapter never collide. Partial trailing blocks are kept as pending tokens until full.
    `known`: the full blocks' hashes of `tokens`, computed elsewhere with the same root (the front
    door hashed the prompt to route it): adopted instead of hashed again.
    """

    __slots__ = ("hash_block_size", "root", "hashes", "_extra", "_pending", "num_tokens")

    def __init__(
        self,
        hash_block_size: int,
        tokens: Sequence[int] = (),
        *,
        model_fingerprint: str = "",
        cache_salt: str | None = None,
        extra_keys: Sequence[str] = (),
        known: Sequence[BlockHash] | None = None,
    ) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
        self.hash_block_size = hash_block_size
        self.root = root_hash(model_fingerprint, cache_salt)
        self.hashes: list[BlockHash] = []
        self._extra = b"".join(_field(k) for k in extra_keys)
        self._pending: list[int] = []
        self.num_tokens = 0
        if known is None:
            self.append(tokens)
            return
        num_full = len(tokens) // hash_block_size
        if len(known) != num_full:
            raise ValueError(f"{len(known)} known hashes for {len(tokens)} tokens (h={hash_block_size}: {num_full})")
        self.hashes.extend(known)
        self._pending.extend(tokens[num_full * hash_block_size :])
        self.num_tokens = len(tokens)

    def append(self, tokens: Sequence[int]) -> int:
        """Append tokens; hash every block they complete. Returns the number of new hashes."""
        if not tokens:
            return 0
        size = self.hash_block_size
        pending = self._pending
        if len(pending) + len(tokens) < size:  # no block completes (most decode steps): nothing to hash
            pending.extend(tokens)
            self.num_tokens += len(tokens)
            return 0
        if pending:
            need = size - len(pending)
            pending.extend(tokens[:need])
            tokens = tokens[need:]
        before = len(self.hashes)
        digest = xxhash.xxh3_128_digest
        extra = self._extra
        parent = self.hashes[-1] if self.hashes else self.root
        if len(pending) == size:
            parent = BlockHash(digest(parent + _pack_tokens(pending) + extra))
            self.hashes.append(parent)
            pending.clear()
        num_full = len(tokens) // size * size
        if num_full:
            data = _pack_tokens(tokens[:num_full])
            stride = size * 8
            out = self.hashes
            for start in range(0, len(data), stride):
                parent = digest(parent + data[start : start + stride] + extra)
                out.append(parent)
        pending.extend(tokens[num_full:])
        self.num_tokens = len(self.hashes) * size + len(pending)
        return len(self.hashes) - before

    def prefix_hash(self, num_tokens: int) -> BlockHash:
        """The key of the prefix [0, num_tokens); num_tokens must be a positive multiple of h."""
        index, rem = divmod(num_tokens, self.hash_block_size)
        if rem or index <= 0 or index > len(self.hashes):
            raise ValueError(
                f"no block hash for a {num_tokens}-token prefix "
                f"(h={self.hash_block_size}, {len(self.hashes)} full blocks hashed)"
            )
        return self.hashes[index - 1]
