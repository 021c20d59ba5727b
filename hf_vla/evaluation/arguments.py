"""The options of `python -m hf_vla.evaluate` (`EvaluateArguments`, beside the shared `RTCArguments`), as a dataclass
for the one parser (`hf_vla.parser.CommandParser`): its help is `--help`, its checks run before a model loads or an
env is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_vla.cli import model_source, output_dir, websocket_uri
from hf_vla.envs.settings import DEFAULT_ENV, DEFAULT_SEED, MAX_ENVS_AT_ONCE, OVERRIDABLE
from hf_vla.errors import ConfigError
from hf_vla.evaluation.envs import check_cameras, check_env, env_camera_keys
from hf_vla.serving.arguments import DEFAULT_DEVICE
from hf_vla.serving.selection import SELECTORS, check_selection_flags

CONTRACT = ("settings the checkpoint's deployment contract (deployment_config.json) provides; a flag that contradicts "
            "it is refused unless --override names it")
SOURCE = ("the policy: --checkpoint or --server")


@dataclass
class EvaluateArguments:
    """What `python -m hf_vla.evaluate` runs, in which env, and how many episodes."""

    checkpoint: str | None = field(default=None, metadata={"group": SOURCE, "help": "model + processor directory or "
                                   "Hub id (a lerobot pi0.5 checkpoint is converted on load), run in-process"})
    revision: str | None = field(default=None, metadata={"group": SOURCE, "help": "Hub revision of --checkpoint"})
    server: str | None = field(default=None, metadata={"group": SOURCE, "help": "ws://HOST:PORT of a policy server "
                               "(python -m hf_vla.serve)"})
    env: str | None = field(default=None, metadata={
        "group": CONTRACT, "help": "gymnasium env id, or `metaworld` / `libero` (lerobot's env wrappers; with --task) "
        f"(default: the env the data was recorded in, else {DEFAULT_ENV})"})
    task: str | None = field(default=None, metadata={
        "group": CONTRACT, "help": "Meta-World task names (comma-separated) or a difficulty group (easy, medium, hard, "
        "very_hard); LIBERO suites (libero_spatial, ...) or suite/index (default: the recorded tasks)"})
    image_size: int | None = field(default=None, metadata={"group": CONTRACT, "min": 1, "help": "the image side the "
                                   "env renders (default: the size the data was recorded at; else the env's own)"})
    max_episode_steps: int | None = field(default=None, metadata={
        "group": CONTRACT, "min": 1, "help": "episode limit (default: the checkpoint's, else the env's: 500 for "
        "Meta-World, the suite's for LIBERO)"})
    n_action_steps: int | None = field(default=None, metadata={"group": CONTRACT, "min": 1, "help": "actions executed "
                                       "per chunk (default: the checkpoint's, else half the chunk)"})
    cameras: list[str] | None = field(default=None, metadata={"group": CONTRACT, "help": "observation image keys in "
                                      "camera-slot order (default: the checkpoint's)"})
    seed: int | None = field(default=None, metadata={"group": CONTRACT, "help": f"first episode seed (default "
                             f"{DEFAULT_SEED}; seeds the training data was recorded with are refused)"})
    override: list[str] = field(default_factory=list, metadata={
        "group": CONTRACT, "choices": OVERRIDABLE, "help": "accept these flags against the checkpoint's contract; "
        "recorded in eval_result.json"})
    episodes: int = field(default=50, metadata={"min": 1, "help": "episodes per task"})
    num_envs: int | None = field(default=None, metadata={"min": 1, "help": "envs run at once, each in a worker "
                                 "process, one policy call per control step for all of them (default: 70% of the "
                                 "cores, as lerobot-eval; per-seed outcomes do not depend on it)"})
    tasks_at_once: int | None = field(default=None, metadata={
        "min": 1, "help": "benchmark tasks evaluated side by side, their envs served by one policy call per control "
        f"step (default: as many as keep {MAX_ENVS_AT_ONCE} env workers or fewer; per-seed outcomes do not depend on "
        "it)"})
    inference_delay: int = field(default=0, metadata={"min": 0, "help": "simulated inference delay in control steps "
                                 "(actions of the old chunk run meanwhile)"})
    rtc: bool = field(default=False, metadata={"help": "real-time chunking: continue the chunk being executed (its "
                      "in-process settings below; a server uses its own)"})
    head: str | None = field(default=None, metadata={"help": "normalization head (default: the processor's only "
                             "one)"})
    cfg_beta: float | None = field(default=None, metadata={"help": "classifier-free guidance of an "
                                   "advantage-conditioned (RECAP) policy, v_u + beta (v_c - v_u) (default: the "
                                   "checkpoint's; 1: plain conditioning on 'Advantage: positive')"})
    subtask: str | None = field(default=None, metadata={
        "help": "a subtask-trained policy's subtask (docs/subtasks.md): auto (it decodes its own; the default for such "
        "a checkpoint), none (the plain prompt), oracle (the env expert's stage, an upper bound), or a text acted on "
        "throughout (in-process)"})
    subtask_every: int | None = field(default=None, metadata={"min": 1, "help": "with --subtask auto: chunks between "
                                      "decodes (default: the checkpoint's contract, 1)"})
    best_of: int | None = field(default=None, metadata={"min": 1, "help": "best-of-N: candidate chunks drawn per "
                                "observation from one prefix, one chosen by --selector (in-process; default: the "
                                "checkpoint's contract, where it bundles a critic, else 1: one sample)"})
    selector: str | None = field(default=None, metadata={"choices": list(SELECTORS), "help": "with --best_of: "
                                 "critic (the highest expected return by --critic), medoid (the candidate closest "
                                 "to all the others) or first (default: critic with --critic, else medoid)"})
    critic: str | None = field(default=None, metadata={"help": "with --best_of: a chunk critic (a directory or Hub id "
                               "trained with policy pi05_chunk_critic) that scores the candidates"})
    save_videos: int = field(default=3, metadata={"min": 0, "help": "rollouts saved as animated GIFs per task"})
    output_dir: str | None = field(default=None, metadata={"help": "where eval_result.json and the GIFs go"})
    device: str = field(default=DEFAULT_DEVICE, metadata={"help": "where the policy runs (in-process): cpu, "
                        "cuda, cuda:N, mps; auto: cuda where available, else cpu"})

    def __post_init__(self):
        from hf_vla.models.common.flow import MAX_CFG_BETA

        if self.cfg_beta is not None and not (math.isfinite(self.cfg_beta) and 0 <= self.cfg_beta <= MAX_CFG_BETA):
            raise ConfigError(f"--cfg_beta {self.cfg_beta}: a number in [0, {MAX_CFG_BETA:g}] (1: plain conditioning)")
        if self.cfg_beta is not None and self.server is not None:
            raise ConfigError("--cfg_beta: an in-process setting; a server's policy is guided by the server "
                              "(serve --cfg_beta, or each request's cfg_beta)")
        if self.server is not None and (self.best_of not in (None, 1) or self.critic or self.selector):
            raise ConfigError("--best_of / --selector / --critic: in-process settings; a server samples as it was "
                              "started")
        self.selector = check_selection_flags(self.best_of, self.selector, self.critic)
        if self.critic is not None:
            self.critic = model_source("--critic", self.critic)
        if (self.subtask is not None or self.subtask_every is not None) and self.server is not None:
            raise ConfigError("--subtask / --subtask_every: in-process settings; a server decides (serve's default, "
                              "or each request's subtask)")
        if self.subtask is not None and not self.subtask.strip():
            raise ConfigError("--subtask '': auto, none, oracle, or a text")
        if self.checkpoint is not None:
            self.checkpoint = model_source("--checkpoint", self.checkpoint)
        if self.server is not None:
            websocket_uri("--server", self.server)
        output_dir("--output_dir", self.output_dir)
        if self.env is not None:
            check_env(self.env, self.task, "--env ", "--task ")  # an unknown env or task stops here, by name
            check_cameras("--cameras", self.cameras, env_camera_keys(self.env))


__all__ = ["EvaluateArguments"]
