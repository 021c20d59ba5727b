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
from .data import ForkFriendlyDataLoader, PI05Collator, WeightedDatasetMixture
from .engines import configure_engine, finish_engine
from .errors import CheckpointError, ConfigError, NonFiniteError
from .losses import (
    GROUP_KEYS,
    LOSS_AGGREGATIONS,
    PerSampleLoss,
    StepTotals,
    policy_per_sample_loss,
    sample_weights,
    valid_elements,
)
from .optim import MasterWeightOptimizer

logger = logging.getLogger("hf_vla.trainer")
STREAM_STATE = checkpoints.STREAM_STATE
NONFINITE_CHOICES = ("stop", "skip")
FREEZE_CHOICES = ("none", "vision_tower", "vlm", "expert_only")
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
    """

    loss_aggregation: str = field(default="sample_mean", metadata={"help": f"one of {LOSS_AGGREGATIONS}"})
    loss_divisor: float | None = field(default=None, metadata={"help": "divisor of loss_aggregation=constant"})
    loss_group_key: str = field(default="episode", metadata={"help": "group_mean groups: episode | dataset"})
    master_weights: bool = field(default=True, metadata={"help": "fp32 master weights for a bf16 model"})
    freeze: str = field(default="none", metadata={"help": f"one of {FREEZE_CHOICES}"})
    stream_open_blocks: int = field(default=32, metadata={"help": "episodes open at once per data worker"})
    decoder_threads: int | None = field(default=None, metadata={"help": "threads per video decoder (default: auto)"})
    action_metrics_batches: int = field(default=0, metadata={"help": "validation batches with sample_actions"})
    on_nonfinite: str = field(default="stop", metadata={"help": f"one of {NONFINITE_CHOICES}"})

    # pi0.5's published optimizer and schedule
    learning_rate: float = 2.5e-5
    adam_beta2: float = 0.95
    weight_decay: float = 0.01
    lr_scheduler_type: str = "cosine_with_min_lr"
    lr_scheduler_kwargs: dict | str | None = field(default_factory=lambda: {"min_lr": 2.5e-6})
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
        if self.decoder_threads is not None and self.decoder_threads <= 0:
            raise ConfigError(f"decoder_threads={self.decoder_threads}: must be positive (or unset for automatic)")
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
        if self.loss_group_key not in GROUP_KEYS:
            raise ConfigError(f"loss_group_key={self.loss_group_key!r}: choose one of {sorted(GROUP_KEYS)}")
        if self.freeze not in FREEZE_CHOICES:
            raise ConfigError(f"freeze={self.freeze!r}: choose one of {FREEZE_CHOICES}")
        if self.on_nonfinite not in NONFINITE_CHOICES:
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r}: choose one of {NONFINITE_CHOICES}")
        if self.on_nonfinite == "skip" and self.deepspeed:
            raise ConfigError("on_nonfinite='skip' is not supported under DeepSpeed, which steps the optimizer inside "
                              "backward; use 'stop'")


class VLATrainer(Trainer):
    """Trains any velocity-predicting policy (hf_vla's pi0.5, transformers' pi0, ...) on a LeRobot mixture.

    The trainer owns the objective: it draws t and the noise (seeded per sample), builds x_t, asks the policy for the
    velocity there and reduces the masked squared error into `PerSampleLoss`, aggregated over the whole optimizer
    step. Evaluation is one deterministic pass over the validation mixture, bucketed by provenance.
    """

    def __init__(self, model, args: VLATrainingArguments, mixture: WeightedDatasetMixture, processing_class=None,
                 data_collator=None, **kwargs):
        if not isinstance(args, VLATrainingArguments):
            raise TypeError("VLATrainer needs VLATrainingArguments")
        configure_engine(model, args)
        self.mixture = mixture
        config = model.config
        collator = data_collator or PI05Collator(processing_class)
        image_size = getattr(processing_class, "image_size", None) or config.vlm_config.vision_config.image_size
        train = mixture.train_stream(image_size, config.chunk_size, batch_size=args.per_device_train_batch_size,
                                     collate_fn=collator, seed=args.data_seed if args.data_seed is not None else args.seed,
                                     open_blocks=args.stream_open_blocks, rank=args.process_index,
                                     world_size=args.world_size, decoder_threads=args.decoder_threads)
        evaluation = None
        if any(mixture.validation_blocks):
            evaluation = mixture.validation_stream(image_size, config.chunk_size, args.per_device_eval_batch_size,
                                                   collate_fn=collator, rank=args.process_index,
                                                   world_size=args.world_size, decoder_threads=args.decoder_threads)
        elif args.eval_strategy != "no":
            raise ValueError("eval_strategy is set but the mixture has no validation split (validation_ratio=0)")
        _freeze(model, args.freeze)
        # What a checkpoint of this run is (compared on resume): recorded before accelerate wraps or upcasts anything.
        core = model.get_base_model() if hasattr(model, "peft_config") else model
        self._run_info = {
            "model_type": getattr(core.config, "model_type", type(core).__name__),
            "lora": hasattr(model, "peft_config"),
            "dtype": "bfloat16" if any(p.dtype == torch.bfloat16 for p in model.parameters()) else "float32",
        }
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train, eval_dataset=evaluation,
                         processing_class=processing_class, **kwargs)
        finish_engine(self.accelerator)
        # We own the loss and normalise it by step-wide totals ourselves: the Trainer must not divide it again.
        self.model_accepts_loss_kwargs = True
        self._step_losses: list[torch.Tensor] = []  # this optimizer step's micro-batch losses (for on_nonfinite=skip)
        self._nonfinite_batches: list[str] = []  # provenance of this step's non-finite micro-batches
        self._nonfinite_skipped = 0
        self._skipped_since_log = 0
        self._defer_push = False

    # ---- data ----------------------------------------------------------------------------------------------------
    def _loader(self, dataset) -> DataLoader:
        args = self.args
        workers = args.dataloader_num_workers
        return ForkFriendlyDataLoader(dataset, batch_size=None, num_workers=workers,
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
    def create_optimizer(self, model=None):
        # AdamW without decay on norms, biases and embeddings; fp32 masters for a bf16 model; fused on CUDA.
        if self.optimizer is not None:
            return self.optimizer
        model = model if model is not None else self.model
        decay, no_decay = [], []
        for name, param in model.named_parameters():
            if param.requires_grad:
                lowered = name.lower()
                (no_decay if param.ndim < 2 or "norm" in lowered or "embed" in lowered or name.endswith(".bias")
                 else decay).append(param)
        groups = [{"params": decay, "weight_decay": self.args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        kwargs = {"lr": self.args.learning_rate, "betas": (self.args.adam_beta1, self.args.adam_beta2),
                  "eps": self.args.adam_epsilon}
        if self.args.device.type == "cuda":
            kwargs["fused"] = True
        bf16_params = any(p.dtype == torch.bfloat16 for g in groups for p in g["params"])
        # Under FSDP2 the sharded fp32 parameters are the masters (see `engines.configure_engine`); DeepSpeed keeps its
        # own.
        if self.args.master_weights and bf16_params and not self.is_deepspeed_enabled and not self.is_fsdp_enabled:
            self.optimizer = MasterWeightOptimizer(groups, optimizer_cls=torch.optim.AdamW, **kwargs)
        else:
            self.optimizer = torch.optim.AdamW(groups, **kwargs)
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
        return policy_per_sample_loss(model, inputs, self.args.seed, step)

    def _get_num_items_in_batch(self, batch_samples, device):
        # The Trainer fetches all micro-batches of a step first: gather their element counts (and groups) over ranks so
        # every aggregation mode divides by totals spanning the whole optimizer step.
        group_key = GROUP_KEYS[self.args.loss_group_key]
        counts, groups = [], []
        for batch in batch_samples:
            counts += valid_elements(batch["action_is_pad"], batch["action_dim_mask"]).sum(dim=(1, 2)).tolist()
            groups += batch[group_key].tolist()
        if self.accelerator.num_processes > 1:
            gathered = gather_object([(counts, groups)])
            counts = [c for rank_counts, _ in gathered for c in rank_counts]
            groups = [g for _, rank_groups in gathered for g in rank_groups]
        return StepTotals.from_counts(counts, groups)

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
        if model.training and not torch.isfinite(loss):
            self._on_nonfinite_loss(loss, per_sample, inputs)
        if model.training and self.accelerator.num_processes > 1:
            loss = loss * self.accelerator.num_processes  # DDP/FSDP/DeepSpeed average gradients over ranks
        return (loss, outputs) if return_outputs else loss

    # ---- non-finite guard ----------------------------------------------------------------------------------------
    def _describe_samples(self, inputs: dict, rows: list[int]) -> str:
        names = self.mixture.names
        by_source: dict[str, list[str]] = {}
        for row in rows:
            source = int(inputs["source_index"][row])
            episode = int(inputs["episode_index"][row]) - self.mixture.sources[source].episode_offset
            frame = f" frame {int(inputs['frame_index'][row])}" if "frame_index" in inputs else ""
            by_source.setdefault(names[source] if source < len(names) else str(source), []).append(
                f"episode {episode}{frame}")
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
        # One deterministic pass; one gather_for_metrics per batch carries sums, counts and provenance together;
        # buckets are sum(sum) / sum(count), never a mean of means.
        model = self._wrap_model(self.model, training=False, dataloader=dataloader)
        model.eval()
        keys = ("sum", "count", "dataset_index", "source_index", "episode_index")
        collected: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        action_errors: dict[int, list[float]] = {}
        for batch_index, inputs in enumerate(dataloader):
            inputs = self._prepare_inputs(inputs)
            with torch.no_grad():
                per_sample, _ = self.per_sample_loss(model, inputs, EVAL_NOISE_STEP)
            values = {"sum": per_sample.sum, "count": per_sample.count,
                      **{k: inputs[k] for k in ("dataset_index", "source_index", "episode_index")}}
            gathered = self.accelerator.gather_for_metrics(values)
            for key in keys:
                collected[key].append(gathered[key].detach().cpu())
            if batch_index < self.args.action_metrics_batches:
                self._action_errors(model, inputs, action_errors)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        data = {k: torch.cat(v) for k, v in collected.items()}
        metrics = self._provenance_metrics(data, metric_key_prefix)
        if self.args.action_metrics_batches:
            merged = gather_object([action_errors])
            for source, name in enumerate(self.mixture.names):
                errors = [e for part in merged for e in part.get(source, [])]
                if errors:
                    metrics[f"{metric_key_prefix}_by_dataset/{name}/action_mse"] = float(sum(errors) / len(errors))
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics,
                              num_samples=int((data["count"] > 0).sum()))

    def _provenance_metrics(self, data: dict, prefix: str) -> dict[str, float]:
        total_sum, total_count = data["sum"].double(), data["count"].double()
        present = total_count > 0
        if not present.any():
            raise ValueError("evaluation found no valid validation element")
        metrics = {f"{prefix}_mse": float(total_sum.sum() / total_count.sum())}
        per_sample = torch.where(present, total_sum / total_count.clamp(min=1), torch.zeros_like(total_sum))
        if self.args.loss_aggregation == "token_mean":
            metrics[f"{prefix}_loss"] = metrics[f"{prefix}_mse"]
        elif self.args.loss_aggregation == "constant":
            metrics[f"{prefix}_loss"] = float(total_sum.sum() / (self.args.loss_divisor * present.sum()))
        elif self.args.loss_aggregation == "group_mean":
            groups = data["episode_index" if self.args.loss_group_key == "episode" else "source_index"]
            means = [total_sum[groups == g].sum() / total_count[groups == g].sum()
                     for g in groups[present].unique() if total_count[groups == g].sum() > 0]
            metrics[f"{prefix}_loss"] = float(torch.stack(means).mean())
        else:
            metrics[f"{prefix}_loss"] = float(per_sample[present].mean())
        for head, name in enumerate(self.mixture.head_names):
            rows = data["dataset_index"] == head
            if total_count[rows].sum() > 0:
                metrics[f"{prefix}_{name}/mse"] = float(total_sum[rows].sum() / total_count[rows].sum())
        weighted, weight_total = 0.0, 0.0
        for source, name in enumerate(self.mixture.names):
            rows = data["source_index"] == source
            if total_count[rows].sum() > 0:
                mse = float(total_sum[rows].sum() / total_count[rows].sum())
                metrics[f"{prefix}_by_dataset/{name}/mse"] = mse
                weighted += self.mixture.weights[source] * mse
                weight_total += self.mixture.weights[source]
        metrics[f"{prefix}_mixture_mse"] = weighted / weight_total
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
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save:
                state = self.train_dataset.state_dict() | {
                    "batches_consumed": self.state.global_step * self.args.gradient_accumulation_steps
                }
                checkpoints.write_json_atomic(os.path.join(folder, STREAM_STATE), state)
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                checkpoints.mark_complete(folder, self._run_info | {
                    "step": self.state.global_step, "world_size": self.args.world_size,
                    "master_weights": self._master_optimizer() is not None})
        except Exception as error:
            if self.args.should_save and os.path.isdir(folder):
                shutil.rmtree(folder, ignore_errors=True)
            raise CheckpointError(checkpoints.describe_save_error(folder, error) + self._previous_checkpoint_note(
                run_dir)) from error
        finally:
            self.args.save_total_limit = limit
            self._defer_push = False
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            checkpoints.rotate(run_dir, limit, protect={self.state.best_model_checkpoint, folder})
        if self.args.push_to_hub:
            self._push_from_checkpoint(folder)

    @staticmethod
    def _previous_checkpoint_note(run_dir: str) -> str:
        previous, _ = checkpoints.last_complete_checkpoint(run_dir)
        if previous is None:
            return "; there is no earlier complete checkpoint"
        return f"; the previous checkpoint {previous} is intact (free space, then --resume_from_checkpoint true)"

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
            core = unwrapped.get_base_model() if hasattr(unwrapped, "peft_config") else unwrapped
            # compared as save_pretrained writes it (the diff against the config class defaults, JSON keys)
            config = None if self._run_info["lora"] or not hasattr(core, "config") else json.loads(
                core.config.to_json_string(use_diff=True))
            checkpoints.check_compatible(folder, self._run_info | {"master_weights": self._wants_master_weights()},
                                         config)
            with open(folder / STREAM_STATE) as handle:
                self.train_dataset.load_state_dict(json.load(handle))
            resume_from_checkpoint = str(folder)
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)

    def _wants_master_weights(self) -> bool:
        return bool(self.args.master_weights and self._run_info["dtype"] == "bfloat16"
                    and not self.is_deepspeed_enabled and not self.is_fsdp_enabled)


MODEL_CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "model_cards" / "vla_model_card.md"
CARD_ARGS = ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps", "world_size", "learning_rate",
             "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "loss_aggregation", "master_weights",
             "freeze", "bf16", "seed")


def render_model_card(trainer: VLATrainer, model_name: str | None = None, base_model: str | None = None):
    """The Hub model card of a trainer's model, from `model_cards/vla_model_card.md`."""
    from huggingface_hub import ModelCard, ModelCardData

    if not MODEL_CARD_TEMPLATE.is_file():
        raise FileNotFoundError(f"model card template {MODEL_CARD_TEMPLATE} not found")
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft_config = getattr(model, "peft_config", None)
    core = model.get_base_model() if peft_config else model
    config = core.config
    base_model = base_model or getattr(config, "_name_or_path", None) or None
    if base_model and (os.path.isdir(base_model) or base_model.startswith((".", "/"))):
        base_model = None  # a local path is not a Hub reference
    mixture = trainer.mixture
    datasets = [{"name": s.name, "source": s.config.repo_id or "local", "weight": s.config.weight,
                 "head": s.norm_key, "cameras": ", ".join(c or "(empty)" for c in s.config.cameras)}
                for s in mixture.sources]
    metrics = {}
    for entry in trainer.state.log_history:
        metrics.update({k: v for k, v in entry.items() if k.startswith("eval_")})

    def fmt(value):
        return f"{value:.4g}" if isinstance(value, float) else "–"

    eval_rows = [{"name": name, "mse": fmt(metrics.get(f"eval_by_dataset/{name}/mse")),
                  "action_mse": fmt(metrics.get(f"eval_by_dataset/{name}/action_mse"))}
                 for name in mixture.names if f"eval_by_dataset/{name}/mse" in metrics]
    repo_id = trainer.args.hub_model_id or model_name or Path(trainer.args.output_dir).name
    card_data = ModelCardData(
        library_name="transformers", license="apache-2.0", pipeline_tag="robotics",
        tags=["robotics", "vla", "lerobot", "hf_vla", config.model_type],
        datasets=[s.config.repo_id for s in mixture.sources if s.config.repo_id] or None,
        base_model=base_model,
    )
    lora = None
    if peft_config:
        adapter = next(iter(peft_config.values()))
        lora = f"rank {adapter.r}, alpha {adapter.lora_alpha}, targets `{adapter.target_modules}`"
    first = mixture.sources[0]
    return ModelCard.from_template(
        card_data, template_path=str(MODEL_CARD_TEMPLATE), model_name=model_name or Path(trainer.args.output_dir).name,
        policy_name={"pi05": "pi0.5", "pi0": "pi0"}.get(config.model_type, config.model_type), base_model=base_model,
        chunk_size=config.chunk_size, num_inference_steps=config.num_inference_steps, repo_id=repo_id,
        example_task=first.task(next(iter(first.tasks)), first.usable_episodes()[0]) if first.tasks else "...",
        example_head=first.norm_key, datasets=datasets, eval_rows=eval_rows,
        eval_loss=fmt(metrics["eval_loss"]) if "eval_loss" in metrics else None,
        mixture_mse=fmt(metrics.get("eval_mixture_mse")),
        training_args=[(k, getattr(trainer.args, k)) for k in CARD_ARGS], lora=lora,
    )


def _freeze(model, mode: str):
    """Freeze parts of a pi0 / pi0.5 policy (`model.model.vlm`, `model.model.expert` / `.dit`)."""
    if mode == "none":
        return
    core = model.model
    if mode == "vision_tower":
        frozen = [core.vlm.vision_tower, core.vlm.multi_modal_projector]
    elif mode == "vlm":
        frozen = [core.vlm]
    else:  # expert_only
        expert = getattr(core, "expert", None) or core.dit
        for param in model.parameters():
            param.requires_grad_(False)
        for param in expert.parameters():
            param.requires_grad_(True)
        return
    for module in frozen:
        for param in module.parameters():
            param.requires_grad_(False)
