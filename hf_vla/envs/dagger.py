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

Each frame records who acted (`intervention`: 1 where the expert's action was executed), what the policy proposed
(`policy_action`; the expert's action where the policy had no chunk of its own at a takeover step), what the env ran
(`executed_action`: the expert's action at an intervention, the policy's elsewhere; RECAP trains on it), and
`next.success` (lerobot's per-frame success flag: the env reported success at or before this step). Every episode is
kept, failures included: the labels are the expert's either way.

A chunked policy trains on chunks. The frames' labels strung together (`action` of frames t..t+H-1) are the expert's
reactions to the states the policy's own later actions led to, not what the expert would do from state t; where the
env can simulate its expert ahead (`expert_plan(H)`: Meta-World), each frame also records `action_plan`, the expert's
next H actions from that state (H: the policy's chunk size, flattened `[H x action_dim]`), and training reads it as the
frame's chunk with the dataset field `action_chunk_key: "action_plan"` (docs/deployment_data.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from hf_vla.errors import ConfigError

INTERVENTION, POLICY_ACTION, SUCCESS, ACTION_PLAN = "intervention", "policy_action", "next.success", "action_plan"
EXECUTED_ACTION = "executed_action"


@dataclass
class DaggerSettings:
    """Who acts in a DAgger episode (see the module docstring); the defaults are plain DAgger with the policy always
    acting (beta 0)."""

    beta: float = 0.0  # probability that the expert acts at a step (each step drawn independently)
    takeover_threshold: float | None = None  # the expert takes over where |policy - expert| exceeds this
    takeover_steps: int = 10  # steps the expert keeps control once a gate handed it over
    stall_steps: int | None = None  # the expert takes over after this many steps without a new best reward
    # False: `hf_vla.record --strategy policy`, the policy alone; no expert is consulted (an env without one works)
    # and each frame's `action` is the one the policy executed (RECAP learns from these; docs/recap.md)
    expert_labels: bool = True

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


def dagger_episodes(actor: DaggerActor, count: int, seeds: Iterator[int], stats: dict | None = None, bar=None,
                    episodes: list | None = None) -> Iterator[list[dict]]:
    """`count` episodes in the actor's env (which has `expert_action()`), its policy acting as its settings say, run
    by the episode loop (`EpisodeRunner`), each a list of frames in the recorder's format with the expert's label as
    `action`. Per-episode summaries (seed, success, steps, expert steps) are appended to `episodes`; `stats` counts
    `kept`, `successes`, `frames` and `expert_steps`."""
    from hf_vla.envs.episodes import EpisodeRunner

    stats = stats if stats is not None else {}
    for key in ("kept", "successes", "frames", "expert_steps"):
        stats.setdefault(key, 0)
    if count <= 0:
        return
    runner = EpisodeRunner([actor.env], actor, n_action_steps=1)
    for episode in runner.episodes(int(seed) for seed in itertools.islice(seeds, count)):
        frames, expert_steps = episode.log
        stats["kept"] += 1
        stats["successes"] += episode.success
        stats["frames"] += len(frames)
        stats["expert_steps"] += expert_steps
        if episodes is not None:
            episodes.append({"seed": episode.seed, "success": episode.success, "steps": len(frames),
                             "expert_steps": expert_steps})
        if bar is not None:
            bar.update(1)
            bar.set_postfix(success=f"{stats['successes']}/{stats['kept']}")
        yield frames


class DaggerActor:
    """The acting side of a DAgger episode as a one-action policy for the episode loop: at each step the policy's
    next action (from its chunk of `n_action_steps`) or the expert's, as `settings` say (see the module docstring);
    every step's frame, labelled with the expert's action, is kept for the episode's log `(frames, expert_steps)`.

    `policy`: `reset(seed=)`, `policy(observation, task) -> chunk`; `camera` / `state`: the recorded keys; `text(env)`,
    when given, is each frame's per-frame text columns (Meta-World's locations, as the expert recording has them);
    `plan_steps`: also record each frame's `action_plan`, the env's `expert_plan(plan_steps)` flattened."""

    def __init__(self, env, policy, n_action_steps: int, settings: DaggerSettings, camera: str | tuple[str, ...], state: str,
                 text=None, plan_steps: int | None = None):
        self.env, self.policy, self.n_action_steps, self.settings = env, policy, n_action_steps, settings
        self.cameras = (camera,) if isinstance(camera, str) else tuple(camera)  # every recorded camera's key
        self.state, self.text, self.plan_steps = state, text, plan_steps
        self._fresh(seed=0)

    def reset(self, seed: int = 0):
        if hasattr(self.policy, "reset"):
            self.policy.reset(seed=seed)
        self._fresh(seed)

    def _fresh(self, seed: int) -> None:
        self.draws = np.random.default_rng([seed, 0xDA66E])  # the beta mixture: a function of the episode seed alone
        self.frames, self.queue = [], []
        self.takeover, self.best, self.since_best, self.success, self.expert_steps = 0, -np.inf, 0, False, 0

    def __call__(self, observation, task):
        settings = self.settings
        if not settings.expert_labels:
            return self._policy_alone(observation, task)
        expert = np.asarray(self.env.expert_action(), dtype=np.float32)
        if not self.queue and not self.takeover:
            chunk = np.asarray(self.policy(observation, task))[:self.n_action_steps]
            self.queue = [np.asarray(a, dtype=np.float32) for a in chunk]
        else:
            self._observe(observation)
        proposed = self.queue[0] if self.queue else expert
        by_expert = self.takeover > 0
        if not by_expert and settings.takeover_threshold is not None and \
                float(np.linalg.norm(proposed - expert)) > settings.takeover_threshold:
            by_expert, self.takeover = True, settings.takeover_steps
        if not by_expert and settings.stall_steps is not None and self.since_best >= settings.stall_steps:
            by_expert, self.takeover, self.since_best = True, settings.takeover_steps, 0
        if not by_expert and settings.beta > 0 and self.draws.random() < settings.beta:
            by_expert = True
        if self.takeover:
            self.takeover -= 1
        if by_expert:
            self.queue = []  # the policy plans again from the state the expert leaves it in
            self.expert_steps += 1
        else:
            self.queue.pop(0)
        frame = {"images": {key: observation[key] for key in self.cameras}, "state": observation[self.state],
                 "action": expert, "task": task,
                 "extra": {INTERVENTION: np.array([int(by_expert)], np.int64),
                           POLICY_ACTION: proposed.astype(np.float32),
                           EXECUTED_ACTION: (expert if by_expert else proposed).astype(np.float32)}}
        if self.text is not None:
            frame["text"] = self.text(self.env)
        if self.plan_steps:  # the expert's own chunk from this state: the chunked policy's target here
            frame["extra"][ACTION_PLAN] = np.asarray(self.env.expert_plan(self.plan_steps), np.float32).reshape(-1)
        self.frames.append(frame)
        return (expert if by_expert else proposed)[None]

    def _policy_alone(self, observation, task):
        """The policy acts at every step and its action is the frame's label (`--strategy policy`)."""
        if not self.queue:
            chunk = np.asarray(self.policy(observation, task))[:self.n_action_steps]
            self.queue = [np.asarray(a, dtype=np.float32) for a in chunk]
        else:
            self._observe(observation)
        action = self.queue.pop(0)
        frame = {"images": {key: observation[key] for key in self.cameras}, "state": observation[self.state],
                 "action": action, "task": task,
                 "extra": {INTERVENTION: np.array([0], np.int64), POLICY_ACTION: action.astype(np.float32),
                           EXECUTED_ACTION: action.astype(np.float32)}}
        if self.text is not None:
            frame["text"] = self.text(self.env)
        self.frames.append(frame)
        return action[None]

    def _observe(self, observation) -> None:
        """A step without a policy call: a MEM policy still keeps the observation (`PolicyRunner.observe`)."""
        if getattr(self.policy, "memory", None) is not None:
            self.policy.observe(observation)

    def after_step(self, action, outcome) -> None:
        _, reward, _, _, info = outcome
        self.success = self.success or bool(info.get("is_success", False))
        self.frames[-1]["extra"][SUCCESS] = np.array([self.success], dtype=bool)
        if float(reward) > self.best:
            self.best, self.since_best = float(reward), 0
        else:
            self.since_best += 1

    def episode_log(self) -> tuple[list[dict], int]:
        return self.frames, self.expert_steps


def dagger_features(action_dim: int, plan_steps: int | None = None) -> dict[str, dict]:
    """The columns a DAgger recording adds to the recorder's (lerobot feature specs)."""
    features = {INTERVENTION: {"dtype": "int64", "shape": (1,), "names": None},
                POLICY_ACTION: {"dtype": "float32", "shape": (action_dim,),
                                "names": [f"a{i}" for i in range(action_dim)]},
                EXECUTED_ACTION: {"dtype": "float32", "shape": (action_dim,),
                                  "names": [f"a{i}" for i in range(action_dim)]},
                SUCCESS: {"dtype": "bool", "shape": (1,), "names": None}}
    if plan_steps:
        features[ACTION_PLAN] = {"dtype": "float32", "shape": (plan_steps * action_dim,),
                                 "names": [f"t{t}_a{i}" for t in range(plan_steps) for i in range(action_dim)]}
    return features


__all__ = ["ACTION_PLAN", "EXECUTED_ACTION", "DaggerActor", "DaggerSettings", "dagger_episodes", "dagger_features"]
