"""Convert lerobot (and openpi-converted) pi0 / pi0.5 checkpoints to hf_vla pi0.5 / transformers pi0.

    python -m hf_vla.convert --input lerobot_pi05_dir --output hf_pi05_dir [--tokenizer google/paligemma-3b-pt-224]
        [--overwrite]

reads `config.json` + `model.safetensors` (+ lerobot's normalizer state, when present) and writes a directory that
`AutoModel.from_pretrained` / `AutoProcessor.from_pretrained` load: weights, config, processor with normalization stats.

    python -m hf_vla.convert --input outputs/lora_run/checkpoint-500 --output merged_dir

merges the LoRA adapters of a checkpoint of a LoRA run with their base model (the run's output directory already holds
the merged model). A Hub id needs no conversion (train / evaluate / serve convert lerobot checkpoints on load).

    python -m hf_vla.convert --input outputs/mw --to lerobot_plugin --output outputs/mw_lerobot [--head HEAD]

writes the lerobot-side directory of an hf_vla checkpoint (`config.json` of the policy type `hf_vla`, which the
`lerobot_policy_hf_vla` plugin installed with hf_vla registers, and lerobot's processor files), so lerobot's own tools
run it: `lerobot-eval --policy.path=outputs/mw_lerobot --env.type=metaworld ...`, `lerobot-record --policy.path=...`.
The checkpoint is referenced, not copied (by its path relative to `--output`: keep them side by side).

Every route follows one output rule (`hf_vla.storage.check_output`): `--output` is never an input, above one or in one;
an existing one is replaced only with `--overwrite`, and only when hf_vla wrote an output of that kind there (its
`.hf_vla_output.json`); the new output is staged beside it and renamed into place.

    python -m hf_vla.convert --input outputs/pi05_droid --to lerobot --output exported [--head HEAD]

exports an hf_vla pi0.5 checkpoint to lerobot's own `pi05` format (weights, `config.json`, processor files with one
head's statistics), which lerobot's `PI05Policy.from_pretrained` and its async-inference server load without hf_vla.

    python -m hf_vla.convert --input outputs/pi05_droid --to transformers --output exported [--head HEAD]

exports it to transformers' own pi0.5 format (5.25+: `PI05ForConditionalGeneration`, `PI05Processor`;
docs/transformers.md); the other way, `--input` a directory transformers' pi0.5 and its processor were saved to
writes an hf_vla checkpoint (one head, `--head`, default "default"), which trains as any other.

    python -m hf_vla.convert --input outputs/policy --critic outputs/critic --best_of 8 --output outputs/policy_bo8

bundles a chunk critic (docs/best_of_n.md) with an hf_vla policy: the copy holds it in `critic/` and its deployment
contract records best-of-8 with it, which `evaluate`, `serve`, `record` and the lerobot plugin run without flags.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hf_vla.cli import HUB_ID, run
from hf_vla.errors import ConfigError
from hf_vla.hub.convert import (  # noqa: F401  (public here: hf_vla.convert.convert_lerobot_state_dict)
    checkpoint_model_type,
    config_from_lerobot,
    convert_checkpoint,
    convert_lerobot_state_dict,
    dims_from_weights,
    read_lerobot_norm_stats,
    read_weights,
    weight_shapes,
)
from hf_vla.hub.transformers_format import import_transformers, is_transformers_pi05
from hf_vla.models.pi05.configuration_pi05 import LEGACY_MODEL_TYPE
from hf_vla.parser import CommandParser

logger = logging.getLogger(__name__)


@dataclass
class ConvertArguments:
    """What `python -m hf_vla.convert` reads and writes."""

    input: str | None = field(default=None, metadata={"required": True, "help": "lerobot checkpoint directory "
                              "(config.json + model.safetensors), transformers' own pi0.5 saved with its processor, "
                              "or LoRA adapters (a checkpoint of a LoRA run): merged with their base"})
    output: str | None = field(default=None, metadata={"required": True, "help": "directory to write (new, or "
                               "replaced with --overwrite); never the input or a directory inside or around it"})
    tokenizer: str | None = field(default=None, metadata={"help": "--to hf_vla from a lerobot checkpoint: the tokenizer "
                                  "id or local path (default google/paligemma-3b-pt-224, pi0.5's)"})
    to: str = field(default="hf_vla", metadata={"help": "hf_vla: a lerobot checkpoint (or LoRA adapters) to an hf_vla "
                    "checkpoint; lerobot_plugin: an hf_vla checkpoint's lerobot-side directory (lerobot's tools run "
                    "it through the hf_vla plugin); lerobot: an hf_vla pi0.5 checkpoint in lerobot's native pi05 "
                    "format; transformers: an hf_vla pi0.5 checkpoint in transformers' own pi0.5 format (5.25+)",
                    "choices": ("hf_vla", "lerobot_plugin", "lerobot", "transformers")})
    head: str | None = field(default=None, metadata={"help": "normalization head: the name given to a lerobot "
                             "checkpoint's stats (default 'default'), or the head a lerobot_plugin directory runs "
                             "or a lerobot export holds (default: the checkpoint's only or default head)"})
    n_action_steps: int | None = field(default=None, metadata={"help": "lerobot_plugin and lerobot: actions executed "
                                       "per chunk, 1..chunk_size (default: the checkpoint's contract)", "min": 1})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing --output (after the new one is "
                            "complete)"})
    critic: str | None = field(default=None, metadata={"help": "bundle this chunk critic (a directory trained with "
                               "policy pi05_chunk_critic) with the hf_vla policy --input: --output is the policy with "
                               "the critic in critic/ and best-of-N in its contract"})
    best_of: int | None = field(default=None, metadata={"help": "with --critic: candidate chunks per observation the "
                                "bundle samples (default 8)"})
    vision_heads: int | None = field(default=None, metadata={"help": "--to hf_vla from a lerobot checkpoint whose "
                                     "SigLIP tower is not pi0's So400m: its attention heads (not stored in the weights; "
                                     "default: heads of 64 dims, with a warning)", "min": 1})


def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    args = CommandParser("python -m hf_vla.convert", (ConvertArguments,), __doc__).parse(argv)
    source = Path(args.input)
    if not source.exists() and HUB_ID.match(args.input) and args.input.count("/") == 1:
        raise ConfigError(f"--input {args.input!r}: convert reads a local directory; a Hub id needs no conversion "
                          "step: pass it to train (--model_name_or_path), evaluate or serve (--checkpoint), which "
                          "convert a lerobot checkpoint on load, or call hf_vla.resolve_pretrained(id) for the path")
    if not source.is_dir():
        raise ConfigError(f"--input {args.input!r}: {'is a file, not' if source.exists() else 'no such'} directory")
    if args.best_of is not None and args.critic is None:
        raise ConfigError(f"--best_of {args.best_of}: taken with --critic (bundling a chunk critic)")
    if args.critic is not None:
        return _bundle(source, Path(args.output), args)
    if args.n_action_steps is not None and args.to == "hf_vla":
        raise ConfigError(f"--n_action_steps {args.n_action_steps}: taken with --to lerobot_plugin or --to lerobot; "
                          "a converted or merged checkpoint keeps its source's (change it at evaluate / serve time)")
    if args.vision_heads is not None and args.to != "hf_vla":
        raise ConfigError(f"--vision_heads {args.vision_heads}: taken when converting a lerobot checkpoint (--to "
                          f"hf_vla); --to {args.to} keeps the checkpoint's own config")
    if args.tokenizer is not None and args.to != "hf_vla":
        raise ConfigError(f"--tokenizer {args.tokenizer}: taken when converting a lerobot checkpoint (--to hf_vla); "
                          f"--to {args.to} uses the checkpoint's own tokenizer")
    if args.to == "lerobot_plugin":
        return _plugin_dir(source, Path(args.output), args)
    if args.to == "transformers":
        if args.n_action_steps is not None:
            raise ConfigError(f"--n_action_steps {args.n_action_steps}: transformers' pi0.5 returns whole chunks; "
                              "leave the flag out")
        from hf_vla.cli import setup_logging
        from hf_vla.hub.transformers_format import export_transformers

        setup_logging()
        return export_transformers(source, Path(args.output), head=args.head, overwrite=args.overwrite)
    if args.to == "lerobot":
        from hf_vla.cli import setup_logging
        from hf_vla.hub.export import export_lerobot

        setup_logging()
        return export_lerobot(source, Path(args.output), head=args.head, overwrite=args.overwrite,
                              n_action_steps=args.n_action_steps)
    if (source / "adapter_config.json").is_file() and not (source / "config.json").is_file():
        unused = [flag for flag, value in (("--head", args.head), ("--tokenizer", args.tokenizer)) if value is not None]
        if unused:
            raise ConfigError(f"{', '.join(unused)}: merging LoRA adapters keeps their base's heads and tokenizer; "
                              "leave the flag out")
        return _merge_adapter(source, Path(args.output), args.overwrite)
    if (source / "config.json").is_file():
        model_type = checkpoint_model_type(source, f"--input {str(source)!r}")
        if model_type == LEGACY_MODEL_TYPE and is_transformers_pi05(json.loads((source / "config.json").read_text())):
            if args.tokenizer is not None:
                raise ConfigError(f"--tokenizer {args.tokenizer}: transformers' pi0.5 is imported with the tokenizer "
                                  "saved beside it; leave the flag out")
            from hf_vla.cli import setup_logging

            setup_logging()
            return import_transformers(source, Path(args.output), head=args.head, overwrite=args.overwrite)
        if model_type == LEGACY_MODEL_TYPE:
            unused = [flag for flag, value in (("--head", args.head), ("--tokenizer", args.tokenizer)) if value]
            if unused:
                raise ConfigError(f"{', '.join(unused)}: rewriting a checkpoint of hf_vla's former model type keeps "
                                  "its heads and tokenizer; leave the flag out")
            return _upgrade_legacy(source, Path(args.output), args.overwrite)
        if model_type:
            raise ConfigError(f"--input {args.input!r}: already a transformers checkpoint (model_type {model_type!r}), "
                              "nothing to convert: load it with AutoModel.from_pretrained, or pass it to evaluate / "
                              "serve --checkpoint as it is")
    missing = [name for name in ("config.json", "model.safetensors") if not (source / name).is_file()]
    if missing:
        raise ConfigError(f"--input {args.input!r}: not a lerobot checkpoint directory (no {' or '.join(missing)})")
    head = "default" if args.head is None else args.head
    if not head.strip():
        raise ConfigError("--head: must not be empty")
    from hf_vla.cli import setup_logging

    setup_logging()
    return convert_checkpoint(args.input, args.output, tokenizer=args.tokenizer or "google/paligemma-3b-pt-224",
                              head=head, overwrite=args.overwrite, vision_heads=args.vision_heads)


def _bundle(source: Path, output: Path, args) -> Path:
    """`--critic`: the hf_vla policy `source` with the chunk critic bundled (`hf_vla.serving.critic.bundle_critic`)."""
    unused = [f"--{name}" for name in ("tokenizer", "head", "n_action_steps", "vision_heads")
              if getattr(args, name) is not None]
    if args.to != "hf_vla" or unused:
        raise ConfigError(f"--critic: bundles a critic into an hf_vla checkpoint; leave out "
                          f"{', '.join(unused) or '--to ' + args.to}")
    model_type = checkpoint_model_type(source, f"--input {str(source)!r}")
    from hf_vla.registry import find_policy

    family = find_policy(model_type) if model_type else None
    if family is None or family.value_model or family.chunk_critic:
        raise ConfigError(f"--input {str(source)!r}: --critic bundles a critic with an hf_vla policy checkpoint (its "
                          f"config.json's model_type is {model_type!r})")
    from hf_vla.cli import setup_logging
    from hf_vla.serving.critic import bundle_critic

    setup_logging()
    count = 8 if args.best_of is None else args.best_of
    written = bundle_critic(source, args.critic, output, count, args.overwrite)
    logger.info("bundled the chunk critic %s with %s into %s (best-of-%d)", args.critic, source, output, count)
    return written


def _upgrade_legacy(source: Path, output: Path, overwrite: bool) -> Path:
    """`--input` is a checkpoint hf_vla wrote as model type "pi05" (before its own, `hf_vla_pi05`): the same checkpoint
    (weights, processor, contract, every other file) with the current model type and remote code, so plain transformers
    (whose own pi0.5 is "pi05") never reads it as its own. transformers' own pi0.5 is refused naming its config."""
    from hf_vla.hub.convert import _check_paths
    from hf_vla.hub.resolve import load_pretrained
    from hf_vla.storage import replace_dir, staging_dir, write_marker

    _check_paths(source, output, overwrite)
    try:
        model, processor = load_pretrained(source)
    except ValueError as error:  # transformers' own pi0.5: one line naming the file
        raise ConfigError(f"--input {str(source)!r}: {str(error).splitlines()[0]}") from None
    staging = staging_dir(output, "rewriting")
    shutil.copytree(source, staging)
    model.save_pretrained(staging)  # config.json (the new model type), weights as they were, the remote code
    processor.save_pretrained(staging)
    write_marker(staging, "hf_vla_checkpoint", source=str(source))
    replace_dir(staging, output)
    logger.info("rewrote %s (model type %r) as %s (%r)", source, LEGACY_MODEL_TYPE, output, model.config.model_type)
    return output


