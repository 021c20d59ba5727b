"""Running an evaluation: the episode engine over every task of a benchmark in waves, a local policy or a policy
server (`RemotePolicy`, openpi's client), and the results (`EvalResult` per task, `BenchmarkResult`)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hf_vla.cli import positive, websocket_uri
from hf_vla.deployment.contract import head_spec, memory_stride
from hf_vla.envs.episodes import check_dims
from hf_vla.envs.settings import MAX_ENVS_AT_ONCE, EnvRequest, env_arguments, evaluation_settings
from hf_vla.errors import ConfigError, ConnectionFailedError
from hf_vla.evaluation.arguments import EvaluateArguments
from hf_vla.evaluation.envs import (
    _check_image_size,
    _close,
    _make_envs,
    check_cameras,
    check_env,
    env_camera_keys,
    env_tasks,
)
from hf_vla.hub.resolve import resolve_contract
from hf_vla.models.common.rtc_config import RTCConfig
from hf_vla.registry import env_names, find_env, task_env
from hf_vla.serving.policy import ObservationMap, RequestError, check_cfg_beta, load_policy

logger = logging.getLogger("hf_vla.evaluate")


@dataclass
class EvalResult:
    success_rate: float
    episodes: int
    successes: int
    mean_steps: float
    videos: list[str] = field(default_factory=list)
    inference_delay: int = 0
    rtc: bool = False
    # At the steps where the robot switches to a new chunk: mean |a_k - a_(k-1)| (jump) and |a_(k+1) - 2 a_k + a_(k-1)|
    # (second difference: jerk for velocity actions such as ColorReach's), L2 over action dims.
    boundary_jump: float = float("nan")
    boundary_jerk: float = float("nan")
    interior_jerk: float = float("nan")  # the same second difference at every other step, for scale
    rtc_method: str | None = None  # with rtc: "guidance" (inference-time) or "prefix" (training-time), as used
    episode_records: list[dict] = field(default_factory=list)  # every episode: {"seed", "success", "steps", "reward"}
    num_envs: int = 1
    settings: dict = field(default_factory=dict)  # what it ran with and where each came from (evaluate_checkpoint)
    # pi0.5's high-level inference: the share of chunks whose decoded subtask was the env expert's stage (None: none
    # decoded where the env has stages)
    subtask_accuracy: float | None = None

    @classmethod
    def from_episodes(cls, episodes: list, inference_delay: int = 0, rtc: bool = False, rtc_methods=(),
                      num_envs: int = 1) -> EvalResult:
        def mean(values):
            values = np.asarray(values, dtype=np.float64)
            return float(np.nanmean(values)) if len(values) and not np.isnan(values).all() else float("nan")

        successes = sum(e.success for e in episodes)
        used = "+".join(sorted(m for m in rtc_methods if m)) or None  # as the policy reported it, per chunk
        checks = sum(e.subtask_checks for e in episodes)
        return cls(successes / len(episodes), len(episodes), successes, float(np.mean([e.steps for e in episodes])),
                   [e.video for e in episodes if e.video], inference_delay, rtc,
                   mean([e.boundary_jump for e in episodes]), mean([e.boundary_jerk for e in episodes]),
                   mean([e.interior_jerk for e in episodes]), used, [e.record() for e in episodes], num_envs,
                   subtask_accuracy=sum(e.subtask_hits for e in episodes) / checks if checks else None)


class RemotePolicy:
    """A policy served by `hf_vla.serve` (or any openpi policy server), through openpi-client's websocket client.

    `api_key` (default: the `HF_VLA_API_KEY` environment variable) is sent at the handshake, as the server expects.
    Sends the env's observation dict with the task under `prompt` and, for real-time chunking, `rtc/inference_delay`
    and `rtc/executed_steps`; returns the `actions` of the reply, and keeps its `rtc/method` (how the server continued
    the previous chunk; absent when it did not) like `PolicyRunner.last_rtc_method`.
    """

    def __init__(self, uri: str, api_key: str | None = None):

        from openpi_client.websocket_client_policy import WebsocketClientPolicy
        from websockets.exceptions import InvalidStatus, InvalidURI

        try:
            self.client = WebsocketClientPolicy(uri, api_key=api_key or os.environ.get("HF_VLA_API_KEY"))
        except InvalidStatus as error:
            status = error.response.status_code
            hint = ": set HF_VLA_API_KEY to the server's key" if status == 401 else ""
            raise ConnectionFailedError(f"policy server {uri} refused the connection (HTTP {status}){hint}") from error
        except (OSError, InvalidURI, TimeoutError) as error:
            raise ConnectionFailedError(f"cannot connect to the policy server {uri}: {error}") from error
        self.metadata = self.client.get_server_metadata()
        self.last_rtc_method: str | None = None
        self.uri, self.api_key = uri, api_key
        self._episode_seed: int | None = None
        # a MEM policy (its contract's `memory`): the server keeps this connection's past, so every step goes to it
        self.memory = ((self.metadata or {}).get("deployment") or {}).get("memory")

    def fork(self) -> RemotePolicy:
        """Another connection to the same server (one per env slot: each keeps its own noise and last chunk)."""
        return RemotePolicy(self.uri, self.api_key)

    def reset(self, seed: int | None = None) -> None:
        """A new episode: the next request carries `episode_seed`, which re-seeds this connection's noise."""
        self._episode_seed = seed

    def observe(self, observation: dict) -> None:
        """A step without a chunk, for a MEM policy's past (`observe_only`; the episode loop calls it)."""
        request = {**observation, "observe_only": True}
        if self._episode_seed is not None:
            request["episode_seed"], self._episode_seed = int(self._episode_seed), None
        self.client.infer(request)

    def __call__(self, observation: dict, task: str, inference_delay: int = 0, executed_steps: int | None = None):
        request = {**observation, "prompt": task, "rtc/inference_delay": int(inference_delay)}
        if executed_steps is not None:
            request["rtc/executed_steps"] = int(executed_steps)
        if self._episode_seed is not None:
            request["episode_seed"], self._episode_seed = int(self._episode_seed), None
        reply = self.client.infer(request)
        self.last_rtc_method = reply.get("rtc/method")
        return np.asarray(reply["actions"])


