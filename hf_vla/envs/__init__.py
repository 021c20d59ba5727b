"""Gymnasium environments for closed-loop evaluation; `hf_vla/ColorReach-v0` is the built-in demo task."""

import gymnasium as gym

from hf_vla.envs.reach import COLORS, ColorReachEnv, expert_action

ENV_ID = "hf_vla/ColorReach-v0"
if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="hf_vla.envs.reach:ColorReachEnv")

__all__ = ["COLORS", "ENV_ID", "ColorReachEnv", "expert_action"]
