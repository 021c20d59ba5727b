"""How `sample_actions` turns noise into an action chunk (`SamplingConfig`), as `GenerationConfig` is to `generate`:
the sampling options (Euler steps, classifier-free guidance, real-time chunking, the subtask mode) in one object passed
whole. The model inputs (token ids, images, masks, MEM's past, guidance's unconditioned prompt) stay arguments: they
come from the processor. torch-free, so the commands and the deployment contract read it without importing torch."""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Any

from hf_vla.models.common.rtc_config import RTCConfig  # absolute: bundled beside a remote checkpoint


@dataclass
class SamplingConfig:
    """The options of one `sample_actions` call; any of them can also be passed to it by name, overriding the object's
    value for that call (as `generate(**kwargs)` overrides its `GenerationConfig`).

    num_steps: Euler steps from noise (t=1) to actions (t=0); None: the model config's `num_inference_steps`.
    cfg_beta: classifier-free guidance of an advantage-conditioned policy (RECAP): the velocity is
        `v_u + cfg_beta * (v_c - v_u)` where the processor added the unconditioned prompt (`uncond_input_ids`); one
        value or one per row (a tensor `[B]`); None: 1 (the conditioned velocity alone).
    subtask: pi0.5's high-level inference (a subtask-trained checkpoint): "auto" decodes each row's subtask first and
        acts on it, a `SubtaskDecode` (from `generate_subtask`) acts on it re-using its cache; None: the prompt as it
        is (a given subtask text goes in through the processor, as `subtask_ids` / `subtask_mask`).
    rtc_config: real-time chunking's settings (`RTCConfig`); None: `RTCConfig()` where a chunk is continued.
    prev_chunk_left_over: the previous chunk's actions not executed when this observation was taken (`[B, T, d]` or
        `[T, d]`, normalised): with it the new chunk continues it (real-time chunking).
    inference_delay: actions of `prev_chunk_left_over` that execute while this call runs (held or guided to equal it).
    execution_horizon: actions blended with the previous chunk; None: `rtc_config.execution_horizon`.
    num_candidates: chunks drawn per observation (best-of-N): the prefix (and its cache) is computed once per
        observation and the expert's denoising runs for every candidate in one batch; 1 returns `[B, T, d]`, N > 1
        `[B, N, T, d]` (noise, when given, `[B, N, T, d]` too).
    """

    num_steps: int | None = None
    cfg_beta: Any = None
    subtask: Any = None
    rtc_config: RTCConfig | None = None
    prev_chunk_left_over: Any = None
    inference_delay: int = 0
    execution_horizon: int | None = None
    num_candidates: int = 1

    def __post_init__(self):
        self.validate()

    def _whole(self, name: str, minimum: int, what: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or int(value) != value or value < minimum:
            raise ValueError(f"SamplingConfig.{name}={value!r}: a whole number of {what} >= {minimum}")

    def validate(self) -> None:
        """One line naming the field and its value for an option that cannot be sampled with."""
        if self.num_steps is not None:
            self._whole("num_steps", 1, "Euler steps")
        self._whole("inference_delay", 0, "actions")
        self._whole("num_candidates", 1, "chunks")
        if self.execution_horizon is not None and self.execution_horizon < 0:
            raise ValueError(f"SamplingConfig.execution_horizon={self.execution_horizon!r}: >= 0 actions, or None")
        if self.subtask is not None and isinstance(self.subtask, str) and self.subtask != "auto":
            raise ValueError(f"SamplingConfig.subtask={self.subtask!r}: 'auto', a SubtaskDecode, or None (a given "
                             "text goes in through the processor, as subtask_ids / subtask_mask)")
        if self.rtc_config is not None and not isinstance(self.rtc_config, RTCConfig):
            raise ValueError(f"SamplingConfig.rtc_config: an RTCConfig, got {type(self.rtc_config).__name__}")
        if self.inference_delay and self.prev_chunk_left_over is None:
            raise ValueError(f"SamplingConfig.inference_delay={self.inference_delay}: continues a chunk, so it needs "
                             "prev_chunk_left_over (the previous chunk's actions not yet executed)")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def update(self, **kwargs) -> tuple[SamplingConfig, dict]:
        """A copy with the options among `kwargs` set (validated), and the `kwargs` that are not options (the model
        inputs); the object itself is left unchanged."""
        options = {key: kwargs.pop(key) for key in self.names() if key in kwargs}
        updated = copy.copy(self)
        for key, value in options.items():
            setattr(updated, key, value)
        updated.validate()
        return updated, kwargs


__all__ = ["SamplingConfig"]
