"""`RLConfig`: the RL fields of `python -m hf_vla.rl` on top of `VLATrainingArguments` (TRL's `GRPOConfig` style:
each field documented where it is declared), and the defaults RL changes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hf_vla.errors import ConfigError
from hf_vla.training.training_args import VLATrainingArguments

ALGORITHMS = ("grpo", "ppo", "filtered_bc")
REWARDS = ("success", "dense")
EVAL_SEED = 10_000


@dataclass
class RLConfig(VLATrainingArguments):
    r"""
    Arguments of [`RLTrainer`]: `VLATrainingArguments` (so every `Trainer` argument) plus the rollout and policy-gradient
    settings. `max_steps` counts policy updates (optimizer steps).

    model_name_or_path (`str`): the policy to improve: an hf_vla output or checkpoint directory, a Hub id, a lerobot
        pi0.5 checkpoint (converted on load) or a LoRA adapter directory (merged with its base).
    model_revision (`str`, *optional*): its Hub revision.
    lora_preset (`str`, *optional*): `expert` or `all_linear`: train peft LoRA adapters (pi_RL uses rank 8) instead of
        the full model; `freeze="expert_only"` trains only the action expert.
    lora_r (`int`, defaults to 8), lora_alpha (`int`, *optional*, default 2r).
    env (`str`, *optional*): `metaworld`, `libero` or a gymnasium id; default the env the checkpoint's data was recorded
        in (its deployment contract).
    task (`str`, *optional*): the benchmark's tasks (as `hf_vla.evaluate --task`); default the recorded ones.
    env_kwargs (`dict`, *optional*): env arguments (`image_size`, `max_episode_steps` are taken from the contract).
    num_envs (`int`, defaults to 2): envs per task, each in a worker process; one batched policy call per control step.
    algorithm (`str`, defaults to `"grpo"`): `grpo`: group-relative advantages over the episodes of one env seed (GRPO,
        DeepSeekMath; SimpleVLA-RL and pi_RL's GRPO variant), no critic. `ppo`: a critic (`PI05ValueHead` on the VLM
        prefix, as pi_RL puts pi0.5's critic) and per-decision advantages by GAE over each episode's chunks (pi_RL's
        Flow-SDE PPO), whitened over the rollout batch. `filtered_bc`: no likelihood: supervised training's
        flow-matching loss on the executed chunks of the rollouts worth imitating: with `reward="success"` the
        episodes that succeeded, with `dense` those whose return beats their group's mean (rejection-sampling
        fine-tuning: RAFT, arXiv 2304.06767; ReST, arXiv 2308.08998; the usual baseline of RL for robot policies).
        It needs no likelihood, so `noise_level` may be 0 (rollouts with the deployed ODE sampler, exploring through
        the initial noise only).
    group_size (`int`, defaults to 8): episodes per env seed (TRL's `num_generations`); PPO needs no groups (1 is
        fine) but several episodes per seed still vary only in the policy's noise.
    groups_per_update (`int`, defaults to 2): env seeds per task and rank in each rollout batch.
    num_iterations (`int`, defaults to 1): optimizer steps on each rollout batch (TRL's `num_iterations`); beyond the
        first the update is off-policy and the clip range matters.
    epsilon (`float`, defaults to 0.2), epsilon_high (`float`, *optional*, default 0.28): the clip range
        `[1 - epsilon, 1 + epsilon_high]` of the likelihood ratio (DAPO's wider upper clip, as SimpleVLA-RL uses).
    beta (`float`, defaults to 0.0): weight of the KL to the start policy in the loss (TRL's default is 0 too); the KL
        is logged either way (`kl_to_start`) when `log_kl` is on.
    log_kl (`bool`, defaults to `True`): compute the KL of the rollouts' chains to the start policy (a frozen copy, or
        the base without adapters under LoRA).
    noise_level (`float`, defaults to 0.5): Flow-SDE's `a` in `sigma_t = a sqrt(t / (1 - t))` (Flow-GRPO: 0.7;
        RL.md: 0.5-0.7); exploration noise of the rollouts. Evaluation samples without it. 0 (`filtered_bc` only):
        the deterministic sampler, and no `kl_to_start` (a deterministic chain has no likelihood).
    noise_schedule (`str`, defaults to `"flow_sde"`): the rollouts' Gaussian steps (`hf_vla.rl.flow.FlowSDE`).
        `flow_sde`: Flow-GRPO's, which keep the deterministic sampler's marginals, so rollouts spread only as far as
        the policy's own distribution, at any `noise_level` (a policy that always makes the same choice then never
        tries another). `constant`: the Euler step plus noise of the same std `noise_level sqrt(1/K)` at every step
        (ReinFlow's noise injection with a fixed std): rollouts leave the policy's distribution.
    task_noise_levels (`dict`, *optional*): a noise level per task, `{"door-open-v3": 0.2}` (JSON on the command
        line), for the tasks named; the others keep `noise_level`. One level does not suit every task of a multi-task
        run: a level that lets one task explore can make another's rollouts fail where the deployed policy succeeds,
        and GRPO then optimises the noisy policy (docs/rl.md).
    denoise_steps (`int`, *optional*): denoising steps K of the rollouts and the likelihood; default the model's
        `num_inference_steps`, so the trained velocity is used as it is deployed.
    reward (`str`, defaults to `"success"`): an episode's return: `success` (0/1, as SimpleVLA-RL and pi_RL) or `dense`
        (the sum of the env's rewards, and for an episode that ended in success its last reward for each step left
        to the episode limit `max_episode_steps`, when it is known: the goal state as absorbing,
        `hf_vla.rl.flow.absorbing_bonus`; without it an env that ends episodes on success, as Meta-World does, pays
        more for lingering near the goal than for reaching it).
        Under PPO each decision's reward is the env's rewards over its executed steps (`dense`, the bonus discounted
        on the last decision) or 1 on the decision that succeeded (`success`).
    reward_scale (`float`, defaults to 1.0): multiplies every reward (Meta-World's dense reward is up to 10 per step:
        0.01 keeps the critic's targets near 1).
    gamma (`float`, defaults to 0.99), lam (`float`, defaults to 0.95): PPO's discount and GAE lambda per decision (one
        executed chunk), pi_RL's values.
    vf_coef (`float`, defaults to 0.5): weight of the critic's loss `0.5 (V - R)^2` in PPO's loss (TRL's default 0.1
        is for LM value heads; 0.5 is the PPO paper's).
    value_clip (`float`, *optional*): keep the critic within this distance of its rollout-time value in the loss
        (PPO2's value clipping, TRL's `cliprange_value`); None turns it off.
    critic_learning_rate (`float`, *optional*): the critic's own learning rate (its parameters in an optimizer group
        of their own, no weight decay); default `learning_rate`. A new critic starts at 0 and must catch up with the
        returns while the policy moves slowly: RL's small policy rates leave it barely trained.
    scale_rewards (`bool`, defaults to `True`): divide group-centred returns by the group's standard deviation.
    dynamic_sampling (`bool`, defaults to `True`): leave out groups whose episodes all have the same return (no
        signal; DAPO's dynamic sampling without the re-sampling), so they do not dilute the loss.
    episode_seed (`int`, defaults to 100000): the first env seed of the rollouts (recorded data starts at 0,
        evaluation at 10,000; both stay disjoint from rollouts for runs of < 90,000 seeds).
    eval_episodes (`int`, defaults to 10): held-out episodes per task at each evaluation (seeds from 10,000).
    bc_datasets (`list[dict]`, *optional*): expert data replayed beside the RL loss (`hf_vla.rl.replay`): LeRobot
        datasets as `python -m hf_vla.train`'s `datasets` (each named as in the policy's supervised training, so it
        is read with the policy's normalisation). Each micro-batch adds `bc_coef` times supervised training's loss on
        `per_device_train_batch_size` of their frames (DAPG's demonstration term): it keeps what supervised training
        taught while the rollouts move the policy. The stream's position is saved with every checkpoint.
    bc_coef (`float`, defaults to 1.0): weight of that supervised loss (with `bc_datasets`).
    max_train_minutes (`float`, *optional*): stop after the update during which this much wall-clock time has passed
        since training started (held-out evaluations not counted), with a checkpoint: a budget in minutes rather than
        updates, as benchmarks compare arms.
    """

    model_name_or_path: str | None = field(default=None, metadata={"help": "the policy to improve (dir, Hub id, "
                                                                          "lerobot pi0.5, LoRA adapter dir)"})
    model_revision: str | None = field(default=None, metadata={"help": "Hub revision of model_name_or_path"})
    lora_preset: str | None = field(default=None, metadata={"help": "expert | all_linear: LoRA instead of full"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (pi_RL: 8)"})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default 2r)"})
    env: str | None = field(default=None, metadata={"help": "metaworld | libero | gym id (default: the checkpoint's)"})
    task: str | None = field(default=None, metadata={"help": "the benchmark's tasks (default: the checkpoint's)"})
    env_kwargs: dict | None = field(default=None, metadata={"help": "env arguments"})
    num_envs: int = field(default=2, metadata={"help": "envs per task, each in a worker process"})
    algorithm: str = field(default="grpo", metadata={"help": f"one of {ALGORITHMS}"})
    group_size: int = field(default=8, metadata={"help": "episodes per env seed (GRPO group)"})
    groups_per_update: int = field(default=2, metadata={"help": "env seeds per task and rank per rollout batch"})
    num_iterations: int = field(default=1, metadata={"help": "optimizer steps per rollout batch"})
    epsilon: float = field(default=0.2, metadata={"help": "lower clip of the ratio: 1 - epsilon"})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "upper clip: 1 + epsilon_high"})
    beta: float = field(default=0.0, metadata={"help": "KL-to-start weight in the loss"})
    log_kl: bool = field(default=True, metadata={"help": "log the rollouts' KL to the start policy"})
    noise_level: float = field(default=0.5, metadata={"help": "Flow-SDE noise level a"})
    noise_schedule: str = field(default="flow_sde", metadata={"help": "flow_sde (keeps the policy's marginals) | "
                                                                       "constant (explores beyond them)"})
    task_noise_levels: dict | None = field(default=None, metadata={"help": "noise level per task, {task: level} "
                                                                           "(the others: noise_level)"})
    denoise_steps: int | None = field(default=None, metadata={"help": "denoising steps K (default: the model's)"})
    reward: str = field(default="success", metadata={"help": f"one of {REWARDS}"})
    reward_scale: float = field(default=1.0, metadata={"help": "multiplies every reward"})
    gamma: float = field(default=0.99, metadata={"help": "PPO: discount per decision"})
    lam: float = field(default=0.95, metadata={"help": "PPO: GAE lambda"})
    vf_coef: float = field(default=0.5, metadata={"help": "PPO: weight of the critic's loss"})
    value_clip: float | None = field(default=None, metadata={"help": "PPO: clip of the critic's change (None: off)"})
    critic_learning_rate: float | None = field(default=None, metadata={"help": "PPO: the critic's learning rate "
                                                                              "(default: learning_rate)"})
    scale_rewards: bool = field(default=True, metadata={"help": "divide advantages by the group's std"})
    dynamic_sampling: bool = field(default=True, metadata={"help": "drop groups with equal returns"})
    episode_seed: int = field(default=100_000, metadata={"help": "first env seed of the rollouts"})
    eval_episodes: int = field(default=10, metadata={"help": "held-out episodes per task per evaluation"})
    bc_datasets: list[dict] | None = field(default=None, metadata={"help": "expert datasets replayed beside the RL "
                                                                           "loss (as hf_vla.train's datasets)"})
    bc_coef: float = field(default=1.0, metadata={"help": "weight of the supervised loss on bc_datasets"})
    max_train_minutes: float | None = field(default=None, metadata={"help": "wall-clock budget of the updates"})

    # pi_RL's learning rate for pi0 / pi0.5 (full size); small policies trained from scratch take larger ones.
    learning_rate: float = 1e-5
    # An RL run is a few hundred updates whose value is unknown in advance: no warm-up, no decay.
    lr_scheduler_type: str = "constant"
    warmup_steps: float = 0
    max_steps: int = 100
    # Every update is a batch of episodes: log each.
    logging_steps: float = 1
    # Held-out success is what the run is for: evaluate before training and with every checkpoint, keep the best.
    eval_strategy: str = "steps"
    eval_steps: float = 10
    save_steps: float = 10
    eval_on_start: bool = True
    metric_for_best_model: str | None = "success"
    greater_is_better: bool | None = True
    save_total_limit: int | None = 2

    def _check_noise_level(self, name: str, level) -> None:
        number = isinstance(level, int | float) and not isinstance(level, bool) and math.isfinite(level)
        if self.algorithm == "filtered_bc":
            if not (number and level >= 0):
                raise ConfigError(f"{name}={level!r}: must be a number >= 0")
        elif not (number and level > 0):
            raise ConfigError(f"{name}={level!r}: must be a positive number (the rollouts' exploration noise; 0 "
                              "gives no likelihood to differentiate)")

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm={self.algorithm!r}: choose one of {ALGORITHMS}")
        if self.reward not in REWARDS:
            raise ConfigError(f"reward={self.reward!r}: choose one of {REWARDS}")
        for name in ("num_envs", "group_size", "groups_per_update", "num_iterations", "eval_episodes", "lora_r"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be positive")
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ConfigError(f"group_size={self.group_size}: GRPO compares episodes of one seed; use at least 2")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be in [0, 1]")
        if not (math.isfinite(self.reward_scale) and self.reward_scale > 0):
            raise ConfigError(f"reward_scale={self.reward_scale}: must be a positive number")
        if not (math.isfinite(self.vf_coef) and self.vf_coef >= 0):
            raise ConfigError(f"vf_coef={self.vf_coef}: must be a finite number >= 0")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ConfigError(f"value_clip={self.value_clip}: must be positive (or unset)")
        if self.critic_learning_rate is not None and not (math.isfinite(self.critic_learning_rate)
                                                          and self.critic_learning_rate >= 0):
            raise ConfigError(f"critic_learning_rate={self.critic_learning_rate}: must be a finite number >= 0")
        if self.image_augmentation != "none":  # the update recomputes the rollouts' own chains on what they saw
            raise ConfigError(f"image_augmentation={self.image_augmentation!r}: RL trains on the observations its "
                              "rollouts saw; augmentation is for supervised training (leave it 'none')")
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"epsilon={self.epsilon}: must be in (0, 1)")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if not self.epsilon_high > 0:
            raise ConfigError(f"epsilon_high={self.epsilon_high}: must be positive")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise ConfigError(f"beta={self.beta}: must be a finite number >= 0")
        # Every noise level, the run's and each task's, is a finite number; zero only under filtered_bc, the one
        # algorithm that needs no likelihood (the deterministic sampler explores through its initial noise alone).
        self._check_noise_level("noise_level", self.noise_level)
        if self.algorithm == "filtered_bc":
            if self.beta > 0:
                raise ConfigError(f"beta={self.beta}: filtered_bc has no likelihood ratio to hold near the start "
                                  "policy; leave beta 0 (a lower learning_rate keeps it close)")
            if self.reward == "dense" and self.group_size < 2:
                raise ConfigError(f"group_size={self.group_size}: filtered_bc with reward='dense' keeps the episodes "
                                  "above their group's mean; use at least 2")
        if self.task_noise_levels is not None:
            if not isinstance(self.task_noise_levels, dict) or not self.task_noise_levels:
                raise ConfigError(f"task_noise_levels={self.task_noise_levels!r}: a non-empty mapping of task names to "
                                  "noise levels, e.g. '{\"door-open-v3\": 0.2}', or unset")
            for task, level in self.task_noise_levels.items():
                self._check_noise_level(f"task_noise_levels[{task!r}]", level)
        from hf_vla.rl.flow import SCHEDULES

        if self.noise_schedule not in SCHEDULES:
            raise ConfigError(f"noise_schedule={self.noise_schedule!r}: choose one of {SCHEDULES}")
        if self.denoise_steps is not None and self.denoise_steps < 2:
            raise ConfigError(f"denoise_steps={self.denoise_steps}: the SDE sampler needs at least 2")
        if self.max_train_minutes is not None and not self.max_train_minutes > 0:
            raise ConfigError(f"max_train_minutes={self.max_train_minutes}: must be positive (or unset)")
        if not (math.isfinite(self.bc_coef) and self.bc_coef > 0):
            raise ConfigError(f"bc_coef={self.bc_coef}: must be a positive number (leave bc_datasets unset for no "
                              "expert term)")
        if self.bc_datasets is not None:
            from hf_vla.parser import check_dataset_specs

            if not isinstance(self.bc_datasets, list) or not self.bc_datasets:
                raise ConfigError(f"bc_datasets={self.bc_datasets!r}: a non-empty list of dataset objects (as "
                                  "hf_vla.train's datasets), or unset")
            self.bc_datasets = check_dataset_specs(self.bc_datasets, "bc_datasets")
        if self.beta > 0 and not self.log_kl:
            raise ConfigError("beta > 0 needs the start policy's means: leave log_kl on")
        super().__post_init__()
        if self.fsdp or self.deepspeed:
            raise ConfigError("RL fine-tuning runs under DDP (torchrun / accelerate launch --multi_gpu); FSDP and "
                              "DeepSpeed are not supported yet (the rollouts read the whole model on every rank)")
