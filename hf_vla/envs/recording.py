"""Recording a simulator's scripted expert (or a DAgger round) as a LeRobot v3.0 dataset: `record()`, the one
function behind `python -m hf_vla.record` (whose docstring says what it writes), and `RecordArguments`, its options."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hf_vla.cli import positive, progress_bar
from hf_vla.deployment.contract import RECORD_MARKER
from hf_vla.envs.dagger import DaggerActor, DaggerSettings, dagger_episodes, dagger_features
from hf_vla.envs.metaworld import LOCATIONS, SUBTASK
from hf_vla.errors import ConfigError
from hf_vla.registry import contract_env, env_names, find_env
from hf_vla.serving.selection import SELECTORS, check_selection_flags
from hf_vla.storage import DirectoryLock

logger = logging.getLogger("hf_vla.record")
STRATEGIES = ("expert", "dagger", "policy")
ACTING = ("dagger", "policy")  # strategies where a policy acts
PART_MARKER = "hf_vla_record_part.json"  # a recorded task in the staging directory: done
LOCK_NAME = "_hf_vla_record.lock"  # one recording at a time into a staging directory
# (image key, state key, action key) of the recorded datasets: lerobot's Meta-World names, also the demo's
CAMERA, STATE, ACTION = "observation.image", "observation.state", "action"


@dataclass
class RecordResult:
    output: str
    env: str
    tasks: dict[str, dict] = field(default_factory=dict)  # task name -> {"kept", "rejected", "description"}
    frames: int = 0
    seconds: float = 0.0
    shortfall: dict[str, int] = field(default_factory=dict)  # task name -> episodes missing after --max_tries




class _ExpertActor:
    """The env's scripted expert as a one-action policy for the episode loop; each step's frame (in the writer's
    format, with the env's per-frame texts under `text`: `target_text()` when `locations`, `subtask_text()` when
    `subtasks`) is kept for the episode's log."""

    def __init__(self, env, texts: tuple[str, ...] = ()):
        self.env, self.texts, self.frames = env, tuple(texts), []

    def reset(self, seed=None):
        self.frames = []

    def __call__(self, observation, task):
        action = np.asarray(self.env.expert_action(), dtype=np.float32)
        images = {key: value for key, value in observation.items() if key.startswith(CAMERA)}  # every camera
        frame = {"images": images, "state": observation[STATE], "action": action, "task": task}
        if self.texts:
            frame["text"] = frame_texts(self.env, self.texts)
        self.frames.append(frame)
        return action[None]

    def episode_log(self) -> list[dict]:
        return self.frames


TEXT_METHODS = {LOCATIONS: "target_text", SUBTASK: "subtask_text"}  # per-frame column -> the env method that says it


def frame_texts(env, texts: tuple[str, ...]) -> dict:
    """A frame's per-frame text columns `texts` (`TEXT_METHODS`: the env's `target_text()` for locations,
    `subtask_text()` for the expert's stage), each asked of the env in its worker where it runs in one."""
    def ask(name):
        return env.call(name) if hasattr(env, "call") else getattr(env, name)()

    return {column: ask(TEXT_METHODS[column]) for column in texts}


def expert_episodes(env, count: int, seeds: Iterator[int], max_attempts: int, only_successful: bool = True,
                    stats: dict | None = None, bar=None, texts: tuple[str, ...] = ()) -> Iterator[list[dict]]:
    """Up to `count` episodes of `env.expert_action()` (frames in the writer's format), over at most `max_attempts`
    of `seeds`, run by the episode loop (`EpisodeRunner`); failures are counted in `stats["rejected"]` and skipped
    when `only_successful`. With `locations`, each frame also carries the env's `target_text()` (where the gripper,
    object and goal are in that frame's image) under `text`."""
    from hf_vla.envs.episodes import EpisodeRunner

    stats = stats if stats is not None else {}
    stats.setdefault("kept", 0)
    stats.setdefault("rejected", 0)
    if count <= 0:
        return
    kept = 0
    runner = EpisodeRunner([env], _ExpertActor(env, texts), n_action_steps=1)
    # seeds are drawn only when an episode starts: the seeds used are exactly those drawn
    for episode in runner.episodes(int(seed) for seed in itertools.islice(seeds, max_attempts)):
        if only_successful and not episode.success:
            stats["rejected"] += 1
            if bar is not None:
                bar.set_postfix(rejected=stats["rejected"])
            continue
        kept += 1
        stats["kept"] += 1
        if bar is not None:
            bar.update(1)
        yield episode.log
        if kept >= count:
            return


