"""Closed-loop evaluation of a checkpoint in a gymnasium env with LeRobot-style observations.

    python -m hf_vla.evaluate --checkpoint outputs/demo --env hf_vla/ColorReach-v0 --episodes 50

    python -m hf_vla.evaluate --server ws://localhost:8000 --inference_delay 2 --rtc

Loads the policy with `AutoModel` (pi0.5) and its `PI05Processor` (or connects to a policy server with openpi-client),
runs episodes with receding-horizon action chunks (`--n_action_steps` of each predicted chunk are executed), with an
optional simulated inference delay and real-time chunking, reports the success rate (`info["is_success"]`) and the
smoothness at chunk switches with a progress bar, and saves the first few rollouts as animated GIFs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

from .cli import ArgumentParser, model_source, output_dir, positive, run, websocket_uri
from .deployment import FILE_NAME, ContractError, for_checkpoint, refuse_repeated_cameras
from .errors import ConfigError, ConnectionFailedError
from .models.pi05.rtc import RTCConfig
from .policy import ObservationMap, RequestError, add_rtc_arguments, load_policy, rtc_config_from_args

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

    @classmethod
    def from_episodes(cls, episodes: list, inference_delay: int = 0, rtc: bool = False, rtc_methods=(),
                      num_envs: int = 1) -> EvalResult:
        def mean(values):
            values = np.asarray(values, dtype=np.float64)
            return float(np.nanmean(values)) if len(values) and not np.isnan(values).all() else float("nan")

        successes = sum(e.success for e in episodes)
        used = "+".join(sorted(m for m in rtc_methods if m)) or None  # as the policy reported it, per chunk
        return cls(successes / len(episodes), len(episodes), successes, float(np.mean([e.steps for e in episodes])),
                   [e.video for e in episodes if e.video], inference_delay, rtc,
                   mean([e.boundary_jump for e in episodes]), mean([e.boundary_jerk for e in episodes]),
                   mean([e.interior_jerk for e in episodes]), used, [e.record() for e in episodes], num_envs)


class RemotePolicy:
    """A policy served by `hf_vla.serve` (or any openpi policy server), through openpi-client's websocket client.

    `api_key` (default: the `HF_VLA_API_KEY` environment variable) is sent at the handshake, as the server expects.
    Sends the env's observation dict with the task under `prompt` and, for real-time chunking, `rtc/inference_delay`
    and `rtc/executed_steps`; returns the `actions` of the reply, and keeps its `rtc/method` (how the server continued
    the previous chunk; absent when it did not) like `PolicyRunner.last_rtc_method`.
    """

    def __init__(self, uri: str, api_key: str | None = None):
        import os

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

    def fork(self) -> RemotePolicy:
        """Another connection to the same server (one per env slot: each keeps its own noise and last chunk)."""
        return RemotePolicy(self.uri, self.api_key)

    def reset(self, seed: int | None = None) -> None:
        """A new episode: the next request carries `episode_seed`, which re-seeds this connection's noise."""
        self._episode_seed = seed

    def __call__(self, observation: dict, task: str, inference_delay: int = 0, executed_steps: int | None = None):
        request = {**observation, "prompt": task, "rtc/inference_delay": int(inference_delay)}
        if executed_steps is not None:
            request["rtc/executed_steps"] = int(executed_steps)
        if self._episode_seed is not None:
            request["episode_seed"], self._episode_seed = int(self._episode_seed), None
        reply = self.client.infer(request)
        self.last_rtc_method = reply.get("rtc/method")
        return np.asarray(reply["actions"])


def run_episodes(env, policy, episodes: int, n_action_steps: int, seed: int = 0, save_videos: int = 0,
                 output_dir: str | Path | None = None, progress: bool = True, inference_delay: int = 0,
                 rtc: bool = False, chunk_size: int | None = None, seeds: list[int] | None = None) -> EvalResult:
    """Closed-loop episodes with receding-horizon chunks in `env` (one env, or a list of envs run at once), through
    the one episode loop (`hf_vla.episodes.EpisodeRunner`); episode i has seed `seed + i` (or `seeds[i]`).

    `policy(observation, task, inference_delay=, executed_steps=)` returns a chunk. With `inference_delay` d > 0,
    inference is simulated as asynchronous: after `n_action_steps` (H) actions of a chunk the next one is requested
    with the current observation, the robot executes d more actions of the current chunk meanwhile, then switches to
    the new chunk at its index d (so every chunk drives H actions, from an observation d steps old). With `rtc` the
    request asks the policy to continue the current chunk (real-time chunking); without, chunks are independent.
    """
    from .episodes import EpisodeRunner

    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: must be positive")
    envs = list(env) if isinstance(env, list | tuple) else [env]
    runner = EpisodeRunner(envs, policy, n_action_steps, inference_delay=inference_delay, rtc=rtc,
                           chunk_size=chunk_size)
    done = runner.run(list(seeds) if seeds is not None else [seed + i for i in range(episodes)],
                      save_videos=save_videos, output_dir=output_dir, progress=progress)
    return EvalResult.from_episodes(done, inference_delay, rtc, runner.rtc_methods, num_envs=len(envs))


