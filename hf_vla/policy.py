"""Inference on a robot: observation dict -> un-normalised action chunk, with real-time chunking between calls.

Used in-process by `hf_vla.evaluate` and per connection by the policy server (`hf_vla.serve`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from .models.pi05.rtc import RTCConfig

STATE_KEYS = ("observation/state", "observation.state", "state")


class RequestError(ValueError):
    """An observation the policy cannot use (missing camera, wrong state size, unknown head, bad RTC fields)."""


def _image_chw(key: str, value) -> torch.Tensor:
    array = np.asarray(value)
    if array.ndim != 3 or 3 not in (array.shape[0], array.shape[-1]):
        raise RequestError(f"camera {key!r}: expected an HxWx3 (or 3xHxW) image, got shape {array.shape}")
    if array.dtype != np.uint8 and not np.issubdtype(array.dtype, np.floating):
        raise RequestError(f"camera {key!r}: expected uint8 (0..255) or float (0..1) pixels, got {array.dtype}")
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.permute(2, 0, 1) if array.shape[-1] == 3 and array.shape[0] != 3 else tensor


@dataclass
class ObservationMap:
    """Which keys of an observation dict feed the policy.

    cameras: image keys in the model's camera-slot order; None: every HxWx3 array, sorted by key.
    state: keys concatenated into the state vector; None: the first of `observation/state` (openpi clients),
        `observation.state` (LeRobot) and `state` that is present.
    prompt: the key of the task string (openpi clients send `prompt`).
    """

    cameras: list[str] | None = None
    state: list[str] | None = None
    prompt: str = "prompt"

    @classmethod
    def from_json(cls, path: str | Path) -> ObservationMap:
        import json

        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"observation map {path}: {error}") from error
        unknown = set(data) - {"cameras", "state", "prompt"}
        if unknown:
            raise ValueError(f"observation map {path}: unknown key(s) {sorted(unknown)}; use cameras, state, prompt")
        return cls(**data)

    def camera_keys(self, observation: dict) -> list[str]:
        if self.cameras:
            missing = [key for key in self.cameras if key not in observation]
            if missing:
                raise RequestError(f"missing camera(s) {missing}; the observation has keys {sorted(observation)}")
            return list(self.cameras)
        keys = sorted(k for k, v in observation.items() if isinstance(v, np.ndarray) and v.ndim == 3)
        if not keys:
            raise RequestError(f"no image in the observation (keys {sorted(observation)}); configure the cameras")
        return keys

    def images(self, observation: dict) -> torch.Tensor:
        """`[n_cams, 3, H, W]` in camera-slot order."""
        keys = self.camera_keys(observation)
        images = [_image_chw(key, observation[key]) for key in keys]
        if len({tuple(image.shape) for image in images}) > 1:
            shapes = {key: tuple(image.shape) for key, image in zip(keys, images)}
            raise RequestError(f"camera images differ in size {shapes}; resize them to one size on the client")
        return torch.stack(images)

    def state_vector(self, observation: dict) -> np.ndarray:
        keys = self.state or [next((k for k in STATE_KEYS if k in observation), STATE_KEYS[0])]
        missing = [key for key in keys if key not in observation]
        if missing:
            raise RequestError(f"missing state key(s) {missing}; the observation has keys {sorted(observation)}")
        try:
            return np.concatenate([np.asarray(observation[k], dtype=np.float32).reshape(-1) for k in keys])
        except (TypeError, ValueError) as error:
            raise RequestError(f"state {keys}: not numeric ({error})") from error

    def task(self, observation: dict) -> str:
        task = observation.get(self.prompt)
        if not isinstance(task, str):
            raise RequestError(f"the observation needs the task string under {self.prompt!r} (got {type(task).__name__})")
        return task


@dataclass
class PolicyRunner:
    """One robot's policy: observation -> un-normalised chunk `[chunk, action_dim]` of its head.

    Keeps the last chunk it returned (normalised) so the next call can continue it with real-time chunking:
    `executed_steps` = actions of that chunk executed when the observation was taken, `inference_delay` = actions
    that will execute while the call runs. The returned chunk's first `inference_delay` actions are the previous
    chunk's (what the robot executes meanwhile); the robot switches to the new chunk at index `inference_delay`.
    """

    model: torch.nn.Module
    processor: object
    head: str | None = None
    obs_map: ObservationMap = field(default_factory=ObservationMap)
    device: str = "cpu"
    seed: int = 0
    rtc: RTCConfig = field(default_factory=RTCConfig)
    num_camera_slots: int | None = None

    def __post_init__(self):
        self.model = self.model.eval().to(self.device)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.last_chunk: torch.Tensor | None = None  # [chunk, max_action_dim], normalised
        self.last_rtc_method: str | None = None  # how the last chunk continued the previous one (None: it did not)

    def reset(self) -> None:
        self.last_chunk = None

    def head_name(self, head=None) -> str:
        try:
            return self.processor._head(head if head is not None else self.head)
        except (KeyError, ValueError, IndexError) as error:
            raise RequestError(str(error).strip('"')) from error

    def __call__(self, observation: dict, task: str | None = None, head=None, inference_delay: int = 0,
                 executed_steps: int | None = None, prev_chunk_left_over=None,
                 execution_horizon: int | None = None) -> np.ndarray:
        head = self.head_name(head)
        task = task if task is not None else self.obs_map.task(observation)
        images = self.obs_map.images(observation)
        slots = self.num_camera_slots or len(images)
        mask = torch.zeros(slots, dtype=torch.bool)
        mask[: len(images)] = True
        if slots > len(images):
            images = torch.cat([images, torch.zeros(slots - len(images), *images.shape[1:], dtype=images.dtype)])
        state = self.obs_map.state_vector(observation)
        expected = len(self.processor.norm_stats[head]["state"]["q01"])
        if state.shape[-1] != expected:
            raise RequestError(f"state {self.obs_map.state or 'vector'} has {state.shape[-1]} values; head {head!r} "
                               f"expects {expected}")
        leftover = self._leftover(head, inference_delay, executed_steps, prev_chunk_left_over)
        method = None
        if leftover is not None:
            try:
                method = self.rtc.resolve_method(inference_delay, getattr(self.model.config, "rtc_max_delay", 0))
            except ValueError as error:
                raise RequestError(str(error)) from error
        chunk = self._sample(images[None], state[None], [task], mask[None], head, leftover, inference_delay,
                             execution_horizon, method)[0]
        self.last_rtc_method = method
        if leftover is not None:
            spliced = min(inference_delay, len(leftover))
            chunk[:spliced, : leftover.shape[-1]] = leftover[:spliced]
        self.last_chunk = chunk
        return self.processor.unnormalize_actions(chunk, head).numpy()

    def _leftover(self, head: str, inference_delay: int, executed_steps, prev_chunk_left_over):
        """The previous chunk's remainder, normalised, or None (no guidance)."""
        chunk_size = self.model.config.chunk_size
        if not isinstance(inference_delay, int | np.integer) or not 0 <= inference_delay < chunk_size:
            raise RequestError(f"inference_delay={inference_delay!r}: an integer in [0, {chunk_size})")
        if prev_chunk_left_over is not None:
            leftover = np.asarray(prev_chunk_left_over, dtype=np.float32)
            if leftover.ndim != 2 or leftover.shape[0] > chunk_size:
                raise RequestError(f"prev_chunk_left_over: expected [steps <= {chunk_size}, action_dim], got "
                                   f"{leftover.shape}")
            try:
                return self.processor.normalize(leftover, "actions", head)
            except ValueError as error:
                raise RequestError(f"prev_chunk_left_over: {error}") from error
        if executed_steps is None or self.last_chunk is None:
            return None
        if not isinstance(executed_steps, int | np.integer) or not 0 <= executed_steps < chunk_size:
            raise RequestError(f"executed_steps={executed_steps!r}: an integer in [0, {chunk_size})")
        return self.last_chunk[executed_steps:]

    @torch.no_grad()
    def _sample(self, images, states, tasks, camera_mask, head, leftover=None, inference_delay=0,
                execution_horizon=None, method=None) -> torch.Tensor:
        try:
            inputs = self.processor(images=images, text=tasks, state=states, head=head, camera_mask=camera_mask)
        except ValueError as error:
            raise RequestError(str(error)) from error
        config = self.model.config
        noise = torch.randn(len(tasks), config.chunk_size, config.max_action_dim, generator=self.generator)
        rtc = {}
        if leftover is not None:
            rtc = {"prev_chunk_left_over": leftover.to(self.device), "inference_delay": int(inference_delay),
                   "execution_horizon": execution_horizon,
                   "rtc_config": replace(self.rtc, method=method)}  # as resolved by the caller
        chunk = self.model.sample_actions(
            input_ids=inputs["input_ids"].to(self.device), attention_mask=inputs["attention_mask"].to(self.device),
            pixel_values=inputs["pixel_values"].to(self.device),
            pixel_attention_mask=inputs["pixel_attention_mask"].to(self.device), noise=noise.to(self.device), **rtc,
        )
        return chunk.float().cpu()

    def predict(self, images: torch.Tensor, states: np.ndarray, tasks: list[str], camera_mask: torch.Tensor) -> np.ndarray:
        """A batch: uint8 images [B, cams, 3, H, W], raw states [B, d], tasks, camera_mask [B, cams] -> chunks
        [B, chunk, action_dim], un-normalised (no real-time chunking)."""
        chunk = self._sample(images, states, tasks, camera_mask, self.head_name())
        return self.processor.unnormalize_actions(chunk, self.head_name()).numpy()