def _part_stats(part: Path) -> dict | None:
    marker = part / PART_MARKER
    return json.loads(marker.read_text()) if marker.exists() else None


def record(args: RecordArguments, env_kwargs: dict | None = None, progress: bool = True,
           seeds: Callable[[int], Iterator[int]] | None = None) -> RecordResult:
    """`python -m hf_vla.record` with its options as one `RecordArguments`: record `args.episodes` successful expert
    episodes per task into a new LeRobot dataset at `args.output` (with `strategy="dagger"`: that many DAgger episodes
    per task of `args.policy`, labelled by the expert; see `hf_vla.envs.dagger`). `env_kwargs`: further env arguments
    beside the flags (`crop`, `action_mode`, `cameras`); `seeds(first)`: each task's episode seeds (default `first`,
    `first` + 1, ...).

    Each task is recorded into its own part under `.<output name>.recording/` beside `output` and marked done when
    complete; the parts are joined with lerobot's `aggregate_datasets` and the result renamed into place. Killed and
    rerun with the same arguments, the recording continues from the first task not done. A task gets at most
    `max_tries` episodes (default 3 x episodes + 10); a shortfall is reported in the result, not hidden."""
    env, output, episodes, tasks, strategy, policy = (args.env, args.output, args.episodes, args.task, args.strategy,
                                                      args.policy)
    image_size, seed, max_episode_steps, max_tries = args.image_size, args.seed, args.max_episode_steps, args.max_tries
    overwrite, device, round_index = args.overwrite, args.device, 1 if args.round is None else args.round
    flags = {k: v for k, v in (("crop", args.crop), ("action_mode", args.action_mode), ("cameras", args.cameras),
                               ("cue_steps", args.cue_steps)) if v}
    env_kwargs = (flags | dict(env_kwargs or {})) or None
    dagger = DaggerSettings(args.beta or 0.0, args.takeover_threshold,
                            10 if args.takeover_steps is None else args.takeover_steps,
                            args.stall_steps) if strategy == "dagger" else None
    family = find_env(env)
    if family is None or not family.recording:
        raise ConfigError(f"env {env!r}: choose one of {env_names(recordable=True)} (the envs with a scripted expert)")
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy {strategy!r}: choose one of {list(STRATEGIES)}")
    if (strategy in ACTING) != (policy is not None):
        raise ConfigError(f"--strategy {strategy} needs --policy CHECKPOINT (the policy that acts)" if policy is None
                          else f"--policy {policy}: only --strategy dagger or policy runs a policy (the expert records "
                          "alone)")
    positive("episodes", episodes)
    positive("round", round_index)
    positive("image_size", image_size)
    positive("max_episode_steps", max_episode_steps)
    positive("max_tries", max_tries)
    max_tries = max_tries or 3 * episodes + 10
    if max_tries < episodes:
        raise ConfigError(f"--max_tries {max_tries} is below --episodes {episodes}: a task could never be complete")
    from hf_vla.storage import check_output, make_dir

    output = check_output("--output", output, overwrite, inputs={"--policy": policy if strategy in ACTING else None},
                          marker=f"meta/{RECORD_MARKER}", what="recording")
    make_dir("--output", output.parent)
    runner = None
    if strategy in ACTING:
        dagger = dagger or DaggerSettings()
        if strategy == "policy":
            dagger = DaggerSettings(expert_labels=False)
        runner, resolved = _dagger_policy(env, policy, tasks, image_size, max_episode_steps, env_kwargs, episodes,
                                          {"device": device, **_best_of_settings(args)})
        tasks, image_size, max_episode_steps, env_kwargs = (resolved["task"], resolved["image_size"],
                                                            resolved["max_episode_steps"], resolved["env_kwargs"])
        if strategy == "policy":
            resolved["plan_steps"] = None  # no expert consulted: no expert plan either
        seed = 1000 * round_index if seed is None else seed
    seed = 0 if seed is None else seed
    recording = family.call("recording", tasks, image_size, max_episode_steps, env_kwargs, seed)
    names, make, kwargs = recording.names, recording.make, recording.env_kwargs
    fps, state_dim, action_dim, robot_type, size = (recording.fps, recording.state_dim, recording.action_dim,
                                                    recording.robot_type, recording.image_size)
    default_steps = recording.default_steps
    seeds = seeds or (lambda first: iter(range(first, first + 10**9)))
    plan = {"env": env, "tasks": names, "episodes_per_task": episodes, "image_size": size, "seed": seed,
            "max_episode_steps": max_episode_steps or default_steps, "max_tries": max_tries,
            "env_kwargs": {k: v for k, v in kwargs.items() if k not in ("image_size", "max_steps")}}
    if runner is not None:
        from hf_vla.serving.recorder import checkpoint_identity
        from hf_vla.storage import weights_fingerprint

        # the policy by its resolved path and its weights: another spelling of it continues the round, other weights
        # under its path do not (a round acted by two policies)
        plan |= {"strategy": strategy, "policy": checkpoint_identity(str(policy)),
                 "weights": weights_fingerprint(policy), "round": round_index, "dagger": dagger.to_dict(),
                 "n_action_steps": resolved["n_action_steps"], "plan_steps": resolved["plan_steps"]}
        if runner.best_of > 1:  # best-of-N: the policy acts on one of N candidates a step
            plan["best_of"] = {"candidates": runner.best_of, "selector": runner.selector,
                               "critic": checkpoint_identity(runner.critic.path) if runner.critic else None}
        if getattr(runner.processor, "advantage_conditioned", False):  # RECAP: what the policy was asked for
            plan["advantage"] = {"indicator": "positive", "cfg_beta": runner.processor.cfg_beta}

    staging = output.parent / f".{output.name}.recording"
    lock = DirectoryLock(staging, label="--output", lock_name=LOCK_NAME,
                         what=f"another recording into {output}").acquire()
    try:
        return _record_tasks(_Job(staging, plan, output, names, make, episodes, overwrite, progress, seeds, seed, env,
                                  runner, resolved if runner is not None else None, dagger, max_tries, fps, size,
                                  state_dim, action_dim, robot_type))
    finally:
        lock.release()
        if staging.is_dir() and not any(staging.iterdir()):  # done: the staging directory held only the lock
            staging.rmdir()


