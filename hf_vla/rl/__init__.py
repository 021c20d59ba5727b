"""Reinforcement-learning fine-tuning of flow policies from their own rollouts (`python -m hf_vla.rl`).

- `flow`: Flow-SDE (the Euler sampler as Gaussian steps with an exact chain likelihood), GRPO advantages, GAE and the
  critic's loss (PPO), the clipped objective;
- `rollout`: the stochastic policy and the envs of a run, through the episode loop evaluation uses;
- `config`: `RLConfig` (extends `VLATrainingArguments`);
- `trainer`: `RLTrainer` (extends `VLATrainer`, as TRL's trainers extend `Trainer`), with its rollout collection
  (`collection`) and reporting (`reporting`).
"""

from hf_vla.cli import lazy_attributes

# loaded on first use: `python -m hf_vla.rl --help` runs this package first and answers before torch is imported
_PUBLIC = {"FlowSDE": ".flow", "RolloutEngine": ".rollout", "StochasticPolicy": ".rollout", "Transition": ".rollout",
           "RLConfig": ".trainer", "RLTrainer": ".trainer"}
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_attributes(__name__, _PUBLIC)
