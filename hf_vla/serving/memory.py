"""One episode's past observations for a MEM policy at inference (`PolicyRunner`, and through it evaluation, RL
rollouts, the server's sessions and the lerobot plugin).

Training reads, for each frame, the frames `stride`, 2 `stride`, ... dataset frames back within its episode (padded
before the episode's start). At inference every control step is one such frame, so the runner keeps a dense ring of
the last `(frames - 1) * stride + 1` observations, one per step, and samples the past by age from the newest: keeping
only every `stride`-th observation would pin the past to a grid and drift up to `stride` steps out of phase with
training. As lerobot's queue, an age before the episode's first observation is padding (masked; its values are the
first observation's).

Each call that acts records its own observation (as lerobot's `select_action` and `predict_action_chunk` do) and
`observe` records the steps without a chunk; a caller that recorded the acted-on observation already (the episode
loop, which observes every step and, with an inference delay, acts on an observation some steps old) says how many
steps back it is (`past(lag=...)`), so the past is sampled from that observation as in training.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch


class ObservationMemory:
    """The last observations of one episode (`record` one per control step; `reset` at an episode's start) and the
    past they give the processor (`past`: its `memory=` argument)."""

    def __init__(self, frames: int, stride: int, visual: bool = True, proprio: bool = True):
        if frames < 1 or stride < 1:
            raise ValueError(f"ObservationMemory: frames={frames} and stride={stride} must be at least 1")
        self.frames, self.stride, self.visual, self.proprio = int(frames), int(stride), bool(visual), bool(proprio)
        self.history: deque = deque(maxlen=(self.frames - 1) * self.stride + 1)
        self.seen = 0

    @property
    def horizon(self) -> int:
        """Observations the oldest past one lies behind the newest: `(frames - 1) * stride`."""
        return (self.frames - 1) * self.stride

    def reserve(self, lag: int) -> None:
        """Keep enough observations to sample the past of one `lag` steps behind the newest (`past(lag=...)`)."""
        size = self.horizon + 1 + max(0, int(lag))
        if size > self.history.maxlen:
            self.history = deque(self.history, maxlen=size)

    @classmethod
    def from_settings(cls, settings: dict | None, stride: int | None = None) -> ObservationMemory | None:
        """From a processor's `memory` settings (None: no memory); `stride` in control steps when it differs from
        the dataset's (`hf_vla.deployment.contract.memory_stride`)."""
        if not settings:
            return None
        return cls(settings["frames"], stride or settings["stride"], settings["visual"], settings["proprio"])

    def reset(self) -> None:
        self.history.clear()
        self.seen = 0

    def record(self, images: torch.Tensor, state: np.ndarray) -> None:
        """One control step's observation: camera images `[n_cams, 3, H, W]` (as the processor takes them) and the
        raw state `[state_dim]`."""
        images = images.clone() if self.visual else None
        self.history.append((images, np.array(state, dtype=np.float32, copy=True)))
        self.seen += 1

    def past(self, lag: int = 0) -> dict:
        """The processor's `memory=` for one row: the `frames - 1` observations `stride` steps apart before the acted-on
        one (the newest, or the one `lag` steps behind it), oldest first (`images` `[1, n_cams, T-1, 3, H, W]`,
        `state` `[1, T-1, d]`, `mask` `[1, T-1]`)."""
        if not self.history:
            raise ValueError("ObservationMemory.past: no observation recorded in this episode yet")
        lag = int(lag)
        if not 0 <= lag < min(self.seen, self.history.maxlen - self.horizon):
            raise ValueError(f"ObservationMemory.past: lag={lag} steps; {self.seen} observation(s) recorded, "
                             f"{self.history.maxlen - self.horizon - 1} step(s) of lag reserved (`reserve`)")
        ages = [age * self.stride for age in range(self.frames - 1, 0, -1)]
        newest = len(self.history) - 1 - lag
        picked = [self.history[max(0, newest - age)] for age in ages]
        out = {"mask": torch.tensor([[self.seen - lag > age for age in ages]], dtype=torch.bool),
               "state": torch.from_numpy(np.stack([state for _, state in picked]) if picked else
                                         np.zeros((0, len(self.history[-1][1])), np.float32))[None]}
        if self.visual:
            newest = self.history[newest][0]
            out["images"] = (torch.stack([images for images, _ in picked], dim=1) if picked else
                             newest.new_zeros(newest.shape[0], 0, *newest.shape[1:]))[None]
        return out


__all__ = ["ObservationMemory"]
