"""Dense FFNs: NemotronH's `MLP` (down(act(up(x))), relu2 by default) and Granite / Bamba's `GatedMLP`
(down(silu(gate(x)) * up(x))). `make_mlp` picks one from the config."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import HybridModelConfig
from workers.model.linear import Linear

ACTIVATIONS = {
    "relu2": lambda x: F.relu(x).square(),
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
}


class MLP(nn.Module):
    """Shard-friendly: a TP rank holds intermediate/tp rows of up_proj and columns of down_proj."""

    def __init__(self, config: HybridModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.up_proj = Linear(config.hidden_size, inter, bias=config.mlp_bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.mlp_hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))  # [T, hidden]


class GatedMLP(nn.Module):
    """Granite's shared_mlp (its fused input_linear is split into gate_proj | up_proj at load time) and
    Bamba's feed_forward. Shard-friendly like MLP: gate/up rows and down columns per rank."""

    def __init__(self, config: HybridModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = Linear(config.hidden_size, inter, bias=config.mlp_bias)
        self.up_proj = Linear(config.hidden_size, inter, bias=config.mlp_bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.mlp_hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))  # [T, hidden]


def make_mlp(config: HybridModelConfig, intermediate_size: int | None = None) -> MLP | GatedMLP:
    return (GatedMLP if config.mlp_gated else MLP)(config, intermediate_size)
