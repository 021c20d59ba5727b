"""The env registry: one place where a simulator says what hf_vla may ask of it (its tasks, cameras, scripted expert,
how to make it in a worker process), so that recording, evaluation, replay, rollouts, RL, DAgger and the lerobot
plugin look it up by name instead of comparing names. A gymnasium id that is not registered here still works as a
plain env without tasks.

hf_vla's own (metaworld, libero, color_reach) are declared at the end of this module. A third-party env registers the
same way from its own module, imported through `HF_VLA_PLUGINS` or the entry-point group `hf_vla.plugins` (see
`hf_vla.registry.policies`):

    from hf_vla.registry import EnvFamily, register_env

    register_env(EnvFamily(name="my_sim", title="My simulator", make="my_pkg.sim:in_worker",
                           tasks="my_pkg.sim:task_names", default_task="pick", cameras="my_pkg.sim:camera_keys"))
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_vla.errors import ConfigError
from hf_vla.registry.policies import load_object, load_plugins, register_in


@dataclass
class RecordingPlan:
    """What `hf_vla.record` records of an env with a scripted expert: the task names and a maker of each task's env
    (with `expert_action()`), the dataset's fps, widths, robot type and image size, the episode limit it defaults to,
    and the env arguments the plan and marker keep (JSON-able)."""

    names: list[str]
    make: dict
    fps: int
    state_dim: int
    action_dim: int
    robot_type: str
    image_size: int
    default_steps: int
    env_kwargs: dict


@dataclass(frozen=True)
class EnvFamily:
    """A simulator: what each of its references (`"module:function"`, imported on first use) answers.

    name: the `--env` of evaluate, record and rl, and the env a checkpoint's contract names (unless `contract_id`).
    title: its name in messages and tables.
    make: `make(task, **kwargs)`: one env of a task, in its own worker process (`hf_vla.envs.worker.InWorker`); it
        takes `image_size` and `max_episode_steps` among its keyword arguments. None: evaluation runs it by its
        gymnasium id (`contract_id`).
    tasks: `tasks(spec)`: the task names a spec selects (a name, a group, a suite); None: an env without tasks.
    default_task: the spec used when none is given.
    cameras: `cameras(env_kwargs)`: the image keys of its observations (every key any camera can have for None).
    check: `check()`: raises when the simulator is not installed (before any model loads).
    groups: `groups(success_by_task)`: (success per group, tasks per group) for a results table (Meta-World's
        difficulty groups), or None.
    recording: `recording(tasks, image_size, max_episode_steps, env_kwargs, seed)`: what `hf_vla.record` records
        with its scripted expert (`hf_vla.envs.recording.RecordingPlan`); None: it has no expert.
    contract_id: the env id a checkpoint trained on its recordings names, when not `name` (a gymnasium id).
    locations: its recordings carry the per-frame location text (a token-objective target).
    subtasks: its recordings carry each frame's `subtask`, the scripted expert's stage in words (`subtask_text()`).
    expert_plans: its expert can simulate itself ahead, so DAgger records the expert's chunk per frame.
    fast_render: its recordings use the fast rendering setting, which evaluation must match.
    fps: its control steps per second (None: unknown), which a MEM policy's stride in dataset frames is converted to.
    """

    name: str
    title: str
    make: str | None = None
    tasks: str | None = None
    default_task: str | None = None
    cameras: str | None = None
    check: str | None = None
    groups: str | None = None
    recording: str | None = None
    contract_id: str | None = None
    locations: bool = False
    subtasks: bool = False
    expert_plans: bool = False
    fast_render: bool = False
    fps: float | None = None

    def call(self, part: str, *args, **kwargs):
        """Call the reference `part` of this env (`make`, `tasks`, `cameras`, `check`, `groups`, `recording`)."""
        reference = getattr(self, part)
        if reference is None:
            raise ConfigError(f"env {self.name!r} ({self.title}) has no {part}")
        return load_object(reference)(*args, **kwargs)

    def task_names(self, spec: str | None) -> list[str]:
        """The task names of `spec` (the default task's without one)."""
        return list(self.call("tasks", spec or self.default_task))


_ENVS: dict[str, EnvFamily] = {}


def register_env(family: EnvFamily) -> EnvFamily:
    """Make `family` known to every command (a name registered twice is an error, unless it is the same env)."""
    return register_in(_ENVS, family, EnvFamily, "env")


def find_env(name: str | None) -> EnvFamily | None:
    """The env registered as `name` (or whose contract id is `name`), or None (a plain gymnasium id)."""
    load_plugins()
    if name in _ENVS:
        return _ENVS[name]
    return next((family for family in _ENVS.values() if family.contract_id == name), None)


def env_names(with_tasks: bool = False, recordable: bool = False) -> list[str]:
    """The registered envs' names (only those with tasks, or with a scripted expert)."""
    load_plugins()
    return [name for name, family in _ENVS.items() if (not with_tasks or family.tasks)
            and (not recordable or family.recording)]


def check_gym_id(env: str, label: str = "env=") -> None:
    """A registered env, or a gymnasium id (hf_vla's own registered first); else one `ConfigError` naming `label`, the
    id and the envs there are."""
    if find_env(env) is not None:
        return
    import gymnasium as gym

    try:
        gym.spec(env)
    except gym.error.Error as error:
        raise ConfigError(f"{label}{env!r}: not an env ({str(error).splitlines()[0]}); hf_vla's envs: "
                          f"{', '.join(env_names())}, or a gymnasium id that an installed package registers") from None


def task_env(name: str | None) -> EnvFamily | None:
    """The registered env `name` when it has tasks (a benchmark), else None."""
    family = find_env(name)
    return family if family is not None and family.tasks else None


def contract_env(name: str) -> str:
    """The env id a checkpoint trained on `name`'s recordings names."""
    family = find_env(name)
    return family.contract_id or family.name if family is not None else name


_HERE = "hf_vla.envs"

register_env(EnvFamily(
    name="metaworld", title="Meta-World", make=f"{_HERE}.metaworld:in_worker", tasks=f"{_HERE}.metaworld:task_names",
    default_task="reach-v3", cameras=f"{_HERE}.metaworld:observation_camera_keys",
    groups=f"{_HERE}.metaworld:group_success", recording=f"{_HERE}.metaworld:recording_plan", locations=True,
    subtasks=True, expert_plans=True, fast_render=True, fps=80))
register_env(EnvFamily(
    name="libero", title="LIBERO", make=f"{_HERE}.libero:in_worker", tasks=f"{_HERE}.libero:task_suites",
    cameras=f"{_HERE}.libero:observation_camera_keys", check=f"{_HERE}.libero:require_libero", fps=20))
register_env(EnvFamily(
    name="color_reach", title="ColorReach", recording=f"{_HERE}.reach:recording_plan",
    contract_id="hf_vla/ColorReach-v0", fps=10))

__all__ = ["EnvFamily", "RecordingPlan", "contract_env", "env_names", "find_env", "register_env", "task_env"]
