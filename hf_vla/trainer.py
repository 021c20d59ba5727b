"""VLATrainer: a `transformers.Trainer` that owns the flow-matching objective for any velocity-predicting policy.

Written like TRL's trainers: one documented config dataclass (`VLATrainingArguments`), and each override short, with a
comment saying why it exists.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput

from . import checkpoints
from .data import ForkFriendlyDataLoader, PI05Collator
from .engines import configure_engine, finish_engine, saved_as_own_class
from .errors import CheckpointError, ConfigError, NonFiniteError
from .losses import (
    GROUP_KEYS,
    LOSS_AGGREGATIONS,
    PerSampleLoss,
    StepTotals,
    aggregate,
    bucket_mse,
    loss_padding,
    policy_per_sample_loss,
    sample_weights,
    valid_elements,
)
from .models.pi0_adapter import policy_structure
from .optim import MasterWeightOptimizer

logger = logging.getLogger("hf_vla.trainer")
STREAM_STATE = checkpoints.STREAM_STATE
NONFINITE_CHOICES = ("stop", "skip")
FREEZE_CHOICES = ("none", "vision_tower", "vlm", "expert_only")  # what every policy's `freeze` accepts
EVAL_NOISE_STEP = -1  # evaluation draws the same noise every time, so successive evals are comparable


@dataclass
class VLATrainingArguments(TrainingArguments):
    r"""
    Training arguments for [`VLATrainer`]. Defaults reproduce the published pi0.5 recipe: AdamW (lr 2.5e-5, betas
    (0.9, 0.95), eps 1e-8, weight decay 0.01), grad clip 1.0, 1k warmup steps then cosine decay to 2.5e-6 with
    transformers' own `cosine_with_min_lr` schedule.

    loss_aggregation (`str`, defaults to `"sample_mean"`):
        Denominator of the loss over one optimizer step (all micro-batches of gradient accumulation, all ranks):
        `sample_mean` (every sample weighs the same), `token_mean` (every valid element weighs the same),
        `group_mean` (every group weighs the same, see `loss_group_key`) or `constant` (sum / (divisor * samples)).
    loss_divisor (`float`, *optional*): the fixed divisor of `constant`; refused by the other modes.
    loss_group_key (`str`, defaults to `"episode"`): groups of `group_mean`: `episode` or `dataset`.
    flow_loss_weight (`float`, defaults to 1.0): alpha of pi0.5's objective `CE + alpha * flow MSE` when batches carry
        target tokens (`labels`, the token objective, `hf_vla.cotraining`); each term is aggregated by
        `loss_aggregation` over its own elements (valid action elements, target tokens). 1 is knowledge insulation's
        choice (the stop-gradient keeps the terms on separate parameters); pi0.5 post-trained with 10 without it.
    master_weights (`bool`, defaults to `True`): with a bf16 model, keep fp32 master weights and fp32 Adam state;
        gradients are clipped in fp32. Under DDP (and in one process) `MasterWeightOptimizer` holds them; under FSDP2
        the sharded fp32 parameters are the masters (bf16 mixed precision); DeepSpeed's bf16 mode keeps its own.
        Ignored for fp32 models.
    freeze (`str`, defaults to `"none"`): `vision_tower` (SigLIP frozen), `vlm` (the whole PaliGemma frozen: the
        expert and the action/time heads train) or `expert_only` (only the action expert's layers train).
    stream_open_blocks (`int`, defaults to 32): episodes decoded concurrently per data worker (batch decorrelation).
    decoder_threads (`int`, *optional*): threads per video decoder; by default the CPUs per DataLoader worker on the
        node, at most 2 (each worker keeps `stream_open_blocks` x cameras decoders open).
    action_metrics_batches (`int`, defaults to 0): on that many validation batches, also run `sample_actions` and
        report the un-normalized action MSE per dataset (`eval_by_dataset/<name>/action_mse`).
    on_nonfinite (`str`, defaults to `"stop"`): what a NaN/inf loss or gradient norm does. `stop` raises an error
        naming the step and the batch's provenance before the optimizer steps (so no NaN reaches the weights or a
        checkpoint); `skip` drops that optimizer step, counts it (`nonfinite_skipped` in the logs) and goes on.
    ema_decay (`float`, *optional*): keep an fp32 exponential moving average of the trainable weights with this decay
        (openpi's pi0.5 recipes: 0.999), updated after every optimizer step (`hf_vla.ema`); evaluation, rollouts and
        the final model use it. Off by default.
    ema_start_step (`int`, defaults to 0): until this step the average follows the weights.
    ema_save_raw (`bool`, defaults to `False`): save the raw weights as the final model instead of the average.
    ema_eval_raw (`bool`, defaults to `False`): also evaluate the raw weights (`eval_raw_loss`, ...): a second pass.
    on_data_change (`str`, defaults to `"error"`): resuming when the training data changed since the checkpoint
        (datasets, episodes, kept ranges, split or weights) is refused (`error`), or starts the next epoch on the new
        data (`restart_epoch`).
    n_action_steps (`int`, *optional*): actions of each predicted chunk executed before the next is predicted, saved
        in the checkpoint's deployment contract (`deployment_config.json`, `hf_vla.deployment`) so evaluation,
        rollouts and serving use it without a flag; default half the chunk.
    max_episode_steps (`int`, *optional*): the closed-loop episode limit the policy is validated with, saved in the
        contract's benchmark settings (default: the limit the data was recorded with).
    rollout_env (`str`, *optional*): closed-loop rollouts during training (`hf_vla.rollouts`) in this env:
        `metaworld`, `libero` or a gymnasium id such as `hf_vla/ColorReach-v0`. Every `rollout_steps` steps the
        weights are snapshotted and evaluated in a separate process while training goes on; the figures are logged
        as `rollout/<task>/success` and `rollout/success` and end up in the model card.
    rollout_tasks (`str`, *optional*): the benchmark's tasks, as `python -m hf_vla.evaluate --task` takes them.
    rollout_steps (`int`, *optional*): optimizer steps between rollouts; required with `rollout_env`.
    rollout_episodes (`int`, defaults to 10): episodes per task and rollout.
    rollout_env_kwargs (`dict`, *optional*): env arguments, e.g. `{"image_size": 96, "max_episode_steps": 200}` (the
        image size the data was recorded at).
    rollout_seed (`int`, defaults to 10000): first episode seed (held out from recorded data that starts at 0).
    rollout_videos (`int`, defaults to 1): GIFs saved per task and rollout, under `_rollouts/step-N/eval`.
    rollout_device (`str`, *optional*): device of the rollout process (default: the training device).
    rollout_wait (`bool`, defaults to `False`): evaluate synchronously (every rank waits) instead of alongside.
    image_augmentation (`str`, defaults to `"none"`): `openpi` augments every training image as openpi's pi0 / pi0.5
        training does (`hf_vla.augment`: a random 95% crop resized back and a rotation of up to 5 degrees, except on
        wrist cameras, then colour jitter), each sample's draws keyed by its identity and step; evaluation images are
        never augmented. Off by default, as in lerobot's trainers.
    """

    loss_aggregation: str = field(default="sample_mean", metadata={"help": f"one of {LOSS_AGGREGATIONS}"})
    loss_divisor: float | None = field(default=None, metadata={"help": "divisor of loss_aggregation=constant"})
    loss_group_key: str = field(default="episode", metadata={"help": "group_mean groups: episode | dataset"})
    flow_loss_weight: float = field(default=1.0, metadata={"help": "alpha in CE + alpha * flow MSE (token objective)"})
    master_weights: bool = field(default=True, metadata={"help": "fp32 master weights for a bf16 model"})
    freeze: str = field(default="none", metadata={"help": f"one of {FREEZE_CHOICES}"})
    stream_open_blocks: int = field(default=32, metadata={"help": "episodes open at once per data worker"})
    decoder_threads: int | None = field(default=None, metadata={"help": "threads per video decoder (default: auto)"})
    action_metrics_batches: int = field(default=0, metadata={"help": "validation batches with sample_actions"})
    on_nonfinite: str = field(default="stop", metadata={"help": f"one of {NONFINITE_CHOICES}"})
    ema_decay: float | None = field(default=None, metadata={"help": "EMA of the weights (e.g. 0.999); off if unset"})
    ema_start_step: int = field(default=0, metadata={"help": "the EMA follows the weights until this step"})
    ema_save_raw: bool = field(default=False, metadata={"help": "final model: the raw weights, not the EMA"})
    ema_eval_raw: bool = field(default=False, metadata={"help": "also evaluate the raw weights (eval_raw_*)"})
    on_data_change: str = field(default="error", metadata={"help": "resume on changed data: error | restart_epoch"})
    n_action_steps: int | None = field(default=None, metadata={"help": "actions executed per chunk, saved in the "
                                                                         "deployment contract (default: half the chunk)"})
    max_episode_steps: int | None = field(default=None, metadata={"help": "closed-loop episode limit, saved in the "
                                                                           "contract (default: the recording's)"})
    rollout_env: str | None = field(default=None, metadata={"help": "closed-loop rollouts: metaworld | libero | gym id"})
    rollout_tasks: str | None = field(default=None, metadata={"help": "the benchmark's tasks (as evaluate --task)"})
    rollout_steps: int | None = field(default=None, metadata={"help": "optimizer steps between rollouts"})
    rollout_episodes: int = field(default=10, metadata={"help": "episodes per task and rollout"})
    rollout_env_kwargs: dict | None = field(default=None, metadata={"help": "env arguments (image_size, ...)"})
    rollout_seed: int = field(default=10_000, metadata={"help": "first rollout episode seed"})
    rollout_videos: int = field(default=1, metadata={"help": "GIFs per task and rollout"})
    rollout_device: str | None = field(default=None, metadata={"help": "rollout device (default: training's)"})
    rollout_wait: bool = field(default=False, metadata={"help": "evaluate synchronously (every rank waits)"})
    image_augmentation: str = field(default="none", metadata={"help": "training images: none | openpi (crop, "
                                                                      "rotation, colour jitter)"})

    # pi0.5's published optimizer and schedule
    learning_rate: float = 2.5e-5
    adam_beta2: float = 0.95
    weight_decay: float = 0.01
    lr_scheduler_type: str = "cosine_with_min_lr"
    lr_scheduler_kwargs: dict | str | None = field(default_factory=lambda: dict(DEFAULT_SCHEDULER_KWARGS))
    warmup_steps: float = 1000
    # The stream restores its own position from the checkpoint; letting the Trainer skip batches would decode them.
    ignore_data_skip: bool = True
    # The trainer reads masks and provenance that the model's forward does not take.
    remove_unused_columns: bool = False
    # An infinite stream has no length; the run is measured in optimizer steps.
    max_steps: int = 30_000
    # A NaN loss is an error (or a counted skip, see `on_nonfinite`), never averaged away into the logged loss.
    logging_nan_inf_filter: bool = False

    def __post_init__(self):
        if self.max_steps is None or self.max_steps <= 0:  # before super(), which reads it
            raise ConfigError(f"max_steps={self.max_steps}: must be positive (the training stream is infinite)")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "stream_open_blocks"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be positive")
        for name in ("decoder_threads", "n_action_steps", "max_episode_steps"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be positive (or unset for the default)")
        from .augment import preset

        preset(self.image_augmentation)  # an unknown name stops here, by name
        for name in ("dataloader_num_workers", "action_metrics_batches"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must not be negative")
        if not self.learning_rate >= 0 or not math.isfinite(self.learning_rate):
            raise ConfigError(f"learning_rate={self.learning_rate}: must be a finite number >= 0")
        try:
            super().__post_init__()
        except ConfigError:
            raise
        except ValueError as error:
            raise ConfigError(str(error)) from error
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ConfigError(f"loss_aggregation={self.loss_aggregation!r}: choose one of {LOSS_AGGREGATIONS}")
        if self.loss_aggregation == "constant":
            if self.loss_divisor is None or not math.isfinite(self.loss_divisor) or self.loss_divisor <= 0:
                raise ConfigError(f"loss_aggregation='constant' needs a finite positive loss_divisor, got {self.loss_divisor}")
        elif self.loss_divisor is not None:
            raise ConfigError(f"loss_divisor={self.loss_divisor} is only used by loss_aggregation='constant', "
                              f"not {self.loss_aggregation!r}")
        if not (math.isfinite(self.flow_loss_weight) and self.flow_loss_weight >= 0):
            raise ConfigError(f"flow_loss_weight={self.flow_loss_weight}: must be a finite number >= 0")
        if self.loss_group_key not in GROUP_KEYS:
            raise ConfigError(f"loss_group_key={self.loss_group_key!r}: choose one of {sorted(GROUP_KEYS)}")
        if self.freeze not in FREEZE_CHOICES:
            raise ConfigError(f"freeze={self.freeze!r}: choose one of {FREEZE_CHOICES}")
        if self.on_nonfinite not in NONFINITE_CHOICES:
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r}: choose one of {NONFINITE_CHOICES}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay={self.ema_decay}: must be in (0, 1), e.g. 0.999 (or unset for no EMA)")
        if self.ema_start_step < 0:
            raise ConfigError(f"ema_start_step={self.ema_start_step}: must be >= 0")
        if self.on_data_change not in ("error", "restart_epoch"):
            raise ConfigError(f"on_data_change={self.on_data_change!r}: choose 'error' or 'restart_epoch'")
        from .rollouts import check_rollout_args

        check_rollout_args(self)
        self._check_scheduler_kwargs()
        if self.on_nonfinite == "skip" and self.deepspeed:
            raise ConfigError("on_nonfinite='skip' is not supported under DeepSpeed, which steps the optimizer inside "
                              "backward; use 'stop'")

    def _check_scheduler_kwargs(self):
        """`lr_scheduler_kwargs` against the chosen schedule's arguments, before anything is built (transformers
        raises a TypeError when the scheduler is created, after the model and data)."""
        import inspect

        from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
        from transformers.trainer_utils import SchedulerType

        kwargs = self.lr_scheduler_kwargs
        kind = SchedulerType(self.lr_scheduler_type)
        if kwargs == DEFAULT_SCHEDULER_KWARGS and kind not in (SchedulerType.COSINE_WITH_MIN_LR,
                                                              SchedulerType.COSINE_WARMUP_WITH_MIN_LR):
            self.lr_scheduler_kwargs = kwargs = {}  # hf_vla's default belongs to its default schedule
        if not isinstance(kwargs, dict) or not kwargs:
            return
        parameters = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[kind]).parameters
        if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
            return
        given = set(parameters) - {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}
        unknown = sorted(set(kwargs) - given)
        if unknown:
            from .validation import _suggest

            raise ConfigError(f"lr_scheduler_kwargs: unknown key(s) {unknown} for lr_scheduler_type "
                              f"{kind.value!r}{_suggest(unknown, sorted(given))}; it takes {sorted(given) or 'none'}")


DEFAULT_SCHEDULER_KWARGS = {"min_lr": 2.5e-6}


class VLATrainer(Trainer):
    """Trains any velocity-predicting policy (hf_vla's pi0.5, transformers' pi0, ...) on LeRobot data.

    Built like TRL's trainers: the datasets, collator, processor and peft config come in from outside.

        train, validation = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=...)
        trainer = VLATrainer(model, args, train_dataset=train, eval_dataset=validation, data_collator=collator,
                             processing_class=processor, peft_config=lora_config("expert", model=model))

    `train_dataset` is an iterable dataset yielding one list of samples per batch that shards itself by rank and
    DataLoader worker and can save and restore its position (`state_dict` / `load_state_dict`), like
    `hf_vla.data.EpisodeShuffleStream`; `eval_dataset` yields each validation frame once across ranks. Their
    `provenance` (`hf_vla.data.Provenance`) names the datasets and heads in metrics, errors and the model card.

    The trainer owns the objective: it draws t and the noise (seeded per sample), builds x_t, asks the policy for the
    velocity there and reduces the masked squared error into `PerSampleLoss`, aggregated over the whole optimizer
    step. Evaluation is one deterministic pass over the validation data, bucketed by provenance.
    """

    def __init__(self, model, args: VLATrainingArguments, train_dataset=None, eval_dataset=None, data_collator=None,
                 processing_class=None, peft_config=None, **kwargs):
        if not isinstance(args, VLATrainingArguments):
            raise TypeError("VLATrainer needs VLATrainingArguments")
        configure_engine(model, args)
        if peft_config is not None:  # as TRL does: the trainer wraps the model
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if data_collator is None:
            from .models.pi05 import PI05Processor

            if not isinstance(processing_class, PI05Processor):
                raise ValueError("pass a data_collator (or a PI05Processor as processing_class for the default one)")
            data_collator = PI05Collator(processing_class)
        if args.eval_strategy != "no" and eval_dataset is None:
            raise ConfigError(f"eval_strategy={args.eval_strategy.value!r} but there is no eval_dataset (no validation "
                              "split: set validation_ratio > 0)")
        policy_structure(model).freeze(args.freeze)
        # What a checkpoint of this run is (compared on resume): recorded before accelerate wraps or upcasts anything.
        core = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._run_info = {
            "model_type": getattr(core.config, "model_type", type(core).__name__),
            "lora": hasattr(model, "get_base_model"),  # a PeftModel (its base model gets a peft_config too)
            "dtype": "bfloat16" if any(p.dtype == torch.bfloat16 for p in model.parameters()) else "float32",
        }
        if args.process_index == 0:
            from .lora import trainable_parameters

            trainable, total = trainable_parameters(model)
            logger.info("trainable parameters: %s of %s (%.2f%%)%s", f"{trainable:,}", f"{total:,}",
                        100 * trainable / max(total, 1), " (LoRA adapters and trained heads)"
                        if self._run_info["lora"] else "")
        self._saving_checkpoint = False
        tokenizer = getattr(processing_class, "tokenizer", None)
        if tokenizer is not None:  # what the Trainer would align (and warn about, a text-generation concern), silently
            for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
                setattr(core.config, name, getattr(tokenizer, name))
                if getattr(core, "generation_config", None) is not None:
                    setattr(core.generation_config, name, getattr(tokenizer, name))
        super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        finish_engine(self.accelerator)
        if hasattr(self.train_dataset, "num_workers"):  # part of the stream's shard layout, saved with its position
            self.train_dataset.num_workers = max(1, args.dataloader_num_workers)
        from .preemption import PreemptionCallback

        # SIGTERM / SIGINT / SIGUSR1: a checkpoint at the end of the current step, then a clean stop (hf_vla.preemption)
        self._preemption = PreemptionCallback(self)
        self.add_callback(self._preemption)
        self._ema = None
        if args.ema_decay is not None:  # before the rollouts: a rollout of step N sees the average of step N
            from .ema import WeightEMA

            self._ema = WeightEMA(self, args.ema_decay, args.ema_start_step)
            self.add_callback(self._ema)
        if args.rollout_env is not None:  # closed-loop success every rollout_steps steps (hf_vla.rollouts)
            from .rollouts import RolloutCallback

            self.add_callback(RolloutCallback(self))
        # We own the loss and normalise it by step-wide totals ourselves: the Trainer must not divide it again.
        self.model_accepts_loss_kwargs = True
        self._step_losses: list[torch.Tensor] = []  # this optimizer step's micro-batch losses (for on_nonfinite=skip)
        self._nonfinite_batches: list[str] = []  # provenance of this step's non-finite micro-batches
        self._nonfinite_skipped = 0
        self._skipped_since_log = 0
        self._defer_push = False
        # Training metrics the TRL way, flushed in log(): per normalization head, the masked squared-error sum and
        # element count since the last log, so a user sees which embodiment is not learning between evaluations.
        self._metrics = {"train": {"head_sum": None, "head_count": None, "tokens": {}}}

    @property
    def provenance(self):
        """The names behind the indices of the training (or else evaluation) data; None for datasets without one."""
        for dataset in (self.train_dataset, self.eval_dataset):
            if getattr(dataset, "provenance", None) is not None:
                return dataset.provenance
        return None

    # ---- data ----------------------------------------------------------------------------------------------------
    def _loader(self, dataset, collate_fn=None) -> DataLoader:
        # The datasets batch themselves (one list of samples per item); the collator (the trainer's, or `collate_fn`)
        # runs in the workers.
        args = self.args
        workers = args.dataloader_num_workers
        return ForkFriendlyDataLoader(dataset, batch_size=None, num_workers=workers,
                                      collate_fn=collate_fn if collate_fn is not None else self.data_collator,
                                      pin_memory=args.dataloader_pin_memory,
                                      persistent_workers=workers > 0 and args.dataloader_persistent_workers,
                                      prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None)

    def get_train_dataloader(self) -> DataLoader:
        # The stream shards itself by (rank, worker); accelerate must neither dispatch nor re-shard it.
        return self._loader(self.train_dataset)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        # Same: each rank's validation stream already holds exactly its slice.
        return self._loader(eval_dataset if eval_dataset is not None else self.eval_dataset)

    # ---- optimizer -----------------------------------------------------------------------------------------------
    def get_decay_parameter_names(self, model) -> list[str]:
        # The Trainer's rule (no decay on biases and norms, by type and name), and none on token embeddings either.
        from transformers.trainer_pt_utils import get_parameter_names

        return [name for name in get_parameter_names(model, [torch.nn.LayerNorm, torch.nn.Embedding])
                if name in set(super().get_decay_parameter_names(model))]

    def create_optimizer(self, model=None):
        # The Trainer's own optimizer (`optim`, `optim_args`, its decay groups); with a bf16 model and master_weights
        # (outside FSDP2/DeepSpeed, which keep their own masters) the same class runs over fp32 masters.
        if self.optimizer is not None:
            return self.optimizer
        model = model if model is not None else self.model
        bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad)
        if not (self.args.master_weights and bf16 and not self.is_deepspeed_enabled and not self.is_fsdp_enabled):
            return super().create_optimizer(model)
        decay = set(self.get_decay_parameter_names(model))
        groups = [
            {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
             "weight_decay": 0.0},
        ]
        if self.optimizer_cls_and_kwargs is not None:  # given to the Trainer, as its own create_optimizer honours
            optimizer_cls, kwargs = self.optimizer_cls_and_kwargs
            kwargs = dict(kwargs)
        else:
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        reason = _master_weight_incompatibility(optimizer_cls, kwargs)
        if reason:
            optim = getattr(self.args.optim, "value", self.args.optim)
            what = "the given optimizer" if self.optimizer_cls_and_kwargs is not None else f"optim={optim!r}"
            raise ConfigError(f"{what} cannot run over fp32 master weights: {reason}. Set "
                              "master_weights false (or dtype float32), or use an optimizer such as adamw_torch, "
                              "adamw_torch_fused, adafactor or sgd")
        self.optimizer = MasterWeightOptimizer(groups, optimizer_cls=optimizer_cls, **kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        # transformers' cosine_with_min_lr turns `min_lr` into a rate with `optimizer.defaults["lr"]`, which DeepSpeed's
        # ZeRO optimizers do not have: give it the same rate from the learning rate directly.
        kwargs = self.args.lr_scheduler_kwargs
        if (self.lr_scheduler is None and self.args.lr_scheduler_type == "cosine_with_min_lr"
                and isinstance(kwargs, dict) and "min_lr" in kwargs and self.args.learning_rate > 0):
            rate = kwargs["min_lr"] / self.args.learning_rate
            self.args.lr_scheduler_kwargs = {k: v for k, v in kwargs.items() if k != "min_lr"} | {"min_lr_rate": rate}
            try:
                return super().create_scheduler(num_training_steps, optimizer)
            finally:
                self.args.lr_scheduler_kwargs = kwargs
        return super().create_scheduler(num_training_steps, optimizer)

    def _master_optimizer(self) -> MasterWeightOptimizer | None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        return optimizer if isinstance(optimizer, MasterWeightOptimizer) else None

    def _clip_grad_norm(self, model):
        # With master weights, clip the upcast fp32 gradients, not the bf16 ones.
        master = self._master_optimizer()
        if master is not None:
            return master.clip_master_grads(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)

    # ---- the objective -------------------------------------------------------------------------------------------
    def per_sample_loss(self, model, inputs: dict, step: int) -> tuple[PerSampleLoss, Any]:
        """Seeded t and noise, x_t = t*noise + (1-t)*actions, velocity from the policy, masked per-sample sums."""
        if model.training and self.args.image_augmentation != "none" and "pixel_values" in inputs:
            inputs = self._augmented(inputs, step)
        return policy_per_sample_loss(model, inputs, self.args.seed, step)

    def _augmented(self, inputs: dict, step: int) -> dict:
        """`inputs` with `image_augmentation`'s pixel values (`hf_vla.augment`); crop and rotation skip the camera
        slots whose key names a wrist camera, as openpi's."""
        from .augment import AUGMENT_SALT, augment_images, preset
        from .losses import _identities, _sample_seed

        seeds = [_sample_seed(self.args.seed, step, *identity, AUGMENT_SALT) for identity in _identities(inputs)]
        pixels = inputs["pixel_values"]
        geometric = None
        datasets = self.provenance.datasets if self.provenance is not None else []
        if pixels.dim() == 5 and datasets and "source_index" in inputs:
            # the model card's "cameras": the dataset's camera keys in slot order, joined by ", "
            wrist = [["wrist" in key.lower() for key in str(d.get("cameras") or "").split(", ")] for d in datasets]
            geometric = torch.ones(pixels.shape[:2], dtype=torch.bool)
            for row, source in enumerate(inputs["source_index"].tolist()):
                for slot, is_wrist in enumerate(wrist[source][:pixels.shape[1]] if source < len(wrist) else []):
                    geometric[row, slot] = not is_wrist
        return dict(inputs, pixel_values=augment_images(pixels, seeds, preset(self.args.image_augmentation), geometric))

    def _get_num_items_in_batch(self, batch_samples, device):
        # The Trainer fetches all micro-batches of a step first: gather their element counts (and groups) over ranks so
        # every aggregation mode divides by totals spanning the whole optimizer step.
        group_key = GROUP_KEYS[self.args.loss_group_key]
        counts, groups = [], []
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        tokens = []  # target tokens per sample (the token objective's own denominators)
        for batch in batch_samples:
            padding, _ = loss_padding(batch, self.args.seed, self.state.global_step, config)
            counts += valid_elements(padding, batch["action_dim_mask"]).sum(dim=(1, 2)).tolist()
            groups += batch[group_key].tolist()
            if "labels" in batch:
                tokens += (batch["labels"] != -100).sum(-1).tolist()
        if self.accelerator.num_processes > 1:
            gathered = gather_object([(counts, groups, tokens)])
            counts = [c for rank_counts, _, _ in gathered for c in rank_counts]
            groups = [g for _, rank_groups, _ in gathered for g in rank_groups]
            tokens = [t for _, _, rank_tokens in gathered for t in rank_tokens]
        totals = StepTotals.from_counts(counts, groups)
        if tokens:
            totals.tokens = StepTotals.from_counts(tokens, groups)
        return totals

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The trainer owns the objective (DESIGN): the model only predicts the velocity.
        per_sample, outputs = self.per_sample_loss(model, inputs, self.state.global_step)
        totals = num_items_in_batch if isinstance(num_items_in_batch, StepTotals) else None
        group_key = GROUP_KEYS[self.args.loss_group_key]
        if group_key not in inputs:
            raise ValueError(f"loss_group_key={self.args.loss_group_key!r} needs {group_key!r} in every batch (the "
                             f"collator's provenance); this batch has only {sorted(inputs)}")
        groups = inputs[group_key]
        if totals is None:  # a lone batch (outside the training loop) is its own step
            totals = StepTotals.from_counts(per_sample.count.tolist(), groups.tolist())
        weights = sample_weights(self.args.loss_aggregation, per_sample, totals, groups, self.args.loss_divisor)
        loss = (weights * per_sample.sum).sum()
        if "labels" in inputs:  # pi0.5's objective: CE + alpha * flow MSE, each over its own elements
            from .cotraining import token_per_sample_loss

            tokens = token_per_sample_loss(outputs.token_logits, inputs["labels"],
                                           getattr(self.processing_class, "fast_token_range", None))
            token_totals = totals.tokens or StepTotals.from_counts(tokens["ce"].count.tolist(), groups.tolist())
            token_weights = sample_weights(self.args.loss_aggregation, tokens["ce"], token_totals, groups,
                                           self.args.loss_divisor)
            loss = self.args.flow_loss_weight * loss + (token_weights * tokens["ce"].sum).sum()
            if model.training:
                self._record_token_losses(tokens, inputs.get("dataset_index"))
        if model.training and not torch.isfinite(loss):
            self._on_nonfinite_loss(loss, per_sample, inputs)
        if model.training and "dataset_index" in inputs:
            self._record_head_errors(per_sample, inputs["dataset_index"])
        if model.training and self.accelerator.num_processes > 1:
            loss = loss * self.accelerator.num_processes  # DDP/FSDP/DeepSpeed average gradients over ranks
        return (loss, outputs) if return_outputs else loss

    # ---- non-finite guard ----------------------------------------------------------------------------------------
    def _describe_samples(self, inputs: dict, rows: list[int]) -> str:
        provenance = self.provenance
        by_source: dict[str, list[str]] = {}
        for row in rows:
            source = int(inputs["source_index"][row])
            episode = int(inputs["episode_index"][row])
            name = str(source)
            if provenance is not None and source < len(provenance.names):
                name, episode = provenance.names[source], provenance.episode(source, episode)
            frame = f" frame {int(inputs['frame_index'][row])}" if "frame_index" in inputs else ""
            by_source.setdefault(name, []).append(f"episode {episode}{frame}")
        return "; ".join(f"dataset {name!r}: {', '.join(items[:6])}{' ...' if len(items) > 6 else ''}"
                         for name, items in by_source.items())

    def _on_nonfinite_loss(self, loss: torch.Tensor, per_sample: PerSampleLoss, inputs: dict):
        bad = (~torch.isfinite(per_sample.sum)).nonzero().flatten().tolist() or list(range(len(per_sample.sum)))
        where = self._describe_samples(inputs, bad)
        text = (f"non-finite training loss ({loss.item()}) at step {self.state.global_step + 1} (rank "
                f"{self.args.process_index}), from {len(bad)} of {len(per_sample.sum)} samples: {where}")
        if self.args.on_nonfinite == "stop":
            raise NonFiniteError(text + ". No weights were updated with it and no checkpoint was written. The data "
                                 "passed the start-up check for NaN/inf, so the model has most likely diverged: lower "
                                 "learning_rate or max_grad_norm, or set on_nonfinite='skip'.")
        self._nonfinite_batches.append(where)
        logger.warning("%s: this optimizer step will be skipped (on_nonfinite='skip')", text)

    def _record_head_errors(self, per_sample: PerSampleLoss, heads: torch.Tensor):
        provenance = self.provenance
        size = max(len(provenance.head_names) if provenance is not None else 0, int(heads.max()) + 1)
        metrics = self._metrics["train"]
        if metrics["head_sum"] is None or len(metrics["head_sum"]) < size:
            grown = torch.zeros(size, dtype=torch.float64, device=per_sample.sum.device)
            metrics["head_sum"], metrics["head_count"] = grown, grown.clone()
        metrics["head_sum"].index_add_(0, heads.to(per_sample.sum.device), per_sample.sum.detach().double())
        metrics["head_count"].index_add_(0, heads.to(per_sample.sum.device), per_sample.count.detach().double())

    def _record_token_losses(self, tokens: dict, heads: torch.Tensor | None):
        """The window's cross-entropy sums and counts: overall, per component, per head (logged as `ce`, `fast_ce`,
        `text_ce`, `<head>/ce`)."""
        window = self._metrics["train"]["tokens"]
        parts = [(name, loss.sum.detach().sum(), loss.count.detach().sum()) for name, loss in tokens.items()]
        if heads is not None:
            provenance = self.provenance
            for head in heads.unique().tolist():
                rows = heads == head
                name = provenance.head_names[head] if provenance is not None else str(head)
                parts.append((f"{name}/ce", tokens["ce"].sum.detach()[rows].sum(), tokens["ce"].count[rows].sum()))
        for name, total, count in parts:
            before = window.get(name, (0.0, 0.0))
            window[name] = (before[0] + total.double(), before[1] + count.double())

    def _flush_head_errors(self, logs: dict):
        window, self._metrics["train"]["tokens"] = self._metrics["train"]["tokens"], {}
        window = {name: (float(total), float(count)) for name, (total, count) in window.items()}
        if self.accelerator.num_processes > 1:  # every rank logs here; a head one rank did not see is not in its dict
            merged: dict = {}
            for part in gather_object([window]):
                for name, (total, count) in part.items():
                    before = merged.get(name, (0.0, 0.0))
                    merged[name] = (before[0] + total, before[1] + count)
            window = merged
        for name, (total, count) in sorted(window.items()):
            if count > 0:
                logs[name] = total / count
        metrics = self._metrics["train"]
        sums, counts = metrics["head_sum"], metrics["head_count"]
        if sums is None:
            return
        if self.accelerator.num_processes > 1:  # every rank logs here during training
            sums, counts = self.accelerator.reduce(sums, reduction="sum"), self.accelerator.reduce(counts, "sum")
        provenance = self.provenance
        for head, (total, count) in enumerate(zip(sums.tolist(), counts.tolist())):
            if count > 0:
                name = provenance.head_names[head] if provenance is not None else str(head)
                logs[f"{name}/mse"] = total / count
        metrics["head_sum"], metrics["head_count"] = None, None

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Remember this step's micro-batch losses, so a skipped step can be taken out of the logged loss exactly.
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss):  # only reached with on_nonfinite='skip'
            loss = torch.zeros_like(loss)
        self._step_losses.append(loss)
        return loss

    def _get_grad_norm(self, model, grad_norm=None):
        # Runs once per optimizer step on every rank, after gradients are reduced and before the optimizer steps.
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        step_losses, self._step_losses = self._step_losses, []
        nonfinite_batches, self._nonfinite_batches = self._nonfinite_batches, []
        bad_loss = bool(nonfinite_batches)  # only with on_nonfinite='skip': 'stop' raised at the loss already
        if self.args.on_nonfinite == "skip" and self.accelerator.num_processes > 1:  # skip on every rank, or none
            flag = torch.tensor([float(bad_loss)], device=self.args.device)
            bad_loss = bool(self.accelerator.reduce(flag, reduction="sum").item())
        if not bad_loss and (grad_norm is None or math.isfinite(float(grad_norm))):
            return grad_norm
        step = self.state.global_step + 1
        if self.accelerator.num_processes > 1:  # every rank is here: say which rank's data did it
            nonfinite_batches = [f"rank {rank}: {item}" for rank, items in enumerate(gather_object([nonfinite_batches]))
                                 for item in items]
        source = f"non-finite loss in {'; '.join(nonfinite_batches)}" if nonfinite_batches else "the loss was finite"
        if self.args.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite gradient norm ({float(grad_norm)}) at step {step} ({source}); the optimizer did not step "
                "and no checkpoint was written. Lower learning_rate or max_grad_norm, or set on_nonfinite='skip'.")
        # skip: drop the whole optimizer step on every rank (the reduced gradient is non-finite everywhere)
        self.optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        for loss in step_losses:
            self._tr_loss -= loss.to(self._tr_loss.device)
        self._nonfinite_skipped += 1
        self._skipped_since_log += 1
        logger.warning("skipped optimizer step %d (gradient norm %s; %s); %d skipped so far", step, float(grad_norm), source,
                       self._nonfinite_skipped)
        return grad_norm

    def _maybe_log_save_evaluate(self, tr_loss, *args, **kwargs):
        self._window_start = self._globalstep_last_logged  # the Trainer moves it before calling log()
        return super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The stream is infinite: an "epoch" is the share of max_steps done, which also survives a resume (the
        # Trainer counts it from the micro-batches of the current session and restarts it at 0 after a resume).
        if self.state.max_steps:
            self.state.epoch = self.state.global_step / self.state.max_steps
        if "train_loss" in logs:
            logs["train_loss"] = self._run_train_loss()
        # The Trainer divides the window's loss by all its steps; skipped steps contributed nothing to it.
        if "loss" in logs and self._skipped_since_log:
            window = self.state.global_step - getattr(self, "_window_start", 0)
            kept = window - self._skipped_since_log
            logs["loss"] = logs["loss"] * window / kept if kept > 0 else float("nan")
        if "loss" in logs:
            self._skipped_since_log = 0
            self._flush_head_errors(logs)
        if self.args.on_nonfinite == "skip" and ("loss" in logs or "train_loss" in logs):
            logs["nonfinite_skipped"] = self._nonfinite_skipped
        super().log(logs, start_time)

    def _run_train_loss(self) -> float:
        """Mean training loss over every step of the run, resumed sessions included: the logged windows (mean x steps,
        from the log history a checkpoint carries) plus the steps logged in no window, averaged over the ranks (the
        Trainer adds rank 0's unlogged share as if it were everyone's, and divides a resumed session by all steps)."""
        total, last, skipped = 0.0, 0, 0
        for entry in self.state.log_history:
            if "loss" in entry and "step" in entry:
                window_skipped = entry.get("nonfinite_skipped", skipped) - skipped  # skipped steps are not in the mean
                total += entry["loss"] * (entry["step"] - last - window_skipped)
                last, skipped = entry["step"], entry.get("nonfinite_skipped", skipped)
        tail = self._tr_loss.detach().float().reshape(1)
        if self.accelerator.num_processes > 1:
            tail = self.accelerator.gather(tail).mean()  # each rank holds its share x world size (see compute_loss)
        total += float(tail)
        steps = self.state.global_step - self._nonfinite_skipped
        return total / steps if steps > 0 else float("nan")

    def _check_finite_weights(self, model=None):
        """No checkpoint of NaN/inf weights: checked on every rank's (local) parameters before anything is written."""
        model = model if model is not None else self.model
        bad = []
        for name, param in model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.numel() and not torch.isfinite(local).all():
                bad.append(name)
        flag = torch.tensor([len(bad)], dtype=torch.float32, device=self.args.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        if flag.item() > 0:
            raise NonFiniteError(f"refusing to save a checkpoint at step {self.state.global_step}: non-finite weights in "
                                 f"{bad[:5] or 'another rank'}{' ...' if len(bad) > 5 else ''}")

    # ---- evaluation ----------------------------------------------------------------------------------------------
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval") -> EvalLoopOutput:
        # With EMA the pass runs on the averaged weights (and, with ema_eval_raw, once more on the raw ones).
        if self._ema is None:
            return self._evaluation_pass(dataloader, metric_key_prefix)
        with self._ema.swapped():
            output = self._evaluation_pass(dataloader, metric_key_prefix)
        if self.args.ema_eval_raw:
            output.metrics.update(self._evaluation_pass(dataloader, f"{metric_key_prefix}_raw").metrics)
        return output

    def _evaluation_pass(self, dataloader, metric_key_prefix: str) -> EvalLoopOutput:
        # One deterministic pass; one gather_for_metrics per batch carries sums, counts and provenance together;
        # buckets are sum(sum) / sum(count), never a mean of means.
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        model.eval()
        collected: dict[str, list[torch.Tensor]] = {}
        action_errors: dict[int, list[float]] = {}
        for batch_index, inputs in enumerate(dataloader):
            inputs = self._prepare_inputs(inputs)
            with torch.no_grad():
                per_sample, outputs = self.per_sample_loss(model, inputs, EVAL_NOISE_STEP)
            values = {"sum": per_sample.sum, "count": per_sample.count,
                      **{k: inputs[k] for k in ("dataset_index", "source_index", "episode_index")}}
            if "labels" in inputs:  # the token objective: CE per sample and component, beside the MSE
                from .cotraining import token_per_sample_loss

                for name, loss in token_per_sample_loss(outputs.token_logits, inputs["labels"], getattr(
                        self.processing_class, "fast_token_range", None)).items():
                    values[f"{name}_sum"], values[f"{name}_count"] = loss.sum, loss.count
            gathered = self.accelerator.gather_for_metrics(values)
            for key, value in gathered.items():
                collected.setdefault(key, []).append(value.detach().cpu())
            if batch_index < self.args.action_metrics_batches:
                self._action_errors(model, inputs, action_errors)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        data = {k: torch.cat(v) for k, v in collected.items()}
        metrics = self._provenance_metrics(data, metric_key_prefix)
        if self.args.action_metrics_batches:
            merged = gather_object([action_errors])
            names = self.provenance.names if self.provenance is not None else []
            for source in sorted({s for part in merged for s in part}):
                errors = [e for part in merged for e in part.get(source, [])]
                name = names[source] if source < len(names) else str(source)
                metrics[f"{metric_key_prefix}_by_dataset/{name}/action_mse"] = float(sum(errors) / len(errors))
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics,
                              num_samples=int((data["count"] > 0).sum()))

    def _provenance_metrics(self, data: dict, prefix: str) -> dict[str, float]:
        # eval_loss is the training objective's own aggregation over the whole pass (losses.aggregate); the buckets
        # are Σsum / Σcount per head and per dataset (losses.bucket_mse), never a mean of means.
        per_sample = PerSampleLoss(data["sum"].double(), data["count"].double())
        if not (per_sample.count > 0).any():
            raise ValueError("evaluation found no valid validation element")
        groups = data[GROUP_KEYS[self.args.loss_group_key]]
        metrics = {
            f"{prefix}_loss": float(aggregate(self.args.loss_aggregation, per_sample, groups, self.args.loss_divisor)),
            f"{prefix}_mse": float(per_sample.sum.sum() / per_sample.count.sum()),
        }
        provenance = self.provenance
        heads = provenance.head_names if provenance is not None else None
        names = provenance.names if provenance is not None else None
        if "ce_sum" in data:  # the token objective: eval_loss is CE + alpha * MSE, as trained; CE as the MSE is
            ce = PerSampleLoss(data["ce_sum"].double(), data["ce_count"].double())
            metrics[f"{prefix}_loss"] = self.args.flow_loss_weight * metrics[f"{prefix}_loss"] + float(
                aggregate(self.args.loss_aggregation, ce, groups, self.args.loss_divisor))
            from .cotraining import COMPONENTS

            for component in ("ce", *COMPONENTS):
                part = PerSampleLoss(data[f"{component}_sum"].double(), data[f"{component}_count"].double())
                if float(part.count.sum()) > 0:
                    metrics[f"{prefix}_{component}"] = float(part.sum.sum() / part.count.sum())
                    for name, value in bucket_mse(part, data["dataset_index"], heads).items():
                        metrics[f"{prefix}_{name}/{component}"] = value
                    for name, value in bucket_mse(part, data["source_index"], names).items():
                        metrics[f"{prefix}_by_dataset/{name}/{component}"] = value
        for name, mse in bucket_mse(per_sample, data["dataset_index"], heads).items():
            metrics[f"{prefix}_{name}/mse"] = mse
        by_dataset = bucket_mse(per_sample, data["source_index"], names)
        weights = dict(zip(names, provenance.weights)) if provenance is not None else {}
        for name, mse in by_dataset.items():
            metrics[f"{prefix}_by_dataset/{name}/mse"] = mse
        total = sum(weights.get(name, 1.0) for name in by_dataset)
        metrics[f"{prefix}_mixture_mse"] = sum(weights.get(name, 1.0) * mse for name, mse in by_dataset.items()) / total
        return metrics

    @torch.no_grad()
    def _action_errors(self, model, inputs, errors: dict):
        """Un-normalized action MSE of `sample_actions` per source (what robotics users read)."""
        unwrapped = self.accelerator.unwrap_model(model)
        if not hasattr(unwrapped, "sample_actions") or self.processing_class is None:
            return
        generator = torch.Generator().manual_seed(self.args.seed)
        noise = torch.randn(inputs["actions"].shape, generator=generator).to(inputs["actions"].device)
        kwargs = {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "state")}
        predicted = unwrapped.sample_actions(noise=noise, **kwargs)
        for i in range(predicted.shape[0]):
            if inputs["action_is_pad"][i].all():
                continue
            head, source = int(inputs["dataset_index"][i]), int(inputs["source_index"][i])
            valid = ~inputs["action_is_pad"][i]
            ours = self.processing_class.unnormalize_actions(predicted[i][valid].float().cpu(), head)
            truth = self.processing_class.unnormalize_actions(inputs["actions"][i][valid].float().cpu(), head)
            errors.setdefault(source, []).append(float((ours - truth).pow(2).mean()))

    # ---- Hub ------------------------------------------------------------------------------------------------------
    def create_model_card(self, model_name: str | None = None, base_model: str | None = None, **kwargs):
        # hf_vla's card (datasets, per-dataset eval table, training arguments, LoRA) instead of the text-model summary.
        if not self.is_world_process_zero():
            return None
        card = render_model_card(self, model_name=model_name, base_model=base_model)
        card.save(os.path.join(self.args.output_dir, "README.md"))
        return card

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # The Trainer's checkpoint push copies only config and weights: add the auto_map code files (so the Hub repo
        # loads with trust_remote_code at every step) and the model card. Pushed only once the checkpoint is complete.
        if self._defer_push:
            return None
        if self.is_world_process_zero() and self.args.hub_strategy != "end":
            for name in os.listdir(checkpoint_folder):
                if name.endswith(".py"):
                    shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(self.args.output_dir, name))
            self.create_model_card(model_name=self.hub_model_id)
        return super()._push_from_checkpoint(checkpoint_folder)

    # ---- checkpoints and resume ----------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict=None):
        # Under FSDP2 the model's class is torch's FSDP subclass: save the auto_map and code files of its own class.
        with saved_as_own_class(self.model):
            super()._save(output_dir, state_dict)
        if self._run_info["lora"] and not self._saving_checkpoint:
            self._save_merged(output_dir or self.args.output_dir, state_dict)

    def _save_merged(self, output_dir: str, state_dict=None):
        # A LoRA model saved for use (the output directory, rollout snapshots): the Trainer wrote the adapters at the
        # root, where transformers' from_pretrained would load the base's heads instead of the trained ones. The
        # merged model goes to the root (every loader reads it as a checkpoint), the adapters into adapter/.
        from .lora import ADAPTER_DIR, ADAPTER_FILES, merged_state_dict

        model = self.accelerator.unwrap_model(self.model)
        merged = merged_state_dict(model, state_dict)
        if any(value.numel() == 0 for value in merged.values()):  # ZeRO-3 without gathered weights
            logger.warning("%s: the weights were not gathered for saving (ZeRO-3: set "
                           "stage3_gather_16bit_weights_on_model_save); only the adapters are saved", output_dir)
            return
        folder = Path(output_dir)
        adapter = folder / ADAPTER_DIR
        shutil.rmtree(adapter, ignore_errors=True)
        adapter.mkdir(parents=True)
        for name in (*ADAPTER_FILES, "README.md"):  # README.md: peft's adapter card
            if (folder / name).exists():
                os.replace(folder / name, adapter / name)
        core = model.get_base_model()
        with saved_as_own_class(core):
            core.save_pretrained(output_dir, state_dict=merged)

    def _save_checkpoint(self, model, trial):
        # Complete or absent: everything (model, processor, optimizer with masters, scheduler, RNG, trainer state, stream
        # position) is written and flushed, then the completion marker; only then are older checkpoints rotated out
        # and the checkpoint pushed. A failed save (disk full) names the path and the cause and leaves the previous
        # checkpoint intact.
        self._check_finite_weights(model)
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder):  # left by an interrupted save of this same step
            checkpoints.remove_checkpoint(folder)
        self.accelerator.wait_for_everyone()
        limit, self.args.save_total_limit = self.args.save_total_limit, None  # no rotation before completion
        self._defer_push = True
        self._saving_checkpoint = True  # the Trainer's layout (adapters at the root) to resume from
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                # batches drawn: those before the resumed checkpoint, then this run's steps at this run's GA
                step, batches = getattr(self, "_stream_origin", (0, 0))
                state = self.train_dataset.state_dict() | {
                    "batches_consumed": batches + (self.state.global_step - step) * self.args.gradient_accumulation_steps,
                    "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                }
                checkpoints.write_json_atomic(os.path.join(folder, STREAM_STATE), state)
            if self._ema is not None:  # every rank's part of the average, before the completion marker
                os.makedirs(folder, exist_ok=True)
                self._ema.save(folder)
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                checkpoints.mark_complete(folder, self._run_info | {
                    "step": self.state.global_step, "world_size": self.args.world_size,
                    "master_weights": self._master_optimizer() is not None})
        except Exception as error:
            if self.args.should_save and os.path.isdir(folder):
                shutil.rmtree(folder, ignore_errors=True)
            raise CheckpointError(checkpoints.describe_save_error(folder, error) + self._previous_checkpoint_note(
                run_dir, checkpoints.no_space(folder, error)[0])) from error
        finally:
            self.args.save_total_limit = limit
            self._defer_push = False
            self._saving_checkpoint = False
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            checkpoints.rotate(run_dir, limit, protect={self.state.best_model_checkpoint, folder})
        if self.args.push_to_hub:
            self._push_from_checkpoint(folder)

    @staticmethod
    def _previous_checkpoint_note(run_dir: str, disk_full: bool = False) -> str:
        previous, _ = checkpoints.last_complete_checkpoint(run_dir)
        if previous is None:
            return "; there is no earlier complete checkpoint"
        then = "free space, then " if disk_full else ""
        return f"; the previous checkpoint {previous} is intact ({then}--resume_from_checkpoint true resumes from it)"

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # save_pretrained writes PaliGemma's legacy key layout and only from_pretrained maps it back; the Trainer's raw
        # load_state_dict would leave the VLM at its fresh weights with just a warning. Load through from_pretrained.
        model = model if model is not None else self.model
        unwrapped = self.accelerator.unwrap_model(model)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or not isinstance(unwrapped, PreTrainedModel):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        loaded = type(unwrapped).from_pretrained(resume_from_checkpoint, dtype=unwrapped.dtype)
        state = loaded.state_dict()
        missing, unexpected = unwrapped.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in dict(unwrapped.named_buffers())]
        if missing or unexpected:
            raise ValueError(f"{resume_from_checkpoint}: checkpoint does not fit the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    def _load_optimizer_and_scheduler(self, checkpoint):
        # The Trainer maps the optimizer state to args.device, which is "cpu:0" in a multi-process CPU run, and
        # torch.load cannot restore that location: on CPU, load it as "cpu".
        if (checkpoint is None or self.is_deepspeed_enabled or self.is_fsdp_enabled or self.args.device.type != "cpu"
                or self.args.world_size == 1):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.optimizer.load_state_dict(torch.load(os.path.join(checkpoint, "optimizer.pt"), map_location="cpu",
                                                  weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        # Resume only from a complete checkpoint of the same model and precision, and restore the stream position
        # before the Trainer starts iterating (it would otherwise start from zero).
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
            resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
        if resume_from_checkpoint is True:
            resume_from_checkpoint = str(checkpoints.resolve_resume(self.args.output_dir))
        if resume_from_checkpoint:
            folder = checkpoints.check_resumable(resume_from_checkpoint)
            unwrapped = self.accelerator.unwrap_model(self.model)
            core = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
            # compared as save_pretrained writes it (the diff against the config class defaults, JSON keys)
            config = None if self._run_info["lora"] or not hasattr(core, "config") else json.loads(
                core.config.to_json_string(use_diff=True))
            checkpoints.check_compatible(folder, self._run_info | {"master_weights": self._wants_master_weights()},
                                         config)
            # the statistics this run computed from its data against those the checkpoint was trained under
            stats_change = checkpoints.norm_stats_change(folder, getattr(self.processing_class, "norm_stats", None))
            if stats_change is not None and self.args.on_data_change != "restart_epoch":
                raise CheckpointError(
                    f"the normalisation statistics of this run's data differ from the checkpoint's ({stats_change}): "
                    "the data changed since it was written, and resuming would train the same weights under another "
                    "normalisation; resume on the same data, or pass --on_data_change restart_epoch to continue under "
                    "the new statistics")
            if stats_change is not None:
                logger.warning("resuming under new normalisation statistics (%s), as --on_data_change restart_epoch "
                               "allows", stats_change)
            with open(folder / STREAM_STATE) as handle:
                stream_state = json.load(handle)
            marker = checkpoints.read_marker(folder)
            if self.is_deepspeed_enabled and marker.get("world_size", self.args.world_size) != self.args.world_size:
                raise CheckpointError(
                    f"resume_from_checkpoint={str(folder)!r} was written by {marker['world_size']} DeepSpeed processes, "
                    f"this run has {self.args.world_size}: ZeRO partitions do not re-shard here; resume with "
                    f"{marker['world_size']} processes (DDP and FSDP2 checkpoints resume on any number)")
            changed = self.train_dataset.load_state_dict(stream_state, on_data_change=self.args.on_data_change)
            with open(folder / "trainer_state.json") as handle:
                step = int(json.load(handle)["global_step"])
            self._stream_origin = (step, int(stream_state["batches_consumed"]) if changed is None else 0)
            before = stream_state.get("gradient_accumulation_steps")
            if before is not None and before != self.args.gradient_accumulation_steps:
                logger.warning("resuming at step %d with gradient_accumulation_steps %d (the checkpoint used %d): the "
                               "stream continues after batch %d, and each step from here draws %d batches", step,
                               self.args.gradient_accumulation_steps, before, self._stream_origin[1],
                               self.args.gradient_accumulation_steps)
            if changed is not None:
                logger.warning("resuming at step %d: %s", step, changed)
            resume_from_checkpoint = str(folder)
        self._resumed_from = resume_from_checkpoint or None  # the EMA loads its part from there
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)
        finally:  # also when training raised (on_train_end did not run): the signals get their handlers back
            self._preemption.restore_signals()

    def _wants_master_weights(self) -> bool:
        return bool(self.args.master_weights and self._run_info["dtype"] == "bfloat16"
                    and not self.is_deepspeed_enabled and not self.is_fsdp_enabled)


def render_model_card(trainer: VLATrainer, model_name: str | None = None, base_model: str | None = None,
                      extra_args: dict | None = None):
    """The Hub model card of a trainer's model (`hf_vla.card.model_card` with the trainer's state); `extra_args`:
    arguments listed after `CARD_ARGS` (a subclass's own, e.g. RL's `max_train_minutes`)."""
    from .card import model_card

    model = trainer.accelerator.unwrap_model(trainer.model)
    peft_config = getattr(model, "peft_config", None) if hasattr(model, "get_base_model") else None
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    metrics, rollouts = {}, None
    for entry in trainer.state.log_history:
        metrics.update({k: v for k, v in entry.items() if k.startswith("eval_")})
        if "rollout/step" in entry:  # the last closed-loop figures (hf_vla.rollouts)
            rollouts = {"env": trainer.args.rollout_env, "step": int(entry["rollout/step"]),
                        "episodes": trainer.args.rollout_episodes,
                        "success": {k.split("/")[1]: v for k, v in entry.items()
                                    if k.startswith("rollout/") and k.endswith("/success") and k.count("/") == 2}}
    provenance = trainer.provenance
    return model_card(
        core.config, datasets=provenance.datasets if provenance is not None else [], eval_metrics=metrics,
        training_args={k: getattr(trainer.args, k) for k in CARD_ARGS} | (extra_args or {}),
        model_name=model_name or Path(trainer.args.output_dir).name,
        repo_id=_card_location(trainer), base_model=base_model,
        lora=next(iter(peft_config.values())) if peft_config else None, rollouts=rollouts,
        weights=None if trainer.args.ema_decay is None else (
            f"the raw training weights (an EMA with decay {trainer.args.ema_decay} was kept beside them)"
            if trainer.args.ema_save_raw else f"the exponential moving average of the training weights (decay "
            f"{trainer.args.ema_decay}, as openpi's recipes ship), not the last step's raw weights"),
    )


def _card_location(trainer) -> str:
    """What the card's load snippets name: the Hub repository when the model goes there (`hub_model_id`, or the one
    `push_to_hub` created), else the output directory as the run was given it (a bare folder name is no Hub id and
    would not resolve)."""
    args = trainer.args
    if args.hub_model_id:
        return args.hub_model_id
    if args.push_to_hub and getattr(trainer, "hub_model_id", None):
        return trainer.hub_model_id
    return str(args.output_dir)


CARD_ARGS = ("ema_decay", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "learning_rate",
             "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "loss_aggregation", "master_weights",
             "freeze", "image_augmentation", "bf16", "seed")


def _master_weight_incompatibility(optimizer_cls, kwargs: dict) -> str | None:
    """Why an optimizer from `Trainer.get_optimizer_cls_and_kwargs` cannot be wrapped in `MasterWeightOptimizer`."""
    from transformers.trainer_optimizer import is_optimizer_factory

    if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer):
        pass
    elif is_optimizer_factory(optimizer_cls) and getattr(optimizer_cls, "__module__", "").startswith("transformers"):
        return "it is built from the model by a factory"
    else:
        return f"{getattr(optimizer_cls, '__name__', optimizer_cls)} is not a torch.optim.Optimizer"
    for key, what in (("params", "its own parameter groups"), ("model", "the model itself"),
                      ("optimizer_dict", "one optimizer per parameter")):
        if key in kwargs:
            return f"it takes {what}"
    if "bitsandbytes" in getattr(optimizer_cls, "__module__", ""):
        return "bitsandbytes optimizers keep quantized state of the parameters they are given"
    if "schedulefree" in getattr(optimizer_cls, "__module__", "").lower():
        return "schedule-free optimizers must switch the parameters between train and eval points"
    return None
