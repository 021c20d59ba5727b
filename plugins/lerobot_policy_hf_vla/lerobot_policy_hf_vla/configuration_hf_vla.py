"""The lerobot-side config of an hf_vla checkpoint: which checkpoint, which head, how many actions per chunk."""

from __future__ import annotations

from dataclasses import dataclass

from lerobot.configs.policies import PreTrainedConfig


@PreTrainedConfig.register_subclass("hf_vla")
@dataclass
class HFVLAConfig(PreTrainedConfig):
    """An hf_vla checkpoint (pi0.5 or pi0, any dims, any heads) as a lerobot policy; the model, its processor and its
    deployment contract (cameras, head, `n_action_steps`, normalisation, relative actions) come from the checkpoint.

    checkpoint: the hf_vla checkpoint: a directory, relative to this config's directory or absolute, or a Hub id.
    head: its normalisation head (default: the contract's default head).
    n_action_steps: actions executed from each chunk (default: the contract's).
    seed: the seed of the policy's noise generator (hf_vla's `PolicyRunner`).
    best_of / selector / critic: best-of-N (hf_vla's docs/best_of_n.md): candidate chunks drawn per observation, the
        selector that picks one (critic, medoid, first; default critic with a critic, else medoid), and a chunk
        critic's checkpoint (relative to this config's directory, absolute, or a Hub id). best_of None: the
        checkpoint's contract (a bundled critic, `python -m hf_vla.convert --critic`), else one sample.
    """

    checkpoint: str = ".."
    head: str | None = None
    n_action_steps: int | None = None
    seed: int = 0
    best_of: int | None = None
    selector: str | None = None
    critic: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.n_action_steps is not None and self.n_action_steps < 1:
            raise ValueError(f"n_action_steps={self.n_action_steps}: must be positive")
        from hf_vla.serving.selection import check_selection_flags

        self.selector = check_selection_flags(self.best_of, self.selector, self.critic)

    @property
    def observation_delta_indices(self):
        return None

    @property
    def action_delta_indices(self):
        return None

    @property
    def reward_delta_indices(self):
        return None

    def get_optimizer_preset(self):
        raise NotImplementedError("an hf_vla policy trains with python -m hf_vla.train, not lerobot-train")

    def get_scheduler_preset(self):
        return None

    def validate_features(self) -> None:
        """Checked against the checkpoint's contract when the policy loads (`HFVLAPolicy.check_features`)."""
