"""pi0.5's critic for PPO fine-tuning (`config.value_head`), a part the model holds and saves with the policy;
`hf_vla.rl.critic` adds, runs and trains it (the model's forward never calls it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_pi05 import PI05Config


class PI05ValueHead(nn.Module):
    """The critic of PPO fine-tuning (`config.value_head`): LayerNorm, Linear, GELU, Linear(1) on the mean over the
    real prefix tokens of the hidden states entering the VLM's last layer (the prefix computation sampling runs
    anyway: the last layer only gives its keys/values). The output layer starts at zero, so a new critic predicts 0."""

    def __init__(self, config: PI05Config):
        super().__init__()
        width = config.vlm_config.text_config.hidden_size
        self.norm = nn.LayerNorm(width)
        self.dense = nn.Linear(width, width)
        self.out = nn.Linear(width, 1)

    def forward(self, hidden: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        weights = valid.to(torch.float32)[..., None]
        pooled = (hidden.float() * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        pooled = self.norm(pooled.to(self.norm.weight.dtype))
        return self.out(F.gelu(self.dense(pooled))).squeeze(-1).float()


__all__ = ["PI05ValueHead"]
