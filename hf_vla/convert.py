"""Convert lerobot (and openpi-converted) pi0 / pi0.5 checkpoints to hf_vla pi0.5 / transformers pi0.

    python -m hf_vla.convert --input lerobot_pi05_dir --output hf_pi05_dir [--tokenizer google/paligemma-3b-pt-224]
        [--overwrite]

reads `config.json` + `model.safetensors` (+ lerobot's normalizer state, when present) and writes a directory that
`AutoModel.from_pretrained` / `AutoProcessor.from_pretrained` load: weights, config, processor with normalization stats.

    python -m hf_vla.convert --input outputs/lora_run/checkpoint-500 --output merged_dir

merges the LoRA adapters of a checkpoint of a LoRA run with their base model (the run's output directory already holds
the merged model). A Hub id needs no conversion (train / evaluate / serve convert lerobot checkpoints on load).
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
    config_from_lerobot,
    convert_checkpoint,
    convert_lerobot_state_dict,
    dims_from_weights,
    read_lerobot_norm_stats,
    read_weights,
    weight_shapes,
)
from hf_vla.parser import CommandParser

logger = logging.getLogger(__name__)


@dataclass
class ConvertArguments:
    """What `python -m hf_vla.convert` reads and writes."""

    input: str | None = field(default=None, metadata={"required": True, "help": "lerobot checkpoint directory "
                              "(config.json + model.safetensors), or LoRA adapters (a checkpoint of a LoRA run): "
                              "merged with their base"})
    output: str | None = field(default=None, metadata={"required": True, "help": "directory to write (new, or "
                               "replaced with --overwrite); never the input or a directory inside or around it"})
    tokenizer: str = field(default="google/paligemma-3b-pt-224", metadata={"help": "tokenizer id or local path"})
    head: str = field(default="default", metadata={"help": "normalization head name for the checkpoint's stats"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing --output (after the new one is "
                            "complete)"})


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
    if (source / "adapter_config.json").is_file() and not (source / "config.json").is_file():
        return _merge_adapter(source, Path(args.output), args.overwrite)
    config_file = source / "config.json"
    if config_file.is_file():
        try:
            model_type = json.loads(config_file.read_text()).get("model_type")
        except (json.JSONDecodeError, AttributeError):
            model_type = None
        if model_type:
            raise ConfigError(f"--input {args.input!r}: already a transformers checkpoint (model_type {model_type!r}), "
                              "nothing to convert: load it with AutoModel.from_pretrained, or pass it to evaluate / "
                              "serve --checkpoint as it is")
    missing = [name for name in ("config.json", "model.safetensors") if not (source / name).is_file()]
    if missing:
        raise ConfigError(f"--input {args.input!r}: not a lerobot checkpoint directory (no {' or '.join(missing)})")
    if not args.head.strip():
        raise ConfigError("--head: must not be empty")
    from hf_vla.cli import setup_logging

    setup_logging()
    return convert_checkpoint(args.input, args.output, tokenizer=args.tokenizer, head=args.head,
                              overwrite=args.overwrite)


def _merge_adapter(source: Path, output: Path, overwrite: bool) -> Path:
    """`--input` holds LoRA adapters (a checkpoint of a LoRA run): write the merged model to `--output`."""
    from hf_vla.hub.resolve import merged_adapter

    if output.exists() and any(output.iterdir()) and not overwrite:
        raise ConfigError(f"--output {str(output)!r} exists: choose a new directory, or pass --overwrite")
    from hf_vla.storage import replace_dir, staging_dir

    merged = Path(merged_adapter(source, label="--input"))
    staging = staging_dir(output, "merging")
    shutil.copytree(merged, staging)
    replace_dir(staging, output)  # an existing output goes only once the merged one is in place
    logger.info("merged the LoRA adapters of %s with their base into %s", source, output)
    return output


def cli(argv=None):
    return run("hf_vla.convert", main, argv)


if __name__ == "__main__":
    cli()
