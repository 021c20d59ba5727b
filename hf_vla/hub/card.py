"""Hub model cards for trained policies, from the package's `templates/vla_model_card.md`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MODEL_CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "vla_model_card.md"  # model_cards/ links here
POLICY_NAMES = {"pi05": "pi0.5", "pi0": "pi0"}


@dataclass
class RunFacts:
    """What a run adds to its card. eval_metrics: the trainer's `eval_*` metrics (per-dataset table). training_args:
    the arguments to list. lora: the peft adapter config, if any. rollouts: the last closed-loop figures of
    `hf_vla.training.rollouts` (`env`, `step`, `episodes`, `success` per task), listed in the card and as model-index
    results (metric `success_rate` per task). weights: which weights the files hold (e.g. the EMA's), when not the
    raw ones."""

    eval_metrics: dict | None = None
    training_args: dict | None = None
    lora: object = None
    rollouts: dict | None = None
    weights: str | None = None


def model_card(config, datasets: list[dict], facts: RunFacts | None = None, model_name: str = "policy",
               repo_id: str | None = None, base_model: str | None = None):
    """A `huggingface_hub.ModelCard` for a policy.

    config: the policy's config. datasets: one dict per dataset (name, source, weight, head, cameras, example_task),
    as `hf_vla.data.Provenance.datasets` has them. facts: the run's metrics, arguments, adapter and rollouts.
    model_name / repo_id / base_model: the names its text and metadata use.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    facts = facts or RunFacts()
    eval_metrics, training_args, lora = facts.eval_metrics, facts.training_args, facts.lora
    rollouts, weights = facts.rollouts, facts.weights

    if not MODEL_CARD_TEMPLATE.is_file():
        raise FileNotFoundError(f"model card template {MODEL_CARD_TEMPLATE} not found")
    metrics = eval_metrics or {}
    from hf_vla.registry import find_policy

    family = find_policy(config.model_type)
    policy = family.name if family is not None else config.model_type  # "pi05" for hf_vla's pi0.5 (hf_vla_pi05)
    base_model = base_model or getattr(config, "_name_or_path", None) or None
    if base_model and (os.path.isdir(base_model) or base_model.startswith((".", "/"))):
        base_model = None  # a local path is not a Hub reference

    def fmt(value):
        return f"{value:.4g}" if isinstance(value, float) else "–"

    eval_rows = [{"name": d["name"], "mse": fmt(metrics.get(f"eval_by_dataset/{d['name']}/mse")),
                  "action_mse": fmt(metrics.get(f"eval_by_dataset/{d['name']}/action_mse")),
                  "fast_ce": fmt(metrics.get(f"eval_by_dataset/{d['name']}/fast_ce")),
                  "text_ce": fmt(metrics.get(f"eval_by_dataset/{d['name']}/text_ce"))}
                 for d in datasets if f"eval_by_dataset/{d['name']}/mse" in metrics]
    token_loss = bool(getattr(config, "token_loss", False)) or "eval_ce" in metrics  # pi0.5's token objective
    card_data = ModelCardData(
        library_name="transformers", license="apache-2.0", pipeline_tag="robotics",
        tags=["robotics", "vla", "lerobot", "hf_vla", config.model_type, *(
            [policy] if policy != config.model_type else [])],
        datasets=[d["source"] for d in datasets if d.get("source") not in (None, "local")] or None,
        base_model=base_model,
    )
    rollout_rows = []
    if rollouts:
        rollout_rows = [{"task": task, "success": f"{100 * value:.1f}%"} for task, value in rollouts["success"].items()]
        card_data.model_name = model_name
        card_data.eval_results = [
            EvalResult(task_type="robotics", task_name="closed-loop control", dataset_type=rollouts["env"],
                       dataset_name=task, metric_type="success_rate", metric_name="success rate",
                       metric_value=round(float(value), 4))
            for task, value in rollouts["success"].items()]
    lora_text = None
    if lora is not None:
        targets = lora.target_modules
        lora_text = f"rank {lora.r}, alpha {lora.lora_alpha}, " + (
            f"{len(targets)} linear layers" if isinstance(targets, list | set) else f"targets `{targets}`")
    lora_base = getattr(lora, "base_model_name_or_path", None) if lora is not None else None
    first = datasets[0] if datasets else {}
    return ModelCard.from_template(
        card_data, template_path=str(MODEL_CARD_TEMPLATE), model_name=model_name,
        policy_name=POLICY_NAMES.get(policy, policy), base_model=base_model,
        chunk_size=config.chunk_size, num_inference_steps=config.num_inference_steps, repo_id=repo_id or model_name,
        example_task=first.get("example_task", "..."), example_head=first.get("head", "..."),
        datasets=[{k: d.get(k) for k in ("name", "source", "weight", "head", "cameras")} for d in datasets],
        eval_rows=eval_rows, eval_loss=fmt(metrics["eval_loss"]) if "eval_loss" in metrics else None,
        token_loss=token_loss, eval_ce=fmt(metrics.get("eval_ce")),
        knowledge_insulation=bool(getattr(config, "knowledge_insulation", False)),
        mixture_mse=fmt(metrics.get("eval_mixture_mse")),
        training_args=[(key, _arg(value)) for key, value in (training_args or {}).items()],
        lora=lora_text, lora_base=lora_base, rollout_rows=rollout_rows, rollouts=rollouts, weights=weights,
    )


def _arg(value):
    """A training argument as a user writes it: `warmup_stable_decay`, not `SchedulerType.WARMUP_STABLE_DECAY`;
    `3000`, not `3000.0`."""
    from enum import Enum

    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


def render_model_card(trainer, model_name: str | None = None, base_model: str | None = None,
                      extra_args: dict | None = None):
    """The Hub model card of a trainer's model (`hf_vla.hub.card.model_card` with the trainer's state); `extra_args`:
    arguments listed after `CARD_ARGS` (a subclass's own, e.g. RL's `max_train_minutes`)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft_config = getattr(model, "peft_config", None) if hasattr(model, "get_base_model") else None
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    metrics, rollouts = {}, None
    for entry in trainer.state.log_history:
        metrics.update({k: v for k, v in entry.items() if k.startswith("eval_")})
        if "rollout/step" in entry:  # the last closed-loop figures (hf_vla.training.rollouts)
            rollouts = {"env": trainer.args.rollout_env, "step": int(entry["rollout/step"]),
                        "episodes": trainer.args.rollout_episodes,
                        "success": {k.split("/")[1]: v for k, v in entry.items()
                                    if k.startswith("rollout/") and k.endswith("/success") and k.count("/") == 2}}
    provenance = trainer.provenance
    facts = RunFacts(
        eval_metrics=metrics, training_args={k: getattr(trainer.args, k) for k in CARD_ARGS} | (extra_args or {}),
        lora=next(iter(peft_config.values())) if peft_config else None, rollouts=rollouts,
        weights=None if trainer.args.ema_decay is None else (
            f"the raw training weights (an EMA with decay {trainer.args.ema_decay} was kept beside them)"
            if trainer.args.ema_save_raw else f"the exponential moving average of the training weights (decay "
            f"{trainer.args.ema_decay}, as openpi's recipes ship), not the last step's raw weights"))
    return model_card(core.config, provenance.datasets if provenance is not None else [], facts,
                      model_name=model_name or Path(trainer.args.output_dir).name, repo_id=_card_location(trainer),
                      base_model=base_model)


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


__all__ = ["MODEL_CARD_TEMPLATE", "model_card"]
