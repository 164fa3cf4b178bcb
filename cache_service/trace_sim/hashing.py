"""Block hashes of trace requests, memoised per (parent hash, trace block id).

A trace block id always stands for the same 512 tokens (`trace.TraceRequest.tokens`), so the
hashes of a full trace block depend only on the chain's hash before it and the id: siblings and
follow-up turns share most of their blocks and re-hash none of them. The blocks after the
memoised run (new ones and a partial last block) are hashed from their tokens in one call. The
result is the `RequestBlockHashes` the real block hash code computes from the same tokens
(`tests/sim/test_trace_sim.py` checks it).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

from cache_service.block_hash import BlockHash, RequestBlockHashes
from cache_service.trace_sim.trace import TRACE_BLOCK_TOKENS, TraceRequest


class TraceHasher:
    def __init__(self, hash_block_size: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> None:
        if block_tokens % hash_block_size:
            raise ValueError(f"trace blocks of {block_tokens} tokens are not a multiple of the "
                             f"hash block size {hash_block_size}")
        self.hash_block_size = hash_block_size
        self.block_tokens = block_tokens
        self._memo: dict[tuple[BlockHash, int], tuple[BlockHash, ...]] = {}
        self._offsets = np.arange(1, block_tokens + 1, dtype=np.uint64)

    def tokens_of(self, block_ids: Sequence[int], num_tokens: int) -> array.array:
        """The first `num_tokens` tokens of the trace blocks `block_ids`, packed as the hash code
        packs them (one array, so a run of new blocks is hashed in one call)."""
        ids = np.asarray(block_ids, dtype=np.uint64) * np.uint64(self.block_tokens)
        tokens = (ids[:, None] + self._offsets[None, :]).ravel()[:num_tokens]
        return array.array("Q", tokens.tobytes())

    def hashes(self, req: TraceRequest) -> RequestBlockHashes:
        out = RequestBlockHashes(self.hash_block_size)
        num_full, rest = divmod(req.input_length, self.block_tokens)
        memo, chain, ids = self._memo, out.hashes, req.hash_ids
        per_block = self.block_tokens // self.hash_block_size
        i = 0
        while i < num_full:  # the memoised run of full blocks
            block = memo.get((chain[-1] if chain else out.root, ids[i]))
            if block is None:
                break
            chain.extend(block)
            i += 1
        out.num_tokens = len(chain) * self.hash_block_size
        if i < len(ids):  # the rest in one go: new full blocks (memoised after) and the partial one
            start = len(chain)
            out.append(self.tokens_of(ids[i:], req.input_length - i * self.block_tokens))
            parent = chain[start - 1] if start else out.root
            for j in range(i, num_full):
                block = tuple(chain[start: start + per_block])
                memo[(parent, ids[j])] = block
                parent = block[-1]
                start += per_block
        return out
