"""`VLATrainingArguments`: transformers' `TrainingArguments` plus hf_vla's fields, each documented where it is
declared (TRL's config-dataclass style); `python -m hf_vla.train` and `--help` read them from here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_vla.errors import ConfigError
from hf_vla.training.losses import GROUP_KEYS, LOSS_AGGREGATIONS

NONFINITE_CHOICES = ("stop", "skip")
FREEZE_CHOICES = ("none", "vision_tower", "vlm", "expert_only")  # what every policy's `freeze` accepts


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
        target tokens (`labels`, the token objective, `hf_vla.training.cotraining`); each term is aggregated by
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
        (openpi's pi0.5 recipes: 0.999), updated after every optimizer step (`hf_vla.training.ema`); evaluation, rollouts and
        the final model use it. Off by default.
    ema_start_step (`int`, defaults to 0): until this step the average follows the weights.
    ema_save_raw (`bool`, defaults to `False`): save the raw weights as the final model instead of the average.
    ema_eval_raw (`bool`, defaults to `False`): also evaluate the raw weights (`eval_raw_loss`, ...): a second pass.
    on_data_change (`str`, defaults to `"error"`): resuming when the training data changed since the checkpoint
        (datasets, episodes, kept ranges, split or weights) is refused (`error`), or starts the next epoch on the new
        data (`restart_epoch`).
    n_action_steps (`int`, *optional*): actions of each predicted chunk executed before the next is predicted, saved
        in the checkpoint's deployment contract (`deployment_config.json`, `hf_vla.deployment.contract`) so evaluation,
        rollouts and serving use it without a flag; default half the chunk.
    max_episode_steps (`int`, *optional*): the closed-loop episode limit the policy is validated with, saved in the
        contract's benchmark settings (default: the limit the data was recorded with).
    rollout_env (`str`, *optional*): closed-loop rollouts during training (`hf_vla.training.rollouts`) in this env:
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
        training does (`hf_vla.data.augment`: a random 95% crop resized back and a rotation of up to 5 degrees, except on
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
    subtask_dropout: float = field(default=0.1, metadata={"min": 0, "help": "share of annotated samples trained "
                                   "without their subtask, so the policy also acts without one (subtask_layout)"})
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
        import sys

        if self.disable_tqdm is None and not sys.stderr.isatty():
            # Output to a log file or a pipe: the logs as lines (transformers' PrinterCallback), not a live bar that
            # writes a line per refresh and, nested under evaluation's, cursor-movement codes. On a terminal: bars.
            self.disable_tqdm = True
        from transformers.trainer_utils import SchedulerType

        names = [kind.value for kind in SchedulerType]
        given = str(getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type))
        if given not in names:  # before super(), whose message names no key
            import difflib

            close = difflib.get_close_matches(given, names, n=1)
            raise ConfigError(f"lr_scheduler_type={self.lr_scheduler_type!r}: "
                              + (f"did you mean {close[0]!r}? " if close else "") + f"one of {names}")
        if self.max_steps is None or self.max_steps <= 0:  # before super(), which reads it
            raise ConfigError(f"max_steps={self.max_steps}: must be positive (the training stream is infinite)")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "stream_open_blocks"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be positive")
        for name in ("decoder_threads", "n_action_steps", "max_episode_steps"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be positive (or unset for the default)")
        from hf_vla.data.augment import preset

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
        from hf_vla.training.rollouts import check_rollout_args

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
            from hf_vla.parser import _suggest

            raise ConfigError(f"lr_scheduler_kwargs: unknown key(s) {unknown} for lr_scheduler_type "
                              f"{kind.value!r}{_suggest(unknown, sorted(given))}; it takes {sorted(given) or 'none'}")


DEFAULT_SCHEDULER_KWARGS = {"min_lr": 2.5e-6}