@dataclass
class ChunkTiming:
    """How chunks drive an env: `n_action_steps` actions of each, an inference delay `inference_delay` (control steps
    the robot runs the old chunk while the next is computed), real-time chunking with `rtc`, and the policy's
    `chunk_size` (the bound the other two are checked against)."""

    n_action_steps: int
    inference_delay: int = 0
    rtc: bool = False
    chunk_size: int | None = None

    def runner(self, envs, policy):
        from hf_vla.envs.episodes import EpisodeRunner

        return EpisodeRunner(envs, policy, self.n_action_steps, inference_delay=self.inference_delay, rtc=self.rtc,
                             chunk_size=self.chunk_size)


def run_episodes(env, policy, seeds, timing: ChunkTiming | int, save_videos: int = 0,
                 output_dir: str | Path | None = None, progress: bool = True) -> EvalResult:
    """Closed-loop episodes with receding-horizon chunks in `env` (one env, or a list of envs run at once), through
    the one episode loop (`hf_vla.envs.episodes.EpisodeRunner`): one episode per seed of `seeds`.

    `policy(observation, task, inference_delay=, executed_steps=)` returns a chunk. `timing` (or just the number of
    actions executed per chunk): with an inference delay d > 0, inference is simulated as asynchronous: after
    `n_action_steps` (H) actions of a chunk the next one is requested with the current observation, the robot executes
    d more actions of the current chunk meanwhile, then switches to the new chunk at its index d (so every chunk
    drives H actions, from an observation d steps old). With `rtc` the request asks the policy to continue the current
    chunk (real-time chunking); without, chunks are independent.
    """
    seeds = [int(seed) for seed in seeds]
    if not seeds:
        raise ConfigError("episodes: no seed to run an episode with")
    timing = timing if isinstance(timing, ChunkTiming) else ChunkTiming(int(timing))
    envs = list(env) if isinstance(env, list | tuple) else [env]
    runner = timing.runner(envs, policy)
    done = runner.run(seeds, save_videos=save_videos, output_dir=output_dir, progress=progress)
    return EvalResult.from_episodes(done, timing.inference_delay, timing.rtc, runner.rtc_methods, num_envs=len(envs))