@dataclass
class _Job:
    """One recording as `record` resolved it: where (the staging directory, its `plan`, the output), which tasks (`make`:
    name -> env factory), how many episodes from which seeds, and who acts (`runner`: a DAgger policy, else the
    expert)."""

    staging: Path
    plan: dict
    output: Path
    names: list
    make: dict
    episodes: int
    overwrite: bool
    progress: bool
    seeds: Callable
    seed: int
    env: str
    runner: object
    resolved: dict | None
    dagger: object
    max_tries: int
    fps: int
    size: int
    state_dim: int
    action_dim: int
    robot_type: str

    @property
    def camera_keys(self) -> list[str]:
        """The recorded cameras' LeRobot keys, in slot order (Meta-World's `cameras`, else the env's one camera)."""
        family = find_env(self.env)
        if not self.plan["env_kwargs"].get("cameras") or not family.cameras:
            return [CAMERA]
        return list(family.call("cameras", self.plan["env_kwargs"]))


def _record_tasks(job: _Job) -> RecordResult:
    """`record`'s work, with the staging directory's writer lock held: each task not done yet recorded into its part,
    then the parts joined into the output."""
    names = job.names
    parts = _prepare_staging(job)
    started = time.perf_counter()
    done = {name: _part_stats(parts / name) for name in names}
    resumed = [name for name, stats in done.items() if stats is not None]
    if resumed:
        logger.info("continuing the recording in %s: %d of %d tasks already done", job.staging, len(resumed),
                    len(names))
    bar = progress_bar(job.episodes * len(names), f"recording {job.env}", "episodes", enabled=job.progress,
                       initial=sum(done[name]["kept"] for name in resumed))
    try:
        for name in names:
            if done[name] is None:
                done[name] = _record_task(job, name, parts, bar)
    finally:
        bar.close()
    return _join(job, parts, done, started, resumed)


