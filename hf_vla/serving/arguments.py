"""The options of `python -m hf_vla.serve` (`ServeArguments`) and the real-time chunking settings that serve and
evaluate share (`RTCArguments`), as dataclasses for the one parser (`hf_vla.parser.CommandParser`): their help is
`--help`, their checks run before any model loads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_vla.cli import model_source
from hf_vla.errors import ConfigError
from hf_vla.models.common.rtc_config import METHODS, SCHEDULES, RTCConfig
from hf_vla.serving.limits import API_KEY_ENV, CONNECTION_MEMORY_FACTOR, MAX_CONNECTIONS_CAP
from hf_vla.serving.selection import SELECTORS, check_best_of_flag, check_selection_flags

DEFAULT_DEVICE = "auto"  # cuda where torch sees one, else cpu (`hf_vla.cli.resolve_device`, once the options parse)
RTC_GROUP = "real-time chunking (RTC)"


@dataclass
class RTCArguments:
    """Real-time chunking's guidance settings (the fields of `RTCConfig`)."""

    execution_horizon: int = field(default=RTCConfig.execution_horizon, metadata={
        "group": RTC_GROUP, "help": "actions of the previous chunk blended with (capped at the remainder)"})
    max_guidance_weight: float = field(default=RTCConfig.max_guidance_weight, metadata={
        "group": RTC_GROUP, "help": "cap of the guidance weight (lerobot's default 10)"})
    prefix_attention_schedule: str = field(default=RTCConfig.prefix_attention_schedule, metadata={
        "group": RTC_GROUP, "choices": SCHEDULES,
        "help": "decay of the prefix weights (lerobot's default linear; exp is the paper's soft mask)"})
    rtc_jacobian: bool = field(default=False, metadata={
        "group": RTC_GROUP, "help": "propagate the guidance error through the action expert as the paper does (one "
        "backward pass per flow step) instead of lerobot's weighted error"})
    rtc_method: str = field(default=RTCConfig.method, metadata={
        "group": RTC_GROUP, "choices": METHODS,
        "help": "guidance: inference-time RTC (the settings above); prefix: training-time RTC, for a model trained "
        "with rtc_max_delay >= the delay; auto: prefix when the model was trained for it"})

    def rtc_config(self) -> RTCConfig:
        from hf_vla.serving.policy import rtc_config_from_args

        return rtc_config_from_args(self)


LIMITS = "limits and access"
RECORDING = "recording (hf_vla.serving.recorder)"