def evaluate_checkpoint(args: EvaluateArguments, rtc_config: RTCConfig | None = None, env_kwargs: dict | None = None,
                        progress: bool = True):
    """Evaluate `args.checkpoint` in-process, or the policy behind `args.server` (ws://HOST:PORT) through openpi-client:
    `python -m hf_vla.evaluate` with its options as one `EvaluateArguments` (`rtc_config`: the in-process real-time
    chunking settings).

    Every setting the checkpoint's deployment contract knows (env and tasks of the recorded benchmark, image size,
    actions per chunk, episode limit, cameras) is taken from it; an argument that contradicts it is refused unless
    named in `args.override` (see `evaluation_settings`). `env="metaworld"` with `task` (names or a difficulty group)
    or `env="libero"` with `task` (suites such as `libero_spatial`, or `suite/index`) runs lerobot's env wrappers;
    `env_kwargs` are further env arguments (its `image_size` and `max_episode_steps` count as those flags where
    `args` leaves them unset). `num_envs` envs run per task at once (default:
    `hf_vla.envs.episodes.default_num_envs`), and `tasks_at_once` benchmark tasks side by side (default:
    `default_tasks_at_once`); each episode's outcome depends on its seed alone. Returns a `BenchmarkResult`
    (per-task results, their mean) for a benchmark env, else an `EvalResult`; both carry the settings and every
    episode, also written to `output_dir/eval_result.json`.
    """
    import hf_vla.envs  # noqa: F401  (registers the demo env)
    from hf_vla.cli import resolve_device
    from hf_vla.deployment.contract import DeploymentConfig
    from hf_vla.envs.episodes import default_num_envs

    checkpoint, server, episodes = args.checkpoint, args.server, args.episodes
    if (checkpoint is None) == (server is None):
        raise ConfigError("pass exactly one of checkpoint (in-process) and server (ws://HOST:PORT)")
    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: must be positive")
    positive("num_envs", args.num_envs)
    positive("tasks_at_once", args.tasks_at_once)
    env_kwargs = dict(env_kwargs or {})
    flags = {name: getattr(args, name) if getattr(args, name) is not None else env_kwargs.get(name)
             for name in ("image_size", "max_episode_steps")}
    for name in flags:
        env_kwargs.pop(name, None)
    remote = None
    if server is not None:
        remote = RemotePolicy(websocket_uri("server", server))
        contract = remote.metadata.get("deployment")
        contract = DeploymentConfig.from_dict(contract, f"{server} metadata") if contract else None
        chunk_size = int(remote.metadata.get("chunk_size", 0)) or None
    else:
        contract = resolve_contract(checkpoint, args.revision)
        chunk_size = contract.chunk_size if contract else None
    settings = evaluation_settings(contract, EnvRequest.of(args, **flags), chunk_size)
    env_id, task = settings["env"].value, settings["task"].value
    check_env(env_id, task)
    if args.subtask == "oracle" and not getattr(task_env(env_id), "subtasks", False):
        raise ConfigError(f"--subtask oracle: acts on the env expert's stage; env {env_id!r} has none (envs with "
                          "stages: " + ", ".join(sorted(n for n in env_names() if getattr(find_env(n), "subtasks",
                                                                                        False))) + ")")
    spec = head_spec(contract, settings["head"].value)
    given = dict(env_kwargs)
    env_kwargs = env_arguments(spec, settings, env_kwargs)
    env_cameras = env_camera_keys(env_id, env_kwargs)  # Meta-World renders the cameras its arguments name
    chosen = settings["cameras"].value
    if chosen and settings["cameras"].source == "checkpoint" and not set(chosen) <= set(env_cameras):
        raise ConfigError(f"the checkpoint's cameras {chosen} are not all images of env {env_id!r}'s observations "
                          f"{env_cameras}; pass --cameras with the env's keys in the checkpoint's slot order")
    check_cameras("--cameras", chosen if settings["cameras"].source != "checkpoint" else None, env_cameras)
    shown = {k: v for k, v in env_kwargs.items() if k != "image_size"}  # the env arguments besides the flags
    output_dir = args.output_dir
    if output_dir is None:
        output_dir = Path(checkpoint) / "rollouts" if checkpoint is not None else Path("outputs") / "eval_server"
    from hf_vla.storage import check_creatable, make_dir

    output_dir = check_creatable("--output_dir", output_dir)  # before the policy loads: /proc/x in one line
    if remote is not None:
        policy = remote
    else:
        subtask = {} if args.subtask is None else {"subtask": None if args.subtask == "none" else args.subtask}
        # a MEM policy's stride: the training data's frames, as this env's control steps
        stride = memory_stride(contract, getattr(task_env(env_id), "fps", None), f"--env {env_id}")
        if stride is not None:
            subtask["memory_stride"] = stride
        policy = load_policy(checkpoint, device=resolve_device(args.device), revision=args.revision, head=args.head,
                             seed=int(settings["seed"].value), rtc=rtc_config or RTCConfig(),
                             obs_map=ObservationMap(cameras=chosen or None),
                             num_camera_slots=len(spec["cameras"]) if spec else None, cfg_beta=args.cfg_beta,
                             subtask_every=args.subtask_every, **subtask)
        if policy.subtask is not None and not getattr(policy.model.config, "subtask_layout", None):
            raise ConfigError(f"--subtask {args.subtask}: this checkpoint was not trained with subtasks")
        check_cfg_beta("--cfg_beta", args.cfg_beta, policy)
        try:
            settings["head"].value = policy.head_name()
        except RequestError as error:
            raise ConfigError(f"head: {error}") from error
        chunk_size = policy.model.config.chunk_size
    count = int(args.num_envs or default_num_envs(episodes))
    recorded = {name: {"value": setting.value, "source": setting.source} for name, setting in settings.items()}
    recorded["num_envs"] = {"value": count, "source": "flag" if args.num_envs else "default"}
    if shown:
        recorded["env_kwargs"] = {"value": shown, "source": "checkpoint" if shown != given else "flag"}
    names = env_tasks(env_id, task)
    family = task_env(env_id)
    at_once = int(args.tasks_at_once or default_tasks_at_once(len(names), count)) if names != [None] else 1
    if names != [None]:
        recorded["tasks_at_once"] = {"value": at_once, "source": "flag" if args.tasks_at_once else "default"}
    plan = _TaskPlan(env_id, policy, spec, settings, tuple(args.override or ()), count, env_kwargs,
                     [int(settings["seed"].value) + i for i in range(episodes)], output_dir, args.save_videos,
                     progress, ChunkTiming(int(settings["n_action_steps"].value), args.inference_delay, args.rtc,
                                           chunk_size))
    results = {}
    for start in range(0, len(names), at_once):
        wave = names[start:start + at_once]
        desc = (f"{family.title} tasks {start + 1}-{start + len(wave)} of {len(names)}" if len(names) > 1
                else "closed-loop episodes")
        results |= _run_tasks(plan, wave, desc)
    make_dir("--output_dir", output_dir)
    if family is not None:
        result = BenchmarkResult.from_tasks(env_id, results)
        result.settings = recorded
    else:
        result = results[None]
        result.settings = recorded
    (output_dir / "eval_result.json").write_text(json.dumps(asdict(result), indent=2))
    return result


