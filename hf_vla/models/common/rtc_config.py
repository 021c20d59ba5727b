"""Real-time chunking's settings (`RTCConfig`), apart from its tensors (`hf_vla.models.common.rtc`): the commands' options
and the deployment contract read them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("zeros", "ones", "linear", "exp")
METHODS = ("auto", "guidance", "prefix")


@dataclass
class RTCConfig:
    """Guidance settings of real-time chunking.

    execution_horizon: actions of the previous chunk the new one is blended with (capped at the remainder's length).
    max_guidance_weight: cap of the guidance weight (lerobot's default 10; the weight is unbounded as time -> 1).
    prefix_attention_schedule: how the prefix weights fall from 1 (at `inference_delay`) to 0 (at the horizon):
        `linear` (lerobot's default), `exp`, `ones` (1 up to the horizon) or `zeros` (only the delayed actions).
    jacobian: back-propagate the error through the network (the paper) instead of using it as is (lerobot).
    method: `guidance` (inference-time RTC, the settings above), `prefix` (training-time RTC: the delayed actions are
        held clean at time 0 and only the rest is sampled; needs a model trained with `rtc_max_delay` >= the delay,
        the other settings do not apply) or `auto` (`prefix` when the model was trained for the delay, else guidance).
    """

    execution_horizon: int = 10
    max_guidance_weight: float = 10.0
    prefix_attention_schedule: str = "linear"
    jacobian: bool = False
    method: str = "auto"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: choose one of {METHODS}")
        if self.prefix_attention_schedule not in SCHEDULES:
            raise ValueError(f"prefix_attention_schedule={self.prefix_attention_schedule!r}: choose one of {SCHEDULES}")
        if self.max_guidance_weight <= 0:
            raise ValueError(f"max_guidance_weight must be positive, got {self.max_guidance_weight}")
        if self.execution_horizon < 0:
            raise ValueError(f"execution_horizon must be >= 0, got {self.execution_horizon}")

    def resolve_method(self, inference_delay: int, rtc_max_delay: int) -> str:
        """`guidance` or `prefix` for a model trained with `rtc_max_delay` (0: not trained for prefixes)."""
        trained = 0 < inference_delay <= rtc_max_delay
        if self.method == "prefix" and not trained:
            raise ValueError(f"RTC method 'prefix' needs a model trained to continue {inference_delay} committed "
                             f"action(s); this one was trained with rtc_max_delay={rtc_max_delay} (use 'guidance')")
        if self.method == "auto":
            return "prefix" if trained else "guidance"
        return self.method