def _check_dims(policy, env, where: str) -> None:
    """The policy's head reads the env's state and writes its actions (in-process; a server checks per request)."""
    from .policy import stat_dims

    if not hasattr(policy, "processor"):
        return
    stats = policy.processor.norm_stats[policy.head_name()]
    state_space = getattr(env.observation_space, "spaces", {}).get("observation.state")
    for name, theirs, ours in (("action", env.action_space.shape[0], stat_dims(stats["actions"])),
                               ("state", state_space.shape[0] if state_space is not None else None,
                                stat_dims(stats["state"]))):
        if theirs is not None and theirs != ours:
            raise ConfigError(f"{where} has {theirs} {name} dims but the checkpoint's head {policy.head_name()!r} has "
                              f"{ours}: a checkpoint trained on another robot or env")


DEFAULT_ENV = "hf_vla/ColorReach-v0"
DEFAULT_SEED = 10_000
OVERRIDABLE = ("image_size", "n_action_steps", "max_episode_steps", "cameras", "seed")
# env workers a benchmark evaluation keeps at once across its tasks (MT50 with 2 envs per task: 8 tasks side by side);
# a Meta-World worker holds about 0.4 GB (proportional set size, 160 px)
MAX_ENVS_AT_ONCE = 16


def _env_takes(env_id: str, argument: str) -> bool:
    """Whether the env's constructor takes `argument` (the benchmarks' wrappers take image_size and
    max_episode_steps; a gymnasium id is asked through its entry point)."""
    if env_id in BENCHMARKS:
        return True
    import importlib
    import inspect

    import hf_vla.envs  # noqa: F401

    entry = gym.spec(env_id).entry_point
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    try:
        return argument in inspect.signature(entry).parameters
    except (TypeError, ValueError):
        return False


