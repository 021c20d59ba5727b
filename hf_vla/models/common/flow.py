"""Flow matching's time distribution, shared by the policies that predict a velocity: t ~ Beta(alpha, beta) * scale +
offset (pi0 and pi0.5 as published: Beta(1.5, 1) * 0.999 + 0.001), from a config's `time_sampling_*` fields. The
trainer draws the same law per sample by identity (`hf_vla.training.losses`); this is the model's own draw, from the
global RNG, for a forward given actions but no time."""

from __future__ import annotations

import torch

# classifier-free guidance's largest beta, v_u + beta (v_c - v_u): RECAP uses about 1..3; far beyond, the guided
# velocity leaves any action range and, near float's limit, overflows to inf / NaN actions
MAX_CFG_BETA = 100.0


def sample_time(config, batch_size: int, device) -> torch.Tensor:
    """`[batch_size]` flow-matching times from `config`'s Beta(time_sampling_beta_alpha, time_sampling_beta_beta),
    scaled by time_sampling_scale and shifted by time_sampling_offset."""
    beta = torch.distributions.Beta(torch.tensor(config.time_sampling_beta_alpha),
                                    torch.tensor(config.time_sampling_beta_beta))
    return (beta.sample((batch_size,)) * config.time_sampling_scale + config.time_sampling_offset).to(device)


__all__ = ["MAX_CFG_BETA", "sample_time"]
