"""The gymnasium wrapper stack Meta-World and LIBERO step through (`EndOnSuccess(TimeLimit(ClipAction(env)))`), and
the render-to-observation resize every env and the lerobot plugin share."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
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


def render_to_observation(image: np.ndarray, crop, size: int) -> np.ndarray:
    """A render as the observation: cut to `crop` (left, top, right, bottom) when given, then resized to `size` px
    (PIL bilinear, not gymnasium's cv2 `ResizeObservation`: every recording and figure was made with this resize).
    The lerobot plugin turns lerobot-eval's 480 px frames into a checkpoint's recorded frames with it too."""
    from PIL import Image

    if crop is not None:
        left, top, right, bottom = crop
        image = image[top:bottom, left:right]
    if image.shape[:2] != (size, size):
        image = np.asarray(Image.fromarray(np.ascontiguousarray(image)).resize((size, size), Image.BILINEAR))
    return image


__all__ = ["EndOnSuccess", "render_to_observation", "stepper"]
