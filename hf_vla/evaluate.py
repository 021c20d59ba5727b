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
from PIL import Image
from tqdm.auto import tqdm

from .cli import ArgumentParser, model_source, output_dir, positive, run, websocket_uri
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

    def __call__(self, observation: dict, task: str, inference_delay: int = 0, executed_steps: int | None = None):
        request = {**observation, "prompt": task, "rtc/inference_delay": int(inference_delay)}
        if executed_steps is not None:
            request["rtc/executed_steps"] = int(executed_steps)
        reply = self.client.infer(request)
        self.last_rtc_method = reply.get("rtc/method")
        return np.asarray(reply["actions"])


def _boundary_metrics(actions: list[np.ndarray], switches: list[int]) -> tuple[float, float, float]:
    if len(actions) < 3:
        return float("nan"), float("nan"), float("nan")
    a = np.stack(actions).astype(np.float64)
    jump = np.linalg.norm(np.diff(a, axis=0), axis=-1)  # jump[k - 1] = |a_k - a_(k-1)|
    jerk = np.linalg.norm(a[2:] - 2 * a[1:-1] + a[:-2], axis=-1)  # jerk[k - 1] is centred on a_k
    at = np.zeros(len(a), dtype=bool)
    at[[k for k in switches if 0 < k < len(a) - 1]] = True
    inner = at[1:-1]
    if not inner.any():
        return float("nan"), float("nan"), float(jerk.mean())
    return float(jump[at[1:]].mean()), float(jerk[inner].mean()), float(jerk[~inner].mean()) if (~inner).any() else float("nan")


def run_episodes(env: gym.Env, policy, episodes: int, n_action_steps: int, seed: int = 0, save_videos: int = 0,
                 output_dir: str | Path | None = None, progress: bool = True, inference_delay: int = 0,
                 rtc: bool = False, chunk_size: int | None = None) -> EvalResult:
    """Closed-loop episodes with receding-horizon chunks.

    `policy(observation, task, inference_delay=, executed_steps=)` returns a chunk. With `inference_delay` d > 0,
    inference is simulated as asynchronous: after `n_action_steps` (H) actions of a chunk the next one is requested
    with the current observation, the robot executes d more actions of the current chunk meanwhile, then switches to
    the new chunk at its index d (so every chunk drives H actions, from an observation d steps old). With `rtc` the
    request asks the policy to continue the current chunk (real-time chunking); without, chunks are independent.
    """
    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: must be positive")
    if not 1 <= n_action_steps <= (chunk_size or n_action_steps):
        raise ConfigError(f"n_action_steps={n_action_steps}: must be 1..{chunk_size or 'the chunk size'} (actions "
                          f"executed from each chunk)")
    if inference_delay < 0:
        raise ConfigError(f"inference_delay={inference_delay}: must be >= 0")
    if inference_delay and chunk_size is not None and n_action_steps + inference_delay > chunk_size:
        raise ConfigError(f"n_action_steps ({n_action_steps}) + inference_delay ({inference_delay}) exceeds the chunk "
                         f"size ({chunk_size}): the robot would run out of actions while waiting")
    successes, steps_taken, videos, metrics, methods = 0, [], [], [], set()
    bar = tqdm(range(episodes), desc="closed-loop episodes", unit="ep", disable=not progress)
    for episode in bar:
        observation, info = env.reset(seed=seed + episode)
        task = info.get("task") or getattr(env.unwrapped, "task", "")
        frames = [env.render()] if episode < save_videos else None
        state = {"done": False, "success": False}
        executed, switches = [], []

        def act(actions, state=state, executed=executed, frames=frames):
            """Execute actions until the episode ends; returns the last observation."""
            for action in actions:
                state["observation"], _, terminated, truncated, step_info = env.step(action)
                executed.append(np.asarray(action))
                if frames is not None:
                    frames.append(env.render())
                state["success"] = state["success"] or bool(step_info.get("is_success", False))
                state["done"] = terminated or truncated
                if state["done"]:
                    break

        state["observation"] = observation
        chunk, index = policy(observation, task), 0
        while True:
            act(chunk[index:n_action_steps])
            if state["done"]:
                break
            request = state["observation"]
            if inference_delay:
                act(chunk[n_action_steps : n_action_steps + inference_delay])  # executed while the policy runs
                if state["done"]:
                    break
                chunk = policy(request, task, inference_delay=inference_delay if rtc else 0,
                               executed_steps=n_action_steps if rtc else None)
                methods.add(getattr(policy, "last_rtc_method", None))
            else:
                chunk = policy(request, task)
            index = inference_delay
            switches.append(len(executed))
        successes += state["success"]
        steps_taken.append(len(executed))
        metrics.append(_boundary_metrics(executed, switches))
        bar.set_postfix(success=f"{successes}/{episode + 1}")
        if frames is not None and output_dir is not None:
            path = Path(output_dir) / f"rollout_{episode:03d}_{'success' if state['success'] else 'failure'}.gif"
            path.parent.mkdir(parents=True, exist_ok=True)
            pictures = [Image.fromarray(f).resize((f.shape[1] * 4, f.shape[0] * 4), Image.NEAREST) for f in frames]
            pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=100, loop=0)
            videos.append(str(path))
    jump, jerk, interior = (float(np.nanmean(column)) if not np.isnan(column).all() else float("nan")
                            for column in np.array(metrics, dtype=np.float64).T)
    used = "+".join(sorted(m for m in methods if m)) or None  # as the policy reported it, per chunk
    return EvalResult(successes / episodes, episodes, successes, float(np.mean(steps_taken)), videos,
                      inference_delay, rtc, jump, jerk, interior, used)


