"""An evaluation's plan, built once before a policy or an env is made: from the checkpoint's deployment contract (or
a policy server's metadata), the `EvaluateArguments` and the env registry. Each setting carries its value and its
source (`checkpoint`, `flag`, `flag (override)`, `default`); every refusal (a flag against the contract, an unknown
env or task, cameras the env has not, a memory stride that is no whole number of control steps, guidance or
subtasks the checkpoint was not trained for, an output folder that cannot be made) is raised while it is built. The
runner then only runs it, and `eval_result.json` records it (`EvaluationPlan.record`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf_vla.cli import positive, websocket_uri
from hf_vla.deployment.contract import DeploymentConfig, Setting
from hf_vla.envs.settings import MAX_ENVS_AT_ONCE, EnvPlan, EnvRequest, plan_env
from hf_vla.errors import ConfigError
from hf_vla.evaluation.arguments import EvaluateArguments
from hf_vla.evaluation.envs import check_cameras, env_camera_keys
from hf_vla.registry import env_names, find_env, task_env


@dataclass
class EvaluationPlan:
    """What an evaluation runs: the env plan (env, tasks, head, cameras, image size, actions per chunk, episode limit,
    memory stride, each with its source), the guidance and subtask settings, the envs per task and tasks at once, the
    episodes' seeds and where results go; `remote`: the policy server's connection, or None for `checkpoint`."""

    env: EnvPlan
    settings: dict  # env.settings and the evaluation's own: subtask, cfg_beta, num_envs, tasks_at_once, env_kwargs
    contract: DeploymentConfig | None
    seeds: list[int]
    output_dir: Path
    num_envs: int
    tasks_at_once: int
    chunk_size: int | None
    checkpoint: str | None = None
    remote: object = None  # RemotePolicy
    overrides: tuple = ()  # `--override`: the contract's settings the flags may contradict
    best_of: object = None  # in-process best-of-N (`hf_vla.serving.critic.BestOfPlan`), None for a server

    def record(self) -> dict:
        """The settings as `eval_result.json` records them: `{name: {"value", "source"}}`."""
        return {name: {"value": setting.value, "source": setting.source} for name, setting in self.settings.items()}

    @property
    def family(self):
        return task_env(self.env.env)


def default_tasks_at_once(tasks: int, num_envs: int) -> int:
    """Benchmark tasks evaluated at once (their envs side by side, one policy call per control step for all of them):
    as many as keep `MAX_ENVS_AT_ONCE` env workers or fewer, at least one."""
    return max(1, min(tasks, MAX_ENVS_AT_ONCE // max(1, num_envs)))


def _subtask_setting(args: EvaluateArguments, contract, env_id: str, local: bool) -> Setting | None:
    """`--subtask` against the env (the oracle needs the env expert's stages) and a local checkpoint (decoding needs a
    policy trained with subtasks, as its contract records; a server decodes as it was started)."""
    if args.subtask == "oracle" and not getattr(task_env(env_id), "subtasks", False):
        raise ConfigError(f"--subtask oracle: acts on the env expert's stage; env {env_id!r} has none (envs with "
                          "stages: " + ", ".join(sorted(n for n in env_names() if getattr(find_env(n), "subtasks",
                                                                                        False))) + ")")
    if not local:
        return None
    trained = (contract.subtask if contract is not None else None) or None
    if args.subtask not in (None, "none") and contract is not None and trained is None:
        raise ConfigError(f"--subtask {args.subtask}: this checkpoint was not trained with subtasks")
    if args.subtask is not None:
        return Setting(args.subtask, "flag")
    return Setting(trained.get("layout"), "checkpoint") if trained else None


def _guidance_setting(args: EvaluateArguments, contract) -> Setting | None:
    """`--cfg_beta` (classifier-free guidance): other than 1 only for an advantage-conditioned (RECAP) checkpoint."""
    from hf_vla.serving.policy import check_cfg_beta

    advantage = (contract.advantage if contract is not None else None) or None
    if contract is not None:
        check_cfg_beta("--cfg_beta", args.cfg_beta, conditioned=bool(advantage and advantage.get("conditioned")))
    if args.cfg_beta is not None:
        return Setting(args.cfg_beta, "flag")
    return Setting(advantage.get("cfg_beta", 1.0), "checkpoint") if advantage else None


def plan_evaluation(args: EvaluateArguments, env_kwargs: dict | None = None) -> EvaluationPlan:
    """The plan of `args` (`env_kwargs`: further env arguments; their `image_size` and `max_episode_steps` count as
    those flags where `args` leaves them unset). Connects to `args.server` for its metadata; loads nothing else."""
    from hf_vla.envs.episodes import default_num_envs
    from hf_vla.evaluation.remote import RemotePolicy
    from hf_vla.hub.resolve import resolve_contract
    from hf_vla.serving.critic import plan_best_of
    from hf_vla.storage import check_creatable

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
    remote = best_of = None
    if server is not None:
        remote = RemotePolicy(websocket_uri("server", server))
        contract = remote.metadata.get("deployment")
        contract = DeploymentConfig.from_dict(contract, f"{server} metadata") if contract else None
        chunk_size = int(remote.metadata.get("chunk_size", 0)) or None
    else:
        contract = resolve_contract(checkpoint, args.revision)
        chunk_size = contract.chunk_size if contract else None
    env = plan_env(contract, EnvRequest.of(args, **flags), chunk_size, env_kwargs)
    settings = dict(env.settings)
    env_id = env.env
    extra = {"subtask": _subtask_setting(args, contract, env_id, local=remote is None)}
    if remote is None:  # a server applies its own guidance (`serve --cfg_beta`, `max_cfg_beta`)
        extra["cfg_beta"] = _guidance_setting(args, contract)
        best_of = plan_best_of(args.best_of, args.selector, args.critic, contract, checkpoint, args.revision)
        if best_of.best_of > 1:  # best-of-N: in-process only (flags, or what the checkpoint bundles)
            extra["best_of"] = Setting(best_of.record(), best_of.source)
    env_cameras = env_camera_keys(env_id, env.env_kwargs)  # Meta-World renders the cameras its arguments name
    chosen = settings["cameras"].value
    if chosen and settings["cameras"].source == "checkpoint" and not set(chosen) <= set(env_cameras):
        raise ConfigError(f"the checkpoint's cameras {chosen} are not all images of env {env_id!r}'s observations "
                          f"{env_cameras}; pass --cameras with the env's keys in the checkpoint's slot order")
    check_cameras("--cameras", chosen if settings["cameras"].source != "checkpoint" else None, env_cameras)
    output_dir = args.output_dir
    if output_dir is None:
        output_dir = Path(checkpoint) / "rollouts" if checkpoint is not None else Path("outputs") / "eval_server"
    output_dir = check_creatable("--output_dir", output_dir)
    count = int(args.num_envs or default_num_envs(episodes))
    if settings["memory_stride"].value is None:
        settings.pop("memory_stride")
    settings |= {name: setting for name, setting in extra.items() if setting is not None}
    settings["num_envs"] = Setting(count, "flag" if args.num_envs else "default")
    shown = {k: v for k, v in env.env_kwargs.items() if k != "image_size"}  # the env arguments besides the flags
    if shown:
        settings["env_kwargs"] = Setting(shown, "checkpoint" if shown != env_kwargs else "flag")
    at_once = int(args.tasks_at_once or default_tasks_at_once(len(env.tasks), count)) if env.tasks != [None] else 1
    if env.tasks != [None]:
        settings["tasks_at_once"] = Setting(at_once, "flag" if args.tasks_at_once else "default")
    first = int(settings["seed"].value)
    return EvaluationPlan(env, settings, contract, [first + i for i in range(episodes)], output_dir, count, at_once,
                          chunk_size, checkpoint, remote, tuple(args.override or ()), best_of)
