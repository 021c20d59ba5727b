"""DAgger episodes: a policy acts in a simulator, the env's scripted expert labels every visited state.

Ross, Gordon and Bagnell (2011): train on the states the policy itself reaches, labelled with what the expert would do
there. `python -m hf_vla.record --policy CHECKPOINT --strategy dagger` runs these episodes and writes them with the
recorder's writer; `python -m hf_vla.train` then trains on the aggregate (the expert recording plus each round's).

At each control step the expert's action for the current state is the frame's label (`action`), and one of the two
acts:
- the policy, from its current chunk (receding horizon: `n_action_steps` actions of each chunk, as in evaluation);
- the expert, when the step is drawn for it (`beta`, the paper's mixture: each step independently, seeded by the
  episode seed), or when a gate hands it control for `takeover_steps` steps (HG-DAgger): the policy's action departs
  from the expert's by more than `takeover_threshold` (Euclidean, in the env's action units), or the episode's best
  reward has not risen for `stall_steps` steps. After the expert acted, the policy plans a new chunk from the state
  it is handed.

Each frame records who acted (`intervention`: 1 where the expert's action was executed) and what the policy proposed
(`policy_action`; the expert's action where the policy had no chunk of its own at a takeover step), and
`next.success` (lerobot's per-frame success flag: the env reported success at or before this step). Every episode is
kept, failures included: the labels are the expert's either way.

A chunked policy trains on chunks. The frames' labels strung together (`action` of frames t..t+H-1) are the expert's
reactions to the states the policy's own later actions led to, not what the expert would do from state t; where the
env can simulate its expert ahead (`expert_plan(H)`: Meta-World), each frame also records `action_plan`, the expert's
next H actions from that state (H: the policy's chunk size, flattened `[H x action_dim]`), and training reads it as the
frame's chunk with the dataset field `action_chunk_key: "action_plan"` (docs/deployment_data.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from hf_vla.errors import ConfigError

INTERVENTION, POLICY_ACTION, SUCCESS, ACTION_PLAN = "intervention", "policy_action", "next.success", "action_plan"


@dataclass
class DaggerSettings:
    """Who acts in a DAgger episode (see the module docstring); the defaults are plain DAgger with the policy always
    acting (beta 0)."""

    beta: float = 0.0  # probability that the expert acts at a step (each step drawn independently)
    takeover_threshold: float | None = None  # the expert takes over where |policy - expert| exceeds this
    takeover_steps: int = 10  # steps the expert keeps control once a gate handed it over
    stall_steps: int | None = None  # the expert takes over after this many steps without a new best reward

    def __post_init__(self):
        if not 0.0 <= self.beta <= 1.0:  # NaN fails this too
            raise ConfigError(f"--beta {self.beta}: the expert's share of the steps must be in [0, 1]")
        if self.takeover_threshold is not None and not (math.isfinite(self.takeover_threshold)
                                                        and self.takeover_threshold > 0):
            raise ConfigError(f"--takeover_threshold {self.takeover_threshold}: must be a positive finite number (an "
                              "action distance)")
        if self.takeover_steps < 1:
            raise ConfigError(f"--takeover_steps {self.takeover_steps}: must be at least 1")
        if self.stall_steps is not None and self.stall_steps < 1:
            raise ConfigError(f"--stall_steps {self.stall_steps}: must be at least 1")

    def to_dict(self) -> dict:
        return asdict(self)


def dagger_episodes(env, policy, n_action_steps: int, count: int, seeds: Iterator[int], settings: DaggerSettings,
                    camera: str, state: str, stats: dict | None = None, bar=None,
                    episodes: list | None = None, text=None, plan_steps: int | None = None) -> Iterator[list[dict]]:
    """`count` episodes in `env` (which has `expert_action()`), the policy (`reset(seed=)`, `policy(observation, task)
    -> chunk`) acting as `settings` say, each a list of frames in the recorder's format with the expert's label as
    `action`. Per-episode summaries (seed, success, steps, expert steps) are appended to `episodes`; `stats` counts
    `kept`, `successes`, `frames` and `expert_steps`. `text(env)`, when given, is each frame's per-frame text columns
    (Meta-World's locations, as the expert recording has them). `plan_steps`: also record each frame's
    `action_plan`, the env's `expert_plan(plan_steps)` flattened."""
    stats = stats if stats is not None else {}
    for key in ("kept", "successes", "frames", "expert_steps"):
        stats.setdefault(key, 0)
    for _ in range(count):
        seed = next(seeds, None)
        if seed is None:
            break
        frames, success, expert_steps = _episode(env, policy, n_action_steps, int(seed), settings, camera, state,
                                                 text, plan_steps)
        stats["kept"] += 1
        stats["successes"] += success
        stats["frames"] += len(frames)
        stats["expert_steps"] += expert_steps
        if episodes is not None:
            episodes.append({"seed": int(seed), "success": success, "steps": len(frames), "expert_steps": expert_steps})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(success=f"{stats['successes']}/{stats['kept']}")
        yield frames


def _episode(env, policy, n_action_steps: int, seed: int, settings: DaggerSettings, camera: str, state: str, text,
             plan_steps: int | None = None):
    observation, info = env.reset(seed=seed)
    if hasattr(policy, "reset"):
        policy.reset(seed=seed)
    task = info.get("task") or getattr(env, "task", "")
    draws = np.random.default_rng([seed, 0xDA66E])  # the beta mixture: a function of the episode seed alone
    frames, queue = [], []
    takeover, best, since_best, success, done, expert_steps = 0, -np.inf, 0, False, False, 0
    while not done:
        expert = np.asarray(env.expert_action(), dtype=np.float32)
        if not queue and not takeover:
            queue = [np.asarray(a, dtype=np.float32) for a in np.asarray(policy(observation, task))[:n_action_steps]]
        proposed = queue[0] if queue else expert
        by_expert = takeover > 0
        if not by_expert and settings.takeover_threshold is not None and \
                float(np.linalg.norm(proposed - expert)) > settings.takeover_threshold:
            by_expert, takeover = True, settings.takeover_steps
        if not by_expert and settings.stall_steps is not None and since_best >= settings.stall_steps:
            by_expert, takeover, since_best = True, settings.takeover_steps, 0
        if not by_expert and settings.beta > 0 and draws.random() < settings.beta:
            by_expert = True
        if takeover:
            takeover -= 1
        if by_expert:
            queue = []  # the policy plans again from the state the expert leaves it in
            expert_steps += 1
        else:
            queue.pop(0)
        frames.append({"images": {camera: observation[camera]}, "state": observation[state], "action": expert,
                       "task": task, "extra": {INTERVENTION: np.array([int(by_expert)], np.int64),
                                               POLICY_ACTION: proposed.astype(np.float32)}})
        if text is not None:
            frames[-1]["text"] = text(env)
        if plan_steps:  # the expert's own chunk from this state: the chunked policy's target here
            frames[-1]["extra"][ACTION_PLAN] = np.asarray(env.expert_plan(plan_steps), np.float32).reshape(-1)
        observation, reward, terminated, truncated, info = env.step(expert if by_expert else proposed)
        success = success or bool(info.get("is_success", False))
        frames[-1]["extra"][SUCCESS] = np.array([success], dtype=bool)
        if float(reward) > best:
            best, since_best = float(reward), 0
        else:
            since_best += 1
        done = terminated or truncated
    return frames, success, expert_steps


def dagger_features(action_dim: int, plan_steps: int | None = None) -> dict[str, dict]:
    """The columns a DAgger recording adds to the recorder's (lerobot feature specs)."""
    features = {INTERVENTION: {"dtype": "int64", "shape": (1,), "names": None},
                POLICY_ACTION: {"dtype": "float32", "shape": (action_dim,),
                                "names": [f"a{i}" for i in range(action_dim)]},
                SUCCESS: {"dtype": "bool", "shape": (1,), "names": None}}
    if plan_steps:
        features[ACTION_PLAN] = {"dtype": "float32", "shape": (plan_steps * action_dim,),
                                 "names": [f"t{t}_a{i}" for t in range(plan_steps) for i in range(action_dim)]}
    return features


__all__ = ["ACTION_PLAN", "DaggerSettings", "dagger_episodes", "dagger_features"]