def _check_action_steps(source: Path, n_action_steps: int) -> None:
    """`--n_action_steps` within 1..the checkpoint's chunk size, or one line (lerobot refuses the result later)."""
    from hf_vla.deployment import contract as contracts

    deployment = contracts.read(source)
    chunk = deployment.chunk_size if deployment is not None else None
    if chunk is not None and not 1 <= n_action_steps <= chunk:
        raise ConfigError(f"--n_action_steps {n_action_steps}: must be 1..{chunk} (the checkpoint's chunk_size; "
                          "actions executed from each chunk)")


def _plugin_dir(source: Path, output: Path, args) -> Path:
    """`--to lerobot_plugin`: the lerobot-side directory of the hf_vla checkpoint `source`."""
    model_type = checkpoint_model_type(source, f"--input {str(source)!r}")
    if model_type is None and (source / "adapter_config.json").is_file():
        raise ConfigError(f"--input {str(source)!r}: LoRA adapters; pass the run's output directory (the merged "
                          "model), or merge them first: python -m hf_vla.convert --input ADAPTERS --output MERGED")
    from hf_vla.registry import find_policy, policy_names

    family = find_policy(model_type)
    if family is None or not family.lerobot_plugin:
        runnable = [name for name in policy_names() if find_policy(name).lerobot_plugin]
        raise ConfigError(f"--input {str(source)!r}: not an hf_vla checkpoint lerobot's tools can run (config.json "
                          f"model_type {model_type!r}; expected {' or '.join(map(repr, runnable))}); convert a lerobot "
                          "checkpoint first (--to hf_vla)")
    if args.n_action_steps is not None:
        _check_action_steps(source, args.n_action_steps)
    try:
        from lerobot_policy_hf_vla import write_policy_dir
    except ImportError as error:
        raise ConfigError("the lerobot plugin lerobot_policy_hf_vla is not installed: install hf_vla with make install "
                          "(or pip install -e plugins/lerobot_policy_hf_vla)") from error
    written = write_policy_dir(source, output, head=args.head, n_action_steps=args.n_action_steps,
                               overwrite=args.overwrite)
    logger.info("wrote %s: lerobot's tools run it with --policy.path=%s", written, written)
    return written


