"""One block's mixer by its kind: Mamba2, paged attention, MoE or MLP (the backbone's and the MTP
head's blocks are built the same way)."""

from __future__ import annotations

from torch import nn

from workers.model.attention import PagedAttention
from workers.model.config import HybridModelConfig, LayerKind
from workers.model.kernels import KernelSet
from workers.model.mamba2 import Mamba2Mixer
from workers.model.mlp import make_mlp
from workers.model.moe import MoE


def make_mixer(config: HybridModelConfig, kind: LayerKind, kernels: KernelSet) -> nn.Module:
    if kind is LayerKind.MAMBA:
        return Mamba2Mixer(config, kernels)
    if kind is LayerKind.ATTENTION:
        return PagedAttention(config, kernels)
    if kind is LayerKind.MOE:
        return MoE(config)
    return make_mlp(config)