def _prepare_staging(job: _Job) -> Path:
    """The staging directory ready for `job`'s plan: an interrupted recording of the same plan is continued (its
    unfinished task started over), one of another plan refused (or, with --overwrite, cleared)."""
    staging, plan = job.staging, job.plan
    plan_file = staging / "plan.json"
    previous = json.loads(plan_file.read_text()) if plan_file.exists() else None
    if previous is not None and previous.get("policy") and plan.get("policy"):  # an older round's plan: its spelling
        from hf_vla.serving.recorder import checkpoint_identity

        previous["policy"] = checkpoint_identity(previous["policy"])
        previous.setdefault("weights", plan.get("weights"))  # plans of an hf_vla without the fingerprint
    if any(p.name != LOCK_NAME for p in staging.iterdir()) and previous != plan:
        if not job.overwrite:
            raise ConfigError(
                f"{staging} holds an interrupted recording with other settings ({_plan_difference(previous, plan)}): "
                "rerun with its settings to continue it, or pass --overwrite to start over")
        for leftover in staging.iterdir():
            if leftover.name != LOCK_NAME:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    parts = staging / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps(plan, indent=2))
    for leftover in parts.glob("*.partial"):  # a task killed mid-way: recorded again from its first seed
        shutil.rmtree(leftover)
    return parts


def _tried(seeds: Iterator[int], used: list[int]) -> Iterator[int]:
    """`seeds`, each noted in `used` when drawn: evaluation must stay off every seed an episode was tried with."""
    for value in seeds:
        used.append(int(value))
        yield value


def _episodes(job: _Job, live, name: str, stats: dict, used: list[int], bar) -> Iterator[list[dict]]:
    """The task's episodes as frame lists: DAgger's (the policy acts, the expert labels), else the expert's."""
    seeds = _tried(job.seeds(job.seed), used)
    if job.runner is None:
        yield from expert_episodes(live, job.episodes, seeds, max_attempts=job.max_tries, stats=stats, bar=bar,
                                   texts=_text_features(find_env(job.env)))
        return
    from hf_vla.envs.episodes import check_dims

    check_dims(job.runner, live, f"{job.env} {name}")
    stats["rejected"] = 0
    actor = DaggerActor(live, job.runner, job.resolved["n_action_steps"], job.dagger, tuple(job.camera_keys), STATE,
                        text=_frame_text(find_env(job.env)),
                        plan_steps=job.resolved["plan_steps"])
    yield from dagger_episodes(actor, job.episodes, seeds, stats=stats, bar=bar,
                               episodes=stats.setdefault("episodes", []))


