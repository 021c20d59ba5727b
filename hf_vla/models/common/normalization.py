"""Normalisation modes and relative (delta) actions: what turns robot units into the model's and back.

One implementation for the processor (training batches, inference), the policy runner (evaluate, serve, RL rollouts,
DAgger), the data statistics and the checkpoint conversion. It lives in the model folder (torch and numpy only), so a
checkpoint loaded with `trust_remote_code` where hf_vla is not installed normalises the same way; a bad value is a
`ValueError` naming it (the commands turn it into their one-line refusal). Everything a head needs is in its
statistics (`norm_stats[head][key]`, saved with the processor), so a checkpoint runs right with no flag:

- `mode` (`state` and `actions` each): lerobot's `NormalizationMode` names, with lerobot's formulas
  (`lerobot/processor/normalize_processor.py`, eps 1e-8):
  - `QUANTILES` (pi0.5's default; a stats dict without `mode` is this): `2 (x - q01) / (q99 - q01) - 1`;
  - `QUANTILE10`: the same with q10 / q90; `MIN_MAX`: with min / max;
  - `MEAN_STD`: `(x - mean) / (std + eps)`, inverse `x * std + mean`;
  - `IDENTITY`: unchanged.
  A degenerate dimension (a span or std below `DEGENERATE_EPS`: a constant joint) maps to 0 and back to its constant,
  where lerobot's formulas divide by eps (a value off the constant by 1e-3 becomes 1e5): the one place hf_vla
  departs from lerobot, on purpose.
- `relative_mask` (`actions` only): dims that are offsets from the frame's state, as openpi's `DeltaActions` /
  `AbsoluteActions` and lerobot's `use_relative_actions`: `relative = action - state[..., :len(mask)] * mask` for
  every step of a chunk (all relative to the frame's own state), `absolute = relative + state * mask`; dims past the
  mask are absolute. The action statistics of such a head are those of the relative chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10")
DEFAULT_MODE = "QUANTILES"
# the statistics each mode reads (lower, upper) or (centre, scale)
NEEDS = {"IDENTITY": (), "MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"),
         "QUANTILE10": ("q10", "q90")}
STAT_NAMES = ("mean", "std", "min", "max", "q01", "q10", "q90", "q99")  # the numeric statistics a head may carry
EPS = 1e-8  # lerobot's
DEGENERATE_EPS = 1e-6  # a span or std below it is a constant dim
KEYS = {"state": "state", "actions": "actions", "action": "actions", "STATE": "state", "ACTION": "actions"}


def parse_mode(value, where: str) -> str:
    """A mode name (lerobot's enum names, any case, or `NormalizationMode.X`), or one line naming `where`."""
    text = str(getattr(value, "value", value)).split(".")[-1].upper()
    if text not in MODES:
        raise ValueError(f"{where}: normalization mode {value!r} is not one of {list(MODES)}")
    return text


def parse_mapping(value, where: str) -> dict[str, str]:
    """`{"state": mode, "actions": mode}` from hf_vla's keys or lerobot's `normalization_mapping` (`STATE`, `ACTION`;
    `VISUAL` must be IDENTITY: images are scaled to [-1, 1] as SigLIP needs, never normalised by statistics)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a dict such as {{'state': 'MEAN_STD', 'actions': 'MEAN_STD'}}, got "
                          f"{type(value).__name__}")
    out = {}
    for key, mode in value.items():
        if str(key).upper() == "VISUAL":
            if parse_mode(mode, f"{where}.{key}") != "IDENTITY":
                raise ValueError(f"{where}.{key}={mode!r}: images are scaled to [-1, 1] (SigLIP's input), never "
                                  "normalised by statistics; only IDENTITY is honoured")
            continue
        if key not in KEYS:
            raise ValueError(f"{where}: unknown key {key!r}; use 'state' and 'actions' (or lerobot's STATE, "
                              "ACTION, VISUAL)")
        out[KEYS[key]] = parse_mode(mode, f"{where}.{key}")
    return out


def mode_of(stats: dict) -> str:
    return stats.get("mode", DEFAULT_MODE)


def missing_stats(stats: dict, mode: str | None = None) -> list[str]:
    """The statistics `mode` (default: the stats' own) needs and `stats` lacks."""
    return [name for name in NEEDS[mode or mode_of(stats)] if name not in stats]


def _tensor(value, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(np.asarray(value, dtype=np.float32), device=like.device)


def _bounds(stats: dict, values: torch.Tensor, what: str):
    mode = mode_of(stats)
    absent = missing_stats(stats, mode)
    if absent:
        raise ValueError(f"{what}: {mode} normalisation needs {' and '.join(absent)}, which its statistics lack")
    low, high = (_tensor(stats[name], values) for name in NEEDS[mode])
    if low.shape[-1] != values.shape[-1]:
        raise ValueError(f"{what} has {values.shape[-1]} dims but its statistics have {low.shape[-1]}")
    return mode, low, high


def normalize(values: torch.Tensor, stats: dict, what: str = "values") -> torch.Tensor:
    """Robot units -> the model's, on the last dim, by the stats' mode (degenerate dims -> 0)."""
    if mode_of(stats) == "IDENTITY":
        return values
    mode, low, high = _bounds(stats, values, what)
    if mode == "MEAN_STD":
        degenerate = high.abs() < DEGENERATE_EPS
        out = (values - low) / (high + EPS)
    else:
        span = high - low
        degenerate = span.abs() < DEGENERATE_EPS
        out = 2.0 * (values - low) / torch.where(degenerate, torch.ones_like(span), span) - 1.0
    return torch.where(degenerate, torch.zeros_like(out), out)


def unnormalize(values: torch.Tensor, stats: dict, what: str = "values") -> torch.Tensor:
    """The model's units -> robot units (inverse of `normalize`; degenerate dims -> their constant)."""
    if mode_of(stats) == "IDENTITY":
        return values
    mode, low, high = _bounds(stats, values, what)
    if mode == "MEAN_STD":
        return values * high + low
    span = high - low
    degenerate = span.abs() < DEGENERATE_EPS
    return torch.where(degenerate, low.expand_as(values), (values + 1.0) * span / 2.0 + low)


# ---- relative actions -----------------------------------------------------------------------------------------------
def relative_mask(stats: dict) -> list[bool] | None:
    """The head's relative-action mask (its actions' statistics carry it), or None (absolute actions)."""
    mask = stats.get("relative_mask")
    return [bool(m) for m in mask] if mask and any(mask) else None


def _offset(actions: torch.Tensor, state: torch.Tensor, mask: Sequence[bool]) -> torch.Tensor:
    """`state[..., :len(mask)] * mask`, padded to the actions' width and broadcast over a chunk's steps."""
    mask_t = torch.as_tensor(list(mask), dtype=actions.dtype, device=actions.device)
    state = torch.as_tensor(state).to(device=actions.device, dtype=actions.dtype)
    dims = len(mask_t)
    if state.shape[-1] < dims:
        raise ValueError(f"relative actions: the state has {state.shape[-1]} dims, the relative mask {dims}")
    offset = torch.zeros(*state.shape[:-1], actions.shape[-1], dtype=actions.dtype, device=actions.device)
    offset[..., :dims] = state[..., :dims] * mask_t
    return offset.unsqueeze(-2) if actions.ndim == state.ndim + 1 else offset


def to_relative(actions: torch.Tensor, state, mask: Sequence[bool] | None) -> torch.Tensor:
    """Absolute actions `[..., T, D]` (or `[..., D]`) -> offsets from `state` `[..., S]` on the masked dims."""
    return actions if not mask else actions - _offset(actions, state, mask)


def to_absolute(actions: torch.Tensor, state, mask: Sequence[bool] | None) -> torch.Tensor:
    """Inverse of `to_relative`."""
    return actions if not mask else actions + _offset(actions, state, mask)


def mask_from_names(action_names: Sequence[str] | None, exclude: Sequence[str], action_dim: int) -> list[bool]:
    """lerobot's rule (`RelativeActionsProcessorStep._build_mask`): a dim is absolute when an excluded name equals its
    action name or is a substring of it, case-insensitively; without names, or nothing excluded, every dim is
    relative."""
    tokens = [str(name).lower() for name in exclude or [] if name]
    if not tokens or action_names is None:
        return [True] * action_dim
    mask = [not any(token == str(name).lower() or token in str(name).lower() for token in tokens)
            for name in list(action_names)[:action_dim]]
    return mask + [True] * (action_dim - len(mask))


def relative_chunk_stats(chunks: np.ndarray) -> dict[str, list[float]]:
    """Per-dim statistics of relative chunks `[N, T, D]`, every step pooled (lerobot's
    `compute_relative_action_stats` pools the same values; quantiles here are exact, float64)."""
    values = chunks.reshape(-1, chunks.shape[-1]).astype(np.float64)
    stats = {"mean": values.mean(0), "std": values.std(0), "min": values.min(0), "max": values.max(0)}
    for name, q in (("q01", 0.01), ("q10", 0.10), ("q90", 0.90), ("q99", 0.99)):
        stats[name] = np.array([np.quantile(values[:, d], q) for d in range(values.shape[1])])
    return {name: np.asarray(value, dtype=np.float64).tolist() for name, value in stats.items()}


__all__ = ["DEFAULT_MODE", "MODES", "NEEDS", "STAT_NAMES", "mask_from_names", "missing_stats", "mode_of", "normalize",
           "parse_mapping", "parse_mode", "relative_chunk_stats", "relative_mask", "to_absolute", "to_relative",
           "unnormalize"]
