"""VLATrainer: a `transformers.Trainer` that owns the flow-matching objective for any velocity-predicting policy.

Written like TRL's trainers: one documented config dataclass (`VLATrainingArguments`, in `training_args.py`), and each
override short, with a comment saying why it exists. Its other jobs live beside it: the provenance evaluation
(`provenance.py`), the logged windows (`step_metrics.py`), checkpoints (`checkpoints.py`), the model card
(`hf_vla.hub.card`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_vla import registry
from hf_vla.data import ForkFriendlyDataLoader, PI05Collator
from hf_vla.errors import CheckpointError, ConfigError, NonFiniteError
from hf_vla.hub.card import render_model_card
from hf_vla.training import checkpoints
from hf_vla.training.cotraining import target_labels
from hf_vla.training.engines import configure_engine, finish_engine, saved_as_own_class
from hf_vla.training.losses import (
    GROUP_KEYS,
    PerSampleLoss,
    StepTotals,
    loss_padding,
    policy_per_sample_loss,
    sample_weights,
    valid_elements,
)
from hf_vla.training.optim import MasterWeightOptimizer
from hf_vla.training.provenance import ProvenanceEvaluation
from hf_vla.training.step_metrics import StepMetrics
from hf_vla.training.structure import policy_structure
from hf_vla.training.training_args import VLATrainingArguments

logger = logging.getLogger("hf_vla.training.trainer")
STREAM_STATE = checkpoints.STREAM_STATE


class VLATrainer(ProvenanceEvaluation, StepMetrics, Trainer):
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
            from hf_vla.models.pi05 import PI05Processor

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
            # the family's name: a run resumed across hf_vla's own model type ("pi05" -> "hf_vla_pi05") matches
            "model_type": getattr(registry.family_of(core), "name", None) or getattr(core.config, "model_type",
                                                                            type(core).__name__),
            "lora": hasattr(model, "get_base_model"),  # a PeftModel (its base model gets a peft_config too)
            "dtype": "bfloat16" if any(p.dtype == torch.bfloat16 for p in model.parameters()) else "float32",
        }
        if args.process_index == 0:
            from hf_vla.training.lora import trainable_parameters

            trainable, total = trainable_parameters(model)
            logger.info("trainable parameters: %s of %s (%.2f%%)%s", f"{trainable:,}", f"{total:,}",
                        100 * trainable / max(total, 1), " (LoRA adapters and trained heads)"
                        if self._run_info["lora"] else "")
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
        from hf_vla.training.preemption import PreemptionCallback

        # SIGTERM / SIGINT / SIGUSR1: a checkpoint at the end of the current step, then a clean stop (hf_vla.training.preemption)
        self._preemption = PreemptionCallback(self)
        self.add_callback(self._preemption)
        from hf_vla.training.step_metrics import TrainBegin

        self.add_callback(TrainBegin(self))  # the summary's rates count this session's steps
        self._ema = None
        self.norm_stats = None  # {"head_names", "norm_stats"} of the data, saved beside the final model (build_trainer)
        if args.ema_decay is not None:  # before the rollouts: a rollout of step N sees the average of step N
            from hf_vla.training.ema import WeightEMA

            self._ema = WeightEMA(self, args.ema_decay, args.ema_start_step)
            self.add_callback(self._ema)
        if args.rollout_env is not None:  # closed-loop success every rollout_steps steps (hf_vla.training.rollouts)
            from hf_vla.training.rollouts import RolloutCallback

            self.add_callback(RolloutCallback(self))
        # We own the loss and normalise it by step-wide totals ourselves: the Trainer must not divide it again.
        self.model_accepts_loss_kwargs = True
        self._step_losses: list[torch.Tensor] = []  # this optimizer step's micro-batch losses (for on_nonfinite=skip)
        self._nonfinite_batches: list[str] = []  # provenance of this step's non-finite micro-batches
        self._nonfinite_skipped = 0
        self._skipped_since_log = 0
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
        if "value_targets" in inputs:  # a value model (RECAP): cross-entropy on the return's bins
            from hf_vla.training.losses import value_per_sample_loss

            return value_per_sample_loss(model, inputs)
        return policy_per_sample_loss(model, inputs, self.args.seed, step)

    def _augmented(self, inputs: dict, step: int) -> dict:
        """`inputs` with `image_augmentation`'s pixel values (`hf_vla.data.augment`); crop and rotation skip the camera
        slots whose key names a wrist camera, as openpi's."""
        from hf_vla.data.augment import AUGMENT_SALT, augment_images, preset
        from hf_vla.training.losses import _identities, _sample_seed

        seeds = [_sample_seed(self.args.seed, step, *identity, AUGMENT_SALT) for identity in _identities(inputs)]
        pixels = inputs["pixel_values"]
        geometric = None
        datasets = self.provenance.datasets if self.provenance is not None else []
        if pixels.dim() in (5, 6) and datasets and "source_index" in inputs:
            # the model card's "cameras": the dataset's camera keys in slot order, joined by ", "
            wrist = [["wrist" in key.lower() for key in str(d.get("cameras") or "").split(", ")] for d in datasets]
            geometric = torch.ones(pixels.shape[:2], dtype=torch.bool)
            for row, source in enumerate(inputs["source_index"].tolist()):
                for slot, is_wrist in enumerate(wrist[source][:pixels.shape[1]] if source < len(wrist) else []):
                    geometric[row, slot] = not is_wrist
        if pixels.dim() == 6:  # MEM's frames [B, cams, T, ...]: the same draws (crop, rotation, colour) for every frame
            return dict(inputs, pixel_values=torch.stack([
                augment_images(pixels[:, :, t], seeds, preset(self.args.image_augmentation), geometric)
                for t in range(pixels.shape[2])], dim=2))
        return dict(inputs, pixel_values=augment_images(pixels, seeds, preset(self.args.image_augmentation), geometric))

    def _get_num_items_in_batch(self, batch_samples, device):
        # The Trainer fetches all micro-batches of a step first: gather their element counts (and groups) over ranks so
        # every aggregation mode divides by totals spanning the whole optimizer step.
        group_key = GROUP_KEYS[self.args.loss_group_key]
        counts, groups = [], []
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        tokens = []  # target tokens per sample (the token objective's own denominators)
        for batch in batch_samples:
            if "value_targets" in batch:  # a value model: one cross-entropy per sample
                counts += [1.0] * len(batch["value_targets"])
                groups += batch[group_key].tolist()
                continue
            padding, _ = loss_padding(batch, self.args.seed, self.state.global_step, config)
            counts += valid_elements(padding, batch["action_dim_mask"]).sum(dim=(1, 2)).tolist()
            groups += batch[group_key].tolist()
            labels = target_labels(batch)
            if labels is not None:
                tokens += (labels != -100).sum(-1).tolist()
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
        labels = target_labels(inputs)
        if labels is not None:  # pi0.5's objective: CE + alpha * flow MSE, each over its own elements
            from hf_vla.training.cotraining import token_per_sample_loss

            tokens = token_per_sample_loss(outputs.token_losses, labels,
                                           getattr(self.processing_class, "fast_token_range", None),
                                           inputs["subtask_ids"].shape[1] if "subtask_ids" in inputs else 0)
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
            self._metrics["train"]["head_label"] = "ce" if "value_targets" in inputs else "mse"
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
        # loads with trust_remote_code at every step) and the model card. Pushed only once the checkpoint is complete
        # (the Trainer's own call, inside its _save_checkpoint, comes before the completion marker: skipped here).
        if checkpoints.incomplete_reason(checkpoint_folder) is not None:
            return None
        if self.is_world_process_zero() and self.args.hub_strategy != "end":
            for name in os.listdir(checkpoint_folder):
                if name.endswith(".py"):
                    shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(self.args.output_dir, name))
            self.create_model_card(model_name=self.hub_model_id)
        return super()._push_from_checkpoint(checkpoint_folder)

    # ---- checkpoints and resume ----------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The model for use in the output directory: with EMA, the averaged weights are the model (unless
        `ema_save_raw`; every rank swaps its part), and `norm_stats.json` (every head's normalisation) goes beside
        them. `Trainer.push_to_hub` saves there again before it uploads: the average again, never the raw weights
        over it. Checkpoints and rollout snapshots (other folders) keep the raw weights, to resume from."""
        final = output_dir is None or os.path.abspath(output_dir) == os.path.abspath(self.args.output_dir)
        if not final or self._ema is None or self.args.ema_save_raw:
            super().save_model(output_dir, _internal_call)
        else:
            with self._ema.swapped():
                super().save_model(output_dir, _internal_call)
        if final and self.args.should_save and self.norm_stats is not None:
            path = os.path.join(output_dir or self.args.output_dir, "norm_stats.json")
            with open(path, "w") as handle:
                json.dump(self.norm_stats, handle, indent=2)

    def _save(self, output_dir: str | None = None, state_dict=None):
        # Under FSDP2 the model's class is torch's FSDP subclass: save the auto_map and code files of its own class.
        with saved_as_own_class(self.model):
            super()._save(output_dir, state_dict)
        checkpoint = os.path.basename(os.path.normpath(output_dir or "")).startswith(f"{PREFIX_CHECKPOINT_DIR}-")
        if self._run_info["lora"] and not checkpoint:  # a checkpoint keeps the Trainer's layout, to resume from
            self._save_merged(output_dir or self.args.output_dir, state_dict)

    def _save_merged(self, output_dir: str, state_dict=None):
        # A LoRA model saved for use (the output directory, rollout snapshots): the Trainer wrote the adapters at the
        # root, where transformers' from_pretrained would load the base's heads instead of the trained ones. The
        # merged model goes to the root (every loader reads it as a checkpoint), the adapters into adapter/.
        from hf_vla.training.lora import ADAPTER_DIR, ADAPTER_FILES, merged_state_dict

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
        # transformers rotates checkpoints inside its _save_checkpoint (a module function, no hook), before this
        # checkpoint is complete: with save_total_limit 1 it would delete the last complete one. So the parent runs
        # without a limit and the rotation below keeps `limit` complete checkpoints once this one is marked.
        limit, self.args.save_total_limit = self.args.save_total_limit, None
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
            raise CheckpointError(checkpoints.describe_save_error(folder, error) + checkpoints.previous_checkpoint_note(
                run_dir, checkpoints.no_space(folder, error)[0])) from error
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            checkpoints.rotate(run_dir, limit, protect={self.state.best_model_checkpoint, folder})
        if self.args.push_to_hub:
            self._push_from_checkpoint(folder)

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