def _record_task(job: _Job, name: str, parts: Path, bar) -> dict:
    """One task recorded into `parts/<name>.partial`, renamed to `parts/<name>` when whole; its statistics."""
    from hf_vla.data.writer import DatasetLayout, write_lerobot_dataset

    live = job.make[name]()
    used: list[int] = []
    stats = {"description": getattr(live, "task", name)}
    frames = 0
    started = time.perf_counter()

    def counted(source):
        nonlocal frames
        for episode in source:
            frames += len(episode)
            yield episode

    partial = parts / f"{name}.partial"
    try:
        bar.set_description(f"recording {name}")
        episodes = counted(_episodes(job, live, name, stats, used, bar))
        first = next(episodes, None)
        if first is not None:
            layout = DatasetLayout(
                fps=job.fps, cameras={key: (job.size, job.size) for key in job.camera_keys}, state_dim=job.state_dim,
                action_dim=job.action_dim, robot_type=job.robot_type, state_key=STATE, action_key=ACTION,
                repo_id=f"local/{name}", text_features=_text_features(find_env(job.env)),
                extra_features=dagger_features(job.action_dim, job.resolved["plan_steps"]) if job.runner is not None
                else None,
                # Lossless video (full-resolution chroma, crf 0): what the policy trains on is what the env renders.
                pix_fmt="yuv444p", crf=0)
            write_lerobot_dataset(partial / "dataset", itertools.chain([first], episodes), layout)
        else:
            partial.mkdir(parents=True, exist_ok=True)
    finally:
        if hasattr(live, "close"):
            live.close()
    if job.runner is not None:
        logger.info("%s: the policy succeeded in %d of %d DAgger episodes; the expert acted at %d of %d steps",
                    name, stats["successes"], stats["kept"], stats["expert_steps"], frames)
    elif stats["kept"] < job.episodes:
        logger.warning("%s: only %d of %d episodes succeeded in %d tries (--max_tries %d)", name,
                       stats["kept"], job.episodes, stats["kept"] + stats["rejected"], job.max_tries)
    stats |= {"frames": frames, "seeds": [min(used, default=job.seed), max(used, default=job.seed)],
              "seconds": round(time.perf_counter() - started, 1)}
    (partial / PART_MARKER).write_text(json.dumps(stats, indent=2))
    os.replace(partial, parts / name)  # the task is done: a rerun skips it
    return stats


def _join(job: _Job, parts: Path, done: dict, started: float, resumed: list[str]) -> RecordResult:
    """The tasks' parts joined (lerobot's `aggregate_datasets`) into the output, with `meta/hf_vla_record.json`."""
    names, episodes, staging, output, plan = job.names, job.episodes, job.staging, job.output, job.plan
    result = RecordResult(str(output), job.env)
    for name in names:
        stats = dict(done[name])
        result.frames += stats.pop("frames")
        result.tasks[name] = stats
    recorded = [parts / name / "dataset" for name in names if (parts / name / "dataset").exists()]
    if not recorded:
        raise ConfigError(f"no successful expert episode in {sum(s['rejected'] for s in result.tasks.values())} tries "
                          f"of {names}: nothing to write ({staging} is kept; --overwrite starts over)")
    dataset = staging / "dataset"
    shutil.rmtree(dataset, ignore_errors=True)
    if len(recorded) == 1:
        shutil.copytree(recorded[0], dataset)
    else:
        from lerobot.datasets.aggregate import aggregate_datasets

        logger.info("joining %d tasks into one dataset", len(recorded))
        aggregate_datasets([f"local/{p.parent.name}" for p in recorded], f"local/{output.name}", roots=recorded,
                           aggr_root=dataset)
    result.seconds = round(time.perf_counter() - started + sum(s.get("seconds", 0) for n, s in result.tasks.items()
                                                                if n in resumed), 1)
    all_seeds = [s["seeds"] for s in result.tasks.values()]
    shortfall = {n: episodes - s["kept"] for n, s in result.tasks.items() if s["kept"] < episodes}
    (dataset / "meta" / RECORD_MARKER).write_text(json.dumps(
        asdict(result) | {"seed": job.seed, "image_size": job.size, "episodes_per_task": episodes,
                          "max_episode_steps": plan["max_episode_steps"], "max_tries": job.max_tries,
                          "fast_render": find_env(job.env).fast_render, "env_kwargs": plan["env_kwargs"],
                          **{key: plan[key] for key in ("strategy", "policy", "weights", "round", "dagger",
                                                        "n_action_steps", "plan_steps", "advantage", "best_of")
                             if key in plan},
                          "shortfall": shortfall,
                          "data_seeds": [min(s[0] for s in all_seeds), max(s[1] for s in all_seeds)]},
        indent=2))
    from hf_vla.storage import replace_dir

    replace_dir(dataset, output)  # an existing output (checked: a recording) is replaced once the new one is whole
    for leftover in staging.iterdir():  # the lock stays until it is released
        if leftover.name != LOCK_NAME:
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
    result.shortfall = shortfall
    total = sum(t["kept"] for t in result.tasks.values())
    logger.info("recorded %d episodes (%d frames; %d rejected) into %s in %.0f s", total, result.frames,
                sum(t["rejected"] for t in result.tasks.values()), output, result.seconds)
    if shortfall:
        logger.warning("%d task(s) short of %d episodes: %s", len(shortfall), episodes,
                       ", ".join(f"{n} ({episodes - k} of {episodes} kept)" for n, k in shortfall.items()))
    return result


