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
import time

import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from hf_vla.errors import ConfigError, NonFiniteError
from hf_vla.rl.collection import RolloutCollection
from hf_vla.rl.config import ALGORITHMS, EVAL_SEED, REWARDS, RLConfig  # noqa: F401  (public here)
from hf_vla.rl.critic import add_value_head
from hf_vla.rl.flow import (
    FlowSDE,
    chain_means,
    clipped_objective,
    step_kl,
    step_log_probs,
    value_loss,
)
from hf_vla.rl.reporting import RLReporting
from hf_vla.training.trainer import VLATrainer

logger = logging.getLogger("hf_vla.rl")


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
    from hf_vla.registry import find_policy

    family = find_policy(model_type)
    if family is None or not family.rl:
        raise ConfigError(f"RL fine-tuning samples through a pi0 / pi0.5 prefix cache; model type {model_type!r} is "
                          "not supported")
    if args.algorithm == "ppo" and not family.rl_critic:
        raise ConfigError(f"algorithm='ppo' needs a critic on the VLM prefix, which model type {model_type!r} does not "
                          "have (hf_vla builds one for pi0.5, PI05ValueHead; transformers' pi0 has none): use "
                          f"algorithm='grpo' for {model_type}")

class RLTrainer(RolloutCollection, RLReporting, VLATrainer):
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
            # training (the trainer's structure freezes the modules unused once token_loss is off), and the saved
            # result says token_loss false (a later token-loss run re-enables it)
            model.config.token_loss = False
            logger.info("token_loss policy: RL trains its flow objective; the target-token path is frozen")
        from hf_vla.rl.settings import rollout_settings

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
            add_value_head(model)
            if peft_config is not None:  # under LoRA the critic trains in full, as the action/time heads do
                peft_config.modules_to_save = sorted(set(peft_config.modules_to_save or []) | {"value_head"})
        replay, self._replay_collate, self._replay_batches = None, None, None
        if args.bc_datasets:  # the expert data replayed beside the RL loss (hf_vla.rl.replay)
            from hf_vla.rl.replay import replay_stream

            replay, self._replay_collate = replay_stream(args, processing_class, model.config)
        super().__init__(model, args, train_dataset=UpdateStream(replay), eval_dataset=UpdateStream(),
                         data_collator=_identity, processing_class=processing_class, peft_config=peft_config,
                         callbacks=callbacks)
        self.reference = reference
        self.sde = FlowSDE(args.denoise_steps or model.config.num_inference_steps, args.noise_level,
                           args.noise_schedule)
        settings = self.rl_settings
        if engine is None:
            from hf_vla.rl.rollout import RolloutEngine

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
        from hf_vla.training.optim import MasterWeightOptimizer

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
        `benchmarks/closed_loop/rl_gradient_snr.py` takes gradients of)."""
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
        """Supervised training's objective (`hf_vla.training.losses.policy_per_sample_loss`: its time distribution, noise seeded
        by the decision's identity) on each kept decision's chunk, over the decision mask (the executed steps' real
        action dims: the rest of the chunk is the policy's own unexecuted guess), weighted as the policy loss is."""
        from hf_vla.training.losses import policy_per_sample_loss

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



__all__ = ["RLConfig", "RLTrainer", "UpdateStream"]
