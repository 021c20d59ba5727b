"""LIBERO through lerobot's own env wrapper (`lerobot.envs.libero.LiberoEnv`), for closed-loop evaluation.

Needs the LIBERO package lerobot uses (`pip install hf-libero`, lerobot's `libero` extra) and its scene assets, which
it downloads from the Hub at the first env creation (and a prepared config at `LIBERO_CONFIG_PATH`, or its import asks
on stdin). Nothing in hf_vla's own tests runs a LIBERO scene: on machines without the assets only the argument
checks and the one-line "not installed" error are exercised.

`LiberoEnv(suite, task_id)` gives the observation lerobot's LIBERO datasets (e.g. `HuggingFaceVLA/libero`) and
`lerobot-eval --env.type=libero` use, under LeRobot dataset keys: `observation.images.image` (agent view) and
`observation.images.image2` (wrist), both turned 180 degrees as lerobot's `LiberoProcessorStep` does, and
`observation.state` = end-effector position (3), axis-angle (3), gripper joint positions (2). Actions are 7-dim
(relative end-effector pose and gripper), clipped to [-1, 1]; an episode ends on success or after the suite's step
limit (lerobot's `TASK_SUITE_MAX_STEPS`). `info["task"]` is the task's language instruction.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from hf_vla.envs.wrappers import stepper
from hf_vla.errors import ConfigError

# the suites and their task counts (LIBERO's benchmark), so that a task list is checked without LIBERO installed
SUITES = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10, "libero_90": 90}
CAMERAS = {"agentview_image": "observation.images.image", "robot0_eye_in_hand_image": "observation.images.image2"}
STATE = "observation.state"


def task_suites(spec: str | None) -> list[str]:
    """`libero_spatial`, `libero_spatial/3`, or a comma-separated mix -> task names `suite/task_id`."""
    names: list[str] = []
    for part in (p.strip() for p in str(spec or "").split(",")):
        if not part:
            continue
        suite, _, index = part.partition("/")
        if suite not in SUITES:
            raise ConfigError(f"LIBERO suite {suite!r} is not known; choose from {sorted(SUITES)} (a task as "
                              f"suite/index, e.g. libero_spatial/0)")
        if not index:
            names += [f"{suite}/{i}" for i in range(SUITES[suite])]
            continue
        if not index.isdigit() or int(index) >= SUITES[suite]:
            raise ConfigError(f"LIBERO task {part!r}: {suite} has tasks 0..{SUITES[suite] - 1}")
        names.append(f"{suite}/{int(index)}")
    if not names:
        raise ConfigError("no LIBERO suite given: pass --task libero_spatial (or libero_object, libero_goal, ...)")
    return list(dict.fromkeys(names))


def observation_camera_keys(env_kwargs: dict | None) -> list[str]:
    """The image keys of the observations (both cameras, whatever the arguments)."""
    return list(CAMERAS.values())


def require_libero():
    try:
        import lerobot.envs.libero as module
    except ModuleNotFoundError as error:
        raise ConfigError(f"LIBERO is not installed ({error}): `pip install hf-libero` (lerobot's libero extra); it "
                          "downloads its scene assets from the Hub when the first env is made") from error
    return module


class LiberoEnv(gym.Env):
    """One LIBERO task in lerobot's wrapper, with LeRobot dataset keys."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 20}

    def __init__(self, task: str = "libero_spatial/0", image_size: int = 256, max_episode_steps: int | None = None,
                 render_mode: str = "rgb_array"):
        (task,) = task_suites(task)
        module = require_libero()
        suite_name, index = task.split("/")
        suite = module._get_suite(suite_name)
        self.inner = module.LiberoEnv(suite, int(index), suite_name, obs_type="pixels_agent_pos",
                                      observation_width=image_size, observation_height=image_size)
        self.task_name, self.task = task, self.inner.task_description
        self.max_episode_steps = max_episode_steps or module.TASK_SUITE_MAX_STEPS[suite_name]
        # gymnasium's wrappers clip the action to lerobot's action space and end the episode at the suite's limit
        self._stepper = stepper(self.inner, self.task, self.max_episode_steps)
        self.render_mode = render_mode
        self.observation_space = spaces.Dict({
            **{key: spaces.Box(0, 255, (image_size, image_size, 3), np.uint8) for key in CAMERAS.values()},
            STATE: spaces.Box(-np.inf, np.inf, (8,), np.float32),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (module.ACTION_DIM,), np.float32)
        self._image = None

    def _observation(self, raw: dict) -> dict:
        import torch
        from lerobot.processor.env_processor import LiberoProcessorStep

        images = {CAMERAS[name]: np.ascontiguousarray(raw["pixels"][self.inner.camera_name_mapping[name]][::-1, ::-1])
                  for name in CAMERAS}
        self._image = images[CAMERAS["agentview_image"]]
        eef = raw["robot_state"]["eef"]
        axis_angle = LiberoProcessorStep()._quat2axisangle(torch.as_tensor(eef["quat"], dtype=torch.float64)[None])[0]
        state = np.concatenate([eef["pos"], axis_angle.numpy(), raw["robot_state"]["gripper"]["qpos"]])
        return {**images, STATE: state.astype(np.float32)}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        raw, _ = self._stepper.reset(seed=seed)
        return self._observation(raw), {"task": self.task, "is_success": False}

    def step(self, action):
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        raw, reward, terminated, truncated, info = self._stepper.step(action)
        return self._observation(raw), reward, terminated, truncated, info

    def render(self):
        return self._image

    def close(self):
        self.inner.close()


def in_worker(task: str, **kwargs):
    """A `LiberoEnv` in its own process (one GL context per process, as for Meta-World)."""
    from hf_vla.envs.worker import InWorker

    require_libero()  # not installed: one line here, not a traceback from the worker
    return InWorker(functools.partial(LiberoEnv, task=task, **kwargs), name=f"LIBERO {task}")


__all__ = ["CAMERAS", "LiberoEnv", "SUITES", "in_worker", "require_libero", "task_suites"]
