"""Best-of-N's learned selector: a chunk critic (`PI05ChunkCritic`, policy family `pi05_chunk_critic`) beside a policy,
scoring each observation's candidate chunks by their expected return (`hf_vla.serving.selection`, selector `critic`).

The critic reads the policy's candidates as they are sampled (normalised actions), so it must share the policy's
action space: the same chunk size and action width, and the same action statistics (normalisation and relative dims)
for the head it scores. Anything else is refused in one line before the first observation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hf_vla.errors import ConfigError


@dataclass
class ChunkCriticScorer:
    """A loaded chunk critic, its processor and where it came from."""

    model: torch.nn.Module
    processor: object
    path: str

    def check_policy(self, policy, processor, flag: str = "--critic") -> None:
        """ConfigError, one line, where the critic cannot score this policy's chunks."""
        theirs, ours = policy.config, self.model.config
        for name in ("chunk_size", "max_action_dim"):
            if getattr(theirs, name) != getattr(ours, name):
                raise ConfigError(f"{flag} {self.path}: {name}={getattr(ours, name)}, the policy's is "
                                  f"{getattr(theirs, name)} (a critic of another action space)")
        for head, stats in processor.norm_stats.items():
            mine = self.processor.norm_stats.get(head)
            if mine is None:
                raise ConfigError(f"{flag} {self.path}: no statistics for the policy's head {head!r} (it knows "
                                  f"{', '.join(sorted(self.processor.norm_stats))}): a critic of another contract")
            if not _same(stats.get("actions"), mine.get("actions")):
                raise ConfigError(f"{flag} {self.path}: head {head!r}'s action statistics differ from the policy's (a "
                                  "critic of another action space; train it with --norm_stats_from the policy)")

    @torch.no_grad()
    def scores(self, rows: dict, head: str, candidates: torch.Tensor, dims: int) -> torch.Tensor:
        """The expected return `[N]` of one observation's candidates `[N, T, d]` (normalised; dims past `dims`, the
        head's own, zeroed). `rows`: the observation as the runner batches it (images, states, tasks, camera_mask)."""
        device = next(self.model.parameters()).device
        inputs = self.processor(images=rows["images"], text=rows["tasks"], state=rows["states"], head=head,
                                camera_mask=rows["camera_mask"])
        inputs = {k: v.to(device) for k, v in inputs.items()
                  if k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}
        mask = torch.zeros(1, candidates.shape[-1], device=device)
        mask[:, :dims] = 1.0
        return self.model.chunk_values(candidates[None].to(device).float(), action_dim_mask=mask, **inputs)[0].cpu()


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if set(a) != set(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list | tuple | np.ndarray) and isinstance(y, list | tuple | np.ndarray):
            x, y = np.asarray(x), np.asarray(y)
            if x.shape != y.shape or not np.allclose(x.astype(float), y.astype(float), rtol=1e-6, atol=1e-6):
                return False
        elif x != y:
            return False
    return True


def load_critic(checkpoint: str | Path, device: str = "cpu", flag: str = "--critic") -> ChunkCriticScorer:
    """A chunk critic from a directory (or Hub id) trained with `python -m hf_vla.train` and policy
    `pi05_chunk_critic`; ConfigError, one line, for anything else."""
    from hf_vla.hub.resolve import load_scorer

    model, processor = load_scorer(checkpoint, device, flag, "chunk_critic", "a chunk critic (train one with python "
                                   "-m hf_vla.train and policy pi05_chunk_critic; docs/best_of_n.md)")
    return ChunkCriticScorer(model.requires_grad_(False), processor, str(checkpoint))


def critic_flag(checkpoint: str | None, device: str = "cpu") -> ChunkCriticScorer | None:
    """A command's `--critic`: the critic loaded where the policy runs, or None without the flag."""
    return None if checkpoint is None else load_critic(checkpoint, device=device)


__all__ = ["ChunkCriticScorer", "critic_flag", "load_critic"]
