"""Learning from experience: RECAP (pi*0.6, arXiv 2511.14759), a value model over episode outcomes and an
advantage-conditioned policy. `hf_vla.models.value.returns` holds the arithmetic (rewards, returns, bins, advantages,
thresholds) the value model trains on; the indicator's wording lives with pi0.5's processor
(`hf_vla.models.pi05.processing_pi05.ADVANTAGE_TAGS`). The method, its constants and the commands: docs/recap.md."""

from hf_vla.models.value.returns import (
    RecapSettings,
    advantages,
    bin_centers,
    episode_returns,
    hl_gauss_targets,
    positive_threshold,
    value_to_bin,
)

__all__ = ["RecapSettings", "advantages", "bin_centers", "episode_returns", "hl_gauss_targets", "positive_threshold",
           "value_to_bin"]
