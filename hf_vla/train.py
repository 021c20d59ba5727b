"""`python -m hf_vla.train CONFIG.json [--key value ...]` (also under `accelerate launch`).

The JSON holds the fields of three dataclasses: `ModelArguments`, `DataArguments` and `VLATrainingArguments`
(transformers' `TrainingArguments` plus hf_vla's). Command-line overrides come on top: `--max_steps 100`,
`--learning_rate 1e-4`, dotted keys reach into dicts (`--model_config.chunk_size 10`); values are JSON-decoded when
they parse (numbers, booleans, lists), strings otherwise, and a bare `--flag` sets a boolean field to true. A string
in the JSON file where a number, boolean, list or object is expected is decoded the same way (`"1e-3"` is 0.001).

The whole configuration is validated before any model is built or any frame is read: unknown keys (also inside
`model_config` and `datasets`), wrong types, bad values, an unwritable `output_dir`, evaluation without a validation
split, a resume path that is not a complete checkpoint. Errors are printed as one line naming the key, file or value,
and the process exits non-zero (2 for configuration errors, 1 for data and training faults).

`HF_VLA_CPU_SHARDING=1` with `"use_cpu": true` dry-runs an FSDP2 or DeepSpeed launch config on CPU processes (gloo),
e.g. `accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes 2 -m hf_vla.train CONFIG.json`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hf_vla.errors import ConfigError
from hf_vla.parser import answer_early
from hf_vla.training.launch import launched_cli

# public here, as before; loaded on first use, so --help and unknown keys answer before torch is imported
_PUBLIC = {name: "hf_vla.training.arguments" for name in (
    "ATTENTION", "DTYPES", "FINE_TUNE_OVERRIDES", "DataArguments", "ModelArguments", "parse_config",
    "policy_config_class", "training_parser")} | {name: "hf_vla.training.builders" for name in (
    "TINY_LOC_TOKENIZER", "TINY_TOKENIZER", "build_model", "build_tokenizer", "check_data_for_policy", "check_dims",
    "check_token_objective", "model_config", "saved_norm_stats")} | {
    "run_checked": "hf_vla.training.launch", "VLATrainingArguments": "hf_vla.training.trainer"}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hf_vla.train' has no attribute {name!r}")


def parser():
    """The live parser of this command (model, data and training arguments), `--help`'s source."""
    from hf_vla.training.arguments import training_parser

    return training_parser(__doc__)


def help_text() -> str:
    """`--help`: this module's text, then every field with its type, default and help, grouped: model, data, hf_vla
    training, transformers' TrainingArguments."""
    return parser().help_text()


def main(argv: list[str] | None = None):
    """Train from a config; raises `hf_vla.errors.VLAError` subclasses for bad input (see `cli`)."""
    argv = sys.argv[1:] if argv is None else argv
    if answer_early("train", argv):  # --help from the cached text; an unknown key refused before torch loads
        return None
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return None
    if os.environ.get("HF_VLA_CPU_SHARDING") == "1":  # dry-run an FSDP/DeepSpeed launch config on CPU processes
        from hf_vla.training.engines import allow_sharding_on_cpu

        allow_sharding_on_cpu()
    if argv[0].startswith("--"):
        raise ConfigError(f"the first argument must be a config file (a .json path), got {argv[0]!r}: e.g. python -m "
                          f"hf_vla.train configs/demo.json {' '.join(argv[:2])}")
    from hf_vla.training.arguments import parse_config
    from hf_vla.training.launch import run_checked

    model_args, data_args, training_args = parse_config(argv[0], argv[1:])
    return run_checked(training_args, lambda: _train(model_args, data_args, training_args))