def evaluation_settings(contract, head: str | None, env_id: str | None, task: str | None, episodes: int,
                        n_action_steps: int | None = None, seed: int | None = None, cameras: list[str] | None = None,
                        image_size: int | None = None, max_episode_steps: int | None = None,
                        overrides=(), chunk_size: int | None = None) -> dict:
    """What an evaluation runs with: `{name: Setting(value, source)}` for env, task, image_size, n_action_steps,
    max_episode_steps, cameras, seed, head and control_mode. Each comes from its flag, else the checkpoint's deployment
    contract (`hf_vla.deployment`), else the default; a flag that contradicts the contract is a `ContractError`
    naming both values and `--override NAME`, unless NAME is in `overrides`."""
    from .deployment import Setting, choose, square_size

    overrides = set(overrides or ())
    unknown = sorted(overrides - set(OVERRIDABLE))
    if unknown:
        raise ConfigError(f"--override {' '.join(unknown)}: choose from {' '.join(OVERRIDABLE)}")
    spec = head_spec(contract, head)
    bench = (spec or {}).get("benchmark") or {}
    settings = {"env": choose("env", env_id, bench.get("env"), DEFAULT_ENV, overrides, equal=lambda a, b: True)}
    env_id = settings["env"].value
    same_env = bench.get("env") == env_id  # the benchmark settings apply to the env the data was recorded in
    recorded_tasks = ",".join(bench["tasks"]) if same_env and bench.get("tasks") else None
    settings["task"] = choose("task", task, recorded_tasks, None, overrides, equal=lambda a, b: True)
    recorded_size = (bench.get("image_size") if same_env else None) or square_size((spec or {}).get("cameras", []))
    takes_size = _env_takes(env_id, "image_size")
    if image_size is not None and not takes_size:
        raise ConfigError(f"--image_size {image_size}: env {env_id!r} takes no image size (its images are what it "
                          f"renders)")
    settings["image_size"] = choose("image_size", image_size, recorded_size if takes_size else None, None, overrides)
    settings["max_episode_steps"] = choose("max_episode_steps", max_episode_steps,
                                           bench.get("max_episode_steps") if same_env else None, None, overrides)
    default_steps = max(1, (chunk_size or (contract.chunk_size if contract else 2)) // 2)
    settings["n_action_steps"] = choose("n_action_steps", n_action_steps, contract.n_action_steps if contract else None,
                                        default_steps, overrides)
    trained = [c["key"] for c in (spec or {}).get("cameras", []) if c.get("key") is not None] or None
    refuse_repeated_cameras("--cameras", cameras)
    # other keys than the trained ones (another camera, another order, another count) contradict the checkpoint
    settings["cameras"] = choose("cameras", list(cameras) if cameras else None, trained, None, overrides)
    settings["seed"] = choose("seed", seed, None, DEFAULT_SEED, overrides)
    data_seeds = bench.get("data_seeds") if same_env else None
    first = int(settings["seed"].value)
    if data_seeds and first <= data_seeds[1] and first + episodes - 1 >= data_seeds[0] and "seed" not in overrides:
        raise ContractError(f"--seed {first}: episodes {first}..{first + episodes - 1} overlap the env seeds "
                            f"{data_seeds[0]}..{data_seeds[1]} the training data was recorded with; evaluate on held-out "
                            f"seeds (default {DEFAULT_SEED}), or pass --override seed")
    if data_seeds and "seed" in overrides and settings["seed"].source == "flag":
        settings["seed"] = Setting(first, "flag (override)")
    head_name = head if head is not None else (contract.default_head if contract else None)
    settings["head"] = Setting(head_name, "flag" if head is not None else "checkpoint" if head_name else "default")
    settings["control_mode"] = Setting((spec or {}).get("control_mode"), "checkpoint" if spec else "default")
    return settings


def head_spec(contract, head: str | None) -> dict | None:
    """The contract's settings of `head` (default: its default or only head); None without a contract, or when the
    checkpoint has several heads and none is named (the robot must say which; the processor refuses that later)."""
    if contract is None:
        return None
    try:
        return contract.head(head)
    except KeyError:
        if head is None:
            return None
        raise ConfigError(f"--head {head!r}: the checkpoint has the heads {sorted(contract.heads)}") from None


def _make_envs(env_id: str, task: str | None, num_envs: int, env_kwargs: dict, max_episode_steps: int | None,
               worker: bool | None = None):
    """`num_envs` envs of `env_id` (a benchmark task, or a gymnasium id): one gymnasium env in this process, else
    (or with `worker`) each in a worker process (hf_vla.envs.worker)."""
    kwargs = dict(env_kwargs) | ({"max_episode_steps": max_episode_steps} if max_episode_steps else {})
    return [make_env(env_id, task, kwargs, worker=num_envs > 1 if worker is None else worker) for _ in range(num_envs)]


def make_env(env_id: str, task: str | None, kwargs: dict, worker: bool):
    """One env of `env_id`: a benchmark task (always in a worker process), else a gymnasium env in a worker process
    (`worker`) or in this one."""
    import functools

    from .envs.worker import InWorker, make_gym

    if env_id in BENCHMARKS:
        return _benchmark_module(env_id).in_worker(task, **kwargs)
    try:
        if not worker:
            return make_gym(env_id, **kwargs)
        return InWorker(functools.partial(make_gym, env_id, **kwargs), name=env_id)
    except (gym.error.Error, TypeError) as error:
        raise ConfigError(f"env {env_id!r}: {error}") from error


def _close(envs) -> None:
    for env in envs:
        try:
            env.close()
        except Exception:  # noqa: BLE001  (a worker that died: nothing left to close)
            logger.debug("closing an env failed", exc_info=True)


def evaluate_checkpoint(checkpoint: str | Path | None = None, env_id: str | None = None, episodes: int = 50,
                        n_action_steps: int | None = None, seed: int | None = None, head=None, cameras=None,
                        save_videos: int = 3, output_dir: str | Path | None = None, device: str = "cpu",
                        env_kwargs: dict | None = None, progress: bool = True, server: str | None = None,
                        inference_delay: int = 0, rtc: bool = False, rtc_config: RTCConfig | None = None,
                        task: str | None = None, revision: str | None = None, num_envs: int | None = None,
                        overrides=(), tasks_at_once: int | None = None):
    """Evaluate a checkpoint in-process, or the policy behind `server` (ws://HOST:PORT) through openpi-client.

    Every setting the checkpoint's deployment contract knows (env and tasks of the recorded benchmark, image size,
    actions per chunk, episode limit, cameras) is taken from it; an argument that contradicts it is refused unless
    named in `overrides` (see `evaluation_settings`). `env_id="metaworld"` with `task` (names or a difficulty group) or
    `env_id="libero"` with `task` (suites such as `libero_spatial`, or `suite/index`) runs lerobot's env wrappers;
    `env_kwargs` may set `image_size` and `max_episode_steps` (as flags) and other env arguments. `num_envs` envs run
    per task at once (default: `hf_vla.episodes.default_num_envs`), and `tasks_at_once` benchmark tasks side by side
    (default: `default_tasks_at_once`); each episode's outcome depends on its seed alone. Returns a
    `BenchmarkResult` (per-task results, their mean) for a benchmark env, else an `EvalResult`; both carry the
    settings and every episode, also written to `output_dir/eval_result.json`.
    """
    import hf_vla.envs  # noqa: F401  (registers the demo env)

    from .deployment import DeploymentConfig
    from .episodes import default_num_envs

    if (checkpoint is None) == (server is None):
        raise ConfigError("pass exactly one of checkpoint (in-process) and server (ws://HOST:PORT)")
    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: must be positive")
    positive("num_envs", num_envs)
    positive("tasks_at_once", tasks_at_once)
    env_kwargs = dict(env_kwargs or {})
    flags = {"image_size": env_kwargs.pop("image_size", None), "max_episode_steps": env_kwargs.pop("max_episode_steps",
                                                                                                     None)}
    remote = None
    if server is not None:
        remote = RemotePolicy(websocket_uri("server", server))
        contract = remote.metadata.get("deployment")
        contract = DeploymentConfig.from_dict(contract, f"{server} metadata") if contract else None
        chunk_size = int(remote.metadata.get("chunk_size", 0)) or None
    else:
        contract = for_checkpoint(checkpoint, revision)
        chunk_size = contract.chunk_size if contract else None
    settings = evaluation_settings(contract, head, env_id, task, episodes, n_action_steps, seed, cameras,
                                   flags["image_size"], flags["max_episode_steps"], overrides, chunk_size)
    env_id, task = settings["env"].value, settings["task"].value
    check_env(env_id, task)
    env_cameras = env_camera_keys(env_id)
    chosen = settings["cameras"].value
    if chosen and settings["cameras"].source == "checkpoint" and not set(chosen) <= set(env_cameras):
        raise ConfigError(f"the checkpoint's cameras {chosen} are not all images of env {env_id!r}'s observations "
                          f"{env_cameras}; pass --cameras with the env's keys in the checkpoint's slot order")
    check_cameras("--cameras", chosen if settings["cameras"].source != "checkpoint" else None, env_cameras)
    if settings["image_size"].value is not None:
        env_kwargs["image_size"] = settings["image_size"].value
    spec = head_spec(contract, settings["head"].value)
    bench = (spec or {}).get("benchmark") or {}
    given = {k: v for k, v in env_kwargs.items() if k != "image_size"}
    if bench.get("env") == env_id:  # the arguments the data was recorded with (ColorReach's layout, a crop, ...)
        env_kwargs = dict(bench.get("env_kwargs") or {}) | env_kwargs
    shown = {k: v for k, v in env_kwargs.items() if k != "image_size"}  # the env arguments besides the flags
    if output_dir is None:
        output_dir = Path(checkpoint) / "rollouts" if checkpoint is not None else Path("outputs") / "eval_server"
    output_dir = Path(output_dir)
    if remote is not None:
        policy = remote
    else:
        policy = load_policy(checkpoint, device=device, revision=revision, head=head, seed=int(settings["seed"].value),
                             rtc=rtc_config or RTCConfig(), obs_map=ObservationMap(cameras=chosen or None),
                             num_camera_slots=len(spec["cameras"]) if spec else None)
        try:
            settings["head"].value = policy.head_name()
        except RequestError as error:
            raise ConfigError(f"head: {error}") from error
        chunk_size = policy.model.config.chunk_size
    steps = int(settings["n_action_steps"].value)
    count = int(num_envs or default_num_envs(episodes))
    seeds = [int(settings["seed"].value) + i for i in range(episodes)]
    common = dict(save_videos=save_videos, progress=progress, inference_delay=inference_delay, rtc=rtc,
                  chunk_size=chunk_size, n_action_steps=steps)
    recorded = {name: {"value": setting.value, "source": setting.source} for name, setting in settings.items()}
    recorded["num_envs"] = {"value": count, "source": "flag" if num_envs else "default"}
    if shown:
        recorded["env_kwargs"] = {"value": shown, "source": "checkpoint" if shown != given else "flag"}
    names = benchmark_tasks(env_id, task) if env_id in BENCHMARKS else [None]
    at_once = int(tasks_at_once or default_tasks_at_once(len(names), count)) if names != [None] else 1
    if names != [None]:
        recorded["tasks_at_once"] = {"value": at_once, "source": "flag" if tasks_at_once else "default"}
    results = {}
    for start in range(0, len(names), at_once):
        wave = names[start:start + at_once]
        desc = (f"{BENCHMARKS[env_id]} tasks {start + 1}-{start + len(wave)} of {len(names)}" if len(names) > 1
                else "closed-loop episodes")
        results |= _run_tasks(env_id, wave, policy, spec, settings, overrides, count, env_kwargs, seeds, output_dir,
                              desc, **common)
    output_dir.mkdir(parents=True, exist_ok=True)
    if env_id in BENCHMARKS:
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


def _run_tasks(env_id: str, names: list, policy, spec, settings: dict, overrides, num_envs: int, env_kwargs: dict,
               seeds: list[int], output_dir: Path, desc: str, save_videos: int, progress: bool, inference_delay: int,
               rtc: bool, chunk_size, n_action_steps: int) -> dict:
    """The episodes of `names` (benchmark tasks, or `[None]` for one gymnasium env) at once: `num_envs` envs per
    task, every task's seeds in its own envs, one batched policy call per control step across all live envs (an
    episode's outcome depends on its seed alone, not on the tasks beside it). -> `{name: EvalResult}`."""
    from .episodes import EpisodeRunner

    envs: dict = {}
    try:
        for name in names:
            # several tasks' envs step side by side, so each in a worker process even at one env per task
            envs[name] = _make_envs(env_id, name, num_envs, env_kwargs, settings["max_episode_steps"].value,
                                    worker=num_envs * len(names) > 1)
            label = f"{BENCHMARKS[env_id]} {name}" if name else f"env {env_id!r}"
            _check_dims(policy, envs[name][0], label)
            if "image_size" not in set(overrides or ()):
                _check_image_size(envs[name][0], spec, settings, label)
        runner = EpisodeRunner(envs, policy, n_action_steps, inference_delay=inference_delay, rtc=rtc,
                               chunk_size=chunk_size)
        done = runner.run({name: seeds for name in names}, save_videos=save_videos, progress=progress, desc=desc,
                          output_dir={name: output_dir / (name or "") for name in names})
    finally:
        for members in envs.values():
            _close(members)
    results = {}
    for name in names:
        results[name] = EvalResult.from_episodes(done[name], inference_delay, rtc, runner.rtc_methods,
                                                 num_envs=num_envs)
        if name:
            logger.info("%s: success %.1f%% (%d/%d), mean steps %.1f", name, 100 * results[name].success_rate,
                        results[name].successes, len(seeds), results[name].mean_steps)
    return results


def _check_image_size(env, spec: dict | None, settings: dict, where: str) -> None:
    """The env's images are the size the checkpoint's data was recorded at (an env that takes no image size)."""
    if spec is None or settings["image_size"].value is not None:
        return
    spaces = getattr(env.observation_space, "spaces", {})
    for camera in spec["cameras"]:
        space = spaces.get(camera.get("key"))
        if space is None or camera.get("height") is None:
            continue
        height, width = space.shape[:2]
        if (height, width) != (camera["height"], camera["width"]):
            raise ContractError(f"{where} renders {camera['key']} at {height}x{width}, but the checkpoint's data was "
                                f"recorded at {camera['height']}x{camera['width']} ({FILE_NAME}); pass --override "
                                f"image_size to run it anyway")


BENCHMARKS = {"metaworld": "Meta-World", "libero": "LIBERO"}  # envs with tasks, each in hf_vla.envs.<name>
DEFAULT_TASKS = {"metaworld": "reach-v3", "libero": None}


def _benchmark_module(env_id: str):
    import importlib

    return importlib.import_module(f"hf_vla.envs.{env_id}")


def benchmark_tasks(env_id: str, task: str | None) -> list[str]:
    """The task names of a benchmark env (`metaworld`: names or difficulty groups; `libero`: suites or suite/index)."""
    module = _benchmark_module(env_id)
    spec = task or DEFAULT_TASKS[env_id]
    return module.task_names(spec) if env_id == "metaworld" else module.task_suites(spec)


def check_env(env: str, task: str | None, env_label: str = "env=", task_label: str = "task=") -> None:
    """An env (and tasks) a run can make, checked before any model loads: a benchmark's task names (and LIBERO being
    installed), or a registered gymnasium id without tasks. The labels name the flag or field in the message."""
    if env in BENCHMARKS:
        benchmark_tasks(env, task)
        if env == "libero":
            from .envs.libero import require_libero

            require_libero()
        return
    import hf_vla.envs  # noqa: F401  (registers the demo env)

    if task is not None:
        raise ConfigError(f"{task_label}{task!r}: only a benchmark env ({', '.join(BENCHMARKS)}) has tasks")
    try:
        gym.spec(env)
    except gym.error.Error as error:
        raise ConfigError(f"{env_label}{env!r}: {error}") from error


def env_camera_keys(env: str) -> list[str]:
    """The image keys an env's observations carry (a benchmark's from its wrapper; a gymnasium env's from its
    observation space: every HxWxC array)."""
    if env == "metaworld":
        from .envs.metaworld import CAMERA

        return [CAMERA]
    if env == "libero":
        from .envs.libero import CAMERAS

        return list(CAMERAS.values())
    made = gym.make(env)
    try:
        spaces = getattr(made.observation_space, "spaces", {})
        return sorted(key for key, space in spaces.items() if len(getattr(space, "shape", None) or ()) == 3)
    finally:
        made.close()


def check_cameras(flag: str, cameras: list[str] | None, available: list[str]) -> None:
    """`cameras` (camera-slot order) name distinct image keys the env has; one line naming the culprit otherwise."""
    if not cameras:
        return
    refuse_repeated_cameras(flag, cameras)
    unknown = [key for key in cameras if key not in available]
    if unknown:
        raise ConfigError(f"{flag}: {unknown} {'is not an image' if len(unknown) == 1 else 'are not images'} of the "
                          f"env's observations; it has {available}")


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
        if env == "metaworld":
            from .envs.metaworld import GROUPS, task_group

            members: dict[str, list[float]] = {}
            for name, task in results.items():
                members.setdefault(task_group(name), []).append(task.success_rate)
            result.groups = {g: float(np.mean(members[g])) for g in GROUPS if g in members}
            result.group_tasks = {g: len(members[g]) for g in GROUPS if g in members}
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


def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    parser = ArgumentParser(prog="python -m hf_vla.evaluate", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="model + processor directory or Hub id (a lerobot pi0.5 checkpoint is "
                        "converted on load), run in-process")
    parser.add_argument("--revision", default=None, help="Hub revision of --checkpoint")
    source.add_argument("--server", help="ws://HOST:PORT of a policy server (python -m hf_vla.serve)")
    contract = parser.add_argument_group(
        "settings the checkpoint's deployment contract (deployment_config.json) provides; a flag that contradicts it "
        "is refused unless --override names it")
    contract.add_argument("--env", default=None, help=f"gymnasium env id, or `metaworld` / `libero` (lerobot's env "
                          f"wrappers; with --task) (default: the env the data was recorded in, else {DEFAULT_ENV})")
    contract.add_argument("--task", default=None, help="Meta-World task names (comma-separated) or a difficulty group "
                          "(easy, medium, hard, very_hard); LIBERO suites (libero_spatial, ...) or suite/index "
                          "(default: the recorded tasks)")
    contract.add_argument("--image_size", type=int, default=None, help="the image side the env renders (default: the "
                          "size the data was recorded at; else the env's own)")
    contract.add_argument("--max_episode_steps", type=int, default=None, help="episode limit (default: the "
                          "checkpoint's, else the env's: 500 for Meta-World, the suite's for LIBERO)")
    contract.add_argument("--n_action_steps", type=int, default=None, help="actions executed per chunk (default: the "
                          "checkpoint's, else half the chunk)")
    contract.add_argument("--cameras", nargs="*", default=None, help="observation image keys in camera-slot order "
                          "(default: the checkpoint's)")
    contract.add_argument("--seed", type=int, default=None, help=f"first episode seed (default {DEFAULT_SEED}; seeds "
                          "the training data was recorded with are refused)")
    contract.add_argument("--override", nargs="+", default=[], choices=OVERRIDABLE, metavar="FIELD",
                          help=f"accept these flags against the checkpoint's contract ({', '.join(OVERRIDABLE)}); "
                          "recorded in eval_result.json")
    parser.add_argument("--episodes", type=int, default=50, help="episodes per task")
    parser.add_argument("--num_envs", type=int, default=None, help="envs run at once, each in a worker process, one "
                        "policy call per control step for all of them (default: 70%% of the cores, as lerobot-eval; "
                        "per-seed outcomes do not depend on it)")
    parser.add_argument("--tasks_at_once", type=int, default=None, help="benchmark tasks evaluated side by side, "
                        "their envs served by one policy call per control step (default: as many as keep "
                        f"{MAX_ENVS_AT_ONCE} env workers or fewer; per-seed outcomes do not depend on it)")
    parser.add_argument("--inference_delay", type=int, default=0,
                        help="simulated inference delay in control steps (actions of the old chunk run meanwhile)")
    parser.add_argument("--rtc", action="store_true", help="real-time chunking: continue the chunk being executed")
    parser.add_argument("--head", default=None, help="normalization head (default: the processor's only one)")
    parser.add_argument("--save_videos", type=int, default=3)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_rtc_arguments(parser, title="real-time chunking settings (in-process; a server uses its own)")
    args = parser.parse_args(argv)
    # every argument is checked before a model is loaded or an env built
    positive("--episodes", args.episodes)
    positive("--n_action_steps", args.n_action_steps)
    positive("--inference_delay", args.inference_delay, allow_zero=True)
    positive("--save_videos", args.save_videos, allow_zero=True)
    positive("--num_envs", args.num_envs)
    positive("--tasks_at_once", args.tasks_at_once)
    checkpoint = model_source("--checkpoint", args.checkpoint) if args.checkpoint else None
    if args.server:
        websocket_uri("--server", args.server)
    output_dir("--output_dir", args.output_dir)
    positive("--image_size", args.image_size)
    positive("--max_episode_steps", args.max_episode_steps)
    if args.env is not None:
        check_env(args.env, args.task, "--env ", "--task ")  # an unknown env or task stops here, by name
        check_cameras("--cameras", args.cameras, env_camera_keys(args.env))
    env = args.env
    if env is None and checkpoint is not None:
        env = (head_spec(for_checkpoint(checkpoint, args.revision), args.head) or {}).get("benchmark", {}) or {}
        env = env.get("env") if isinstance(env, dict) else None
    if "OMP_NUM_THREADS" not in os.environ and (env in BENCHMARKS or (args.num_envs or 1) > 1):
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # leave a core to the env workers
    env_kwargs = {k: v for k, v in (("image_size", args.image_size), ("max_episode_steps", args.max_episode_steps))
                  if v is not None}
    from .cli import setup_logging

    setup_logging()
    result = evaluate_checkpoint(checkpoint, args.env, args.episodes, args.n_action_steps, args.seed, args.head,
                                 args.cameras, args.save_videos, args.output_dir, args.device, server=args.server,
                                 inference_delay=args.inference_delay, rtc=args.rtc,
                                 rtc_config=rtc_config_from_args(args), task=args.task, env_kwargs=env_kwargs or None,
                                 revision=args.revision, num_envs=args.num_envs, overrides=args.override,
                                 tasks_at_once=args.tasks_at_once)
    if isinstance(result, BenchmarkResult):
        print(result.table())
    print(json.dumps(_summary(result), indent=2))
    return result


def _summary(result) -> dict:
    """The printed result: everything but the per-episode records (they are in eval_result.json)."""
    data = asdict(result)
    for part in [data] + list((data.get("tasks") or {}).values()):
        part.pop("episode_records", None)
    return data


def cli(argv=None):
    return run("hf_vla.evaluate", main, argv)


if __name__ == "__main__":
    cli()
