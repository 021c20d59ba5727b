"""Provenance evaluation (DESIGN: "provenance evaluation"): one deterministic pass over the validation episodes whose
`eval_loss` is the training objective's own aggregation, with the MSE (and, under the token objective, the CE) per
normalisation head and per dataset as sum / count buckets, never a mean of means; plus the un-normalised action error
of `sample_actions` per dataset. A mixin of `VLATrainer`."""

from __future__ import annotations

import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import EvalLoopOutput

from hf_vla.training.cotraining import target_labels
from hf_vla.training.losses import GROUP_KEYS, PerSampleLoss, aggregate, bucket_mse

EVAL_NOISE_STEP = -1  # evaluation draws the same noise every time, so successive evals are comparable


class ProvenanceEvaluation:
    """`Trainer.evaluation_loop` replaced by the provenance pass (with EMA: on the averaged weights)."""

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
            if "advantage" in inputs:  # RECAP: the loss per indicator value too
                values["advantage"] = inputs["advantage"]
            if "value_targets" in inputs:  # a value model: the expected value's absolute error beside the CE
                values["value_abs_sum"] = (outputs.value.float() - inputs["value_targets"].float()).abs()
            labels = target_labels(inputs)
            if labels is not None:  # the token objective (and a subtask): CE per sample and component, beside the MSE
                from hf_vla.training.cotraining import token_per_sample_loss

                width = inputs["subtask_ids"].shape[1] if "subtask_ids" in inputs else 0
                for name, loss in token_per_sample_loss(outputs.token_losses, labels, getattr(
                        self.processing_class, "fast_token_range", None), width).items():
                    values[f"{name}_sum"], values[f"{name}_count"] = loss.sum, loss.count
            if "subtask_ids" in inputs:  # the greedily decoded subtask against the annotated one, per sample
                values["subtask_match"], values["subtask_rows"] = self._subtask_matches(model, inputs)
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
            from hf_vla.training.cotraining import COMPONENTS

            for component in ("ce", *COMPONENTS):
                part = PerSampleLoss(data[f"{component}_sum"].double(), data[f"{component}_count"].double())
                if float(part.count.sum()) > 0:
                    metrics[f"{prefix}_{component}"] = float(part.sum.sum() / part.count.sum())
                    for name, value in bucket_mse(part, data["dataset_index"], heads).items():
                        metrics[f"{prefix}_{name}/{component}"] = value
                    for name, value in bucket_mse(part, data["source_index"], names).items():
                        metrics[f"{prefix}_by_dataset/{name}/{component}"] = value
        if "subtask_rows" in data and float(data["subtask_rows"].sum()) > 0:  # exact match of the decoded subtask
            matches = PerSampleLoss(data["subtask_match"].double(), data["subtask_rows"].double())
            metrics[f"{prefix}_subtask_accuracy"] = float(matches.sum.sum() / matches.count.sum())
            for name, value in bucket_mse(matches, data["source_index"], names).items():
                metrics[f"{prefix}_by_dataset/{name}/subtask_accuracy"] = value
        if "value_abs_sum" in data:  # a value model: its loss is a cross-entropy, named so; and the value's error
            return self._value_metrics(data, per_sample, metrics, prefix, heads, names)
        if "advantage" in data:  # RECAP: the flow MSE of the frames marked positive, negative, or without indicator
            for name, mse in bucket_mse(per_sample, data["advantage"] + 1, ["none", "negative", "positive"]).items():
                metrics[f"{prefix}_by_advantage/{name}/mse"] = mse
        for name, mse in bucket_mse(per_sample, data["dataset_index"], heads).items():
            metrics[f"{prefix}_{name}/mse"] = mse
        by_dataset = bucket_mse(per_sample, data["source_index"], names)
        weights = dict(zip(names, provenance.weights)) if provenance is not None else {}
        for name, mse in by_dataset.items():
            metrics[f"{prefix}_by_dataset/{name}/mse"] = mse
        total = sum(weights.get(name, 1.0) for name in by_dataset)
        metrics[f"{prefix}_mixture_mse"] = sum(weights.get(name, 1.0) * mse for name, mse in by_dataset.items()) / total
        return metrics

    @staticmethod
    def _value_metrics(data: dict, per_sample: PerSampleLoss, metrics: dict, prefix: str, heads, names) -> dict:
        """A value model's pass: `ce` (the mean cross-entropy) and `value_mae` (the expected value's mean absolute
        error against the normalised return), overall, per head and per dataset; `eval_loss` as trained."""
        metrics[f"{prefix}_ce"] = metrics.pop(f"{prefix}_mse")
        absolute = PerSampleLoss(data["value_abs_sum"].double(), per_sample.count)
        metrics[f"{prefix}_value_mae"] = float(absolute.sum.sum() / absolute.count.sum())
        for part, label in ((per_sample, "ce"), (absolute, "value_mae")):
            for name, value in bucket_mse(part, data["dataset_index"], heads).items():
                metrics[f"{prefix}_{name}/{label}"] = value
            for name, value in bucket_mse(part, data["source_index"], names).items():
                metrics[f"{prefix}_by_dataset/{name}/{label}"] = value
        return metrics

    @torch.no_grad()
    def _subtask_matches(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample: 1 where the subtask decoded greedily after its prompt (`generate_subtask`) is exactly the
        annotated one, EOS included; and 1 where the sample has an annotated subtask (the others count nowhere)."""
        mask = inputs["subtask_mask"].bool()
        rows = mask.any(-1)
        match = torch.zeros(len(mask), device=mask.device)
        if rows.any():
            unwrapped = self.accelerator.unwrap_model(model)
            keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "memory_state", "memory_mask")
            decoded = unwrapped.generate_subtask(**{k: inputs[k][rows] for k in keys if k in inputs},
                                                 max_new_tokens=mask.shape[1])
            width = min(decoded.ids.shape[1], mask.shape[1])
            wanted_ids, wanted = inputs["subtask_ids"][rows], mask[rows]
            same = (decoded.mask.sum(-1) == wanted.sum(-1)) & (
                (decoded.ids[:, :width] == wanted_ids[:, :width]) | ~wanted[:, :width]).all(-1)
            match[rows] = same.float()
        return match, rows.float()

    @torch.no_grad()
    def _action_errors(self, model, inputs, errors: dict):
        """Un-normalized action MSE of `sample_actions` per source (what robotics users read)."""
        unwrapped = self.accelerator.unwrap_model(model)
        if not hasattr(unwrapped, "sample_actions") or self.processing_class is None:
            return
        generator = torch.Generator().manual_seed(self.args.seed)
        noise = torch.randn(inputs["actions"].shape, generator=generator).to(inputs["actions"].device)
        kwargs = {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "state",
                                         "memory_state", "memory_mask", "advantage_ids") if k in inputs}
        predicted = unwrapped.sample_actions(noise=noise, **kwargs)
        for i in range(predicted.shape[0]):
            if inputs["action_is_pad"][i].all():
                continue
            head, source = int(inputs["dataset_index"][i]), int(inputs["source_index"][i])
            valid = ~inputs["action_is_pad"][i]
            # robot units; for a relative head both are offsets from one state, which the difference cancels
            ours = self.processing_class.unnormalize(predicted[i][valid].float().cpu(), "actions", head)
            truth = self.processing_class.unnormalize(inputs["actions"][i][valid].float().cpu(), "actions", head)
            errors.setdefault(source, []).append(float((ours - truth).pow(2).mean()))