def _train(model_args, data_args, training_args):
    # Cheapest first: tokenizer and config, then the data checks and statistics, the weights last.
    from hf_vla.training.builders import (
        build_model,
        build_tokenizer,
        check_data_for_policy,
        check_dims,
        check_token_objective,
        model_config,
        saved_norm_stats,
    )

    tokenizer = build_tokenizer(model_args.tokenizer)
    source = model_args.model_name_or_path
    if source:  # a lerobot checkpoint (Hub id or directory) is converted once per node, then read from the cache
        from hf_vla.hub.resolve import resolve_pretrained

        with training_args.main_process_first(local=True, desc="checkpoint conversion"):
            model_args.model_name_or_path = resolve_pretrained(source, model_args.model_revision, tokenizer=tokenizer,
                                                               label="model_name_or_path")
        if model_args.model_name_or_path != source:
            model_args.model_revision = None  # the converted copy is local
    config = model_config(model_args)
    if getattr(config, "token_loss", False):
        check_token_objective(config, model_args, training_args)
    check_data_for_policy(config, model_args, data_args)
    if training_args.n_action_steps is not None and training_args.n_action_steps > config.chunk_size:
        raise ConfigError(f"n_action_steps={training_args.n_action_steps}: at most the chunk size "
                          f"({config.chunk_size}); it is how many actions of each predicted chunk are executed")
    if data_args.generate_demo_data:
        from hf_vla.envs.generate import ensure_demo_dataset

        ensure_demo_dataset(data_args.datasets[0]["root"], episodes=data_args.demo_episodes,
                            main_process=training_args.process_index == 0)
    from hf_vla.data import WeightedDatasetMixture
    from hf_vla.registry import get_policy
    from hf_vla.training.trainer import VLATrainer

    family = get_policy(model_args.policy)

    # The data checks and exact statistics scan run once per node (the local main process first); the other ranks
    # read its cache. An error there reaches every rank.
    with training_args.main_process_first(local=True, desc="dataset checks and statistics"):
        mixture = WeightedDatasetMixture(data_args.datasets, validation_ratio=data_args.validation_ratio,
                                         split_seed=data_args.split_seed, chunk_size=config.chunk_size)
    if data_args.norm_stats_from:
        mixture.norm_stats = saved_norm_stats(data_args.norm_stats_from, mixture.norm_stats)
    check_dims(config, mixture, from_scratch=model_args.model_name_or_path is None, given=model_args.model_config)
    mixture.check_chunks(config.chunk_size)  # before anything reads chunks (the FAST fit, the streams)
    model = build_model(model_args, config, seed=training_args.seed, full_determinism=training_args.full_determinism)
    if source and model_args.model_name_or_path != source:
        model.config._name_or_path = source  # the model card names the Hub id it was fine-tuned from
    # the family's processor and collator (its setup: a FAST fit, returns as targets)
    processor = family.load("processor").from_config(model.config, tokenizer, norm_stats=mixture.norm_stats,
                                                     head_names=mixture.head_names)
    if family.setup:
        family.load("setup")(processor, model, mixture, model_args, data_args, training_args)
    collator = family.load("collator")(processor)
    from hf_vla.deployment import contract as deployment

    # how the result must be run (cameras and their recorded sizes, actions per chunk, heads, benchmark settings):
    # saved with the processor in every checkpoint, the final output and rollout snapshots
    processor.deployment = deployment.from_training(
        mixture, processor, model.config, model_args.policy, n_action_steps=training_args.n_action_steps,
        # the limit the run validates with: its own, else its rollouts' (rollout_env_kwargs)
        max_episode_steps=training_args.max_episode_steps or (training_args.rollout_env_kwargs or {}).get(
            "max_episode_steps"),
        source={"made_by": "hf_vla.train", "base_model": source or model_args.model_name_or_path}).to_dict()
    train_dataset, eval_dataset = mixture.training_datasets(training_args, image_size=processor.image_size,
                                                            chunk_size=model.config.chunk_size)
    peft_config = None
    if model_args.lora_preset:
        from hf_vla.lora import lora_config

        # the adapters are drawn from the RNG the seeded build left: every rank draws the same ones
        peft_config = lora_config(model_args.lora_preset, r=model_args.lora_r, alpha=model_args.lora_alpha, model=model)
    trainer = VLATrainer(model, training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         data_collator=collator, processing_class=processor, peft_config=peft_config)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    from hf_vla.training.preemption import raise_if_preempted

    raise_if_preempted(trainer)  # a complete checkpoint of this step is written: stop here, resumable
    if trainer._ema is not None and not training_args.ema_save_raw:
        with trainer._ema.swapped():  # the averaged weights are the model (every rank swaps its part)
            trainer.save_model()
    else:
        trainer.save_model()
    if training_args.should_save:  # the normalization of every head, next to the weights
        stats = {"head_names": mixture.head_names, "norm_stats": mixture.norm_stats}
        (Path(training_args.output_dir) / "norm_stats.json").write_text(json.dumps(stats, indent=2))
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)  # train_results.json: train_runtime, train_steps_per_second, ...
    if trainer.eval_dataset is not None:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if training_args.push_to_hub:
        trainer.push_to_hub()  # writes the model card too
    elif training_args.should_save:  # the model card (data, evaluation, closed-loop figures) beside the weights
        trainer.create_model_card()
    if training_args.should_save:
        output_dir = training_args.output_dir
        suggestion = family.next_step.format(output_dir=output_dir) if family.next_step else next_step(output_dir,
                                                                                                      data_args)
        print(f"saved the trained model to {output_dir}: {suggestion}", flush=True)
    # every rank leaves together: a rank that exited while the main one still saved was seen to abort in gloo
    trainer.accelerator.wait_for_everyone()
    return trainer


def next_step(output_dir: str, data_args) -> str:
    """What to do with the trained model: evaluate it in the simulator its data came from (a recording of
    `hf_vla.record`, the demo's), else serve it to the robot whose data it learned."""
    from hf_vla.deployment.contract import benchmark_of

    roots = [Path(spec["root"]) for spec in data_args.datasets if spec.get("root")]
    simulated = data_args.generate_demo_data or any(
        benchmark_of(root) or (root / "meta" / "hf_vla_demo.json").is_file() for root in roots)
    load = f"load it with AutoModel.from_pretrained({output_dir!r})"
    if simulated:
        return f"{load}, or run python -m hf_vla.evaluate --checkpoint {output_dir}"
    return (f"{load}, or serve it to your robot with python -m hf_vla.serve --checkpoint {output_dir} (README: "
            "'On a lerobot robot')")


def cli(argv: list[str] | None = None):
    """The console entry: a bad input or a training fault is one line naming the culprit and a non-zero exit.

    Set `HF_VLA_TRACEBACK=1` to see the full traceback as well.
    """
    return launched_cli("hf_vla.train", main, argv)


if __name__ == "__main__":
    cli()
