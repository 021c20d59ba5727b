"""`python -m hf_vla.rl CONFIG.json [--key value ...]` (also under `torchrun` / `accelerate launch`): reinforcement-
learning fine-tuning of a pi0.5 or pi0 policy from its own rollouts.

The JSON holds the fields of `hf_vla.rl.RLConfig` (the project's training arguments plus the rollout and
policy-gradient settings; `max_steps` counts policy updates); `--key value` overrides come on top, decoded as
`python -m hf_vla.train` decodes them. `model_name_or_path` is the policy to start from (an hf_vla output or
checkpoint, a Hub id, a lerobot pi0 / pi0.5 checkpoint, a LoRA adapter directory; pi0 trains with GRPO, PPO's critic
is pi0.5's); env, tasks, image size, episode limit, actions per chunk and cameras come from its deployment contract
unless the config names them. The run writes checkpoints in the training format (resume with
`--resume_from_checkpoint true`; SIGTERM saves one and exits 75), keeps the best by held-out success, and ends with the
final model, its card (start checkpoint, method, budget, success before -> after) and `rl_result.json`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from hf_vla.errors import ConfigError

logger = logging.getLogger("hf_vla.rl")


def _sections(parser):
    """`--help`'s groups: the RL fields, then the training arguments whose RL default differs."""
    import dataclasses

    from hf_vla.parser import field_default
    from hf_vla.rl.config import RLConfig
    from hf_vla.training.trainer import VLATrainingArguments

    base = {f.name: f for f in dataclasses.fields(VLATrainingArguments)}
    fields = [f for f in dataclasses.fields(RLConfig) if f.init and not f.name.startswith("_")]

    def training(item, value):
        return f"; training's: {field_default(base[item.name])}"

    return [("RL fields (every field of `python -m hf_vla.train --help`'s training arguments applies too)",
             [f for f in fields if f.name not in base], None),
            ("training arguments with RL defaults", [f for f in fields if f.name in base
                                                     and field_default(base[f.name]) != field_default(f)], training)]


def rl_parser():
    from hf_vla.parser import CommandParser, HelpStyle
    from hf_vla.rl.config import RLConfig

    return CommandParser("python -m hf_vla.rl", (RLConfig,), __doc__, config_file="required",
                         style=HelpStyle(help_exits=False, what="an RLConfig field", sections=_sections,
                                         types_in_help=False))


def help_text() -> str:
    """`--help`: the module's text, the RL fields, and the training arguments whose RL default differs."""
    return rl_parser().help_text()


def parse_rl_config(path: str | Path, overrides: list[str] | None = None):
    """JSON config + `--key value` overrides -> a validated `RLConfig` (nothing loaded yet)."""
    from hf_vla.cli import check_writable_dir
    from hf_vla.training.arguments import read_config

    parser = rl_parser()
    args = parser.build(read_config(parser, Path(path), overrides), str(path))
    if not args.model_name_or_path:
        raise ConfigError(f"{path}: set model_name_or_path (the policy to improve: an hf_vla output directory, a Hub id "
                          "or a lerobot pi0 / pi0.5 checkpoint)")
    check_writable_dir("output_dir", args.output_dir)
    if args.env:  # an env named here is checked before gigabytes of weights load (the contract's, after loading)
        from hf_vla.evaluation.envs import check_env

        check_env(args.env, args.task, "env=", "task=")
    resume = args.resume_from_checkpoint
    if resume and resume.lower() not in ("true", "false"):
        from hf_vla.training.checkpoints import check_resumable

        check_resumable(resume)
    return args


def load_start(args):
    """The start policy and its processor (a lerobot checkpoint converted, a LoRA adapter merged, on load)."""
    import torch
    from transformers import AutoConfig

    import hf_vla.models.auto  # noqa: F401  (registers pi05 with AutoConfig)
    from hf_vla.hub.resolve import load_error, load_pretrained, resolve_pretrained
    from hf_vla.rl.trainer import check_model_type

    with args.main_process_first(local=True, desc="checkpoint conversion"):
        source = resolve_pretrained(args.model_name_or_path, args.model_revision, label="model_name_or_path")
    revision = None if source != args.model_name_or_path else args.model_revision
    try:
        # the model type from config.json alone: a pi0 given to PPO is refused before gigabytes of weights load
        check_model_type(AutoConfig.from_pretrained(source, revision=revision).model_type, args)
        model, processor = load_pretrained(source, revision=revision, dtype=torch.bfloat16 if args.bf16 else None)
    except (OSError, ValueError) as error:
        raise load_error(error, f"model_name_or_path={args.model_name_or_path!r} could not be loaded",
                         args.model_name_or_path) from error
    return model, processor


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    from hf_vla.parser import answer_early

    if answer_early("rl", argv):  # --help from the cached text; an unknown key refused before torch loads
        return None
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return None
    args = parse_rl_config(argv[0], argv[1:])
    from hf_vla.training.launch import run_checked

    return run_checked(args, lambda: _run(args))


def _run(args):
    from hf_vla.rl.trainer import RLTrainer
    from hf_vla.training.preemption import raise_if_preempted

    model, processor = load_start(args)
    peft_config = None
    if args.lora_preset:
        from hf_vla.training.lora import lora_config

        peft_config = lora_config(args.lora_preset, r=args.lora_r, alpha=args.lora_alpha, model=model)
    trainer = RLTrainer(model, args, processing_class=processor, peft_config=peft_config)
    try:
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        raise_if_preempted(trainer)
        evaluated = [e["step"] for e in trainer.state.log_history if "eval_success" in e]
        if args.eval_strategy != "no" and (not evaluated or evaluated[-1] != trainer.state.global_step):
            trainer.evaluate()  # the final weights' held-out success (what "after" reports)
        trainer.save_model()  # EMA's averaged weights are the model, as python -m hf_vla.train saves it
        trainer.log_metrics("train", result.metrics)
        summary = trainer.rl_summary()
        if args.should_save:
            (Path(args.output_dir) / "rl_result.json").write_text(json.dumps(summary, indent=2) + "\n")
        if args.push_to_hub:
            trainer.push_to_hub()
        elif args.should_save:
            trainer.create_model_card()
    finally:
        trainer.engine.close()
    if args.should_save:
        before = "-" if summary["before"] is None else f"{100 * summary['before']:.1f}%"
        after = "-" if summary["after"] is None else f"{100 * summary['after']:.1f}%"
        print(f"held-out success {before} -> {after} after {summary['updates']} updates ({summary['episodes']} "
              f"episodes); saved the model to {args.output_dir}" + (
                  f"; best checkpoint {summary['best'][1]} ({100 * summary['best'][0]:.1f}%)"
                  if summary["best"][0] is not None and summary["best"][1] else ""), flush=True)
    trainer.accelerator.wait_for_everyone()
    return trainer


def cli(argv: list[str] | None = None):
    from hf_vla.training.launch import launched_cli

    return launched_cli("hf_vla.rl", main, argv)


if __name__ == "__main__":
    cli()
