"""make_* / run_* helpers for model-layer tests: checkpoints, block tables, prefill and decode loops."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from workers.model.caches import ModelCaches
from workers.model.forward_batch import ForwardBatch, SeqChunk
from workers.model.hybrid import HybridForCausalLM
from workers.model.init_model import main as init_model_main

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "configs" / "models" / "tiny-nemotron-h.yaml"


def make_checkpoint(out: Path, *, seed: int = 0, mtp: bool = True, yaml_path: Path = TINY_YAML) -> Path:
    argv = ["--config", str(yaml_path), "--out", str(out), "--seed", str(seed)]
    assert init_model_main(argv + ([] if mtp else ["--no-mtp"])) == 0
    return out


def make_tokens(n: int, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def make_table(num_blocks: int, seed: int, pool: int) -> torch.Tensor:
    """A scrambled block table of `num_blocks` distinct ids out of `pool` (so paging is really exercised)."""
    return torch.randperm(pool, generator=torch.Generator().manual_seed(seed))[:num_blocks]


def run_chunks(
    model: HybridForCausalLM,
    caches: ModelCaches,
    ids: torch.Tensor,
    splits: Sequence[int],
    table: torch.Tensor,
    slot: int,
    start: int = 0,
) -> torch.Tensor:
    """Feed ids in consecutive chunks of the given sizes (context carried through caches); returns
    logits [len(ids), vocab]."""
    assert sum(splits) == len(ids)
    out, pos = [], 0
    for n in splits:
        chunk = SeqChunk(start + pos, n, table, slot)
        out.append(model.compute_logits(model.forward(ForwardBatch(ids[pos : pos + n], (chunk,)), caches)))
        pos += n
    return torch.cat(out)


def greedy_ours(
    model: HybridForCausalLM, prompt: torch.Tensor, num_new: int, block_size: int = 16
) -> list[int]:
    """Prefill the prompt in one chunk, then 1-token decode steps through the caches."""
    total = len(prompt) + num_new
    num_blocks = -(-total // block_size)
    caches = model.allocate_caches(num_blocks + 3, block_size, 2)
    table = make_table(num_blocks, 7, num_blocks + 3)
    logits = run_chunks(model, caches, prompt, [len(prompt)], table, slot=1)
    tokens, n = [], len(prompt)
    for _ in range(num_new):
        t = logits[-1:].argmax(-1)
        tokens.append(int(t))
        logits = run_chunks(model, caches, t, [1], table, slot=1, start=n)
        n += 1
    return tokens


def greedy_hf_nocache(hf, prompt: torch.Tensor, num_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers reference: full forward of the growing sequence each step (no cache)."""
    seq, step_logits = prompt.clone(), []
    with torch.no_grad():
        for _ in range(num_new):
            last = hf(seq[None]).logits[0, -1]
            step_logits.append(last)
            seq = torch.cat([seq, last.argmax()[None]])
    return seq[len(prompt) :].tolist(), step_logits