def load_policy(checkpoint: str | Path, device: str = "cpu", **kwargs) -> PolicyRunner:
    """`AutoModel` + `PI05Processor` from a directory or Hub id, wrapped in a `PolicyRunner`."""
    from transformers import AutoModel

    import hf_vla  # noqa: F401  (registers pi05)

    from .models.pi05 import PI05Processor

    model = AutoModel.from_pretrained(checkpoint)
    processor = PI05Processor.from_pretrained(checkpoint)
    return PolicyRunner(model, processor, device=device, **kwargs)


def add_rtc_arguments(parser, title: str = "real-time chunking (RTC)") -> None:
    """The real-time chunking flags of `hf_vla.serve` and `hf_vla.evaluate` (fields of `RTCConfig`)."""
    from .models.pi05.rtc import METHODS, SCHEDULES

    group = parser.add_argument_group(title)
    group.add_argument("--execution_horizon", type=int, default=RTCConfig.execution_horizon,
                       help="actions of the previous chunk blended with (capped at the remainder)")
    group.add_argument("--max_guidance_weight", type=float, default=RTCConfig.max_guidance_weight,
                       help="cap of the guidance weight (lerobot's default 10)")
    group.add_argument("--prefix_attention_schedule", choices=SCHEDULES, default=RTCConfig.prefix_attention_schedule,
                       help="decay of the prefix weights (lerobot's default linear; exp is the paper's soft mask)")
    group.add_argument("--rtc_jacobian", action="store_true",
                       help="propagate the guidance error through the action expert as the paper does (one backward "
                            "pass per flow step) instead of lerobot's weighted error")
    group.add_argument("--rtc_method", choices=METHODS, default=RTCConfig.method,
                       help="guidance: inference-time RTC (the settings above); prefix: training-time RTC, for a model "
                            "trained with rtc_max_delay >= the delay; auto: prefix when the model was trained for it")


def rtc_config_from_args(args) -> RTCConfig:
    return RTCConfig(execution_horizon=args.execution_horizon, max_guidance_weight=args.max_guidance_weight,
                     prefix_attention_schedule=args.prefix_attention_schedule, jacobian=args.rtc_jacobian,
                     method=args.rtc_method)


__all__ = ["ObservationMap", "PolicyRunner", "RequestError", "add_rtc_arguments", "load_policy", "rtc_config_from_args"]
