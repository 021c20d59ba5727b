"""How a checkpoint runs in an env, resolved once against its deployment contract: each setting (env, tasks, image
size, episode limit, actions per chunk, cameras, seeds) with its value and where it came from (`checkpoint`, `flag`,
`flag (override)`, `default`); a flag that contradicts the contract is refused unless overridden. Evaluation, rollouts
during training, RL and DAgger take their settings from here."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import gymnasium as gym

from hf_vla.deployment.contract import ContractError, Setting, head_spec, memory_stride, refuse_repeated_cameras
from hf_vla.errors import ConfigError
from hf_vla.registry import env_names, task_env
from hf_vla.registry.envs import check_gym_id

# env workers a benchmark evaluation keeps at once across its tasks (MT50 with 2 envs per task: 8 tasks side by side);
# a Meta-World worker holds about 0.4 GB (proportional set size, 160 px)
MAX_ENVS_AT_ONCE = 16

logger = logging.getLogger("hf_vla.serve")
DEFAULT_ENV = "hf_vla/ColorReach-v0"
DEFAULT_SEED = 10_000
OVERRIDABLE = ("image_size", "n_action_steps", "max_episode_steps", "cameras", "seed")


def env_takes(env_id: str, argument: str) -> bool:
    """Whether the env's constructor takes `argument` (the benchmarks' wrappers take image_size and
    max_episode_steps; a gymnasium id is asked through its entry point)."""
    if task_env(env_id) is not None:
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


@dataclass
class EnvRequest:
    """What a caller asks of an env run, before the checkpoint's contract is consulted: each field None (or empty)
    where the caller leaves it to the contract or the default. `EvaluateArguments` has the same names
    (`EnvRequest.of(args)`)."""

    env: str | None = None
    task: str | None = None
    episodes: int = 1
    n_action_steps: int | None = None
    seed: int | None = None
    cameras: list[str] | None = None
    image_size: int | None = None
    max_episode_steps: int | None = None
    override: tuple = ()
    head: str | None = None

    @classmethod
    def of(cls, args, **changes) -> EnvRequest:
        """The request of an options object with these field names (others left at their defaults), with `changes`."""
        taken = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**(taken | changes))


def evaluation_settings(contract, request: EnvRequest, chunk_size: int | None = None) -> dict:
    """What an evaluation runs with: `{name: Setting(value, source)}` for env, task, image_size, n_action_steps,
    max_episode_steps, cameras, seed, head and control_mode. Each comes from its flag in `request`, else the
    checkpoint's deployment contract (`hf_vla.deployment.contract`), else the default; a flag that contradicts the
    contract is a `ContractError` naming both values and `--override NAME`, unless NAME is in `request.override`."""
    from hf_vla.deployment.contract import choose, square_size

    head, env_id, task, episodes = request.head, request.env, request.task, request.episodes
    n_action_steps, seed, cameras = request.n_action_steps, request.seed, request.cameras
    image_size, max_episode_steps = request.image_size, request.max_episode_steps
    overrides = set(request.override or ())
    unknown = sorted(overrides - set(OVERRIDABLE))
    if unknown:
        raise ConfigError(f"--override {' '.join(unknown)}: choose from {' '.join(OVERRIDABLE)}")
    spec = head_spec(contract, head)
    bench = (spec or {}).get("benchmark") or {}
    settings = {"env": choose("env", env_id, bench.get("env"), DEFAULT_ENV, overrides, equal=lambda a, b: True)}
    env_id = settings["env"].value
    source = "the checkpoint's deployment contract: env " if settings["env"].source == "checkpoint" else "--env "
    check_gym_id(env_id, source)  # an unknown env: one line naming the envs there are, before anything is built
    same_env = bench.get("env") == env_id  # the benchmark settings apply to the env the data was recorded in
    recorded_tasks = ",".join(bench["tasks"]) if same_env and bench.get("tasks") else None
    settings["task"] = choose("task", task, recorded_tasks, None, overrides, equal=lambda a, b: True)
    recorded_size = (bench.get("image_size") if same_env else None) or square_size((spec or {}).get("cameras", []))
    takes_size = env_takes(env_id, "image_size")
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


def env_arguments(spec: dict | None, settings: dict, env_kwargs: dict) -> dict:
    """The env's constructor arguments, resolved once for evaluation, RL rollouts and rollouts during training: those
    the data was recorded with (the contract's `benchmark.env_kwargs`, when the env is the recorded one: ColorReach's
    layout, a Meta-World crop), overridden by the caller's, then the resolved `image_size`."""
    bench = (spec or {}).get("benchmark") or {}
    merged = dict(env_kwargs)
    if bench.get("env") == settings["env"].value:
        merged = dict(bench.get("env_kwargs") or {}) | merged
    if settings["image_size"].value is not None:
        merged["image_size"] = settings["image_size"].value
    return merged


def env_tasks(env_id: str, task: str | None) -> list[str | None]:
    """The tasks a run of `env_id` steps through: a registered env's task names, else `[None]` (an env without
    tasks, such as a gymnasium id)."""
    return benchmark_tasks(env_id, task) if task_env(env_id) is not None else [None]


def benchmark_tasks(env_id: str, task: str | None) -> list[str]:
    """The task names of a registered env with tasks (`metaworld`: names or difficulty groups; `libero`: suites or
    suite/index; see `hf_vla.registry`)."""
    return task_env(env_id).task_names(task)


def check_env(env: str, task: str | None, env_label: str = "env=", task_label: str = "task=") -> None:
    """An env (and tasks) a run can make, checked before any model loads: a benchmark's task names (and LIBERO being
    installed), or a registered gymnasium id without tasks. The labels name the flag or field in the message."""
    family = task_env(env)
    if family is not None:
        family.task_names(task)
        if family.check:
            family.call("check")
        return
    if task is not None:
        raise ConfigError(f"{task_label}{task!r}: only a benchmark env ({', '.join(env_names(with_tasks=True))}) has "
                          "tasks")
    check_gym_id(env, env_label)


@dataclass
class EnvPlan:
    """How a checkpoint runs in an env, resolved once from its contract, the caller's request and the env registry,
    before a policy or an env is made: `settings` (`{name: Setting(value, source)}`: those of `evaluation_settings`
    and `memory_stride`), the contract's `spec` of the head, the env's constructor arguments and the tasks a run
    steps through. Evaluation, RL and DAgger build theirs here."""

    settings: dict
    spec: dict | None
    env_kwargs: dict
    tasks: list

    @property
    def env(self) -> str:
        return self.settings["env"].value

    def value(self, name: str):
        return self.settings[name].value


def plan_env(contract, request: EnvRequest, chunk_size: int | None = None, env_kwargs: dict | None = None,
             labels: tuple[str, str] = ("env=", "task=")) -> EnvPlan:
    """The `EnvPlan` of `request` against `contract`: every refusal (a flag against the contract, an unknown env or
    task, a memory stride that is no whole number of the env's control steps) raised here. `labels` name the env and
    task options in the messages."""
    settings = evaluation_settings(contract, request, chunk_size)
    env, task = settings["env"].value, settings["task"].value
    check_env(env, task, *labels)
    spec = head_spec(contract, settings["head"].value)
    stride = memory_stride(contract, getattr(task_env(env), "fps", None), f"--env {env}")
    settings["memory_stride"] = Setting(stride, "checkpoint" if stride is not None else "default")
    return EnvPlan(settings, spec, env_arguments(spec, settings, dict(env_kwargs or {})), env_tasks(env, task))

