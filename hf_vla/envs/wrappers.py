"""The gymnasium wrapper stack Meta-World and LIBERO step through: `EndOnSuccess(TimeLimit(ClipAction(env)))`."""

from __future__ import annotations

import gymnasium as gym
from gymnasium.wrappers import ClipAction, TimeLimit


class EndOnSuccess(gym.Wrapper):
    """An episode ends at its first success: terminated, not truncated, also on the step where `TimeLimit` truncates
    it; `info` holds the task and `is_success`."""

    def __init__(self, env: gym.Env, task: str):
        super().__init__(env)
        self.task = task

    def step(self, action):
        observation, reward, terminated, truncated, info = self.env.step(action)
        success = bool(info.get("is_success", False))
        return (observation, float(reward), bool(terminated) or success, bool(truncated) and not success,
                {"task": self.task, "is_success": success})


def stepper(env: gym.Env, task: str, max_episode_steps: int) -> gym.Env:
    """The action clipped to the env's action space, the episode ended at `max_episode_steps` or its first success."""
    return EndOnSuccess(TimeLimit(ClipAction(env), max_episode_steps), task)


__all__ = ["EndOnSuccess", "stepper"]