def _merge_adapter(source: Path, output: Path, overwrite: bool) -> Path:
    """`--input` holds LoRA adapters (a checkpoint of a LoRA run): write the merged model to `--output`."""
    from hf_vla.hub.convert import _check_paths
    from hf_vla.hub.resolve import merged_adapter
    from hf_vla.storage import replace_dir, staging_dir, write_marker

    adapter_config = source / "adapter_config.json"
    try:
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    except (ValueError, AttributeError) as error:
        raise ConfigError(f"--input {str(source)!r}: {adapter_config.name} is not a JSON object ({error})") from None
    base_dir = Path(base).expanduser() if isinstance(base, str) and Path(base).expanduser().is_dir() else None
    _check_paths(source, output, overwrite, inputs={"the adapters' base model": base_dir})
    merged = Path(merged_adapter(source, label="--input"))
    staging = staging_dir(output, "merging")
    shutil.copytree(merged, staging)
    write_marker(staging, "hf_vla_checkpoint", source=str(source))
    replace_dir(staging, output)  # an existing output goes only once the merged one is in place
    logger.info("merged the LoRA adapters of %s with their base into %s", source, output)
    return output


def cli(argv=None):
    written = run("hf_vla.convert", main, argv)
    if written is not None:  # the one line a successful conversion says (its library logs are hidden by default)
        print(f"wrote {written}", flush=True)
    return written


if __name__ == "__main__":
    cli()
