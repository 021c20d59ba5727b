"""Best-of-N: one chunk chosen among N candidates drawn for one observation (`SamplingConfig.num_candidates`), and how
much the candidates disagree.

Selectors: `critic` (the highest expected return by a learned chunk critic, `hf_vla.serving.critic`), `medoid`
(OpenTau's consensus: the candidate closest to all the others, summed Euclidean distance over the chunk) and `first`
(the first sample: one chunk's behaviour, at N chunks' cost; the baseline). The spread (the root
mean square distance of the candidates from their mean, per action value, in normalised units) is an uncertainty
figure: 0 where every candidate agrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SELECTORS = ("medoid", "first", "critic")
MAX_BEST_OF = 64  # candidates per observation a runner or a request may ask for


@dataclass
class Selection:
    """The chosen candidate of one observation, the candidates' spread and (selector `critic`) the chosen one's
    expected return and the best minus the worst candidate's."""

    index: int
    spread: float
    value: float | None = None
    value_range: float | None = None

    def record(self) -> dict:
        record = {"best_of/index": self.index, "best_of/spread": self.spread}
        if self.value is not None:
            record |= {"best_of/value": self.value, "best_of/value_range": self.value_range}
        return record


def _valid_count(best_of) -> bool:
    return not isinstance(best_of, bool) and isinstance(best_of, int) and 1 <= best_of <= MAX_BEST_OF


def check_best_of_flag(best_of, flag: str = "--best_of") -> None:
    """ConfigError, one line, for a `--best_of` (or `flag`) the commands (evaluate, serve) cannot run with."""
    from hf_vla.errors import ConfigError

    if not _valid_count(best_of):
        raise ConfigError(f"{flag} {best_of}: 1 to {MAX_BEST_OF} candidate chunks per observation")


def check_selection_flags(best_of, selector: str | None, critic: str | None) -> str | None:
    """The commands' best-of-N flags (`--best_of`, `--selector`, `--critic`) checked together, ConfigError in one line;
    -> the selector (default: `critic` with `--critic`, else `medoid`). `best_of` None: the checkpoint's (its contract
    may bundle a critic, `hf_vla.serving.critic.plan_best_of`): only what no contract changes is checked, and the
    selector is returned as given."""
    from hf_vla.errors import ConfigError

    if critic and selector not in (None, "critic"):
        raise ConfigError(f"--critic with --selector {selector}: the critic scores candidates for --selector critic")
    if best_of is None:
        return selector
    check_best_of_flag(best_of)
    if selector is None:
        selector = "critic" if critic else "medoid"
    if selector == "critic" and not critic:
        raise ConfigError("--selector critic: give --critic PATH, a chunk critic (python -m hf_vla.train with policy "
                          "pi05_chunk_critic; docs/best_of_n.md)")
    if critic and best_of < 2:
        raise ConfigError(f"--critic picks among candidate chunks: --best_of {best_of} draws one (2 or more)")
    return selector


def check_best_of(best_of, selector: str) -> None:
    """ValueError, one line, for a count or selector a runner cannot sample with."""
    if not _valid_count(best_of):
        raise ValueError(f"best_of={best_of!r}: a whole number of candidate chunks in [1, {MAX_BEST_OF}]")
    if selector not in SELECTORS:
        raise ValueError(f"selector={selector!r}: one of {', '.join(SELECTORS)}")


def select_chunk(candidates: torch.Tensor, selector: str, dims: int | None = None,
                 scores: torch.Tensor | None = None) -> tuple[torch.Tensor, Selection]:
    """`candidates` `[N, T, d]` (normalised) -> the chosen chunk `[T, d]` and its `Selection`. `dims`: the head's own
    action dims (the model's padded ones carry no action and are left out of the distances). `scores` `[N]`: the
    critic's expected returns (selector `critic`: the highest; the first of equals)."""
    import torch

    if selector not in SELECTORS:
        raise ValueError(f"selector={selector!r}: one of {', '.join(SELECTORS)}")
    if selector == "critic" and (scores is None or len(scores) != len(candidates)):
        raise ValueError("selector='critic': one critic score per candidate")
    values = candidates[..., :dims].double().flatten(1)  # [N, T * dims]
    spread = float((values - values.mean(0)).pow(2).mean().sqrt()) if len(values) > 1 else 0.0
    if selector == "critic":
        scores = torch.as_tensor(scores, dtype=torch.float64)
        index = int(scores.argmax())
        return candidates[index], Selection(index, spread, float(scores[index]), float(scores.max() - scores.min()))
    if selector == "first" or len(values) == 1:
        index = 0
    else:
        index = int(torch.cdist(values, values).sum(1).argmin())
    return candidates[index], Selection(index, spread)


__all__ = ["MAX_BEST_OF", "SELECTORS", "Selection", "check_best_of", "check_best_of_flag", "check_selection_flags",
           "select_chunk"]
