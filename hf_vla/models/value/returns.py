"""RECAP's arithmetic (pi*0.6, arXiv 2511.14759, Sec. IV-V and its Appendix; constants as lerobot's `feat/add-recap`
branch and OpenTau document them, docs/recap.md):

- rewards: -1 per step, 0 at the last step of a successful episode, `-failure_cost` at the last step of a failed one
  (default: the task's episode limit, so any failure is worse than any success);
- the return of frame t is the sum of the rewards from t to the end, normalised by the task's episode limit plus the
  failure cost (OpenTau's normalisation) and clipped to [-1, 0]: a success k steps away is -k / (limit + cost), a
  failure k steps away -(k - 1 + cost) / (limit + cost), so failures keep their time order (an earlier frame of a
  failed episode is worse) instead of all clipping to -1;
- the value model predicts a distribution over `num_bins` bins on [-1, 0] (201: a bin every 0.005), trained with
  cross-entropy against the bin of the return (one-hot, "Dirac") or a Gaussian smeared over neighbouring bins
  ("HL-Gauss");
- the advantage of frame t is the N-step estimate sum_{k<N} r_{t+k} / limit + V(t+N) - V(t) (Monte-Carlo: the
  return itself minus V(t), where the episode ends within N steps);
- a per-task threshold makes `positive_fraction` of a task's frames "Advantage: positive"; frames where a person
  intervened are always positive.

Pure numpy, float64: the annotation and the value model's targets both come from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RecapSettings:
    """RECAP's constants. num_bins: the value distribution's bins on [-1, 0]; failure_cost: the reward of a failed
    episode's last step, in steps (None: the task's episode limit; a failure is then worse than any success); lookahead: N of the N-step advantage
    (None: Monte-Carlo); positive_fraction: the share of each task's frames marked positive; targets: "dirac" or
    "hl_gauss" (sigma in bins, `hl_gauss_sigma`)."""

    num_bins: int = 201
    failure_cost: float | None = None
    lookahead: int | None = 50
    positive_fraction: float = 0.3
    targets: str = "dirac"
    hl_gauss_sigma: float = 0.75


def failure_cost_of(max_episode_steps: int, failure_cost: float | None = None) -> float:
    """The failure cost in steps: the given one, else the task's episode limit."""
    return float(max_episode_steps if failure_cost is None else failure_cost)


def return_scale(max_episode_steps: int, failure_cost: float | None = None) -> float:
    """What returns are divided by: the episode limit plus the failure cost (the lowest return of an episode within
    its limit is then -1)."""
    if max_episode_steps < 1:
        raise ValueError(f"max_episode_steps={max_episode_steps}: the task's episode limit must be positive")
    return float(max_episode_steps) + failure_cost_of(max_episode_steps, failure_cost)


def episode_returns(length: int, success: bool, max_episode_steps: int,
                    failure_cost: float | None = None) -> np.ndarray:
    """Each frame's normalised return `[length]` on [-1, 0] (float64)."""
    if length < 1:
        raise ValueError(f"an episode of {length} frames")
    scale = return_scale(max_episode_steps, failure_cost)
    rewards = step_rewards(length, success, failure_cost_of(max_episode_steps, failure_cost))
    returns = np.cumsum(rewards[::-1])[::-1]
    return np.clip(returns / scale, -1.0, 0.0)


def step_rewards(length: int, success: bool, failure_cost: float = 1000.0) -> np.ndarray:
    """-1 per step, the last step 0 (success) or -failure_cost (failure)."""
    rewards = -np.ones(length, dtype=np.float64)
    rewards[-1] = 0.0 if success else -float(failure_cost)
    return rewards


def bin_centers(num_bins: int = 201) -> np.ndarray:
    """The value bins' centres, -1 .. 0 inclusive."""
    return np.linspace(-1.0, 0.0, num_bins)


def value_to_bin(values: np.ndarray, num_bins: int = 201) -> np.ndarray:
    """The nearest bin of each value in [-1, 0] (values outside are clipped)."""
    scaled = (np.clip(np.asarray(values, dtype=np.float64), -1.0, 0.0) + 1.0) * (num_bins - 1)
    return np.rint(scaled).astype(np.int64)


def hl_gauss_targets(values: np.ndarray, num_bins: int = 201, sigma_bins: float = 0.75) -> np.ndarray:
    """HL-Gauss targets (Farebrother et al. 2024): the probability mass of a Gaussian at each value (std
    `sigma_bins` bin widths) that falls in each bin, the bins' edges half way between centres, the outer edges at
    -inf / +inf so each row sums to 1. `[n, num_bins]` float64."""
    import torch

    values = np.clip(np.asarray(values, dtype=np.float64), -1.0, 0.0)[:, None]
    width = 1.0 / (num_bins - 1)
    edges = np.concatenate([[-np.inf], bin_centers(num_bins)[:-1] + width / 2, [np.inf]])
    cdf = 0.5 * (1 + torch.special.erf(torch.from_numpy((edges[None] - values) / (sigma_bins * width * np.sqrt(2)))))
    cdf = cdf.numpy()
    return np.diff(cdf, axis=1)


def advantages(returns: np.ndarray, values: np.ndarray, success: bool, max_episode_steps: int,
               lookahead: int | None = 50, failure_cost: float | None = None) -> np.ndarray:
    """Each frame's advantage `[n]` (float64): `lookahead` None is Monte-Carlo (return - value); otherwise the N-step
    estimate, the normalised rewards of the next N steps plus the value N steps on, minus the value here; where the
    episode ends within N steps the rest of the return stands in for the bootstrap."""
    returns, values = np.asarray(returns, dtype=np.float64), np.asarray(values, dtype=np.float64)
    n = len(returns)
    if len(values) != n:
        raise ValueError(f"{len(values)} values for {n} returns")
    if lookahead is None:
        return returns - values
    if lookahead < 1:
        raise ValueError(f"lookahead={lookahead}: at least 1 step")
    rewards = (step_rewards(n, success, failure_cost_of(max_episode_steps, failure_cost))
               / return_scale(max_episode_steps, failure_cost))
    partial = np.concatenate([np.cumsum(rewards[::-1])[::-1], [0.0]])  # partial[t] = sum of rewards t..end
    t = np.arange(n)
    ahead = t + lookahead
    inside = ahead < n
    estimate = np.where(inside, partial[t] - partial[np.minimum(ahead, n)] + values[np.minimum(ahead, n - 1)],
                        returns)
    return estimate - values


def positive_threshold(values: np.ndarray, positive_fraction: float) -> float:
    """The threshold whose `values > threshold` are `round(positive_fraction * n)` of them: the midpoint between
    the k-th largest value and the next (ties at the boundary can make the count differ by the tie's size)."""
    values = np.sort(np.asarray(values, dtype=np.float64))[::-1]
    if not 0.0 < positive_fraction < 1.0:
        raise ValueError(f"positive_fraction={positive_fraction}: in (0, 1)")
    k = int(round(positive_fraction * len(values)))
    if k <= 0:
        return float(values[0]) if len(values) else 0.0
    if k >= len(values):
        return float(values[-1]) - 1.0
    return float((values[k - 1] + values[k]) / 2)


__all__ = ["RecapSettings", "advantages", "bin_centers", "episode_returns", "failure_cost_of", "hl_gauss_targets",
           "positive_threshold", "return_scale", "step_rewards", "value_to_bin"]
