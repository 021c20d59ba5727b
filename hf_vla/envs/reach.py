"""ColorReach: the built-in language-conditioned visual task.

A point agent (white square) and several coloured targets are drawn in a small RGB image; the instruction names
one colour ("move to the red target"). Only the image tells where the targets are and only the instruction tells
which one to reach, so a policy must use both. Observations are LeRobot-style: `observation.image` (HxWx3 uint8)
and `observation.state` (the agent's xy in [-1, 1]); the task string is `env.unwrapped.task` and `info["task"]`.
Actions are xy displacements, clipped to `step_size`.

`layout="corners"` (the default) places the targets on 3 of 4 fixed corner spots with random colours, so finding a
target is easy for a small vision tower while choosing it still needs the instruction; `layout="random"` scatters
them anywhere. `start="random"` (the default) starts the agent anywhere at least 0.35 from every target;
`start="center"` always at the centre.

`cue_steps=k` (> 0) makes a task that needs memory (docs/memory.md): the instruction no longer names the colour ("move
to the target shown first"), and the first k frames show the goal target alone; from then on every target is drawn,
so a single later frame cannot tell which one to reach.

Why random starts: from a fixed start, every frame after the first shows how far the agent has already moved, and
the state alone then tells which way to keep going. Only first frames would need the instruction, a small share of
the training signal. With random starts every frame needs both the instruction and the image.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

ROBOT_TYPE = "color_reach"  # the robot type of ColorReach's recordings (the demo data)
COLORS = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 40),
}
BACKGROUND = 90
CORNERS = np.array([[-0.6, 0.6], [0.6, 0.6], [-0.6, -0.6], [0.6, -0.6]])


class ColorReachEnv(gym.Env):
    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, image_size: int = 32, num_targets: int = 3, max_steps: int = 40, step_size: float = 0.1,
                 success_radius: float = 0.18, layout: str = "corners", start: str = "random",
                 render_mode: str = "rgb_array", cue_steps: int = 0):
        if num_targets > len(COLORS):
            raise ValueError(f"num_targets={num_targets}: at most {len(COLORS)} colours")
        if layout not in ("corners", "random"):
            raise ValueError(f"layout={layout!r}: 'corners' or 'random'")
        if start not in ("center", "random"):
            raise ValueError(f"start={start!r}: 'center' or 'random'")
        if cue_steps < 0:
            raise ValueError(f"cue_steps={cue_steps}: 0 (the instruction names the colour) or more frames of cue")
        self.layout, self.start, self.cue_steps = layout, start, int(cue_steps)
        self.image_size, self.num_targets, self.max_steps = image_size, num_targets, max_steps
        self.step_size, self.success_radius, self.render_mode = step_size, success_radius, render_mode
        self.observation_space = spaces.Dict({
            "observation.image": spaces.Box(0, 255, (image_size, image_size, 3), np.uint8),
            "observation.state": spaces.Box(-1.0, 1.0, (2,), np.float32),
        })
        self.action_space = spaces.Box(-step_size, step_size, (2,), np.float32)
        self.task = ""

    # ---- dynamics ------------------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        rng = self.np_random
        names = list(rng.choice(list(COLORS), size=self.num_targets, replace=False))
        positions: list[np.ndarray] = []
        if self.layout == "corners":
            positions = [CORNERS[i].copy() for i in rng.choice(len(CORNERS), size=self.num_targets, replace=False)]
        while len(positions) < self.num_targets:
            candidate = rng.uniform(-0.75, 0.75, size=2)
            if all(np.linalg.norm(candidate - p) > 0.45 for p in positions):
                positions.append(candidate)
        self.targets = dict(zip(names, positions))
        self.goal = str(names[rng.integers(self.num_targets)])
        while True:
            agent = np.zeros(2) if self.start == "center" else rng.uniform(-0.85, 0.85, size=2)
            if min(np.linalg.norm(agent - p) for p in positions) > 0.35:
                break
        self.agent = agent.astype(np.float32)
        self.steps = 0
        self.task = "move to the target shown first" if self.cue_steps else f"move to the {self.goal} target"
        return self._observation(), {"task": self.task, "is_success": False}

    def distance(self) -> float:
        return float(np.linalg.norm(self.agent - self.targets[self.goal]))

    def step(self, action):
        action = np.asarray(action, dtype=np.float32).reshape(2)
        norm = float(np.linalg.norm(action))
        if norm > self.step_size:
            action = action * (self.step_size / norm)
        self.agent = np.clip(self.agent + action, -1.0, 1.0).astype(np.float32)
        self.steps += 1
        success = self.distance() < self.success_radius
        truncated = self.steps >= self.max_steps and not success
        info = {"task": self.task, "is_success": success}
        return self._observation(), float(success), success, truncated, info

    # ---- rendering -----------------------------------------------------------------------------------------------
    def _pixel(self, xy) -> tuple[float, float]:
        scale = (self.image_size - 1) / 2
        return (xy[0] + 1) * scale, (1 - xy[1]) * scale  # column, row

    def render(self) -> np.ndarray:
        size = self.image_size
        image = np.full((size, size, 3), BACKGROUND, dtype=np.uint8)
        rows, cols = np.mgrid[0:size, 0:size]
        radius = 0.09 * size
        cue = self.steps < self.cue_steps  # the cue: the goal alone in the first frames
        for name, position in self.targets.items():
            if cue and name != self.goal:
                continue
            col, row = self._pixel(position)
            image[(rows - row) ** 2 + (cols - col) ** 2 <= radius**2] = COLORS[name]
        col, row = self._pixel(self.agent)
        half = max(1.5, 0.04 * size)
        image[(np.abs(rows - row) <= half) & (np.abs(cols - col) <= half)] = 255
        return image

    def _observation(self) -> dict:
        return {"observation.image": self.render(), "observation.state": self.agent.copy()}


def expert_action(env: ColorReachEnv, rng: np.random.Generator, noise: float = 0.01) -> np.ndarray:
    """Scripted expert: straight to the goal at full speed, slowing down on arrival, with a little noise."""
    delta = env.targets[env.goal] - env.agent
    distance = float(np.linalg.norm(delta))
    action = delta / max(distance, 1e-8) * min(env.step_size, distance)
    return (action + rng.normal(0, noise, size=2)).astype(np.float32)


class ColorReachWithExpert:
    """ColorReach with its scripted expert as `expert_action()` (one seeded generator for the expert's noise).

    `decoy=True` (RECAP's mechanism test, docs/recap.md): the expert drives to another target than the one the
    instruction names (drawn per episode from its generator), and the episode ends, "successful" for the recorder,
    when it reaches that one: demonstrations of ignoring the instruction, which a dataset entry marks as failures
    (`success: false`)."""

    def __init__(self, seed: int, decoy: bool = False, **env_kwargs):
        self.env = ColorReachEnv(**env_kwargs)
        self.rng = np.random.default_rng(seed)
        self.metadata = self.env.metadata
        self.decoy = bool(decoy)
        self.target: str | None = None  # the target the expert drives to

    def __getattr__(self, name):
        if name == "env" or name.startswith("__"):  # not set yet (a copy being built): no recursion through it
            raise AttributeError(name)
        return getattr(self.env, name)

    def reset(self, seed=None):
        observation, info = self.env.reset(seed=seed)
        others = [name for name in self.env.targets if name != self.env.goal]
        self.target = str(others[self.rng.integers(len(others))]) if self.decoy else self.env.goal
        return observation, info

    def step(self, action):
        observation, reward, terminated, truncated, info = self.env.step(action)
        if self.decoy:  # the episode is the decoy's: it ends where the expert arrives, never at the named target
            reached = float(np.linalg.norm(self.env.agent - self.env.targets[self.target])) < self.env.success_radius
            terminated, reward, info = reached, float(reached), dict(info, is_success=reached)
            truncated = self.env.steps >= self.env.max_steps and not reached
        return observation, reward, terminated, truncated, info

    def expert_action(self):
        if not self.decoy:
            return expert_action(self.env, self.rng)
        delta = self.env.targets[self.target] - self.env.agent
        distance = float(np.linalg.norm(delta))
        action = delta / max(distance, 1e-8) * min(self.env.step_size, distance)
        return (action + self.rng.normal(0, 0.01, size=2)).astype(np.float32)


def recording_plan(tasks: str | None, image_size: int | None, max_episode_steps: int | None, env_kwargs: dict | None,
                   seed: int):
    """What `hf_vla.record` records: one env with its scripted expert (the instruction is drawn per episode, so there
    is no task to choose, and Meta-World's crop, action mode and cameras do not apply)."""
    from hf_vla.errors import ConfigError
    from hf_vla.registry import RecordingPlan

    if "cue_steps" in (env_kwargs or {}) and int(env_kwargs["cue_steps"]) < 0:
        raise ConfigError(f"--cue_steps {env_kwargs['cue_steps']}: frames of cue, 0 or more")
    for key, why in (("crop", "ColorReach renders its 32 px scene whole"),
                     ("action_mode", "ColorReach's actions are its own"), ("cameras", "ColorReach draws one image")):
        if (env_kwargs or {}).get(key) is not None:
            raise ConfigError(f"--{key}: Meta-World only ({why})")
    if tasks:
        raise ConfigError("--task: ColorReach draws its instruction per episode; it has no task to choose")
    kwargs = dict(env_kwargs or {})
    decoy = bool(kwargs.pop("decoy", False))  # the expert's choice, not the env's: not recorded as an env argument
    if image_size:
        kwargs["image_size"] = image_size
    if max_episode_steps:
        kwargs["max_steps"] = max_episode_steps
    probe = ColorReachEnv(**kwargs)
    return RecordingPlan(["color_reach"], {"color_reach": lambda: ColorReachWithExpert(seed, decoy=decoy, **kwargs)},
                         fps=probe.metadata["render_fps"], state_dim=2, action_dim=2, robot_type=ROBOT_TYPE,
                         image_size=probe.image_size, default_steps=probe.max_steps,
                         env_kwargs={k: v for k, v in kwargs.items() if k not in ("image_size", "max_steps")})