def _text_features(family) -> tuple[str, ...]:
    """The per-frame string columns an env's recordings carry."""
    return tuple(name for name, wanted in ((LOCATIONS, family.locations), (SUBTASK, family.subtasks)) if wanted)


def _frame_text(family):
    """The per-frame text of a DAgger frame (as the expert recording's), or None when the env has none."""
    texts = _text_features(family)
    return functools.partial(frame_texts, texts=texts) if texts else None


def _best_of_settings(args: RecordArguments) -> dict:
    """The runner's best-of-N settings from `--best_of`, `--selector`, `--critic` over the policy's contract (a bundled
    critic: `hf_vla.serving.critic.plan_best_of`), the critic loaded."""
    from hf_vla.hub.resolve import resolve_contract
    from hf_vla.serving.critic import plan_best_of

    try:
        contract = resolve_contract(args.policy)
    except ConfigError:  # a policy that cannot be found or read: said under its flag when it is loaded
        contract = None
    best_of = plan_best_of(args.best_of, args.selector, args.critic, contract, args.policy)
    return best_of.runner_kwargs(args.device)


def _dagger_policy(env: str, policy: str, tasks: str | None, image_size: int | None, max_episode_steps: int | None,
                   env_kwargs: dict | None, episodes: int, runner: dict):
    """The policy of a DAgger recording, loaded (`runner`: `load_policy`'s device and best-of-N settings), and the
    settings its deployment contract fixes (tasks, image size, episode limit, env arguments such as a crop): a flag
    that contradicts the contract, or a checkpoint trained in another env, is refused in one line."""
    from hf_vla.deployment.contract import ContractError, head_spec
    from hf_vla.envs.settings import EnvRequest, plan_env
    from hf_vla.hub.resolve import resolve_contract
    from hf_vla.serving.policy import ObservationMap, load_policy

    try:
        contract = resolve_contract(policy, None)
    except ConfigError as error:
        raise ConfigError(f"--policy {error}") from None
    spec = head_spec(contract, None)
    trained_env = ((spec or {}).get("benchmark") or {}).get("env")
    if trained_env is not None and trained_env != contract_env(env):
        raise ConfigError(f"--policy {policy}: its data was recorded in {trained_env!r}, not {contract_env(env)!r} "
                          f"(--env {env}); DAgger runs a policy in the env it was trained for")
    try:
        plan = plan_env(contract, EnvRequest(contract_env(env), tasks, episodes, image_size=image_size,
                                             max_episode_steps=max_episode_steps, override=("seed",)),
                        contract.chunk_size if contract else None, labels=("--env ", "--tasks "))
    except ContractError as error:
        raise ConfigError(f"--policy {policy}: {str(error).split('; drop the flag')[0]}; drop the flag: DAgger runs "
                          "the policy as it was trained") from None
    settings, given, merged = plan.settings, dict(env_kwargs or {}), plan.env_kwargs
    for key, value in given.items():
        if value is not None and merged.get(key) is not None and _as_list(merged[key]) != _as_list(value):
            raise ConfigError(f"--policy {policy}: --{key} {value} contradicts the checkpoint, which was trained with "
                              f"{key}={merged[key]}; drop the flag: DAgger runs the policy as it was trained")
    merged = {k: v for k, v in (merged | {k: v for k, v in given.items() if v is not None}).items()
              if k != "image_size"}
    runner = load_policy(policy, obs_map=ObservationMap(cameras=settings["cameras"].value or None),
                         num_camera_slots=len(spec["cameras"]) if spec else None,
                         memory_stride=settings["memory_stride"].value, **runner)
    task = settings["task"].value if find_env(env).tasks else None  # ColorReach draws its instruction per episode
    return runner, {"task": task, "image_size": settings["image_size"].value,
                    "n_action_steps": int(settings["n_action_steps"].value),
                    # the expert's own chunk per frame where the env can simulate its expert ahead (hf_vla.envs.dagger)
                    "plan_steps": int(runner.model.config.chunk_size) if find_env(env).expert_plans else None,
                    "max_episode_steps": settings["max_episode_steps"].value, "env_kwargs": merged}


