"""Inference on a robot: observation dict -> un-normalised action chunk, with real-time chunking between calls.

Used in-process by `hf_vla.evaluate` and per connection by the policy server (`hf_vla.serve`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from hf_vla.models.common.rtc_config import RTCConfig
from hf_vla.models.common.sampling_config import SamplingConfig
from hf_vla.serving.memory import ObservationMemory
from hf_vla.serving.selection import Selection, check_best_of, select_chunk

STATE_KEYS = ("observation/state", "observation.state", "state")


class RequestError(ValueError):
    """An observation the policy cannot use (missing camera, wrong state size, unknown head, bad RTC fields)."""


@dataclass(frozen=True)
class InputLimits:
    """What a request may carry; anything outside is refused before inference (a sensor fault must not become an
    action). `max_image_side`: pixels per image side; `max_prompt_chars`: task string length; `max_state_range`: how
    far a state value, or an action of an RTC leftover (`prev_chunk_left_over`), may lie outside the head's training
    range, in multiples of its q01..q99 width (a reading 10,000 widths away is a sensor fault or a wrong unit, not a
    state the policy has seen, and a leftover that far out would be blended into the next chunk); `max_best_of`: the
    most candidate chunks a request's own `best_of` may ask for (None: the runner's `best_of`)."""

    max_image_side: int = 2048
    max_prompt_chars: int = 2000
    max_state_range: float = 1e4
    max_best_of: int | None = None


def _image_chw(key: str, value, limits: InputLimits = InputLimits()) -> torch.Tensor:
    if not isinstance(value, np.ndarray):
        raise RequestError(f"camera {key!r}: expected an image array, got {type(value).__name__}")
    array = value
    if array.ndim != 3 or 3 not in (array.shape[0], array.shape[-1]):
        raise RequestError(f"camera {key!r}: expected an HxWx3 (or 3xHxW) image, got shape {array.shape}")
    if array.dtype != np.uint8 and not np.issubdtype(array.dtype, np.floating):
        raise RequestError(f"camera {key!r}: expected uint8 (0..255) or float (0..1) pixels, got {array.dtype}")
    channels_last = array.shape[-1] == 3 and array.shape[0] != 3
    height, width = array.shape[:2] if channels_last else array.shape[1:]
    if min(height, width) < 1 or max(height, width) > limits.max_image_side:
        raise RequestError(f"camera {key!r}: image of {height}x{width} pixels; each side must be 1..."
                           f"{limits.max_image_side} (the server's --max_image_side)")
    if array.dtype != np.uint8:
        finite = np.isfinite(array)
        if not finite.all():
            raise RequestError(f"camera {key!r}: {int((~finite).sum())} pixel value(s) are NaN or inf")
        low, high = float(array.min()), float(array.max())
        if low < 0.0 or high > 1.0:
            raise RequestError(f"camera {key!r}: float pixels must lie in [0, 1], got {low:g}..{high:g} (send uint8 "
                               f"0..255 or float 0..1)")
    tensor = torch.from_numpy(np.array(array, copy=True, order="C"))  # owned: a received buffer is read-only
    return tensor.permute(2, 0, 1) if channels_last else tensor


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

    def images(self, observation: dict, limits: InputLimits = InputLimits()) -> torch.Tensor:
        """`[n_cams, 3, H, W]` in camera-slot order."""
        keys = self.camera_keys(observation)
        images = [_image_chw(key, observation[key], limits) for key in keys]
        if len({tuple(image.shape) for image in images}) > 1:
            shapes = {key: tuple(image.shape) for key, image in zip(keys, images)}
            raise RequestError(f"camera images differ in size {shapes}; resize them to one size on the client")
        return torch.stack(images)

    def state_vector(self, observation: dict) -> np.ndarray:
        keys = self.state or [next((k for k in STATE_KEYS if k in observation), STATE_KEYS[0])]
        missing = [key for key in keys if key not in observation]
        if missing:
            raise RequestError(f"missing state key(s) {missing}; the observation has keys {sorted(observation)}")
        parts = []
        for key in keys:
            value = observation[key]
            if isinstance(value, str | bytes) or (isinstance(value, np.ndarray) and value.dtype.kind not in "biuf"):
                raise RequestError(f"state {key!r}: expected numbers, got {getattr(value, 'dtype', type(value).__name__)}")
            try:
                with np.errstate(over="ignore"):  # a value beyond float32 becomes inf and is refused below
                    parts.append(np.asarray(value, dtype=np.float32).reshape(-1))
            except (TypeError, ValueError) as error:
                raise RequestError(f"state {key!r}: not numeric ({error})") from error
            bad = ~np.isfinite(parts[-1])
            if bad.any():
                raise RequestError(f"state {key!r}: value(s) at index {np.flatnonzero(bad)[:8].tolist()} are NaN or inf "
                                   f"(a sensor fault?); no action is computed from it")
        return np.concatenate(parts)

    def task(self, observation: dict, limits: InputLimits = InputLimits()) -> str:
        return check_task(observation.get(self.prompt), self.prompt, limits)


def check_task(task, key: str = "prompt", limits: InputLimits = InputLimits()) -> str:
    if not isinstance(task, str):
        raise RequestError(f"the observation needs the task string under {key!r} (got {type(task).__name__})")
    if len(task) > limits.max_prompt_chars:
        raise RequestError(f"{key!r}: task string of {len(task)} characters; at most {limits.max_prompt_chars}")
    return task


MODEL_INPUTS = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")
# classifier-free guidance of an advantage-conditioned pi0.5 (RECAP): the processor adds them where cfg_beta != 1
GUIDANCE_INPUTS = ("uncond_input_ids", "uncond_attention_mask", "cfg_beta", "advantage_ids", "uncond_advantage_ids")
STATE_INPUTS = MODEL_INPUTS + ("state",)  # transformers' pi0 takes the state as a tensor (pi0.5 reads it as tokens)
SUBTASK_INPUTS = ("subtask_ids", "subtask_mask")  # a given subtask's tokens (pi0.5's high-level inference)
MEMORY_INPUTS = ("memory_state", "memory_mask")  # MEM's past observations (`ObservationMemory`)


def model_input_keys(model) -> tuple[str, ...]:
    """What a policy's `sample_actions` / forward reads from the processor's output (its family's `state_input`)."""
    from hf_vla.registry import family_of

    family = family_of(model)
    return STATE_INPUTS if family is not None and family.state_input else MODEL_INPUTS


def stat_range(stats: dict) -> tuple[np.ndarray, np.ndarray]:
    """The training range of one normalised quantity: its q01..q99, or for mean/std stats alone (transformers' pi0
    conversions) mean -/+ 2.326 std, the 1st and 99th percentiles of a Gaussian."""
    if "q01" in stats and "q99" in stats:
        return np.asarray(stats["q01"], np.float64), np.asarray(stats["q99"], np.float64)
    mean, std = np.asarray(stats["mean"], np.float64), np.asarray(stats["std"], np.float64)
    return mean - 2.326 * std, mean + 2.326 * std


def stat_dims(stats: dict) -> int:
    """How many dims one normalised quantity has (its q01, else its mean)."""
    return len(stats["q01"] if "q01" in stats else stats["mean"])


@dataclass
class Continuation:
    """How a request continues the chunk the robot is executing (real-time chunking): `inference_delay` actions of it
    run while the call does, `executed_steps` of it were executed when the observation was taken (the runner then
    continues its own last chunk), or the client sends what is left of it (`prev_chunk_left_over`); the new chunk is
    blended with `execution_horizon` of its actions. The defaults: an independent chunk.

    `recorded` (a MEM policy's past): None, the observation is this control step's and the call records it; an
    integer, `observe` recorded it already, that many steps before the newest recorded observation (the episode
    loop observes every step; with an inference delay it acts on an observation some steps old)."""

    inference_delay: int = 0
    executed_steps: int | None = None
    prev_chunk_left_over: object = None
    execution_horizon: int | None = None
    recorded: int | None = None


@dataclass
class PreparedRequest:
    """A validated request, ready for the model: its inputs and noise (a batch of its own), head and RTC arguments of
    `sample_actions` (None: an independent chunk)."""

    inputs: dict
    noise: torch.Tensor
    head: str
    rtc: dict | None = None
    state: np.ndarray | None = None  # the raw state `[rows, state_dim]`: a relative head's actions are offsets from it
    decode_subtask: bool = False  # the model decodes the subtask first (`generate_subtask`), then acts on it
    subtask: str | None = None  # the subtask text acted on: given, or (once sampled) decoded
    decoded: tuple | None = None  # the decoded subtask's (ids, mask) `[S]`, set by `sample_batch`
    # the factorised layout: (ids, mask) of the decoded subtask -> the inputs of the prompt with it in the task's place
    reprompt: Callable | None = None
    rows: dict | None = None  # the observation (images, states, tasks, camera_mask) a chunk critic reads

    @property
    def candidates(self) -> int:
        """Chunks drawn for this observation (best-of-N: its noise `[rows, N, T, d]`)."""
        return self.noise.shape[1] if self.noise.ndim == 4 else 1

    def batch_key(self):
        """Requests with equal keys can share one forward; one that continues a chunk (RTC) runs alone."""
        if self.rtc is not None:
            return None
        return (self.decode_subtask, self.candidates) + tuple((key, tuple(self.inputs[key].shape[1:]))
                                                              for key in sorted(self.inputs))


def batch_requests(requests: list[PreparedRequest], device) -> tuple[dict, torch.Tensor]:
    """The model inputs and noise of prepared requests, concatenated into one batch on `device`."""
    inputs = {key: torch.cat([r.inputs[key] for r in requests]).to(device) for key in requests[0].inputs}
    return inputs, torch.cat([r.noise for r in requests]).to(device)


@torch.no_grad()
def decode_subtasks(model, requests: list[PreparedRequest], inputs: dict):
    """The subtask of each request decoded after its prompt (`generate_subtask` on the batched `inputs`), kept on the
    request as `decoded` (its ids and mask); -> the `SubtaskDecode` (its cache holds the prompts and the tokens)."""
    decoded = model.generate_subtask(**{key: inputs[key] for key in MODEL_INPUTS + MEMORY_INPUTS if key in inputs})
    for row, request in enumerate(requests):
        request.decoded = (decoded.ids[row].cpu(), decoded.mask[row].cpu())
    return decoded


@torch.no_grad()
def sample_batch(model, requests: list[PreparedRequest], device) -> torch.Tensor:
    """One `sample_actions` over requests of one `batch_key` (or one RTC request) -> `[rows, chunk, max_action_dim]`
    normalised chunks on the CPU, in request order."""
    if len(requests) > 1 and (requests[0].batch_key() is None or len({r.batch_key() for r in requests}) > 1):
        raise ValueError("sample_batch: these requests cannot share a forward (RTC, or different input shapes)")
    inputs, noise = batch_requests(requests, device)
    rtc = dict(requests[0].rtc or {})
    if rtc:
        rtc["prev_chunk_left_over"] = rtc["prev_chunk_left_over"].to(device)
    sampling = SamplingConfig(**rtc, num_candidates=requests[0].candidates)
    if requests[0].decode_subtask:  # pi0.5's high-level inference: the subtask first, then the actions on it
        decoded = decode_subtasks(model, requests, inputs)
        if requests[0].reprompt is not None:  # factorised: a second prompt, the subtask in the task's place
            parts = [request.reprompt(*request.decoded) for request in requests]
            inputs = {key: torch.cat([part[key] for part in parts]).to(device) for key in parts[0]}
        else:  # joint: the actions follow the decoded tokens in the same cache
            sampling.subtask = decoded
    # the processor's per-row guidance (`cfg_beta`, where it added the unconditioned prompt) is a sampling option
    if "cfg_beta" in inputs:
        sampling.cfg_beta = inputs.pop("cfg_beta")
    if model_input_keys(model) == STATE_INPUTS:  # transformers' pi0: no sampling options (RTC, guidance, N refused)
        return model.sample_actions(**inputs, noise=noise).float().cpu()
    return model.sample_actions(**inputs, noise=noise, sampling_config=sampling).float().cpu()


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
    limits: InputLimits = field(default_factory=InputLimits)
    cfg_beta: float | None = None  # an advantage-conditioned policy's guidance (None: the checkpoint's, its processor's)
    # pi0.5's high-level inference (a subtask-trained checkpoint): "auto" decodes the subtask every `subtask_every`
    # chunks of an episode and acts on it (between decodes on the last one); a text acts on that text (a person's or a
    # planner's); "oracle" acts on the env expert's stage, which the episode loop passes with each request (an
    # evaluation's upper bound); None: the plain prompt. Default: "auto" where the checkpoint's contract records a
    # subtask layout.
    subtask: str | None = "contract"
    subtask_every: int | None = None
    # MEM policies: the stride of their past observations in this robot's control steps, when its rate is not the
    # dataset's (None: the checkpoint's `memory_stride`, in dataset frames; `hf_vla.deployment.contract.memory_stride`)
    memory_stride: int | None = None
    # best-of-N: candidate chunks drawn per observation from one prefix, one chosen by `selector`
    # (`hf_vla.serving.selection`: "medoid", "first", or "critic" with `critic`, `hf_vla.serving.critic`); 1: one
    best_of: int = 1
    selector: str = "medoid"
    critic: object | None = None  # a `ChunkCriticScorer` (`load_critic`): selector "critic" scores with it

    def __post_init__(self):
        self.model = self.model.eval().to(self.device)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.last_chunk: torch.Tensor | None = None  # [chunk, max_action_dim], normalised
        self.last_state: np.ndarray | None = None  # the raw state last_chunk's relative actions are offsets from
        self.last_rtc_method: str | None = None  # how the last chunk continued the previous one (None: it did not)
        check_best_of(self.best_of, self.selector)
        if self.best_of > 1 and model_input_keys(self.model) == STATE_INPUTS:
            raise ValueError("best_of: candidate chunks from one prefix need a pi0.5 policy; transformers' pi0 "
                             "samples one chunk per call")
        self.last_selection: Selection | None = None  # the last chunk's best-of-N choice (None: one sample)
        if (self.selector == "critic") != (self.critic is not None):
            raise ValueError("selector='critic' scores candidates with a chunk critic: give both or neither")
        if self.critic is not None:
            if self.best_of < 2:
                raise ValueError(f"a chunk critic picks among candidates: best_of={self.best_of} draws one")
            self.critic.check_policy(self.model, self.processor)
        contract = (getattr(self.processor, "deployment", None) or {}).get("subtask") or {}
        if self.subtask == "contract":
            self.subtask = "auto" if getattr(self.model.config, "subtask_layout", None) else None
        if self.subtask_every is None:
            self.subtask_every = int(contract.get("every_chunks", 1))
        if self.subtask_every < 1:
            raise ValueError(f"subtask_every={self.subtask_every}: decode a subtask every 1 or more chunks")
        # MEM: the episode's observations, one per control step (a stride in the env's steps: `memory_stride`)
        self.memory = ObservationMemory.from_settings(getattr(self.processor, "memory", None), self.memory_stride)
        self.last_subtask: str | None = None  # the subtask the last chunk acted on (None: none)
        self._subtask_age = 0  # chunks acted on the last decoded subtask
        self._decoded: tuple | None = None  # the last decoded subtask's tokens (ids, mask), acted on between decodes

    def reset(self, seed: int | None = None) -> None:
        """A new episode: forget the last chunk; with `seed`, re-seed the noise generator (an episode's noise then
        depends on its seed alone, however many episodes ran before or beside it)."""
        self.last_chunk = None
        self.last_subtask, self._subtask_age, self._decoded = None, 0, None
        if self.memory is not None:
            self.memory.reset()
        if seed is not None:
            self.generator.manual_seed(int(seed))

    def fork(self) -> PolicyRunner:
        """The same model and settings with a noise generator, chunk memory and observation memory of its own (one
        per env slot, one per server session)."""
        return replace(self)

    def prepare_observation_check(self, observation: dict, head=None) -> None:
        """`RequestError` for an observation the policy could not act on (its cameras and state), without acting."""
        self._camera_images(observation)
        self._check_state(self.obs_map.state_vector(observation), self.head_name(head))

    def observe(self, observation: dict) -> None:
        """One control step's observation where no chunk is asked for: a MEM policy keeps it as the past of later
        chunks (a call that acts records its own observation; `Continuation.recorded` says it was observed here
        already). Without memory: nothing."""
        if self.memory is None:
            return
        images, state = self._camera_images(observation)[0], self.obs_map.state_vector(observation)
        self._check_memory_shape(images)
        self.memory.record(images, state)

    def _check_memory_shape(self, images: torch.Tensor) -> None:
        """A MEM policy's cameras keep their size through an episode (its past frames are stacked with the new one)."""
        if self.memory is not None and self.memory.visual and self.memory.history:
            before = tuple(self.memory.history[-1][0].shape)
            if tuple(images.shape) != before:
                raise RequestError(f"camera images of shape {tuple(images.shape)} [cams, 3, H, W]; this episode's "
                                   f"earlier observations were {before}: a MEM policy's cameras keep one size within "
                                   "an episode (start a new one: reset, or a new episode_seed)")

    def sample_batch(self, requests: list[PreparedRequest]) -> torch.Tensor:
        """The normalised chunks of prepared requests that share one forward (`sample_batch`); the one place the
        episode loop samples, so a subclass can sample otherwise (the stochastic policy of `hf_vla.rl`)."""
        return sample_batch(self.model, requests, self.device)

    def head_name(self, head=None) -> str:
        try:
            return self.processor._head(head if head is not None else self.head)
        except (KeyError, ValueError, IndexError, TypeError) as error:
            raise RequestError(str(error).strip('"')) from error

    def __call__(self, observation: dict, task: str | None = None, head=None, inference_delay: int = 0,
                 executed_steps: int | None = None, prev_chunk_left_over=None,
                 execution_horizon: int | None = None) -> np.ndarray:
        request = self.prepare(observation, task, head, Continuation(inference_delay, executed_steps,
                                                                      prev_chunk_left_over, execution_horizon))
        return self.finish(request, self.sample_batch([request])[0])

    def _subtask_of(self, subtask) -> tuple[str | None, bool]:
        """This chunk's subtask: (the text to act on, or None; whether the model decodes it first). `subtask`: the
        request's own (a text, "auto", or None for the runner's setting)."""
        wanted = self.subtask if subtask is None else subtask
        if wanted is None:
            return None, False
        if wanted == "oracle":
            raise RequestError("subtask='oracle' acts on an env expert's stage, which this request does not carry "
                               "(an env with stages, in the episode loop)")
        if not isinstance(wanted, str) or not wanted.strip():
            raise RequestError(f"subtask={wanted!r}: a text, or 'auto' (the policy decodes it)")
        if not getattr(self.model.config, "subtask_layout", None):
            raise RequestError("subtask: this checkpoint was not trained with subtasks; leave the field out")
        if wanted != "auto":
            return wanted, False
        if self.last_subtask is not None and self._subtask_age < self.subtask_every:
            return self.last_subtask, False  # between decodes: act on the last decoded one (its very tokens)
        return None, True

    def prepare(self, observation: dict, task: str | None = None, head=None, continuation: Continuation | None = None,
                cfg_beta: float | None = None, subtask: str | None = None,
                best_of: int | None = None) -> PreparedRequest:
        """Validate an observation and build its model inputs and noise (no model call): `RequestError` for anything
        the policy must not act on. `continuation`: how it continues the chunk being executed (default: an
        independent chunk); `cfg_beta`: this request's guidance of an advantage-conditioned policy (default the
        runner's); `subtask`: this request's subtask (a text, or "auto"; default the runner's); `best_of`: this
        request's candidate count (default the runner's; at most `limits.max_best_of`)."""
        continuation = continuation or Continuation()
        best_of = self._request_best_of(best_of)
        inference_delay, executed_steps = continuation.inference_delay, continuation.executed_steps
        prev_chunk_left_over, execution_horizon = continuation.prev_chunk_left_over, continuation.execution_horizon
        head = self.head_name(head)
        task = check_task(task, "task", self.limits) if task is not None else self.obs_map.task(observation, self.limits)
        images, mask = self._camera_images(observation)
        state = self.obs_map.state_vector(observation)
        self._check_state(state, head)
        leftover = self._leftover(head, inference_delay, executed_steps, prev_chunk_left_over, state)
        chunk_size = self.model.config.chunk_size
        if execution_horizon is not None and (isinstance(execution_horizon, bool) or not isinstance(
                execution_horizon, int | np.integer) or not 1 <= execution_horizon <= chunk_size):
            # checked whether or not a chunk is continued: a client's bad value is a bug to show at once
            raise RequestError(f"execution_horizon={execution_horizon!r}: an integer in [1, {chunk_size}] (actions of "
                               "the previous chunk the new one is blended with)")
        method = None
        if leftover is not None and model_input_keys(self.model) == STATE_INPUTS:
            raise RequestError("real-time chunking (executed_steps / prev_chunk_left_over) needs a pi0.5 policy; "
                               "transformers' pi0 samples independent chunks: leave those fields out")
        if leftover is not None:
            try:
                method = self.rtc.resolve_method(inference_delay, getattr(self.model.config, "rtc_max_delay", 0))
            except ValueError as error:
                raise RequestError(str(error)) from error
        text, decode = self._subtask_of(subtask)
        # between decodes (joint layout): the decoded tokens themselves, not their text tokenized again
        reuse = (not decode and text is not None and subtask in (None, "auto") and self._decoded is not None
                 and self.model.config.subtask_layout == "joint")
        rows = {"images": images[None], "states": state[None], "tasks": [task], "camera_mask": mask[None]}
        if self.memory is not None:  # MEM: this step joins the episode's history (unless `observe` recorded it)
            lag = continuation.recorded
            if lag is None:
                self._check_memory_shape(images)
            elif isinstance(lag, bool) or not isinstance(lag, int | np.integer) or lag < 0:
                raise RequestError(f"recorded={lag!r}: how many steps before the newest observation this one was "
                                   "recorded (an integer >= 0), or None")
            if lag is None:
                self.memory.record(images, state)
            try:
                rows["memory"] = self.memory.past(lag or 0)
            except ValueError as error:
                raise RequestError(str(error)) from error
        inputs, noise = self._inputs(rows, head, cfg_beta, "auto" if decode or reuse else text, best_of)
        if reuse:
            valid = self._decoded[1]
            inputs["subtask_ids"], inputs["subtask_mask"] = self._decoded[0][valid][None], valid[valid][None]
        reprompt = None
        if decode and self.model.config.subtask_layout == "factorised":
            def reprompt(ids, valid, rows=rows, task=task):
                decoded = self.processor.decode_subtask(ids[None], valid[None])[0] or task
                return self._model_inputs(rows, head, cfg_beta, decoded)
        rtc = None
        if leftover is not None:
            rtc = {"prev_chunk_left_over": leftover[None], "inference_delay": int(inference_delay),
                   "execution_horizon": execution_horizon,
                   "rtc_config": replace(self.rtc, method=method)}  # as resolved here
        return PreparedRequest(inputs, noise, head, rtc, state=state[None], decode_subtask=decode, subtask=text,
                               reprompt=reprompt, rows=rows if self.critic is not None else None)

    def max_best_of(self) -> int:
        """The most candidates a request may ask for."""
        return self.limits.max_best_of or self.best_of

    def _request_best_of(self, value) -> int | None:
        """A request's `best_of`: a whole number in [1, max_best_of], or None (the runner's)."""
        if value is None:
            return None
        bound = self.max_best_of()
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= int(value) <= bound:
            raise RequestError(f"best_of={value!r}: a whole number in [1, {bound}] (the server's --max_best_of)")
        if int(value) > 1 and model_input_keys(self.model) == STATE_INPUTS:
            raise RequestError("best_of: candidate chunks from one prefix need a pi0.5 policy; transformers' pi0 "
                               "samples one chunk per call")
        return int(value)

    def _camera_images(self, observation: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The observation's camera images in the policy's slots `[slots, 3, H, W]` (absent slots zero) and which are
        present."""
        images = self.obs_map.images(observation, self.limits)
        slots = self.num_camera_slots or len(images)
        if len(images) > slots:
            raise RequestError(f"{len(images)} camera images; the policy has {slots} camera slots")
        mask = torch.zeros(slots, dtype=torch.bool)
        mask[: len(images)] = True
        if slots > len(images):
            images = torch.cat([images, torch.zeros(slots - len(images), *images.shape[1:], dtype=images.dtype)])
        return images, mask

    def finish(self, request: PreparedRequest, chunk: torch.Tensor) -> np.ndarray:
        """The sampled chunk `[chunk, max_action_dim]` (normalised) of a prepared request -> un-normalised actions
        (a relative head's with the request's state added back); keeps it for the next call's real-time chunking."""
        self.last_rtc_method = request.rtc["rtc_config"].method if request.rtc else None
        self.last_selection = None
        if chunk.ndim == 3:  # best-of-N: `[N, T, d]` candidates, one chosen
            chunk, self.last_selection = self._select(chunk, request.head, request.rows)
        if request.rtc is not None:
            leftover = request.rtc["prev_chunk_left_over"][0]
            spliced = min(request.rtc["inference_delay"], len(leftover))
            chunk[:spliced, : leftover.shape[-1]] = leftover[:spliced]
        self.last_chunk, self.last_state = chunk, request.state
        if request.decoded is not None:  # a freshly decoded subtask: acted on for the next `subtask_every` chunks
            request.subtask = self.processor.decode_subtask(request.decoded[0][None], request.decoded[1][None])[0]
            self._subtask_age, self._decoded = 0, request.decoded
        self._subtask_age += 1
        self.last_subtask = request.subtask
        return self._actions(chunk, request.head, request.state).numpy()

    def _select(self, candidates: torch.Tensor, head: str, rows: dict | None = None) -> tuple[torch.Tensor, Selection]:
        """One of an observation's candidate chunks `[N, T, d]` by `selector`, over the head's own action dims
        (`rows`: the observation, which the critic reads)."""
        dims = stat_dims(self.processor.norm_stats[head]["actions"])
        scores = self.critic.scores(rows, head, candidates, dims) if self.critic is not None else None
        return select_chunk(candidates, self.selector, dims, scores)

    def _actions(self, chunk: torch.Tensor, head: str, state) -> torch.Tensor:
        """Normalised chunk(s) -> robot units; `state` (raw, `[rows, d]`) is added back where the head is relative."""
        if self._relative_mask(head) is None:
            return self.processor.unnormalize_actions(chunk, head)
        state = torch.as_tensor(np.asarray(state, np.float32))
        return self.processor.unnormalize_actions(chunk, head, state=state if chunk.ndim == 3 else state[0])

    def _relative_mask(self, head: str) -> list[bool] | None:
        """The head's relative-action mask (transformers' pi0 processor has none: absolute actions)."""
        return self.processor.relative_mask(head) if hasattr(self.processor, "relative_mask") else None

    def _relative(self, actions: torch.Tensor, head: str, state: np.ndarray) -> torch.Tensor:
        """Robot-unit actions `[steps, action_dim]` as the model predicts them for an observation of `state`:
        offsets from it where the head is relative, else unchanged (not normalised)."""
        from hf_vla.models.common.normalization import to_relative

        mask = self._relative_mask(head)
        actions = torch.as_tensor(actions, dtype=torch.float32)
        return actions if mask is None else to_relative(actions, torch.as_tensor(state), mask)

    def _check_state(self, state: np.ndarray, head: str) -> None:
        """The state fits the head and lies within `limits.max_state_range` widths of its training range."""
        expected = stat_dims(self.processor.norm_stats[head]["state"])
        if state.shape[-1] != expected:
            raise RequestError(f"state {self.obs_map.state or 'vector'} has {state.shape[-1]} values; head {head!r} "
                               f"expects {expected}")
        self._check_range(state, head, "state", "state value")

    def _check_range(self, values: np.ndarray, head: str, key: str, what: str) -> None:
        """Every value lies within `limits.max_state_range` q01..q99 widths of the head's training range of `key`
        (state, or actions for an RTC leftover): a value 10,000 widths away is a sensor fault, a wrong unit or an
        attack, never something to act on or blend into a chunk."""
        q01, q99 = stat_range(self.processor.norm_stats[head][key])
        width = np.maximum(q99 - q01, 1e-6)  # a constant dim still gets a finite tolerance
        distance = (np.maximum(q01 - values, values - q99) / width).reshape(-1, len(q01))
        far = np.argwhere(distance > self.limits.max_state_range)
        if far.size:
            row, i = (int(v) for v in far[0])
            value = float(np.asarray(values, np.float64).reshape(-1, len(q01))[row, i])
            at = f"index {i}" if values.ndim == 1 else f"step {row}, dim {i}"
            raise RequestError(f"{what} {value:g} at {at} lies {float(distance[row, i]):.3g} widths outside head "
                               f"{head!r}'s training range [{q01[i]:g}, {q99[i]:g}] (limit "
                               f"{self.limits.max_state_range:g}): a sensor fault or a wrong unit?")

    def _leftover(self, head: str, inference_delay: int, executed_steps, prev_chunk_left_over, state=None):
        """The previous chunk's remainder in the model's space for this observation (`state`: a relative head's
        leftover is re-expressed as offsets from it), or None (no guidance)."""
        chunk_size = self.model.config.chunk_size
        if not isinstance(inference_delay, int | np.integer) or not 0 <= inference_delay < chunk_size:
            raise RequestError(f"inference_delay={inference_delay!r}: an integer in [0, {chunk_size})")
        if prev_chunk_left_over is not None:
            try:
                leftover = np.asarray(prev_chunk_left_over, dtype=np.float32)
            except (TypeError, ValueError) as error:
                raise RequestError(f"prev_chunk_left_over: not numeric ({error})") from error
            if not np.isfinite(leftover).all():
                raise RequestError("prev_chunk_left_over: holds NaN or inf")
            if leftover.ndim != 2 or not 1 <= leftover.shape[0] <= chunk_size:
                raise RequestError(f"prev_chunk_left_over: expected [steps in 1..{chunk_size}, action_dim], got "
                                   f"{leftover.shape} (send no leftover when the previous chunk is used up)")
            dims = stat_dims(self.processor.norm_stats[head]["actions"])
            if leftover.shape[1] != dims:
                raise RequestError(f"prev_chunk_left_over: actions has {leftover.shape[1]} dims but head {head!r} has "
                                   f"stats for {dims}")
            relative = self._relative_mask(head) is not None
            seen = self._relative(torch.as_tensor(leftover), head, state)  # what the model sees: offsets, if relative
            self._check_range(seen.numpy(), head, "actions", "prev_chunk_left_over: action"
                              + (" (relative to the state)" if relative else ""))
            try:
                return self.processor.normalize(seen, "actions", head)
            except ValueError as error:
                raise RequestError(f"prev_chunk_left_over: {error}") from error
        if executed_steps is None:
            return None
        if (isinstance(executed_steps, bool) or not isinstance(executed_steps, int | np.integer)
                or not 0 <= executed_steps < chunk_size):  # checked before the first chunk too: a client's bug
            raise RequestError(f"executed_steps={executed_steps!r}: an integer in [0, {chunk_size})")
        if self.last_chunk is None:  # the episode's first request: nothing to continue
            return None
        left = self.last_chunk[executed_steps:]
        if self._relative_mask(head) is not None:
            # offsets from the previous observation's state: in robot units, then offsets from this one's
            absolute = self._actions(left[None], head, self.last_state)[0]
            return self.processor.normalize(self._relative(absolute, head, state), "actions", head)
        return left

    def _inputs(self, rows: dict, head, cfg_beta=None, subtask: str | None = None,
                best_of: int | None = None) -> tuple[dict, torch.Tensor]:
        """The model inputs of a batch (`_model_inputs`) and its noise, drawn from this runner's generator
        (`best_of` candidates per row, default the runner's)."""
        inputs = self._model_inputs(rows, head, cfg_beta, subtask)
        config = self.model.config
        count = self.best_of if best_of is None else best_of
        candidates = (count,) if count > 1 else ()
        noise = torch.randn(len(rows["tasks"]), *candidates, config.chunk_size, config.max_action_dim,
                            generator=self.generator)
        return inputs, noise

    def _model_inputs(self, rows: dict, head, cfg_beta=None, subtask: str | None = None) -> dict:
        """The processor's output for a batch (`rows`: its images, states, tasks, camera_mask and, for a MEM policy,
        memory), the keys the model reads (no noise drawn)."""
        try:
            cfg_beta = self.cfg_beta if cfg_beta is None else cfg_beta
            guidance = {} if cfg_beta is None else {"cfg_beta": cfg_beta}  # else the processor's own
            if subtask is not None:
                guidance["subtask"] = subtask
            if rows.get("memory") is not None:
                guidance["memory"] = rows["memory"]
            inputs = self.processor(images=rows["images"], text=rows["tasks"], state=rows["states"], head=head,
                                    camera_mask=rows["camera_mask"], **guidance)
        except ValueError as error:
            raise RequestError(str(error)) from error
        keys = model_input_keys(self.model) + tuple(key for key in GUIDANCE_INPUTS + SUBTASK_INPUTS + MEMORY_INPUTS
                                                    if key in inputs)
        return {key: inputs[key] for key in keys}

    def predict(self, images: torch.Tensor, states: np.ndarray, tasks: list[str], camera_mask: torch.Tensor) -> np.ndarray:
        """A batch: uint8 images [B, cams, 3, H, W], raw states [B, d], tasks, camera_mask [B, cams] -> chunks
        [B, chunk, action_dim], un-normalised (no real-time chunking)."""
        states = np.asarray(states)
        if not np.isfinite(states).all():
            raise RequestError("states: NaN or inf in the batch; no action is computed from it")
        rows = {"images": images, "states": states, "tasks": tasks, "camera_mask": camera_mask}
        inputs, noise = self._inputs(rows, self.head_name())
        chunk = sample_batch(self.model, [PreparedRequest(inputs, noise, self.head_name())], self.device)
        if chunk.ndim == 4:  # best-of-N: one chosen per row
            chunk = torch.stack([self._select(candidates, self.head_name(), {
                "images": images[i:i + 1], "states": states[i:i + 1], "tasks": tasks[i:i + 1],
                "camera_mask": camera_mask[i:i + 1]})[0] for i, candidates in enumerate(chunk)])
        return self._actions(chunk, self.head_name(), states).numpy()


def load_policy(checkpoint: str | Path, device: str = "cpu", revision: str | None = None, **kwargs) -> PolicyRunner:
    """The policy and processor from a directory or Hub id (`load_pretrained`; a lerobot pi0 / pi0.5 checkpoint is
    converted on load and cached, `hf_vla.hub.resolve.resolve_pretrained`), wrapped in a `PolicyRunner`."""
    from hf_vla.errors import ConfigError
    from hf_vla.hub.resolve import load_pretrained, resolve_pretrained

    resolved = resolve_pretrained(checkpoint, revision=revision)
    if resolved != str(checkpoint):
        checkpoint, revision = resolved, None
    try:
        model, processor = load_pretrained(checkpoint, revision=revision)
    except (OSError, ValueError) as error:  # a missing directory or Hub repo, offline, a config without a model type
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"checkpoint {str(checkpoint)!r} could not be loaded: {first}") from error
    try:
        return PolicyRunner(model.requires_grad_(False), processor, device=device, **kwargs)  # for inference only
    except ConfigError:  # a flag's own line (--critic of another action space)
        raise
    except ValueError as error:  # a setting this policy cannot run with (best_of for pi0, subtask_every < 1)
        raise ConfigError(f"checkpoint {str(checkpoint)!r}: {error}") from error


def check_cfg_beta(flag: str, cfg_beta: float | None, runner: PolicyRunner | None = None, *,
                   conditioned: bool | None = None) -> None:
    """A guidance flag (`--cfg_beta`) other than 1 only for an advantage-conditioned (RECAP) policy: one line before
    anything runs (the processor refuses it too, but at the first inference). `conditioned`: what the checkpoint's
    contract says, before the policy is loaded; else the loaded `runner`'s processor."""
    from hf_vla.errors import ConfigError

    if conditioned is None:
        conditioned = bool(getattr(runner.processor, "advantage_conditioned", False))
    if cfg_beta is not None and cfg_beta != 1.0 and not conditioned:
        raise ConfigError(f"{flag} {cfg_beta}: guidance needs an advantage-conditioned policy (RECAP); this checkpoint "
                          "is not one")


def rtc_config_from_args(args) -> RTCConfig:
    """The `RTCConfig` of parsed options with `hf_vla.serving.arguments.RTCArguments`' fields."""
    return RTCConfig(execution_horizon=args.execution_horizon, max_guidance_weight=args.max_guidance_weight,
                     prefix_attention_schedule=args.prefix_attention_schedule, jacobian=args.rtc_jacobian,
                     method=args.rtc_method)


__all__ = ["Continuation", "InputLimits", "ObservationMap", "PreparedRequest", "batch_requests", "sample_batch", "PolicyRunner", "RequestError", "load_policy", "rtc_config_from_args", "stat_dims", "stat_range"]