def _check_dims(policy, env, where: str) -> None:
    """The policy's head reads the env's state and writes its actions (in-process; a server checks per request)."""
    if not hasattr(policy, "processor"):
        return
    stats = policy.processor.norm_stats[policy.head_name()]
    state_space = getattr(env.observation_space, "spaces", {}).get("observation.state")
    for name, theirs, ours in (("action", env.action_space.shape[0], len(stats["actions"]["q01"])),
                               ("state", state_space.shape[0] if state_space is not None else None,
                                len(stats["state"]["q01"]))):
        if theirs is not None and theirs != ours:
            raise ConfigError(f"{where} has {theirs} {name} dims but the checkpoint's head {policy.head_name()!r} has "
                              f"{ours}: a checkpoint trained on another robot or env")


def _policy(checkpoint, server, device, head, seed, rtc_config, cameras, revision=None):
    if server is not None:
        policy = RemotePolicy(websocket_uri("server", server))
        return policy, int(policy.metadata.get("chunk_size", 0)) or None
    policy = load_policy(checkpoint, device=device, revision=revision, head=head, seed=seed, rtc=rtc_config or RTCConfig(),
                         obs_map=ObservationMap(cameras=cameras or None))
    try:
        policy.head_name()
    except RequestError as error:
        raise ConfigError(f"head: {error}") from error
    return policy, policy.model.config.chunk_size


def evaluate_checkpoint(checkpoint: str | Path | None = None, env_id: str = "hf_vla/ColorReach-v0", episodes: int = 50,
                        n_action_steps: int | None = None, seed: int = 10_000, head=None, cameras=None,
                        save_videos: int = 3, output_dir: str | Path | None = None, device: str = "cpu",
                        env_kwargs: dict | None = None, progress: bool = True, server: str | None = None,
                        inference_delay: int = 0, rtc: bool = False, rtc_config: RTCConfig | None = None,
                        task: str | None = None, revision: str | None = None):
    """Evaluate a checkpoint in-process, or the policy behind `server` (ws://HOST:PORT) through openpi-client.

    `env_id="metaworld"` with `task` (names or a difficulty group) or `env_id="libero"` with `task` (suites such as
    `libero_spatial`, or `suite/index`); `env_kwargs` may set `image_size`, the size the data was recorded at, and
    `max_episode_steps`: each task in lerobot's env wrapper in its own worker process; returns a `BenchmarkResult`
    (per-task results and their mean success rate) instead of an `EvalResult`.
    """
    import hf_vla.envs  # noqa: F401  (registers the demo env)

    if (checkpoint is None) == (server is None):
        raise ConfigError("pass exactly one of checkpoint (in-process) and server (ws://HOST:PORT)")
    if episodes < 1:
        raise ConfigError(f"episodes={episodes}: must be positive")
    if output_dir is None:
        output_dir = Path(checkpoint) / "rollouts" if checkpoint is not None else Path("outputs") / "eval_server"
    output_dir = Path(output_dir)
    common = dict(seed=seed, save_videos=save_videos, progress=progress, inference_delay=inference_delay, rtc=rtc)
    if env_id in BENCHMARKS:
        names = benchmark_tasks(env_id, task)
        policy, chunk_size = _policy(checkpoint, server, device, head, seed, rtc_config, cameras, revision)
        steps = n_action_steps or max(1, (chunk_size or 2) // 2)
        results = {}
        for name in names:
            env = _benchmark_module(env_id).in_worker(name, **(env_kwargs or {}))
            try:
                _check_dims(policy, env, f"{BENCHMARKS[env_id]} {name}")
                if hasattr(policy, "reset"):
                    policy.reset()
                results[name] = run_episodes(env, policy, episodes, steps, output_dir=output_dir / name,
                                             chunk_size=chunk_size, **common)
            finally:
                env.close()
            logger.info("%s: success %.1f%% (%d/%d), mean steps %.1f", name, 100 * results[name].success_rate,
                        results[name].successes, episodes, results[name].mean_steps)
        result = BenchmarkResult.from_tasks(env_id, results)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "eval_result.json").write_text(json.dumps(asdict(result), indent=2))
        return result
    if task is not None:
        raise ConfigError(f"task={task!r}: only a benchmark env ({', '.join(BENCHMARKS)}) has tasks to choose")
    policy, chunk_size = _policy(checkpoint, server, device, head, seed, rtc_config, cameras, revision)
    try:
        env = gym.make(env_id, **(env_kwargs or {}))
    except gym.error.Error as error:
        raise ConfigError(f"env {env_id!r}: {error}") from error
    _check_dims(policy, env, f"env {env_id!r}")
    steps = n_action_steps or max(1, (chunk_size or 2) // 2)
    result = run_episodes(env, policy, episodes, steps, output_dir=output_dir, chunk_size=chunk_size, **common)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "eval_result.json").write_text(json.dumps(asdict(result), indent=2))
    return result


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
    twice = sorted({key for key in cameras if cameras.count(key) > 1})
    if twice:
        raise ConfigError(f"{flag}: {twice} given more than once; each camera fills one slot")
    unknown = [key for key in cameras if key not in available]
    if unknown:
        raise ConfigError(f"{flag}: {unknown} {'is not an image' if len(unknown) == 1 else 'are not images'} of the "
                          f"env's observations; it has {available}")