@dataclass
class ServeArguments:
    """What `python -m hf_vla.serve` serves, where, and within which limits."""

    checkpoint: str | None = field(default=None, metadata={"required": True, "help": "model + processor directory or "
                                   "Hub id (a lerobot pi0.5 checkpoint is converted on load)"})
    revision: str | None = field(default=None, metadata={"help": "Hub revision of --checkpoint"})
    host: str = field(default="0.0.0.0", metadata={"help": "interface to bind (all, as openpi's server; 127.0.0.1 "
                      "for this machine only)"})
    port: int = field(default=8000, metadata={"help": "0 picks a free port (printed)"})
    head: str | None = field(default=None, metadata={"help": "normalization head robot_type::control_mode (default: "
                             "the processor's only one; a request may name another under `head`)"})
    obs_map: str | None = field(default=None, metadata={"help": "JSON file {cameras: [...], state: [...], prompt: "
                                "key}"})
    cameras: list[str] | None = field(default=None, metadata={"help": "image keys in camera-slot order (default: the "
                                      "checkpoint's contract; without one, every HxWx3 array of the observation, "
                                      "sorted)"})
    state: list[str] | None = field(default=None, metadata={"help": "state keys, concatenated (default: the first of "
                                    "observation/state, observation.state, state)"})
    prompt_key: str | None = field(default=None, metadata={"help": "key of the task string (default: prompt)"})
    num_camera_slots: int | None = field(default=None, metadata={"help": "pad with masked cameras up to "
                                         "this many (default: the checkpoint's)"})
    override: list[str] = field(default_factory=list, metadata={
        "choices": ("cameras", "num_camera_slots"),
        "help": "accept --cameras / --num_camera_slots against the checkpoint's deployment contract"})
    cfg_beta: float | None = field(default=None, metadata={"help": "classifier-free guidance of an "
                                   "advantage-conditioned (RECAP) policy, v_u + beta (v_c - v_u) (default: the "
                                   "checkpoint's, 1: plain conditioning); a request may send its own `cfg_beta`"})
    max_cfg_beta: float = field(default=3.0, metadata={"group": LIMITS, "help": "largest `cfg_beta` a request may "
                                "ask for"})
    best_of: int | None = field(default=None, metadata={"min": 1, "help": "best-of-N: candidate chunks drawn per "
                                "observation from one prefix, one chosen by --selector; the reply carries "
                                "best_of/index and best_of/spread (default: the checkpoint's contract, where it "
                                "bundles a critic, else 1: one sample)"})
    selector: str | None = field(default=None, metadata={"choices": list(SELECTORS), "help": "with --best_of: "
                                 "critic (the highest expected return by --critic), medoid (the candidate closest "
                                 "to all the others) or first (default: critic with --critic, else medoid)"})
    critic: str | None = field(default=None, metadata={"help": "with --best_of: a chunk critic (a directory or Hub id "
                               "trained with policy pi05_chunk_critic) that scores the candidates"})
    max_best_of: int | None = field(default=None, metadata={"group": LIMITS, "help": "most candidate chunks a "
                                    "request's `best_of` may ask for (default: --best_of)"})
    max_message_mb: float | None = field(default=None, metadata={
        "group": LIMITS, "help": "largest request read, in MiB (default: every camera at 1920x1080 float32 + "
        "1, e.g. 73 for 3 cameras)"})
    max_image_side: int = field(default=2048, metadata={"group": LIMITS,
                                                        "help": "largest image side accepted, in pixels"})
    max_state_range: float = field(default=1e4, metadata={
        "group": LIMITS, "help": "refuse a state value (or an RTC leftover action) this many q01..q99 widths "
        "outside the training range"})
    max_batch: int = field(default=8, metadata={"group": LIMITS, "help": "most requests of clients waiting "
                           "at once that run in one forward (1: one request at a time)"})
    max_connections: int | None = field(default=None, metadata={
        "group": LIMITS, "help": "open connections at most; more are refused at the handshake (HTTP 503) "
        "(default: what half the available memory holds when each sends a --max_message_mb message at once, "
        f"{CONNECTION_MEMORY_FACTOR}x the bound per connection, at most {MAX_CONNECTIONS_CAP})"})
    api_key: str | None = field(default=None, metadata={"group": LIMITS, "help": "require this key at the handshake "
                                f"(prefer the {API_KEY_ENV} environment variable: a flag is visible in the process "
                                "list)"})
    record: str | None = field(default=None, metadata={
        "group": RECORDING, "help": "write what each client sent and got as LeRobot episodes under this directory (a "
        "new or empty one, or this checkpoint's earlier recording to continue); joined into DIR/dataset when the "
        "server stops"})
    record_fps: float | None = field(default=None, metadata={
        "group": RECORDING, "help": "frames per second of the recording (one frame a request; default: the data's "
        "fps / the contract's actions per chunk)"})
    device: str = field(default=DEFAULT_DEVICE, metadata={"help": "where the policy runs: cpu, cuda, "
                        "cuda:N, mps; auto: cuda where available, else cpu"})
    seed: int = field(default=0, metadata={"help": "noise seed of every connection"})

    def __post_init__(self):
        self.checkpoint = model_source("--checkpoint", self.checkpoint)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be 0..65535")
        self.selector = check_selection_flags(self.best_of, self.selector, self.critic)
        if self.max_best_of is not None:
            check_best_of_flag(self.max_best_of, "--max_best_of")
            if self.best_of is not None and self.max_best_of < self.best_of:
                raise ConfigError(f"--max_best_of {self.max_best_of} is below --best_of {self.best_of}")
        if self.critic is not None:
            self.critic = model_source("--critic", self.critic)
        for name in ("max_message_mb", "max_image_side", "max_state_range", "num_camera_slots", "max_batch",
                     "max_connections"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"--{name}: must be positive, got {value}")
        self.record_fps = record_fps(self.record_fps)  # whole, or refused


def record_fps(fps: float | None) -> int | None:
    """--record_fps: a whole number of frames per second (a LeRobot dataset's fps is one), or one line."""
    if fps is None:
        return None
    if not (math.isfinite(fps) and fps > 0):
        raise ConfigError(f"--record_fps {fps}: must be positive")
    if not float(fps).is_integer():
        raise ConfigError(f"--record_fps {fps}: a LeRobot dataset has a whole number of frames per second; give an "
                          f"integer (e.g. {max(1, round(fps))})")
    return int(fps)


__all__ = ["RTCArguments", "ServeArguments", "record_fps"]
