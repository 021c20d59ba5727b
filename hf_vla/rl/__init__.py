"""Reinforcement-learning fine-tuning of flow policies from their own rollouts (`python -m hf_vla.rl`).

- `flow`: Flow-SDE (the Euler sampler as Gaussian steps with an exact chain likelihood), GRPO advantages, GAE and the
  critic's loss (PPO), the clipped objective;
- `rollout`: the stochastic policy and the envs of a run, through the episode loop evaluation uses;
- `config`: `RLConfig` (extends `VLATrainingArguments`);
- `trainer`: `RLTrainer` (extends `VLATrainer`, as TRL's trainers extend `Trainer`), with its rollout collection
  (`collection`) and reporting (`reporting`).
"""

from hf_vla.rl.flow import FlowSDE
from hf_vla.rl.rollout import RolloutEngine, StochasticPolicy, Transition
from hf_vla.rl.trainer import RLConfig, RLTrainer

__all__ = ["FlowSDE", "RLConfig", "RLTrainer", "RolloutEngine", "StochasticPolicy", "Transition"]
