"""`HybridForCausalLM`: hybrid decoder (Mamba2 / attention / MLP / MoE blocks) over ModelCaches.

Module tree and parameter names match transformers' NemotronHForCausalLM in memory (model.embeddings,
model.layers.{i}.norm, model.layers.{i}.mixer.*, model.norm_f, lm_head; MTP under mtp.*, see mtp.py).
Granite / Bamba checkpoints are renamed onto this tree by checkpoint_names.py (their layer i is our
blocks 2i and 2i+1).

    h = embeddings(ids) * embedding_multiplier
    h = h + residual_multiplier * mixer(RMSNorm(h))        each block, pre-norm
    hidden = norm_f(h);   logits = lm_head(hidden) / logits_scaling
The multipliers are 1 except for Granite.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model import caches as cache_mod
from workers.model.caches import ModelCaches
from workers.model.config import HybridModelConfig, LayerKind
from workers.model.forward_batch import ForwardBatch, ForwardCounts
from workers.model.kernels import TORCH_KERNELS, KernelSet
from workers.model.linear import Linear
from workers.model.mamba_plan import MambaPlan
from workers.model.mixers import make_mixer
from workers.model.mtp import MTPHead
from workers.model.norms import RMSNorm
from workers.model.paged_plan import PagedPlan


class HybridBlock(nn.Module):
    """One layer: `norm` then `mixer` (kind from the pattern), residual add outside."""

    def __init__(self, config: HybridModelConfig, kind: LayerKind, kernels: KernelSet) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = make_mixer(config, kind, kernels)


class HybridBackbone(nn.Module):
    def __init__(self, config: HybridModelConfig, kernels: KernelSet) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([HybridBlock(config, k, kernels) for k in config.layer_kinds])
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class HybridForCausalLM(nn.Module):
    """The target model. Inference only: forward runs under no_grad and mutates `caches`.

    forward(batch, caches) -> hidden [T, hidden_size] after the final norm
    compute_logits(hidden) -> [T, vocab] float32
    mtp: MTPHead | None (draft head sharing embeddings and lm_head)
    """

    def __init__(
        self,
        config: HybridModelConfig,
        kernels: KernelSet = TORCH_KERNELS,
        *,
        with_mtp: bool = False,
        tie_lm_head: bool | None = None,
    ):
        super().__init__()
        self.config = config
        self.kernels = kernels
        self.model = HybridBackbone(config, kernels)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # tie_lm_head=False: a NemotronH checkpoint that stores lm_head.weight despite tie_word_embeddings
        # (transformers' NemotronH never ties: it loads lm_head.weight). See loader.py.
        self.tied = config.tie_word_embeddings if tie_lm_head is None else tie_lm_head
        if self.tied:
            self.lm_head.weight = self.model.embeddings.weight
        self.mtp: MTPHead | None = MTPHead(config, self.model.embeddings, kernels) if with_mtp else None
        self.forward_counts = ForwardCounts()  # rows this model (shard) actually ran: the work metric

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        """Run the batch's new tokens through all layers; see forward_batch.SeqChunk for cache semantics."""
        self.admit_batch(batch, caches)
        # one plan per kind for the whole step: every layer runs once over all chunks (varlen)
        plan = PagedPlan.build(batch, caches.kv_block_size, self.device) if caches.kv else None
        mamba_plan = MambaPlan.build(batch, self.device) if caches.conv else None
        return self.forward_planned(batch.input_ids.to(self.device), plan, mamba_plan, caches)

    def admit_batch(self, batch: ForwardBatch, caches: ModelCaches) -> None:
        """Validate `batch` against the caches (ForwardBatchError) and count its rows (forward_counts)."""
        batch.validate(
            caches.kv_block_size,
            caches.num_kv_blocks,
            caches.num_state_slots if self.config.mamba_layer_ids else None,
        )
        self.forward_counts = ForwardCounts(self.forward_counts.num_tokens + batch.num_tokens,
                                            self.forward_counts.num_prompt_tokens + batch.num_prompt_tokens)

    @torch.no_grad()
    def forward_planned(self, input_ids: torch.Tensor, plan: PagedPlan | None, mamba_plan: MambaPlan | None,
                        caches: ModelCaches) -> torch.Tensor:
        """The layers over a step's prebuilt plans (input_ids [T] on the model's device): device work only,
        no host reads, which is what a CUDA graph of a decode step captures (decode_graphs.py)."""
        c = self.config
        h = self.model.embeddings(input_ids)  # [T, hidden]
        if c.embedding_multiplier != 1.0:
            h = h * c.embedding_multiplier
        for i, block in enumerate(self.model.layers):
            x = block.norm(h)  # [T, hidden]
            if block.kind is LayerKind.MAMBA:
                x = block.mixer(x, mamba_plan, caches.conv[i], caches.ssm[i])
            elif block.kind is LayerKind.ATTENTION:
                x = block.mixer(x, caches.kv[i], plan)
            else:
                x = block.mixer(x)
            h = h + (x * c.residual_multiplier if c.residual_multiplier != 1.0 else x)  # [T, hidden]
        return self.model.norm_f(h)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden.to(self.dtype))  # [T, vocab]
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits.float()

    # ---- caches ----------------------------------------------------------------------------------
    def allocate_caches(
        self,
        num_kv_blocks: int,
        kv_block_size: int,
        num_state_slots: int,
        num_draft_blocks: int = 0,
        draft_block_size: int | None = None,
    ) -> ModelCaches:
        """Zeroed caches in the model's dtype and device (SSM state in config.mamba_ssm_cache_dtype)."""
        return cache_mod.allocate_caches(
            self.config,
            num_kv_blocks,
            kv_block_size,
            num_state_slots,
            num_draft_blocks if self.mtp is not None else 0,
            draft_block_size,
            dtype=self.dtype,
            device=self.device,
        )

    def kv_bytes_per_block(self, block_size: int) -> int:
        return cache_mod.kv_bytes_per_block(self.config, block_size, self.dtype)

    def draft_kv_bytes_per_block(self, block_size: int) -> int:
        return cache_mod.draft_kv_bytes_per_block(self.config, block_size, self.dtype) if self.mtp else 0

    def state_bytes_per_slot(self) -> int:
        return cache_mod.state_bytes_per_slot(self.config, self.dtype)
