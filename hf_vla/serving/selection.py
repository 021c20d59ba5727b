"""Best-of-N: one chunk chosen among N candidates drawn for one observation (`SamplingConfig.num_candidates`), and how
much the candidates disagree.

Selectors: `medoid` (OpenTau's consensus: the candidate closest to all the others, summed Euclidean distance over the
chunk) and `first` (the first sample: one chunk's behaviour, at N chunks' cost; the baseline). The spread (the root
mean square distance of the candidates from their mean, per action value, in normalised units) is an uncertainty
figure: 0 where every candidate agrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SELECTORS = ("medoid", "first")
MAX_BEST_OF = 64  # candidates per observation a runner or a request may ask for


@dataclass
class Selection:
    """The chosen candidate of one observation and the candidates' spread."""

    index: int
    spread: float

    def record(self) -> dict:
        return {"best_of/index": self.index, "best_of/spread": self.spread}


def _valid_count(best_of) -> bool:
    return not isinstance(best_of, bool) and isinstance(best_of, int) and 1 <= best_of <= MAX_BEST_OF


def check_best_of_flag(best_of) -> None:
    """ConfigError, one line, for a `--best_of` the commands (evaluate, serve) cannot run with."""
    from hf_vla.errors import ConfigError

    if not _valid_count(best_of):
        raise ConfigError(f"--best_of {best_of}: 1 to {MAX_BEST_OF} candidate chunks per observation")


def check_best_of(best_of, selector: str) -> None:
    """ValueError, one line, for a count or selector a runner cannot sample with."""
    if not _valid_count(best_of):
        raise ValueError(f"best_of={best_of!r}: a whole number of candidate chunks in [1, {MAX_BEST_OF}]")
    if selector not in SELECTORS:
        raise ValueError(f"selector={selector!r}: one of {', '.join(SELECTORS)}")


def select_chunk(candidates: torch.Tensor, selector: str, dims: int | None = None) -> tuple[torch.Tensor, Selection]:
    """`candidates` `[N, T, d]` (normalised) -> the chosen chunk `[T, d]` and its `Selection`. `dims`: the head's own
    action dims (the model's padded ones carry no action and are left out of the distances)."""
    import torch

    if selector not in SELECTORS:
        raise ValueError(f"selector={selector!r}: one of {', '.join(SELECTORS)}")
    values = candidates[..., :dims].double().flatten(1)  # [N, T * dims]
    spread = float((values - values.mean(0)).pow(2).mean().sqrt()) if len(values) > 1 else 0.0
    if selector == "first" or len(values) == 1:
        index = 0
    else:
        index = int(torch.cdist(values, values).sum(1).argmin())
    return candidates[index], Selection(index, spread)


__all__ = ["MAX_BEST_OF", "SELECTORS", "Selection", "check_best_of", "check_best_of_flag", "select_chunk"]
