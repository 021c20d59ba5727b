"""`RLTrainer`: reinforcement-learning fine-tuning of a flow policy from its own rollouts, a sibling of TRL's
`GRPOTrainer` built on the SFT trainer (`VLATrainer`).

Where TRL generates completions for prompts, this trainer rolls the policy out in envs: in `_prepare_inputs`, every
`num_iterations` optimizer steps, each rank runs `groups_per_update` env seeds per task, `group_size` episodes from each
seed (differing in the policy's noise), with the stochastic Flow-SDE sampler (`hf_vla.rl.flow`), and keeps every policy
decision (one executed chunk) with its denoising chain and log-probability. Advantages are group-relative (GRPO) over
the episodes of one seed, or (PPO) GAE per decision with a critic on the VLM prefix (`PI05ValueHead`); the loss, in
`compute_loss`, is the clipped surrogate on each denoising step's likelihood ratio (plus the critic's loss under PPO).
`filtered_bc` instead trains supervised training's flow-matching loss on the chunks of the episodes worth imitating
(rejection-sampling fine-tuning), the baseline a likelihood-ratio method has to beat on the same rollouts.
Everything else is `VLATrainer`'s and so `Trainer`'s: the optimizer (fp32 master weights for bf16), the schedule,
logging and `report_to`, the checkpoint format and run lock, the NaN guard, preemption (exit 75, resume), EMA, LoRA
through peft, the Hub push. Evaluation (`evaluate`) runs held-out seeds (from 10,000, never rolled out)
with the deterministic sampler the policy is deployed with, and the best checkpoint by held-out success is kept
(`metric_for_best_model="success"`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from ..errors import ConfigError, NonFiniteError
from ..trainer import VLATrainer, VLATrainingArguments
from .flow import (
    FlowSDE,
    absorbing_bonus,
    chain_means,
    clipped_objective,
    gae,
    group_advantages,
    step_kl,
    step_log_probs,
    value_loss,
)

logger = logging.getLogger("hf_vla.rl")
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
        run: on Meta-World at constant noise 0.5 the start's door-open rollouts succeed 70% against 92% deployed, and
        GRPO then optimises the noisy policy, while drawer-open needs that noise to explore (docs/measurements.md).
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
        from .flow import SCHEDULES

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
            from ..validation import check_dataset_specs

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


class TimeBudget(TrainerCallback):
    """Stops training (with a checkpoint) after the update during which `max_train_minutes` of training time passed;
    the time held-out evaluations take is not counted. Every rank stops at the same update (rank 0's clock decides)."""

    def __init__(self, trainer):
        self.trainer, self.started, self.evaluating = trainer, None, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluating += float((metrics or {}).get("eval_runtime", 0.0))

    def on_step_end(self, args, state, control, **kwargs):
        spent = torch.tensor([(time.perf_counter() - self.started - self.evaluating) / 60], device=args.device)
        if self.trainer.accelerator.num_processes > 1:
            spent = self.trainer.accelerator.reduce(spent, reduction="max")
        for callback in self.trainer.callback_handler.callbacks:  # the budget beside the updates on the progress bar
            if isinstance(callback, ProgressCallback) and callback.training_bar is not None:
                callback.training_bar.set_postfix_str(f"{spent.item():.1f} of {args.max_train_minutes:g} min")
        if spent.item() >= args.max_train_minutes:
            logger.info("max_train_minutes=%g reached after update %d: saving and stopping", args.max_train_minutes,
                        state.global_step)
            control.should_save, control.should_training_stop = True, True
            self.trainer.stopped_by = f"max_train_minutes={args.max_train_minutes:g}"
        return control


class UpdateStream(IterableDataset):
    """What the Trainer iterates: one empty item per micro-batch. The rollouts are made in `_prepare_inputs` from the
    step count (each rank its own seeds), so they have no position of their own to save; the expert data replayed
    beside them (`replay`, one batch per micro-batch) has, and the trainer's checkpoints save and restore it here."""

    def __init__(self, replay=None):
        self.replay = replay

    @property
    def provenance(self):
        return getattr(self.replay, "provenance", None)

    @property
    def num_workers(self) -> int:  # the replay stream's DataLoader workers: part of its shard layout
        return self.replay.num_workers if self.replay is not None else 0

    @num_workers.setter
    def num_workers(self, value: int):
        if self.replay is not None:
            self.replay.num_workers = value

    def __iter__(self):
        while True:
            yield {}

    def state_dict(self) -> dict:
        return self.replay.state_dict() if self.replay is not None else {}

    def load_state_dict(self, state: dict, on_data_change: str = "error"):
        if self.replay is None:
            return None
        return self.replay.load_state_dict(state, on_data_change=on_data_change)


def _identity(item):
    return item


def check_model_type(model_type: str | None, args: RLConfig) -> None:
    """`ConfigError` unless RL can train a model of `model_type` with `args.algorithm` (checked from the config
    alone, so `python -m hf_vla.rl` refuses before loading the weights)."""
    if model_type not in ("pi05", "pi0"):
        raise ConfigError(f"RL fine-tuning samples through a pi0 / pi0.5 prefix cache; model type {model_type!r} is "
                          "not supported")
    if model_type == "pi0" and args.algorithm == "ppo":
        raise ConfigError("algorithm='ppo' needs a critic on the VLM prefix, which hf_vla builds for pi0.5 "
                          "(PI05ValueHead); transformers' pi0 has none: use algorithm='grpo' for pi0")


class RLTrainer(VLATrainer):
    """Improves a flow policy (pi0.5) from its own rollouts (GRPO, or PPO with a critic); see the module's docstring.

        trainer = RLTrainer(model, RLConfig(output_dir=..., env="metaworld", task="reach-v3"),
                            processing_class=processor, peft_config=lora_config("expert", r=8, model=model))
        trainer.train()

    `processing_class` is the policy's `PI05Processor` (normalisation, prompt, deployment contract); `engine` an
    `hf_vla.rl.RolloutEngine` to use instead of the one built from `args` (tests).
    """

    def __init__(self, model, args: RLConfig, processing_class=None, peft_config=None, engine=None, callbacks=None):
        if not isinstance(args, RLConfig):
            raise TypeError("RLTrainer needs an RLConfig")
        check_model_type(getattr(getattr(model, "config", None), "model_type", None), args)
        if getattr(model.config, "token_loss", False):
            # a policy trained with pi0.5's token objective improves by its flow policy's objective alone (and its
            # replayed flow loss): the backbone's target-token path takes no part, so it is frozen as in flow-only
            # training, and the saved result says token_loss false (a later token-loss run re-enables it)
            model.config.token_loss = False
            model.model.freeze_unused()
            logger.info("token_loss policy: RL trains its flow objective; the target-token path is frozen")
        from .settings import rollout_settings

        self.rl_settings = rollout_settings(args, processing_class, model.config)
        unknown = sorted(set(args.task_noise_levels or {}) - set(self.rl_settings["tasks"]))
        if unknown:
            raise ConfigError(f"task_noise_levels names {unknown}, not tasks of this run; its tasks: "
                              f"{[t for t in self.rl_settings['tasks'] if t]}")
        reference = None
        if args.log_kl and peft_config is None:  # the start policy, frozen (under LoRA: the base, adapters off)
            import copy

            reference = copy.deepcopy(model).eval().requires_grad_(False)
        if args.algorithm == "ppo":  # the critic: the checkpoint's (a PPO run's output) or a new one predicting 0
            model.add_value_head()
            if peft_config is not None:  # under LoRA the critic trains in full, as the action/time heads do
                peft_config.modules_to_save = sorted(set(peft_config.modules_to_save or []) | {"value_head"})
        replay, self._replay_collate, self._replay_batches = None, None, None
        if args.bc_datasets:  # the expert data replayed beside the RL loss (hf_vla.rl.replay)
            from .replay import replay_stream

            replay, self._replay_collate = replay_stream(args, processing_class, model.config)
        super().__init__(model, args, train_dataset=UpdateStream(replay), eval_dataset=UpdateStream(),
                         data_collator=_identity, processing_class=processing_class, peft_config=peft_config,
                         callbacks=callbacks)
        self.reference = reference
        self.sde = FlowSDE(args.denoise_steps or model.config.num_inference_steps, args.noise_level,
                           args.noise_schedule)
        settings = self.rl_settings
        if engine is None:
            from .rollout import RolloutEngine

            engine = RolloutEngine(settings["env"], settings["tasks"], args.num_envs, settings["env_kwargs"],
                                   settings["n_action_steps"], model.config.chunk_size)
        self.engine = engine
        if args.max_train_minutes is not None:
            self.add_callback(TimeBudget(self))
        self._buffer: list[dict] | None = None
        self._buffer_generation = -1
        self._micro = 0
        self._rl_metrics: dict[str, list[float]] = {}
        self._episodes_total = 0
        self.stopped_by: str | None = None  # what ended training before max_steps (the time budget), for the card

    # ---- data: the rollouts ----------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        # Rollouts are made in the main process (the envs are worker processes of their own): no DataLoader workers.
        return DataLoader(self.train_dataset, batch_size=None, collate_fn=_identity, num_workers=0)

    def create_optimizer(self, model=None):
        # The SFT trainer's optimizer; under PPO with critic_learning_rate, the critic's parameters move to a group of
        # their own (before any step, so the optimizer state and the schedule see the final groups).
        optimizer = super().create_optimizer(model)
        rate = self.args.critic_learning_rate
        if self.args.algorithm != "ppo" or rate is None or rate == self.args.learning_rate:
            return optimizer
        from ..optim import MasterWeightOptimizer

        model = model if model is not None else self.model
        if isinstance(optimizer, MasterWeightOptimizer):  # bf16 with fp32 masters: the masters move with them
            optimizer.move_to_new_group([p for n, p in model.named_parameters() if "value_head" in n and p.requires_grad],
                                        lr=rate, weight_decay=0.0)
            return optimizer
        critic = {id(p) for n, p in model.named_parameters() if "value_head" in n and p.requires_grad}
        moved = []
        for group in optimizer.param_groups:
            moved += [p for p in group["params"] if id(p) in critic]
            group["params"] = [p for p in group["params"] if id(p) not in critic]
        if moved:
            optimizer.add_param_group({"params": moved, "lr": rate, "weight_decay": 0.0})
        return optimizer

    def _get_num_items_in_batch(self, batch_samples, device):
        # compute_loss normalises by the rollout batch's kept decisions (all ranks): the Trainer must not divide again.
        return 1

    def _policy(self, stochastic: bool):
        from ..policy import ObservationMap, PolicyRunner
        from .rollout import StochasticPolicy

        model = self.accelerator.unwrap_model(self.model)
        settings = self.rl_settings
        common = dict(model=model, processor=self.processing_class, head=settings["head"],
                      obs_map=ObservationMap(cameras=settings["cameras"]), device=str(self.args.device),
                      num_camera_slots=settings["camera_slots"])
        if not stochastic:
            return PolicyRunner(**common)
        return StochasticPolicy(**common, sde=self.sde, n_action_steps=settings["n_action_steps"],
                                action_dims=settings["action_dims"], with_value=self.args.algorithm == "ppo",
                                task_noise_levels=self.args.task_noise_levels)

    def _levels(self, transitions: list) -> list[float] | None:
        """The noise level of each decision (its task's; the run's `noise_level` if not recorded), `None` for none."""
        return [self.sde.noise_level if tr.level is None else tr.level for tr in transitions] or None

    def _stochastic(self) -> bool:
        """Whether every task's rollouts sample with noise (a chain with a likelihood, and a KL to log)."""
        return min([self.sde.noise_level, *(self.args.task_noise_levels or {}).values()]) > 0

    def _level_text(self) -> str:
        own = self.args.task_noise_levels or {}
        return f"{self.args.noise_level:g}" + (
            f" ({', '.join(f'{task} {level:g}' for task, level in own.items())})" if own else "")

    def _mask(self) -> torch.Tensor:
        from .rollout import decision_mask

        settings = self.rl_settings
        return decision_mask(self.accelerator.unwrap_model(self.model).config, settings["n_action_steps"],
                             settings["action_dims"])

    def _seeds(self, generation: int) -> tuple[dict, dict]:
        """Env seeds and noise seeds per task of one rollout batch on this rank: `groups_per_update` env seeds, each
        `group_size` times with distinct noise seeds; a function of (generation, rank) alone, so a resumed run rolls
        out what the uninterrupted one would have."""
        args, tasks = self.args, self.rl_settings["tasks"]
        block = (generation * args.world_size + args.process_index) * args.groups_per_update
        seeds, noise = {}, {}
        for t, task in enumerate(tasks):
            seeds[task] = [args.episode_seed + block + g for g in range(args.groups_per_update)
                           for _ in range(args.group_size)]
            base = ((generation * args.world_size + args.process_index) * len(tasks) + t) * len(seeds[task])
            noise[task] = [10**9 + base + i for i in range(len(seeds[task]))]
        return seeds, noise

    def _prepare_inputs(self, inputs):
        # As TRL's GRPOTrainer: the batch is generated here, every num_iterations optimizer steps, and split into the
        # step's gradient-accumulation micro-batches.
        generation = self.state.global_step // self.args.num_iterations
        if self._buffer is None or generation != self._buffer_generation:
            self._buffer = self._generate(generation)
            self._buffer_generation = generation
        batch = self._buffer[self._micro % len(self._buffer)]
        self._micro += 1
        return batch

    @torch.no_grad()
    def _generate(self, generation: int) -> list[dict]:
        args = self.args
        started = time.perf_counter()
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        policy = self._policy(stochastic=True)
        seeds, noise_seeds = self._seeds(generation)
        try:
            episodes, transitions = self.engine.run(policy, seeds, noise_seeds, progress=self.is_world_process_zero()
                                                    and not args.disable_tqdm, desc=f"rollouts (update {generation})")
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - started
        # returns and advantages; GRPO: per episode, over its group (one task's episodes from one env seed, all on this
        # rank); PPO: per decision, GAE with the critic's values
        kept_by_noise, rows = {}, []
        for t, (task, items) in enumerate(episodes.items()):
            kept = [e for e in items if not e.discarded]
            if not kept:
                continue
            returns = torch.tensor([float(e.success) if args.reward == "success" else e.reward + self._bonus(e)
                                    for e in kept])
            rows.append((task, [e.success for e in kept], returns.tolist(), [e.steps for e in kept]))
            if args.algorithm == "ppo":
                kept_by_noise.update({e.noise_seed: (e, None, True) for e in kept})
                continue
            groups = torch.tensor([t * 10**9 + e.seed for e in kept])
            advantages, informative = group_advantages(returns * args.reward_scale, groups, scale=args.scale_rewards)
            if args.algorithm == "filtered_bc":  # imitate the successes, or (dense) the episodes above their group's mean
                chosen = [e.success for e in kept] if args.reward == "success" else (advantages > 0).tolist()
                kept_by_noise.update({e.noise_seed: (e, 1.0, bool(c)) for e, c in zip(kept, chosen)})
                continue
            for e, a, keep in zip(kept, advantages.tolist(), informative.tolist()):
                kept_by_noise[e.noise_seed] = (e, a, keep or not args.dynamic_sampling)
        used = [tr for tr in transitions if tr.noise_seed in kept_by_noise and kept_by_noise[tr.noise_seed][2]]
        if args.algorithm == "ppo":
            self._ppo_advantages(used, kept_by_noise)
        else:
            for tr in used:
                tr.advantage = kept_by_noise[tr.noise_seed][1]
        total = torch.tensor([float(len(used))], device=args.device)
        if self.accelerator.num_processes > 1:
            total = self.accelerator.reduce(total, reduction="sum")
        total = float(total.item())
        self._log_rollouts(episodes, rows, transitions, used, seconds, sum(len(v) for v in seeds.values()))
        if args.log_kl and self._stochastic():  # the start policy's means at the stored x_k: the KL along the
            # rollouts' chains (a deterministic chain, noise_level 0, has none)
            measured = used if args.beta > 0 else (used or transitions)[:256]
            self._reference_means(measured)
            if measured:
                kl = step_kl(torch.stack([tr.means for tr in measured]),
                             torch.stack([tr.reference_means for tr in measured]), self.sde,
                             self._mask(), self._levels(measured)).sum(dim=1)
                self._metric("kl_to_start", kl.mean().item())
        return self._micro_batches(used, transitions, total, generation)

    def _ppo_advantages(self, used: list, kept_by_noise: dict) -> None:
        """GAE per episode over its decisions (`hf_vla.rl.flow.gae`), rewards per decision (the env's over its executed
        steps, or 1 on the successful one), then advantages whitened over the rollout batch of every rank (PPO's
        usual normalisation; one process on the union gets the same numbers)."""
        args = self.args
        n = self.rl_settings["n_action_steps"]
        by_episode: dict = {}
        for tr in used:
            by_episode.setdefault(tr.noise_seed, []).append(tr)
        for noise_seed, decisions in by_episode.items():
            decisions.sort(key=lambda tr: tr.index)
            episode = kept_by_noise[noise_seed][0]
            rewards = torch.zeros(len(decisions), dtype=torch.float64)
            if args.reward == "dense":
                for i in range(len(decisions)):
                    rewards[i] = sum(episode.step_rewards[i * n:(i + 1) * n])
                rewards[-1] += self._bonus(episode, args.gamma)
            elif episode.success:
                rewards[-1] = 1.0
            values = torch.tensor([tr.value for tr in decisions], dtype=torch.float64)
            advantages, returns = gae(rewards * args.reward_scale, values, args.gamma, args.lam)
            for tr, a, r in zip(decisions, advantages.tolist(), returns.tolist()):
                tr.advantage, tr.value_target = a, r
        advantages = torch.tensor([tr.advantage for tr in used], dtype=torch.float64)
        returns = torch.tensor([tr.value_target for tr in used], dtype=torch.float64)
        values = torch.tensor([tr.value for tr in used], dtype=torch.float64)
        residual = returns - values
        stats = torch.stack([torch.tensor(float(len(used)), dtype=torch.float64), advantages.sum(),
                             (advantages ** 2).sum(), returns.sum(), (returns ** 2).sum(), residual.sum(),
                             (residual ** 2).sum(), values.sum()]).to(args.device)
        if self.accelerator.num_processes > 1:
            stats = self.accelerator.reduce(stats, reduction="sum")
        count, a_sum, a_sq, r_sum, r_sq, e_sum, e_sq, v_sum = stats.cpu().tolist()
        count = max(count, 1.0)

        def variance(total, squares):
            return max(squares / count - (total / count) ** 2, 0.0) * count / max(count - 1, 1.0)

        mean, std = a_sum / count, math.sqrt(variance(a_sum, a_sq))
        for tr in used:
            tr.advantage = (tr.advantage - mean) / (std + 1e-8)
        self._metric("value", v_sum / count)
        returns_variance = variance(r_sum, r_sq)
        if returns_variance > 0:  # 1: the critic explains the returns; 0: no better than their mean
            self._metric("explained_variance", 1 - variance(e_sum, e_sq) / returns_variance)

    def _bonus(self, episode, gamma: float = 1.0) -> float:
        """`absorbing_bonus` of an episode that ended in success before the episode limit (0 otherwise)."""
        limit, n = self.rl_settings["max_episode_steps"], self.rl_settings["n_action_steps"]
        if not episode.success or not limit or not episode.step_rewards:
            return 0.0
        executed = episode.steps - (math.ceil(episode.steps / n) - 1) * n
        return absorbing_bonus(episode.step_rewards[-1], int(limit) - episode.steps, executed, n, gamma)

    def _reference_means(self, transitions: list) -> None:
        """The start policy's means at each stored x_k (for the KL), in batches."""
        model = self.accelerator.unwrap_model(self.model)
        device = self.args.device
        for start in range(0, len(transitions), 64):
            part = transitions[start:start + 64]
            inputs = {k: torch.cat([tr.inputs[k] for tr in part]).to(device) for k in part[0].inputs}
            chain = torch.stack([tr.chain for tr in part]).to(device)
            if self.reference is not None:
                means = chain_means(self.reference, inputs, chain, self.sde, levels=self._levels(part))
            else:
                with model.disable_adapter():
                    means = chain_means(model, inputs, chain, self.sde, levels=self._levels(part))
            for tr, mean in zip(part, means.cpu()):
                tr.reference_means = mean

    def _micro_batches(self, used: list, transitions: list, total: float, generation: int):
        """The kept decisions, shuffled (seeded by the generation), in `gradient_accumulation_steps` micro-batches of
        the loss weight 1 / (kept decisions on all ranks); a part left empty holds one decision of weight 0, so every
        rank runs the same number of forward/backward passes."""
        parts = self.args.gradient_accumulation_steps
        order = torch.randperm(len(used), generator=torch.Generator().manual_seed(generation)).tolist()
        shuffled = [used[i] for i in order]
        batches = []
        policy_mask = self._mask()
        for p in range(parts):
            members = shuffled[p::parts]
            weight = 1.0 / total if members else 0.0
            if not members:
                members = [transitions[0]]
                if self.args.beta > 0 and not hasattr(members[0], "reference_means"):
                    self._reference_means(members)
            batch = {k: torch.cat([tr.inputs[k] for tr in members]) for k in members[0].inputs}
            batch["chain"] = torch.stack([tr.chain for tr in members])
            batch["levels"] = torch.tensor(self._levels(members))
            batch["old_log_probs"] = torch.stack([tr.log_probs for tr in members])
            batch["advantages"] = torch.tensor([getattr(tr, "advantage", 0.0) if weight else 0.0 for tr in members])
            if self.args.algorithm == "ppo":
                batch["returns"] = torch.tensor([getattr(tr, "value_target", tr.value) for tr in members])
                batch["old_values"] = torch.tensor([tr.value for tr in members])
            batch["weights"] = torch.full((len(members),), weight)
            batch["mask"] = policy_mask
            if self.args.beta > 0:
                batch["reference_means"] = torch.stack([tr.reference_means for tr in members])
            if self.args.algorithm == "filtered_bc":  # the supervised loss's sample identity: its noise and time seed
                batch["source_index"] = torch.zeros(len(members), dtype=torch.long)
                batch["episode_index"] = torch.tensor([tr.noise_seed for tr in members])
                batch["frame_index"] = torch.tensor([tr.index for tr in members])
            batches.append({k: v.to(self.args.device) for k, v in batch.items()})
        return batches

    # ---- the objective ---------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.algorithm == "filtered_bc":
            loss = self._filtered_bc_loss(model, inputs)
        else:
            loss = self._policy_gradient_loss(model, inputs)
        if self.train_dataset.replay is not None and model.training:
            loss = loss + self.args.bc_coef * self._replay_loss(model)
        return (loss, None) if return_outputs else loss

    def _replay_loss(self, model) -> torch.Tensor:
        """Supervised training's loss (`VLATrainer.compute_loss`) on the next batch of the replayed expert data, as
        one of the update's `gradient_accumulation_steps x world_size` batches: the update's gradient is the mean of
        theirs (each batch's loss is its samples' mean)."""
        batch = self._next_replay_batch()
        ranks = self.accelerator.num_processes
        # Through the unwrapped model: the RL loss went through DDP's forward once (which prepares the all-reduce), and
        # a second DDP forward before one backward would mark parameters ready twice; autograd sums both paths' grads.
        core = self.accelerator.unwrap_model(model)
        loss = VLATrainer.compute_loss(self, core, batch)  # under DDP times the ranks (their average undone)
        self._metric("bc_loss", loss.detach().item() / ranks)
        return loss / (self.args.gradient_accumulation_steps * ranks)

    def _next_replay_batch(self) -> dict:
        if self._replay_batches is None:  # opened at the first use: after a resume has restored the position
            self._replay_batches = iter(self._loader(self.train_dataset.replay, self._replay_collate))
        batch = next(self._replay_batches)
        return {k: v.to(self.args.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _policy_gradient_loss(self, model, inputs, per_step: bool = False) -> torch.Tensor:
        """The clipped policy-gradient loss of one micro-batch (plus the KL and critic terms); with `per_step`, GRPO's
        policy term split by denoising step (`[K]`, summing to the loss without KL: what
        `benchmarks/rl_gradient_snr.py` takes gradients of)."""
        args = self.args
        ppo = args.algorithm == "ppo"
        if per_step and (ppo or args.beta > 0):
            raise ValueError("per_step splits GRPO's policy term alone (algorithm grpo, beta 0)")
        levels = inputs["levels"]  # each decision's noise level (its task's)
        if ppo:  # the critic's values from the same prefix pass
            means, values = chain_means(model, inputs, inputs["chain"], self.sde, value=True, levels=levels)
        else:
            means = chain_means(model, inputs, inputs["chain"], self.sde, levels=levels)
        log_probs = step_log_probs(inputs["chain"], means, self.sde, inputs["mask"], levels)  # [b, K]
        log_ratio = log_probs - inputs["old_log_probs"]
        elements, clipped = clipped_objective(log_ratio, inputs["advantages"], args.epsilon, args.epsilon_high)
        if per_step:
            ranks = self.accelerator.num_processes  # DDP's average undone, as below
            return (inputs["weights"][:, None] * elements).sum(dim=0) / elements.shape[1] * ranks
        per_decision = elements.mean(dim=1)
        if args.beta > 0:  # the KL to the start policy per denoising step, as TRL adds beta * KL per token
            per_decision = per_decision + args.beta * step_kl(means, inputs["reference_means"], self.sde,
                                                              inputs["mask"], levels).mean(dim=1)
        if ppo:
            critic = value_loss(values, inputs["returns"], inputs["old_values"], args.value_clip)
            per_decision = per_decision + args.vf_coef * critic
        weights = inputs["weights"]
        loss = self._finite((weights * per_decision).sum(), "RL",
                            f": log-ratios {log_ratio.detach().min().item():.3g}...{log_ratio.detach().max().item():.3g}")
        live = weights > 0
        if live.any():
            with torch.no_grad():
                ratio = log_ratio.detach()[live]
                self._metric("clip_fraction", clipped[live].float().mean().item())
                self._metric("approx_kl", ((ratio.exp() - 1) - ratio).mean().item())  # old -> new (Schulman's k3)
                self._metric("ratio", ratio.exp().mean().item())
                if ppo:
                    self._metric("value_loss", critic.detach()[live].mean().item())
        if self.accelerator.num_processes > 1:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over ranks
        return loss

    def _filtered_bc_loss(self, model, inputs):
        """Supervised training's objective (`hf_vla.losses.policy_per_sample_loss`: its time distribution, noise seeded
        by the decision's identity) on each kept decision's chunk, over the decision mask (the executed steps' real
        action dims: the rest of the chunk is the policy's own unexecuted guess), weighted as the policy loss is."""
        from ..losses import policy_per_sample_loss

        mask = inputs["mask"].bool()
        rows = inputs["chain"].shape[0]
        batch = dict(inputs, actions=inputs["chain"][:, -1].float(),
                     action_is_pad=(~mask.any(dim=1))[None].expand(rows, -1),
                     action_dim_mask=mask.any(dim=0)[None].expand(rows, -1))
        per_sample, _ = policy_per_sample_loss(model, batch, self.args.seed, self.state.global_step)
        per_decision = per_sample.sum / per_sample.count.clamp(min=1)
        weights = inputs["weights"]
        loss = self._finite((weights * per_decision).sum(), "filtered-BC")
        live = weights > 0
        if live.any():
            self._metric("flow_loss", per_decision.detach()[live].mean().item())
        if self.accelerator.num_processes > 1:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over ranks
        return loss

    def _finite(self, loss: torch.Tensor, what: str, detail: str = "") -> torch.Tensor:
        """The NaN guard of every RL loss: `on_nonfinite="stop"` raises before any weight moves, `"skip"` records the
        batch and contributes no gradient."""
        if torch.isfinite(loss):
            return loss
        text = (f"non-finite {what} loss ({loss.item()}) at update {self.state.global_step + 1} (rank "
                f"{self.args.process_index}){detail}")
        if self.args.on_nonfinite == "stop":
            raise NonFiniteError(text + "; no weights were updated. Lower learning_rate or raise noise_level, or "
                                        "set on_nonfinite='skip'.")
        self._nonfinite_batches.append(text)
        return torch.zeros_like(loss)

    # ---- metrics ---------------------------------------------------------------------------------------------------
    def _metric(self, name: str, value: float) -> None:
        self._rl_metrics.setdefault(name, []).append(float(value))

    def _log_rollouts(self, episodes: dict, rows: list, transitions: list, used: list, seconds: float, planned: int):
        from accelerate.utils import gather_object

        mine = (rows, (len(transitions), len(used), self.engine.discarded))
        both = gather_object([mine]) if self.accelerator.num_processes > 1 else [mine]
        gathered, counts = [b[0] for b in both], [b[1] for b in both]
        per_task: dict = {}
        for rank_rows in gathered:
            for task, successes, returns, steps in rank_rows:
                entry = per_task.setdefault(task, ([], [], []))
                entry[0].extend(successes), entry[1].extend(returns), entry[2].extend(steps)
        all_success = [s for v in per_task.values() for s in v[0]]
        self._episodes_total += len(all_success)
        for task, (successes, returns, steps) in per_task.items():
            if task:
                self._metric(f"rollout/{task}/success", sum(successes) / len(successes))
                self._metric(f"rollout/{task}/return", sum(returns) / len(returns))
                self._metric(f"rollout/{task}/episode_length", sum(steps) / len(steps))
        self._metric("rollout/success", sum(all_success) / max(1, len(all_success)))
        self._metric("rollout/return", sum(r for v in per_task.values() for r in v[1]) / max(1, len(all_success)))
        self._metric("rollout/episode_length", sum(s for v in per_task.values() for s in v[2]) / max(1, len(all_success)))
        self._metric("rollout/episodes_per_s", len(all_success) / max(seconds, 1e-9) / max(1, len(gathered)))
        self._metric("rollout/episodes", self._episodes_total)
        self._metric("rollout/decisions", sum(c[0] for c in counts))
        self._metric("rollout/decisions_used", sum(c[1] for c in counts))
        self._metric("rollout/discarded_episodes", sum(c[2] for c in counts))
        # the Gaussian steps' std and entropy per action element, over this rank's decisions (fixed by the noise level
        # under Flow-SDE, the task's where it has its own; no entropy at level 0)
        stds = [s for level in self._levels(transitions) or [self.sde.noise_level] for s in self.sde.stds(level)]
        self._metric("noise_std", sum(stds) / len(stds))
        if min(stds) > 0:
            self._metric("entropy", sum(0.5 * math.log(2 * math.pi * math.e * s * s) for s in stds) / len(stds))

    def log(self, logs: dict, start_time: float | None = None) -> None:
        # TRL's way: the metrics gathered since the last log, averaged, beside the Trainer's.
        if "loss" in logs or "train_loss" in logs:
            for name, values in self._rl_metrics.items():
                if values:
                    logs[name] = values[-1] if name.startswith("rollout/episodes") else sum(values) / len(values)
            self._rl_metrics = {}
        return super().log(logs, start_time)

    # ---- held-out evaluation ---------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Held-out success: `eval_episodes` per task on seeds from 10,000 (never rolled out), deterministic sampling
        as deployed; the ranks share the seeds. Logged as `eval_success` and `eval_<task>/success`."""
        from accelerate.utils import gather_object

        args = self.args
        started = time.perf_counter()
        model = self.accelerator.unwrap_model(self.model)
        was_training = model.training
        seeds = {task: [EVAL_SEED + i for i in range(args.eval_episodes)][args.process_index::args.world_size]
                 for task in self.rl_settings["tasks"]}
        import contextlib

        try:  # with EMA, the averaged weights are what is evaluated (and saved), as in SFT
            with contextlib.nullcontext() if self._ema is None else self._ema.swapped():
                episodes, _ = self.engine.run(self._policy(stochastic=False), seeds, desc="held-out evaluation",
                                              progress=self.is_world_process_zero() and not args.disable_tqdm)
        finally:
            model.train(was_training)
        outcome = {task: [e.success for e in items if not e.discarded] for task, items in episodes.items()}
        if self.accelerator.num_processes > 1:
            merged: dict = {}
            for part in gather_object([outcome]):
                for task, values in part.items():
                    merged.setdefault(task, []).extend(values)
            outcome = merged
        metrics = {}
        for task, values in outcome.items():
            if task:
                metrics[f"{metric_key_prefix}_{task}/success"] = sum(values) / max(1, len(values))
        rates = [sum(v) / max(1, len(v)) for v in outcome.values()]
        metrics[f"{metric_key_prefix}_success"] = sum(rates) / max(1, len(rates))
        metrics[f"{metric_key_prefix}_episodes"] = sum(len(v) for v in outcome.values())
        metrics[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - started, 2)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- the model card --------------------------------------------------------------------------------------------
    def rl_summary(self) -> dict:
        """Start checkpoint, method, budget and held-out success before -> after (and best), from the log history."""
        evals = [(int(e["step"]), e["eval_success"]) for e in self.state.log_history if "eval_success" in e]
        args = self.args
        critic = f" (critic on the VLM prefix, GAE gamma {args.gamma:g} lambda {args.lam:g})" \
            if args.algorithm == "ppo" else ""
        return {
            "start": args.model_name_or_path, "env": self.rl_settings["env"],
            "tasks": [t for t in self.rl_settings["tasks"] if t],
            "method": (f"filtered behaviour cloning (flow matching on the rollouts' "
                       f"{'successful' if args.reward == 'success' else 'above-group-mean'} episodes; rollouts with "
                       f"{args.noise_schedule} noise, level {self._level_text()}, {self.sde.num_steps} denoising "
                       "steps)"
                       if args.algorithm == "filtered_bc" else
                       f"{args.algorithm.upper()}{critic} on Flow-SDE likelihoods ({args.noise_schedule} noise, "
                       f"level {self._level_text()}, "
                       f"{self.sde.num_steps} denoising steps), clip [{1 - args.epsilon:g}, {1 + args.epsilon_high:g}], "
                       f"beta {args.beta:g}, reward {args.reward}")
                      + (f"; plus supervised training's loss (weight {args.bc_coef:g}) on the expert data "
                         f"{', '.join(d['name'] for d in args.bc_datasets)}" if args.bc_datasets else ""),
            "updates": self.state.global_step, "episodes": self._episodes_total,
            "max_steps": args.max_steps, "max_train_minutes": args.max_train_minutes, "stopped_by": self.stopped_by,
            # the whole train() call, held-out evaluations included
            "minutes": round(sum(e.get("train_runtime", 0) for e in self.state.log_history) / 60, 1),
            "eval_episodes": args.eval_episodes,
            "before": evals[0][1] if evals and evals[0][0] == 0 else None,
            "after": evals[-1][1] if evals else None,
            "best": (self.state.best_metric, self.state.best_model_checkpoint),
        }

    def create_model_card(self, model_name: str | None = None, base_model: str | None = None, **kwargs):
        from ..trainer import render_model_card

        if not self.is_world_process_zero():
            return None
        summary = self.rl_summary()
        # the arguments that bound the run: a time-budgeted run's max_steps is only a ceiling
        card = render_model_card(self, model_name=model_name, base_model=base_model,
                                 extra_args={"max_train_minutes": self.args.max_train_minutes}
                                 if self.args.max_train_minutes is not None else None)
        stopped = f"stopped by {summary['stopped_by']}" if summary["stopped_by"] else f"max_steps={summary['max_steps']}"

        before = "–" if summary["before"] is None else f"{100 * summary['before']:.1f}%"
        after = "–" if summary["after"] is None else f"{100 * summary['after']:.1f}%"
        card.text += (
            "\n\n## Reinforcement-learning fine-tuning (hf_vla.rl)\n\n"
            f"- start checkpoint: `{summary['start']}`\n- env: {summary['env']} "
            f"{', '.join(summary['tasks'])}\n- method: {summary['method']}\n"
            f"- budget: {summary['updates']} updates ({stopped}), {summary['episodes']} rollout episodes, "
            f"{summary['minutes']} min\n- held-out success ({summary['eval_episodes']} episodes per task, seeds from "
            f"{EVAL_SEED}): {before} before -> {after} after"
            + (f" (best {100 * summary['best'][0]:.1f}%, {summary['best'][1]})" if summary["best"][0] is not None
               else "") + "\n")
        if self.args.should_save:
            import os

            card.save(os.path.join(self.args.output_dir, "README.md"))
        return card


__all__ = ["RLConfig", "RLTrainer", "UpdateStream"]