def default_tasks_at_once(tasks: int, num_envs: int) -> int:
    """Benchmark tasks evaluated at once (their envs side by side, one policy call per control step for all of them):
    as many as keep `MAX_ENVS_AT_ONCE` env workers or fewer, at least one."""
    return max(1, min(tasks, MAX_ENVS_AT_ONCE // max(1, num_envs)))


@dataclass
class _TaskPlan:
    """What every wave of an evaluation shares: the env, the policy, the resolved settings and where results go."""

    env_id: str
    policy: object
    spec: dict | None
    settings: dict
    overrides: tuple
    num_envs: int
    env_kwargs: dict
    seeds: list[int]
    output_dir: Path
    save_videos: int
    progress: bool
    timing: ChunkTiming


def _run_tasks(plan: _TaskPlan, names: list, desc: str) -> dict:
    """The episodes of `names` (benchmark tasks, or `[None]` for one gymnasium env) at once: `num_envs` envs per
    task, every task's seeds in its own envs, one batched policy call per control step across all live envs (an
    episode's outcome depends on its seed alone, not on the tasks beside it). -> `{name: EvalResult}`."""
    envs: dict = {}
    try:
        for name in names:
            # several tasks' envs step side by side, so each in a worker process even at one env per task
            envs[name] = _make_envs(plan.env_id, name, plan.num_envs, plan.env_kwargs,
                                    plan.settings["max_episode_steps"].value, worker=plan.num_envs * len(names) > 1)
            label = f"{task_env(plan.env_id).title} {name}" if name else f"env {plan.env_id!r}"
            check_dims(plan.policy, envs[name][0], label)
            if "image_size" not in set(plan.overrides):
                _check_image_size(envs[name][0], plan.spec, plan.settings, label)
        runner = plan.timing.runner(envs, plan.policy)
        done = runner.run({name: plan.seeds for name in names}, save_videos=plan.save_videos, progress=plan.progress,
                          desc=desc, output_dir={name: plan.output_dir / (name or "") for name in names})
    finally:
        for members in envs.values():
            _close(members)
    results = {}
    for name in names:
        results[name] = EvalResult.from_episodes(done[name], plan.timing.inference_delay, plan.timing.rtc,
                                                 runner.rtc_methods, num_envs=plan.num_envs)
        if name:
            logger.info("%s: success %.1f%% (%d/%d), mean steps %.1f", name, 100 * results[name].success_rate,
                        results[name].successes, len(plan.seeds), results[name].mean_steps)
    return results


@dataclass
class BenchmarkResult:
    env: str
    success_rate: float  # mean over tasks
    tasks: dict[str, EvalResult]
    settings: dict = field(default_factory=dict)  # what it ran with and where each came from
    # Meta-World: success per difficulty group (mean over the group's tasks evaluated) and `average`, the mean of the
    # group means: the published MT50 figure (SmolVLA's 87.1 / 51.8 / 70.0 / 64.0 -> 68.2)
    groups: dict[str, float] | None = None
    group_tasks: dict[str, int] | None = None
    average: float | None = None

    @classmethod
    def from_tasks(cls, env: str, results: dict[str, EvalResult]) -> BenchmarkResult:
        result = cls(env, float(np.mean([r.success_rate for r in results.values()])), results)
        family = task_env(env)
        if family is not None and family.groups:
            result.groups, result.group_tasks = family.call("groups", {n: t.success_rate for n, t in results.items()})
            result.average = float(np.mean(list(result.groups.values())))
        return result

    def table(self) -> str:
        rows = [f"{'task':<32} {'success':>8} {'episodes':>9} {'mean steps':>11}"]
        for name, r in self.tasks.items():
            rows.append(f"{name:<32} {100 * r.success_rate:>7.1f}% {r.episodes:>9d} {r.mean_steps:>11.1f}")
        rows.append(f"{'mean over tasks':<32} {100 * self.success_rate:>7.1f}%")
        if self.groups:
            for group, value in self.groups.items():
                rows.append(f"{group + f' ({self.group_tasks[group]} tasks)':<32} {100 * value:>7.1f}%")
            label = "MT50 average" if sum(self.group_tasks.values()) == 50 else "average of the groups"
            figures = " / ".join(f"{100 * v:.1f}" for v in self.groups.values())
            rows.append(f"{label:<32} {100 * self.average:>7.1f}%   ({' / '.join(self.groups)}: {figures} -> "
                        f"{100 * self.average:.1f})")
        return "\n".join(rows)


def printed_result(result) -> dict:
    """The printed result: everything but the per-episode records (they are in eval_result.json)."""
    data = asdict(result)
    for part in [data] + list((data.get("tasks") or {}).values()):
        part.pop("episode_records", None)
    return data
