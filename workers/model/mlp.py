"""NemotronH MLP: down_proj(act(up_proj(x))), no gate; `relu2` = relu(x)^2 by default."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.config import HybridModelConfig

ACTIVATIONS = {
    "relu2": lambda x: F.relu(x).square(),
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
}


class MLP(nn.Module):
    """Shard-friendly: a TP rank would hold intermediate_size/tp rows of up_proj and columns of down_proj."""

    def __init__(self, config: HybridModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.mlp_hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))  # [T, hidden]