def _as_list(value):
    if isinstance(value, str):
        return [int(v) if v.strip().lstrip("-").isdigit() else v.strip() for v in value.split(",")]
    return list(value) if isinstance(value, list | tuple) else value


def _plan_difference(previous: dict | None, plan: dict) -> str:
    if previous is None:
        return "no plan.json"
    keys = [k for k in plan if previous.get(k) != plan[k]]
    return ", ".join(f"{k}: {previous.get(k)!r} there, {plan[k]!r} now" for k in keys)[:300]


DAGGER = "DAgger (a policy acts, the expert labels; hf_vla.envs.dagger)"


@dataclass
class RecordArguments:
    """What `python -m hf_vla.record` records, from which env, where to."""

    env: str | None = field(default=None, metadata={"required": True, "help": "the simulator: a registered env with a "
                                                    "scripted expert (metaworld, color_reach; hf_vla.registry)"})
    task: str | None = field(default=None, metadata={"help": "Meta-World: task names (comma-separated, -v3 optional), "
                             "a difficulty group (easy, medium, hard, very_hard), or mt50 / all (the 50 tasks)"})
    episodes: int | None = field(default=None, metadata={"help": "successful episodes per task (required to record)"})
    output: str | None = field(default=None, metadata={"required": True, "help": "the dataset directory to create"})
    image_size: int | None = field(default=None, metadata={"help": "square image side (Meta-World default 128)"})
    seed: int | None = field(default=None, metadata={"help": "first episode seed of each task (default 0; DAgger: "
                             "1000 x --round)"})
    max_episode_steps: int | None = field(default=None, metadata={"help": "episode limit (default: the env's)"})
    max_tries: int | None = field(default=None, metadata={"help": "expert episodes tried per task before its "
                                  "shortfall is reported (default 3 x --episodes + 10)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing --output once the new one is "
                            "complete"})
    crop: str | None = field(default=None, metadata={
        "help": "Meta-World: left,top,right,bottom pixels of the 480 px render to keep before resizing to --image_size "
        "(e.g. 144,96,400,352, the five-task workspace); kept in the dataset's deployment contract, so evaluation and "
        "RL crop the same way"})
    action_mode: str | None = field(default=None, metadata={
        "choices": ("delta", "absolute_ee"), "help": "Meta-World: delta (its own actions) or absolute_ee (the hand's "
        "target position, what a position-controlled arm receives; gripper unchanged); kept in the deployment "
        "contract (default: delta)"})
    cameras: str | None = field(default=None, metadata={
        "help": "Meta-World: the scene's cameras to record, comma-separated, in slot order (corner2, corner, corner3, "
        "topview, behindGripper, gripperPOV: the wrist view), each a video feature observation.images.<name> "
        "(default: corner2 alone, as lerobot's observation.image); --crop cuts corner2 only; kept in the contract"})
    cue_steps: int | None = field(default=None, metadata={
        "help": "ColorReach: the task that needs memory: the instruction does not name the colour and only the first "
        "N frames show which target to reach (docs/memory.md); kept in the contract, so evaluation shows the same"})
    add_locations: str | None = field(default=None, metadata={
        "help": "Meta-World: instead of recording, write --output as this recording (one of this command without the "
        "per-frame locations column) with it, by replaying each episode from its seed; refused where the replay "
        "departs from the recording"})
    strategy: str = field(default="expert", metadata={
        "group": DAGGER, "choices": STRATEGIES, "help": "expert: the scripted expert acts (successful episodes only); "
        "dagger: --policy acts and the expert labels every state; policy: --policy alone, its own actions recorded, "
        "every episode kept with next.success (RECAP's collection: docs/recap.md)"})
    policy: str | None = field(default=None, metadata={"group": DAGGER, "help": "dagger: the checkpoint (directory or "
                               "Hub id) that acts"})
    round: int | None = field(default=None, metadata={"group": DAGGER, "help": "dagger: the round's number, kept in "
                              "the metadata (default: 1; seeds 1000 x round)"})
    beta: float | None = field(default=None, metadata={"group": DAGGER, "help": "dagger: the expert's share of the "
                               "steps (each step drawn; the paper's mixture) (default: 0)"})
    takeover_threshold: float | None = field(default=None, metadata={
        "group": DAGGER, "help": "dagger: the expert takes over where the policy's action is farther than this from "
        "its own (HG-DAgger's gate)"})
    takeover_steps: int | None = field(default=None, metadata={"group": DAGGER, "help": "dagger: steps the expert "
                                       "keeps control (default: 10)"})
    stall_steps: int | None = field(default=None, metadata={"group": DAGGER, "help": "dagger: the expert takes over "
                                    "after this many steps without a new best reward"})
    device: str = field(default="cpu", metadata={"group": DAGGER, "help": "dagger: where the policy runs"})
    best_of: int | None = field(default=None, metadata={"group": DAGGER, "min": 1, "help": "dagger / policy: "
                                "candidate chunks drawn per step, one chosen by --selector (docs/best_of_n.md; "
                                "default: the policy's contract, where it bundles a critic, else 1)"})
    selector: str | None = field(default=None, metadata={"group": DAGGER, "choices": list(SELECTORS), "help": "with "
                                 "--best_of: critic, medoid or first (default: critic with --critic, else medoid)"})
    critic: str | None = field(default=None, metadata={"group": DAGGER, "help": "with --best_of: a chunk critic "
                               "(policy pi05_chunk_critic) that scores the candidates"})

    def __post_init__(self):
        recordable = env_names(recordable=True)
        if self.env is not None and self.env not in recordable:
            raise ConfigError(f"argument --env: invalid choice: {self.env!r} (choose from "
                              f"{', '.join(map(repr, recordable))}: the registered envs with a scripted expert)")
        if self.add_locations is not None and not getattr(find_env(self.env), "locations", False):
            raise ConfigError("--add_locations: locations are those of "
                              f"{[n for n in env_names() if find_env(n).locations]} (--env)")
        if self.add_locations is None and self.episodes is None:
            raise ConfigError("--episodes is required to record")
        for flag in ("cameras", "crop", "action_mode"):
            if getattr(self, flag) is not None and not str(getattr(self, flag)).strip(" ,"):
                raise ConfigError(f"--{flag} {getattr(self, flag)!r}: empty; name a value, or leave the flag out for "
                                  "the default")
        dagger_flags = [f"--{name}" for name in ("round", "beta", "takeover_threshold", "takeover_steps",
                                                 "stall_steps") if getattr(self, name) is not None]
        if self.strategy == "policy":
            dagger_flags = [flag for flag in dagger_flags if flag != "--round"]
        if self.best_of is not None or self.critic is not None or self.selector is not None:
            if self.strategy not in ACTING:
                raise ConfigError("--best_of / --selector / --critic: how the policy acts, taken with --strategy "
                                  "dagger or policy")
            self.selector = check_selection_flags(self.best_of, self.selector, self.critic)
        if self.strategy != "dagger" and dagger_flags:
            raise ConfigError(f"{', '.join(dagger_flags)}: DAgger settings, taken with --strategy dagger only (the "
                              "expert records alone)")


__all__ = ["RecordArguments", "RecordResult", "expert_episodes", "record"]
