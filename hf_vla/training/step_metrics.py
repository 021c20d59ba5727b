"""What `VLATrainer` logs each window beyond the Trainer's loss: the flow MSE per normalisation head, the token
objective's CE overall, per component and per head (sum / count over the window and every rank), the skipped
non-finite steps, and a run-long `train_loss` that survives a resume. A mixin of `VLATrainer`."""

from __future__ import annotations

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from hf_vla.training.losses import PerSampleLoss


class TrainBegin(TrainerCallback):
    """Notes the step a session starts at (a resumed one at its checkpoint's), so the summary's rates count the steps
    this session ran."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._step_at_train_begin = state.global_step


class StepMetrics:
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
                logs[f"{name}/{metrics.get('head_label', 'mse')}"] = total / count
        metrics["head_sum"], metrics["head_count"] = None, None

    def _maybe_log_save_evaluate(self, tr_loss, *args, **kwargs):
        self._window_start = self._globalstep_last_logged  # the Trainer moves it before calling log()
        return super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The stream is infinite, and the Trainer counts its "epoch" from the micro-batches of the current session
        # (restarting at 0 after a resume, 1.0 at max_steps whatever the data's size): here it is the passes over the
        # training frames the samples so far amount to (all ranks, from the step count, so a resume keeps it; after
        # a resume on another number of processes, the earlier steps are counted at the new batch).
        frames = getattr(self.train_dataset, "frames", None)
        if frames:
            per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size
            self.state.epoch = self.state.global_step * per_step / frames
        elif self.state.max_steps:
            self.state.epoch = self.state.global_step / self.state.max_steps
        if "train_loss" in logs:
            logs["train_loss"] = self._run_train_loss()
        if logs.get("train_runtime"):  # the Trainer rates max_steps over the runtime, also for a run stopped early
            done = self.state.global_step - getattr(self, "_step_at_train_begin", 0)
            per_step = self.args.train_batch_size * self.args.gradient_accumulation_steps * self.args.world_size
            logs["train_steps_per_second"] = round(done / logs["train_runtime"], 3)
            logs["train_samples_per_second"] = round(done * per_step / logs["train_runtime"], 3)
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
