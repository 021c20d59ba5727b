"""Running an evaluation's plan (`hf_vla.evaluation.plan`): the episode engine over every task of a benchmark in
waves, a local policy or a policy server (`RemotePolicy`, openpi's client), and the results (`EvalResult` per task,
`BenchmarkResult`)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hf_vla.envs.episodes import check_dims
from hf_vla.envs.settings import MAX_ENVS_AT_ONCE
from hf_vla.errors import ConfigError
from hf_vla.evaluation.arguments import EvaluateArguments
from hf_vla.evaluation.envs import (
    _check_image_size,
    _close,
    _make_envs,
)
from hf_vla.evaluation.plan import EvaluationPlan, default_tasks_at_once, plan_evaluation
from hf_vla.evaluation.remote import RemotePolicy
from hf_vla.models.common.rtc_config import RTCConfig
from hf_vla.registry import task_env
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

    The evaluation's plan is built first (`hf_vla.evaluation.plan`): every setting the checkpoint's deployment
    contract knows (env and tasks of the recorded benchmark, image size, actions per chunk, episode limit, cameras,
    memory stride) is taken from it; an argument that contradicts it is refused unless named in `args.override` (see
    `evaluation_settings`), and every other refusal is raised there, before a policy or an env is made.
    `env="metaworld"` with `task` (names or a difficulty group) or `env="libero"` with `task` (suites such as
    `libero_spatial`, or `suite/index`) runs lerobot's env wrappers; `env_kwargs` are further env arguments (its
    `image_size` and `max_episode_steps` count as those flags where `args` leaves them unset). `num_envs` envs run
    per task at once (default: `hf_vla.envs.episodes.default_num_envs`), and `tasks_at_once` benchmark tasks side by
    side (default: `default_tasks_at_once`); each episode's outcome depends on its seed alone. Returns a
    `BenchmarkResult` (per-task results, their mean) for a benchmark env, else an `EvalResult`; both carry the plan's
    settings and every episode, also written to `output_dir/eval_result.json`.
    """
    import hf_vla.envs  # noqa: F401  (registers the demo env)
    from hf_vla.storage import make_dir

    plan = plan_evaluation(args, env_kwargs)
    policy, chunk_size = (plan.remote, plan.chunk_size) if plan.remote is not None else _local_policy(plan, args,
                                                                                                      rtc_config)
    timing = ChunkTiming(int(plan.env.value("n_action_steps")), args.inference_delay, args.rtc, chunk_size)
    names, family = plan.env.tasks, plan.family
    results = {}
    for start in range(0, len(names), plan.tasks_at_once):
        wave = names[start:start + plan.tasks_at_once]
        desc = (f"{family.title} tasks {start + 1}-{start + len(wave)} of {len(names)}" if len(names) > 1
                else "closed-loop episodes")
        results |= _run_tasks(plan, policy, timing, wave, desc, args.save_videos, progress)
    make_dir("--output_dir", plan.output_dir)
    result = BenchmarkResult.from_tasks(plan.env.env, results) if family is not None else results[None]
    result.settings = plan.record()
    (plan.output_dir / "eval_result.json").write_text(json.dumps(asdict(result), indent=2))
    return result


def _local_policy(plan: EvaluationPlan, args: EvaluateArguments, rtc_config: RTCConfig | None):
    """The plan's checkpoint loaded in-process (`PolicyRunner`) and its chunk size. A checkpoint without a contract
    is checked here against what the loaded policy says (guidance, subtasks, its default head)."""
    from hf_vla.cli import resolve_device

    subtask = {} if args.subtask is None else {"subtask": None if args.subtask == "none" else args.subtask}
    stride = plan.settings.get("memory_stride")
    if stride is not None:  # a MEM policy's stride: the training data's frames, as this env's control steps
        subtask["memory_stride"] = stride.value
    spec, settings = plan.env.spec, plan.settings
    best_of = plan.best_of.runner_kwargs(resolve_device(args.device)) if plan.best_of is not None else {}
    policy = load_policy(plan.checkpoint, device=resolve_device(args.device), revision=args.revision, head=args.head,
                         seed=int(settings["seed"].value), rtc=rtc_config or RTCConfig(),
                         obs_map=ObservationMap(cameras=settings["cameras"].value or None),
                         num_camera_slots=len(spec["cameras"]) if spec else None, cfg_beta=args.cfg_beta,
                         subtask_every=args.subtask_every, **best_of, **subtask)
    if policy.subtask is not None and not getattr(policy.model.config, "subtask_layout", None):
        raise ConfigError(f"--subtask {args.subtask}: this checkpoint was not trained with subtasks")
    check_cfg_beta("--cfg_beta", args.cfg_beta, policy)
    try:
        settings["head"].value = policy.head_name()
    except RequestError as error:
        raise ConfigError(f"head: {error}") from error
    return policy, policy.model.config.chunk_size


def _run_tasks(plan: EvaluationPlan, policy, timing: ChunkTiming, names: list, desc: str, save_videos: int,
               progress: bool) -> dict:
    """The episodes of `names` (benchmark tasks, or `[None]` for one gymnasium env) at once: `num_envs` envs per
    task, every task's seeds in its own envs, one batched policy call per control step across all live envs (an
    episode's outcome depends on its seed alone, not on the tasks beside it). -> `{name: EvalResult}`."""
    envs: dict = {}
    try:
        env_id, overrides = plan.env.env, set(plan.overrides)
        for name in names:
            # several tasks' envs step side by side, so each in a worker process even at one env per task
            envs[name] = _make_envs(env_id, name, plan.num_envs, plan.env.env_kwargs,
                                    plan.settings["max_episode_steps"].value, worker=plan.num_envs * len(names) > 1)
            label = f"{task_env(env_id).title} {name}" if name else f"env {env_id!r}"
            check_dims(policy, envs[name][0], label)
            if "image_size" not in overrides:
                _check_image_size(envs[name][0], plan.env.spec, plan.settings, label)
        runner = timing.runner(envs, policy)
        done = runner.run({name: plan.seeds for name in names}, save_videos=save_videos, progress=progress,
                          desc=desc, output_dir={name: plan.output_dir / (name or "") for name in names})
    finally:
        for members in envs.values():
            _close(members)
    results = {}
    for name in names:
        results[name] = EvalResult.from_episodes(done[name], timing.inference_delay, timing.rtc,
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


__all__ = ["MAX_ENVS_AT_ONCE", "BenchmarkResult", "ChunkTiming", "EvalResult", "RemotePolicy", "default_tasks_at_once",
           "evaluate_checkpoint", "printed_result", "run_episodes"]
