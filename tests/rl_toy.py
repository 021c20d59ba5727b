"""Toy envs for the RL tests (importable in env worker processes: the tests folder is on their sys.path).

`PointBandit`: one decision per episode; the policy's first action is scored against a fixed optimum (`TARGET`, or
the env argument `target`)
(dense reward -|a - TARGET|^2, success within 0.3 of the action scale), so the direction a policy-gradient step must
move the mean action is known. `CrashingReach`: ColorReach whose worker process dies at step 3 of one seed's episode.
"""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np
from gymnasium import spaces

TARGET = np.array([0.05, -0.05], dtype=np.float32)  # in raw action units (the action range is +-0.1)
CRASH_SEED = 3


class PointBandit(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, image_size: int = 32, target=None):
        self.image_size = image_size
        self.target = np.asarray(TARGET if target is None else target, dtype=np.float32)
        self.observation_space = spaces.Dict({
            "observation.image": spaces.Box(0, 255, (image_size, image_size, 3), np.uint8),
            "observation.state": spaces.Box(-1.0, 1.0, (2,), np.float32),
        })
        self.action_space = spaces.Box(-0.1, 0.1, (2,), np.float32)
        self.task = "move to the red target"

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._observation(), {"task": self.task, "is_success": False}

    def _observation(self):
        return {"observation.image": np.full((self.image_size, self.image_size, 3), 90, np.uint8),
                "observation.state": np.zeros(2, np.float32)}

    def step(self, action):
        error = float(np.sum((np.asarray(action, np.float32).reshape(2) - self.target) ** 2))
        success = error < (0.3 * 0.1) ** 2
        return self._observation(), -error / 0.01, True, False, {"task": self.task, "is_success": success}

    def render(self):
        return self._observation()["observation.image"]


class CrashingReach(gym.Env):
    """ColorReach whose process exits (as a crashed simulator would) at step 3 of the episode with `CRASH_SEED`."""

    def __init__(self, **kwargs):
        from hf_vla.envs.reach import ColorReachEnv

        self.env = ColorReachEnv(**kwargs)
        self.observation_space, self.action_space = self.env.observation_space, self.env.action_space
        self.seed = None

    @property
    def task(self):
        return self.env.task

    def reset(self, *, seed=None, options=None):
        self.seed, self.steps = seed, 0
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        self.steps += 1
        if self.seed == CRASH_SEED and self.steps == 3:
            os._exit(3)
        return self.env.step(action)

    def render(self):
        return self.env.render()


def register() -> None:
    for name, entry in (("PointBandit", "rl_toy:PointBandit"), ("CrashingReach", "rl_toy:CrashingReach")):
        if f"hf_vla_test/{name}-v0" not in gym.registry:
            gym.register(f"hf_vla_test/{name}-v0", entry_point=entry)


register()
