"""DeepSeek-style MTP draft head (NemotronH-MTP layout, one step: num_nextn_predict_layers = 1).

For position p with target hidden h_p (after the target's final norm) and the next token t_{p+1}:

    x = eh_proj(cat(enorm(embed(t_{p+1})), hnorm(h_p)))           layers[0] holds enorm, hnorm, eh_proj
    x = x + mixer_j(norm_j(x))   for each layer j of mtp_hybrid_override_pattern (default '*-')
    out = final_layernorm(x)                                         on the last layer

Attention layers attend over their own paged pool (ModelCaches.draft_kv[j]) with no positional
embedding, like the target's. The embedding and lm_head are the target's (not stored under mtp.*).
Checkpoint names: mtp.layers.{j}.{enorm,hnorm,eh_proj,norm,mixer.*,final_layernorm}.weight.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.caches import ModelCaches
from workers.model.config import HybridModelConfig, LayerKind
from workers.model.forward_batch import ForwardBatch
from workers.model.kernels import KernelSet
from workers.model.linear import Linear
from workers.model.mixers import make_mixer
from workers.model.norms import RMSNorm
from workers.model.paged_plan import PagedPlan


class MTPLayer(nn.Module):
    def __init__(
        self, config: HybridModelConfig, kind: LayerKind, kernels: KernelSet, *, first: bool, last: bool
    ) -> None:
        super().__init__()
        self.kind = kind
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        if first:
            self.enorm = RMSNorm(hidden, eps)
            self.hnorm = RMSNorm(hidden, eps)
            self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)
        self.mixer = make_mixer(config, kind, kernels)
        if last:
            self.final_layernorm = RMSNorm(hidden, eps)


class MTPHead(nn.Module):
    """forward(prev_hidden [T, H], batch, caches) -> mtp hidden [T, H]; draft logits come from the
    target's compute_logits. batch.input_ids are the NEXT tokens (t_{p+1} for the row of position p);
    chunk block tables index caches.draft_kv; state slots are ignored."""

    def __init__(self, config: HybridModelConfig, embeddings: nn.Embedding, kernels: KernelSet) -> None:
        super().__init__()
        kinds = config.mtp_layer_kinds
        self.layers = nn.ModuleList(
            [
                MTPLayer(config, k, kernels, first=j == 0, last=j == len(kinds) - 1)
                for j, k in enumerate(kinds)
            ]
        )
        self._shared = (embeddings,)  # a tuple keeps the target's embedding out of mtp.* parameters

    @torch.no_grad()
    def forward(self, prev_hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        self.admit_batch(batch, caches)
        if prev_hidden.shape[0] != batch.num_tokens:
            raise ValueError(f"prev_hidden has {prev_hidden.shape[0]} rows for {batch.num_tokens} tokens")
        device = self._shared[0].weight.device
        plan = PagedPlan.build(batch, caches.draft_block_size, device) if caches.draft_kv else None
        return self.forward_planned(batch.input_ids.to(device), prev_hidden, plan, None, caches)

    def admit_batch(self, batch: ForwardBatch, caches: ModelCaches) -> None:
        """Validate `batch` against the draft pool (ForwardBatchError)."""
        batch.validate(caches.draft_block_size, caches.num_draft_blocks, None)

    @torch.no_grad()
    def forward_planned(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, plan: PagedPlan | None,
                        mamba_plan, caches: ModelCaches) -> torch.Tensor:
        """The head over a prebuilt plan (input_ids [T] on the device): device work only (what a CUDA
        graph of a draft step captures). `mamba_plan` is unused: the head has no Mamba layers."""
        del mamba_plan
        embeddings = self._shared[0]
        first = self.layers[0]
        e = embeddings(input_ids)  # [T, H]
        h = prev_hidden.to(e.device, e.dtype)  # [T, H]
        x = first.eh_proj(torch.cat([first.enorm(e), first.hnorm(h)], dim=-1))  # [T, H]
        for j, layer in enumerate(self.layers):
            if layer.kind is LayerKind.ATTENTION:
                if j not in caches.draft_kv:
                    raise ValueError("caches have no draft KV pool: allocate_caches(num_draft_blocks=...)")
                x = x + layer.mixer(layer.norm(x), caches.draft_kv[j], plan)
            else:
                x = x + layer.mixer(layer.norm(x))
        return self.layers[-1].final_layernorm(x)  # [T, H]
