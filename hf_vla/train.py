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

import os
import sys
from pathlib import Path

from hf_vla.errors import ConfigError
from hf_vla.parser import answer_early
from hf_vla.training.launch import launched_cli


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
    from hf_vla.registry import get_policy
    from hf_vla.training.builders import build_trainer
    from hf_vla.training.preemption import raise_if_preempted

    trainer = build_trainer(model_args, data_args, training_args)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    raise_if_preempted(trainer)  # a complete checkpoint of this step is written: stop here, resumable
    trainer.save_model()  # the model for use: EMA's averaged weights, norm_stats.json beside them (VLATrainer)
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
        output_dir, family = training_args.output_dir, get_policy(model_args.policy)
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
