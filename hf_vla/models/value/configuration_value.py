"""RECAP's value model (pi*0.6) configuration: pi0.5's vision-language backbone with a distributional value readout."""

from huggingface_hub.dataclasses import strict

from hf_vla.models.pi05.configuration_pi05 import PI05Config


@strict
class PI05ValueConfig(PI05Config):
    r"""
    Configuration for [`PI05ValueModel`]: the fields of [`PI05Config`] (its `vlm_config` is the backbone, so a
    pi0.5 checkpoint's VLM weights load into it; the action fields are kept so one processor serves both), plus:

    num_bins (`int`, defaults to 201): bins of the value distribution on [-1, 0] (a bin every 0.005 at 201), the
        normalised return (`hf_vla.models.value.returns`).
    value_targets (`str`, defaults to `"dirac"`): the cross-entropy's target distribution, the return's nearest bin
        (`"dirac"`, C51-style) or a Gaussian of `hl_gauss_sigma` bin widths over the bins (`"hl_gauss"`).
    hl_gauss_sigma (`float`, defaults to 0.75): the HL-Gauss target's std, in bins.
    discrete_state_input (`bool`, defaults to `False` here): the value prompt is pi0.5's state-free one (the task,
        then a newline token; lerobot's branch documents "Task: {task}." for its value model); True adds pi0.5's
        discretised state.
    episode_limits (`dict`, *optional*): `{task: limit}`, each task's one episode limit its returns were normalised
        by (set by training; annotation reads them, so its advantages are on the same scale).
    failure_cost (`float`, *optional*): the failure cost its returns used, in steps (None: each task's limit).
    held_out_fold (`dict`, *optional*): cross-fitting, `{"fold": k, "folds": K, "datasets": [roots]}`: the episodes of
        these datasets whose index is k modulo K were left out of its training (`hold_out_fold`), so it may annotate
        them.
    """

    model_type = "pi05_value"

    num_bins: int = 201
    value_targets: str = "dirac"
    hl_gauss_sigma: float = 0.75
    discrete_state_input: bool = False
    episode_limits: dict | None = None
    failure_cost: float | None = None
    held_out_fold: dict | None = None

    def validate_architecture(self):
        super().validate_architecture()
        if self.num_bins < 2:
            raise ValueError(f"PI05ValueConfig: num_bins={self.num_bins} must be at least 2")
        if self.value_targets not in ("dirac", "hl_gauss"):
            raise ValueError(f"PI05ValueConfig: value_targets={self.value_targets!r}: 'dirac' or 'hl_gauss'")
        if not self.hl_gauss_sigma > 0:
            raise ValueError(f"PI05ValueConfig: hl_gauss_sigma={self.hl_gauss_sigma} must be positive")


@strict
class PI05ChunkCriticConfig(PI05ValueConfig):
    r"""
    Configuration for [`PI05ChunkCritic`]: best-of-N's chunk critic `Q(observation, prompt, chunk)`, the value model's
    fields (backbone, bins, returns' scale, cross-fitting) read with an action chunk: `chunk_size` steps of
    `max_action_dim` normalised actions (the policy's, so its candidates are scored as sampled).

    negative_chunks (`float`, defaults to 0.0): in training, the share of a batch's rows whose executed chunk is
        swapped for another row's (another frame, mostly another episode's: a chunk that does not fit this
        observation) and labelled the worst return, -1: negatives that make the critic read the chunk against the
        observation where the returns alone let it read the observation only.
    """

    model_type = "pi05_chunk_critic"

    negative_chunks: float = 0.0

    def validate_architecture(self):
        super().validate_architecture()
        if not 0.0 <= self.negative_chunks < 1.0:
            raise ValueError(f"PI05ChunkCriticConfig: negative_chunks={self.negative_chunks}: a share in [0, 1)")


__all__ = ["PI05ChunkCriticConfig", "PI05ValueConfig"]