@dataclass
class BenchmarkResult:
    env: str
    success_rate: float  # mean over tasks
    tasks: dict[str, EvalResult]

    @classmethod
    def from_tasks(cls, env: str, results: dict[str, EvalResult]) -> BenchmarkResult:
        return cls(env, float(np.mean([r.success_rate for r in results.values()])), results)

    def table(self) -> str:
        rows = [f"{'task':<32} {'success':>8} {'episodes':>9} {'mean steps':>11}"]
        for name, r in self.tasks.items():
            rows.append(f"{name:<32} {100 * r.success_rate:>7.1f}% {r.episodes:>9d} {r.mean_steps:>11.1f}")
        rows.append(f"{'mean':<32} {100 * self.success_rate:>7.1f}%")
        return "\n".join(rows)


def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    parser = ArgumentParser(prog="python -m hf_vla.evaluate", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="model + processor directory or Hub id (a lerobot pi0.5 checkpoint is "
                        "converted on load), run in-process")
    parser.add_argument("--revision", default=None, help="Hub revision of --checkpoint")
    source.add_argument("--server", help="ws://HOST:PORT of a policy server (python -m hf_vla.serve)")
    parser.add_argument("--env", default="hf_vla/ColorReach-v0", help="gymnasium env id, or `metaworld` / `libero` "
                        "(lerobot's env wrappers; with --task)")
    parser.add_argument("--task", default=None, help="Meta-World task names (comma-separated) or a difficulty group "
                        "(easy, medium, hard, very_hard); LIBERO suites (libero_spatial, ...) or suite/index")
    parser.add_argument("--image_size", type=int, default=None, help="Meta-World / LIBERO: the image side the training "
                        "data was recorded at (default: 128 for Meta-World, as hf_vla.record; 256 for LIBERO)")
    parser.add_argument("--max_episode_steps", type=int, default=None, help="benchmark envs: episode limit (default: "
                        "500 for Meta-World, the suite's limit for LIBERO)")
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--n_action_steps", type=int, default=None, help="actions executed per chunk (default: half)")
    parser.add_argument("--inference_delay", type=int, default=0,
                        help="simulated inference delay in control steps (actions of the old chunk run meanwhile)")
    parser.add_argument("--rtc", action="store_true", help="real-time chunking: continue the chunk being executed")
    parser.add_argument("--seed", type=int, default=10_000, help="first episode seed (training data used 0..)")
    parser.add_argument("--head", default=None, help="normalization head (default: the processor's only one)")
    parser.add_argument("--cameras", nargs="*", default=None, help="observation image keys, in camera-slot order")
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
    checkpoint = model_source("--checkpoint", args.checkpoint) if args.checkpoint else None
    if args.server:
        websocket_uri("--server", args.server)
    output_dir("--output_dir", args.output_dir)
    positive("--image_size", args.image_size)
    positive("--max_episode_steps", args.max_episode_steps)
    env_kwargs = {}
    check_env(args.env, args.task, "--env ", "--task ")  # an unknown env or task stops here, by name
    check_cameras("--cameras", args.cameras, env_camera_keys(args.env))
    if args.env in BENCHMARKS:
        env_kwargs = {k: v for k, v in (("image_size", args.image_size), ("max_episode_steps", args.max_episode_steps))
                      if v is not None}
        if "OMP_NUM_THREADS" not in os.environ:  # leave a core to the env's worker: 30 ms a step instead of 150 on 2
            torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    from .cli import setup_logging

    setup_logging()
    result = evaluate_checkpoint(checkpoint, args.env, args.episodes, args.n_action_steps, args.seed, args.head,
                                 args.cameras, args.save_videos, args.output_dir, args.device, server=args.server,
                                 inference_delay=args.inference_delay, rtc=args.rtc,
                                 rtc_config=rtc_config_from_args(args), task=args.task, env_kwargs=env_kwargs or None,
                                 revision=args.revision)
    if isinstance(result, BenchmarkResult):
        print(result.table())
    print(json.dumps(asdict(result), indent=2))
    return result


def cli(argv=None):
    return run("hf_vla.evaluate", main, argv)


if __name__ == "__main__":
    cli()
