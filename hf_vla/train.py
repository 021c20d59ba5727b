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

import contextlib
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser

from hf_vla.cli import check_writable_dir
from hf_vla.errors import ConfigError, MissingFileError
from hf_vla.lora import PRESETS
from hf_vla.training.config_checks import (
    check_dataset_specs,
    check_fields,
    check_model_config,
    field_annotations,
    is_bool_field,
)
from hf_vla.training.trainer import VLATrainingArguments

logger = logging.getLogger("hf_vla.train")
POLICIES = ("pi05", "pi0")
DTYPES = ("float32", "bfloat16")
TINY_TOKENIZER = "tiny"
TINY_LOC_TOKENIZER = "tiny_loc"  # with <loc0000>..<loc1023> (a model vocabulary of 2560)
ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass
class ModelArguments:
    """Which policy to train and from where.

    policy: `pi05` (hf_vla) or `pi0` (transformers' own model).
    model_name_or_path: a checkpoint (local dir or Hub id) to start from: hf_vla / transformers, or lerobot's pi0 /
        pi0.5 (e.g. `lerobot/pi05_base`), converted on load and cached (`hf_vla.hub.resolve.resolve_pretrained`); without it
        the policy is built from `model_config` with fresh weights (seeded with `seed`).
    model_revision: the Hub revision (branch, tag or commit) of `model_name_or_path`.
    model_config: config fields for a policy built from scratch (the demo's tiny dims, for example); its keys are
        checked against the policy's config class. With `model_name_or_path`, fields that change no weight's shape
        override the checkpoint's (`FINE_TUNE_OVERRIDES`: openpi fine-tunes pi0.5's base with its own
        `action_horizon`, i.e. `chunk_size`, and `discrete_state_input`); any other is refused.
    tokenizer: tokenizer id or path (real runs: `google/paligemma-3b-pt-224`); `"tiny"` builds the small offline one
        (`"tiny_loc"`: with PaliGemma's `<loc>` tokens, for location targets; model vocabulary 2560).
    attn_implementation: eager | sdpa | flex_attention | flash_attention_2 | flash_attention_3.
    dtype: float32 | bfloat16 (bf16 trains with fp32 master weights unless `master_weights` is off).
    lora_preset: `expert` or `all_linear` (peft LoRA, see `hf_vla.lora`); none trains the full model.
    rtc_max_delay: training-time real-time chunking (pi0.5): each sample gets a committed prefix of up to this many
        actions (clean, at time 0, left out of the loss), so the policy learns to continue the actions a robot
        executes while it infers. Overrides the checkpoint's or `model_config`'s value and is saved with the model.
        Measured on the demo: from scratch it teaches a shortcut (the prefix shows the way, the instruction is not
        learned: 36% success); fine-tuning a trained policy with it keeps the policy and adds the skill.
    rtc_prefix_noise: with `rtc_max_delay`, the std of one offset per sample on its committed prefix (normalised
        units; see `PI05Config`). Overrides the checkpoint's value and is saved with the model. On the demo's RTC
        fine-tune, 0 lost 0.9 points of closed-loop success to no RTC; 0.2 lost 0.1 (10 vs 6 failures of 3,500).
    token_loss: pi0.5's token objective (pi05; docs/cotraining.md): the backbone also predicts each chunk's FAST
        action tokens (cross-entropy beside `flow_loss_weight` x the flow MSE). Saved with the model; inference is
        unchanged.
    knowledge_insulation: with `token_loss`, the expert reads stop-gradient backbone keys/values, so the backbone
        learns from the tokens only (KI, arXiv 2505.23705). Saved with the model.
    fast_tokenizer: a FAST tokenizer to use (`fast_tokenizer.json`, its folder, or a checkpoint trained with the
        token loss); unset, one is fitted at start-up on the training mixture's chunks.
    fast_vocab_size / fast_scale / fast_fit_chunks: the fit's BPE vocabulary, DCT coefficient scale, and how many
        chunks of the training mixture it reads.
    """

    policy: str = field(default="pi05", metadata={"help": f"one of {POLICIES}"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "checkpoint to start from"})
    model_revision: str | None = field(default=None, metadata={"help": "Hub revision of model_name_or_path"})
    model_config: dict | None = field(default=None, metadata={"help": "config of a policy built from scratch"})
    tokenizer: str = field(default="google/paligemma-3b-pt-224", metadata={"help": "tokenizer id/path or 'tiny'"})
    attn_implementation: str = field(default="sdpa", metadata={"help": f"one of {ATTENTION}"})
    dtype: str = field(default="float32", metadata={"help": f"one of {DTYPES}"})
    lora_preset: str | None = field(default=None, metadata={"help": f"one of {sorted(PRESETS)}"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default 2r)"})
    rtc_max_delay: int | None = field(default=None, metadata={
        "help": "training-time RTC: committed prefixes of up to this many actions (pi05; default: the config's)"})
    rtc_prefix_noise: float | None = field(default=None, metadata={
        "help": "training-time RTC: std of a per-sample offset on the committed prefix (default: the config's)"})
    token_loss: bool | None = field(default=None, metadata={
        "help": "pi0.5's token objective: FAST action tokens trained by the backbone (default: the config's)"})
    knowledge_insulation: bool | None = field(default=None, metadata={
        "help": "with token_loss: the flow loss trains only the expert (default: the config's, true)"})
    fast_tokenizer: str | None = field(default=None, metadata={"help": "FAST tokenizer to load (default: fit one)"})
    fast_vocab_size: int = field(default=1024, metadata={"help": "FAST BPE vocabulary when fitted"})
    fast_scale: float = field(default=10.0, metadata={"help": "FAST DCT coefficient scale when fitted"})
    fast_fit_chunks: int = field(default=20_000, metadata={"help": "training chunks the FAST fit reads"})

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ConfigError(f"policy={self.policy!r}: choose one of {POLICIES}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: choose one of {DTYPES}")
        if self.attn_implementation not in ATTENTION:
            raise ConfigError(f"attn_implementation={self.attn_implementation!r}: choose one of {ATTENTION}")
        if self.attn_implementation.startswith("flash_attention"):
            import importlib.util

            package = "flash_attn" if self.attn_implementation == "flash_attention_2" else "flash_attn_interface"
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"attn_implementation={self.attn_implementation!r} needs the {package!r} package, "
                                  "which is not installed; use 'sdpa'")
        if self.lora_preset is not None and self.lora_preset not in PRESETS:
            raise ConfigError(f"lora_preset={self.lora_preset!r}: choose one of {sorted(PRESETS)}")
        if self.lora_r <= 0:
            raise ConfigError(f"lora_r={self.lora_r}: must be positive")
        for name in ("rtc_max_delay", "rtc_prefix_noise"):
            if getattr(self, name) is not None and self.policy != "pi05":
                raise ConfigError(f"{name}={getattr(self, name)}: training-time RTC needs policy 'pi05' (its "
                                  f"action expert takes a time per action token), not {self.policy!r}")
        for name in ("token_loss", "knowledge_insulation", "fast_tokenizer"):
            if getattr(self, name) not in (None, False) and self.policy != "pi05":
                raise ConfigError(f"{name}={getattr(self, name)!r}: the token objective needs policy 'pi05', not "
                                  f"{self.policy!r}")
        if self.fast_vocab_size <= 0 or self.fast_fit_chunks <= 0:
            raise ConfigError(f"fast_vocab_size={self.fast_vocab_size}, fast_fit_chunks={self.fast_fit_chunks}: "
                              "must be positive")
        if not (math.isfinite(self.fast_scale) and self.fast_scale > 0):
            raise ConfigError(f"fast_scale={self.fast_scale}: must be a finite number > 0")
        if self.rtc_prefix_noise is not None and not (math.isfinite(self.rtc_prefix_noise)
                                                      and self.rtc_prefix_noise >= 0):
            raise ConfigError(f"rtc_prefix_noise={self.rtc_prefix_noise}: must be a finite number >= 0")
        if self.model_name_or_path is None and self.model_config is None and self.policy != "pi05":
            raise ConfigError("set model_name_or_path (a checkpoint) or model_config (dims to build from scratch)")
        if self.model_config is not None and self.model_name_or_path is None:
            config_class = policy_config_class(self.policy)
            check_model_config(self.model_config, config_class,
                               default_sub_types={"vlm_config": "paligemma", "dit_config": "gemma"})
            from huggingface_hub.errors import StrictDataclassError

            try:  # builds only the config (no weights): catches wrong types and incompatible tower shapes now
                config_class(**self.model_config)
            except (ValueError, TypeError, StrictDataclassError) as error:
                cause = error.__cause__ if isinstance(error, StrictDataclassError) and error.__cause__ else error
                raise ConfigError(f"model_config: {cause}") from error


# config fields a fine-tune may set over its checkpoint's: none changes a weight's shape
FINE_TUNE_OVERRIDES = {"chunk_size", "num_inference_steps", "tokenizer_max_length", "discrete_state_input",
                       "time_sampling_beta_alpha", "time_sampling_beta_beta", "time_sampling_scale",
                       "time_sampling_offset"}


def _first_difference(given, loaded, where: str) -> str | None:
    """Where a `model_config` value differs from the loaded checkpoint's (dicts compared key by key against the
    sub-config's attributes), or None."""
    if isinstance(given, dict):
        for key, value in given.items():
            theirs = loaded.get(key) if isinstance(loaded, dict) else getattr(loaded, key, None)
            found = _first_difference(value, theirs, f"{where}.{key}")
            if found:
                return found
        return None
    if hasattr(given, "to_dict"):
        given = given.to_dict()
        return _first_difference(given, loaded, where)
    return None if given == loaded else f"{where}={given!r} but the checkpoint has {loaded!r}"


def policy_config_class(policy: str):
    if policy == "pi05":
        from hf_vla.models.pi05 import PI05Config

        return PI05Config
    from transformers import PI0Config

    return PI0Config


def saved_norm_stats(source: str, current: dict) -> dict:
    """The normalisation statistics saved with a checkpoint (`source`: its directory or `norm_stats.json`), for the
    heads of `current` (the mixture's): a head it lacks, or other dims, is refused naming the file."""
    path = Path(source)
    if path.is_dir():  # a training output's norm_stats.json, else a (converted) checkpoint's processor_config.json
        path = path / "norm_stats.json" if (path / "norm_stats.json").is_file() else path / "processor_config.json"
    if not path.is_file():
        raise ConfigError(f"norm_stats_from={source!r}: no norm_stats.json or processor_config.json there (an hf_vla "
                          "output directory or a converted checkpoint has one)")
    try:
        saved = json.loads(path.read_text())["norm_stats"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ConfigError(f"norm_stats_from: {path} is not an hf_vla norm_stats.json ({error})") from None
    stats = {}
    for head, values in current.items():
        if head not in saved:
            raise ConfigError(f"norm_stats_from: {path} has no head {head!r} (it has {sorted(saved)}); the mixture's "
                              "heads must be the checkpoint's")
        for key in ("state", "actions"):
            try:
                ours, theirs = len(values[key]["q01"]), len(saved[head][key]["q01"])
            except (KeyError, TypeError):
                raise ConfigError(f"norm_stats_from: {path} head {head!r} has no {key} q01 (an hf_vla "
                                  "norm_stats.json has q01/q99/mean/std per head for state and actions)") from None
            if ours != theirs:
                raise ConfigError(f"norm_stats_from: head {head!r} {key} has {theirs} dims in {path} but {ours} in "
                                  "the mixture")
            for setting in ("mode", "relative_mask"):  # how the numbers are used must be how this run uses them
                if saved[head][key].get(setting) != values[key].get(setting):
                    raise ConfigError(f"norm_stats_from: head {head!r} {key} {setting} is "
                                      f"{saved[head][key].get(setting)!r} in {path} but {values[key].get(setting)!r} "
                                      "in the mixture (its datasets' normalization / relative_actions): statistics "
                                      "are only reused with the same transforms")
            for name, numbers in saved[head][key].items():  # a NaN here would surface as a diverged model at step 1
                if name in ("mode", "relative_mask", "count"):
                    continue
                bad = _not_finite(numbers)
                if bad:
                    raise ConfigError(f"norm_stats_from: {path} head {head!r} {key} {name}: {bad}")
        stats[head] = saved[head]
    return stats


def _not_finite(numbers) -> str | None:
    """Why a saved statistic is unusable (not a list of numbers, or NaN/inf at some dims), or None."""
    import numpy as np

    try:
        array = np.asarray(numbers, dtype=np.float64)
    except (TypeError, ValueError):
        array = None
    if array is None or array.ndim != 1:
        return "not a list of numbers"
    bad = np.flatnonzero(~np.isfinite(array))
    return f"NaN or inf at dims {bad[:8].tolist()}" if len(bad) else None


@dataclass
class DataArguments:
    """The LeRobot mixture: `datasets` is a list of `hf_vla.data.DatasetConfig` dicts (feature mapping per dataset).

    validation_ratio: share of each dataset's episodes held out for evaluation (deterministic with `split_seed`).
    generate_demo_data: write the built-in demo dataset to the first dataset's `root` when it is missing.
    norm_stats_from: a checkpoint directory (or its `norm_stats.json`) whose normalisation statistics replace the
        mixture's for every head: a policy trained further on grown data (DAgger rounds added to its expert data)
        keeps the normalisation it learned with, instead of one re-computed over the new mixture.
    """

    datasets: list[dict] = field(default_factory=list, metadata={"help": "list of DatasetConfig dicts"})
    validation_ratio: float = field(default=0.0, metadata={"help": "held-out share of episodes"})
    split_seed: int = field(default=0, metadata={"help": "seed of the episode split"})
    generate_demo_data: bool = field(default=False, metadata={"help": "write the demo dataset when missing"})
    demo_episodes: int = field(default=200, metadata={"help": "episodes of the generated demo dataset"})
    norm_stats_from: str | None = field(default=None, metadata={
        "help": "checkpoint dir or norm_stats.json whose normalisation replaces the mixture's"})

    def __post_init__(self):
        if not self.datasets:
            raise ConfigError("datasets: at least one LeRobot dataset is needed")
        self.datasets[:] = check_dataset_specs(self.datasets)
        if not 0.0 <= self.validation_ratio < 1.0:
            raise ConfigError(f"validation_ratio={self.validation_ratio}: must be in [0, 1)")
        if self.demo_episodes <= 0:
            raise ConfigError(f"demo_episodes={self.demo_episodes}: must be positive")


def _decode(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _apply_overrides(config: dict, overrides: list[str], annotations: dict) -> None:
    overrides = list(overrides)
    while overrides:
        flag = overrides.pop(0)
        if not flag.startswith("--"):
            raise ConfigError(f"override {flag!r}: expected --key value")
        key = flag[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif overrides and not overrides[0].startswith("--"):
            value = overrides.pop(0)
        else:  # a bare flag: only a boolean field may be set that way
            name = key.replace("-", "_")
            if name not in annotations or not is_bool_field(annotations[name]):
                raise ConfigError(f"--{key} needs a value (only boolean fields may be given as a bare flag)")
            value = "true"
        key = key.replace("-", "_")
        target, *path_keys = key.split(".")
        if target not in annotations:  # a typo on the command line is the command line's, not the config file's
            from hf_vla.training.config_checks import _suggest

            raise ConfigError(f"command line: --{key}: unknown argument{_suggest([target], annotations)} (not a "
                              "model, data or training argument; python -m hf_vla.train --help lists them)")
        if path_keys:
            node = config.setdefault(target, [] if target == "datasets" else {})
            where = target
            for part in path_keys[:-1]:
                node = _child(node, part, key, where)
                where = f"{where}.{part}"
            leaf = path_keys[-1]
            if isinstance(node, list):  # --datasets.0 '{...}': one whole entry
                node[_index(node, leaf, key, where)] = _decode(value)
            elif isinstance(node, dict):
                node[leaf] = _decode(value)
            else:
                raise ConfigError(f"override --{key}: {where!r} is not an object")
        else:
            config[target] = _decode(value)


def _index(node: list, part: str, key: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override --{key}: {where} is a list of {len(node)} entr{'y' if len(node) == 1 else 'ies'}; "
                          f"use an index 0..{len(node) - 1} (--{where}.0.<field> VALUE), or give the whole list")
    return int(part)


def _child(node, part: str, key: str, where: str):
    """One step of a dotted override into dicts (created when missing) and lists (by index: `datasets.0.cameras`)."""
    if isinstance(node, list):
        child = node[_index(node, part, key, where)]
    elif isinstance(node, dict):
        child = node.setdefault(part, {})
    else:
        raise ConfigError(f"override --{key}: {where!r} is not an object")
    if not isinstance(child, dict | list):
        raise ConfigError(f"override --{key}: {where}.{part} is {child!r}, not an object or list")
    return child


def help_text(width: int = 110) -> str:
    """`--help`: the module's usage text, then every field with its type, default and help, grouped: model, data,
    hf_vla training, transformers' TrainingArguments."""
    import dataclasses
    import textwrap

    from transformers import TrainingArguments

    inherited = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    groups = [("model (ModelArguments)", ModelArguments, None), ("data (DataArguments)", DataArguments, None),
              ("hf_vla training (VLATrainingArguments)", VLATrainingArguments, False),
              ("transformers TrainingArguments (all apply)", VLATrainingArguments, True)]
    lines = [__doc__.strip(), "", "Every field below is a JSON key of the config and a --key VALUE override.",
             "Library logs (FFmpeg, datasets, lerobot, DeepSpeed) are hidden unless --verbose is given."]
    for title, kind, from_transformers in groups:
        lines += ["", f"{title}:"]
        for item in dataclasses.fields(kind):
            if not item.init or item.name.startswith("_"):
                continue
            if from_transformers is not None and (item.name in inherited) != from_transformers:
                continue
            if item.default is not dataclasses.MISSING:
                default = item.default
            elif item.default_factory is not dataclasses.MISSING:
                default = item.default_factory()
            else:
                default = "(required)"
            default = getattr(default, "value", default)  # enums as written in a config
            kind_name = getattr(item.type, "__name__", None) or str(item.type).replace("typing.", "")
            kind_name = kind_name.replace("transformers.training_args.", "")
            shown = json.dumps(default) if default is None or isinstance(default, bool | list | dict) else default
            original = inherited.get(item.name)
            ours = ""
            if original is not None and original.default is not dataclasses.MISSING and getattr(
                    original.default, "value", original.default) != default:
                ours = f"; hf_vla's default, transformers' is {getattr(original.default, 'value', original.default)}"
            lines.append(f"  --{item.name} ({kind_name}, default: {shown}{ours})")
            text = item.metadata.get("help") or (original.metadata.get("help", "") if original is not None else "")
            text = " ".join(str(text).split())
            if text:
                lines += textwrap.wrap(text, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def read_config_file(path: Path) -> dict:
    """A JSON config file as a dict (its free-form `//` comment dropped); one line naming the file otherwise."""
    if not path.is_file():
        raise MissingFileError(f"config file {path} not found")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the configuration must be a JSON object, got {type(config).__name__}")
    config.pop("//", None)  # free-form comment key
    return config


def parse_config(path: str | Path, overrides: list[str] | None = None):
    """JSON config + `--key value` overrides -> (ModelArguments, DataArguments, VLATrainingArguments), validated.

    Nothing is loaded or created: a bad key, type or value raises `ConfigError` naming it.
    """
    path = Path(path)
    config = read_config_file(path)
    parser = HfArgumentParser((ModelArguments, DataArguments, VLATrainingArguments))
    annotations = {}
    for dataclass_type in parser.dataclass_types:
        annotations.update(field_annotations(dataclass_type))
    _apply_overrides(config, overrides or [], annotations)
    if isinstance(config.get("resume_from_checkpoint"), bool):  # `--resume_from_checkpoint true`: newest complete
        config["resume_from_checkpoint"] = "true" if config["resume_from_checkpoint"] else None
    deepspeed = config.get("deepspeed") or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed and config.get("dtype") == "bfloat16" and "bf16" not in config and not config.get("fp16"):
        # a bfloat16 model under DeepSpeed trains in its bf16 mode (fp32 master partitions); the DeepSpeed plugin
        # takes its precision when the training arguments are built, so it is set here
        config["bf16"] = True
    unknown = sorted(set(config) - set(annotations))
    if unknown:
        from hf_vla.training.config_checks import _suggest

        raise ConfigError(f"{path}: unknown key(s) {unknown}{_suggest(unknown, annotations)} (not a model, data or "
                          "training argument)")
    config = check_fields(config, parser.dataclass_types)
    try:
        model_args, data_args, training_args = parser.parse_dict(config, allow_extra_keys=False)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{path}: {error}") from error
    _check_combination(model_args, data_args, training_args)
    return model_args, data_args, training_args


def _check_combination(model_args: ModelArguments, data_args: DataArguments, args: VLATrainingArguments):
    """Rules that span the three argument groups."""
    if args.eval_strategy != "no" and data_args.validation_ratio == 0:
        raise ConfigError(f"eval_strategy={args.eval_strategy.value!r} needs a validation split: set validation_ratio "
                          "> 0 (for example 0.01), or eval_strategy 'no'")
    check_writable_dir("output_dir", args.output_dir)
    if model_args.dtype == "bfloat16" and args.fp16:
        raise ConfigError("dtype='bfloat16' with fp16=true: choose one precision")
    resume = args.resume_from_checkpoint
    if resume and resume.lower() not in ("true", "false"):
        from hf_vla.training.checkpoints import check_resumable

        check_resumable(resume)


def build_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name in (TINY_TOKENIZER, TINY_LOC_TOKENIZER):
        from hf_vla.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer(locations=name == TINY_LOC_TOKENIZER)
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        from hf_vla.hub.resolve import load_error

        raise load_error(error, f"tokenizer={name!r} could not be loaded", name) from error


def model_config(model_args: ModelArguments):
    """The policy's config, without any weights: from the checkpoint's config.json or from `model_config`, with
    `rtc_max_delay` and `rtc_prefix_noise` applied."""
    config = _base_model_config(model_args)
    if model_args.rtc_max_delay is not None:
        if not 0 <= model_args.rtc_max_delay < config.chunk_size:
            raise ConfigError(f"rtc_max_delay={model_args.rtc_max_delay}: must be in [0, chunk_size="
                              f"{config.chunk_size}) (a committed prefix shorter than the chunk)")
        config.rtc_max_delay = model_args.rtc_max_delay
    if model_args.rtc_prefix_noise is not None:
        if model_args.rtc_prefix_noise > 0 and not config.rtc_max_delay:
            raise ConfigError(f"rtc_prefix_noise={model_args.rtc_prefix_noise}: only used with training-time RTC; "
                              "set rtc_max_delay > 0 too")
        config.rtc_prefix_noise = float(model_args.rtc_prefix_noise)
    for name in ("token_loss", "knowledge_insulation"):
        if getattr(model_args, name) is not None:
            setattr(config, name, bool(getattr(model_args, name)))
    return config


def _base_model_config(model_args: ModelArguments):
    config_class = policy_config_class(model_args.policy)
    if model_args.model_name_or_path:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
        except (OSError, ValueError) as error:
            raise ConfigError(f"model_name_or_path={model_args.model_name_or_path!r}: no loadable config ({error})") \
                from error
        if config.model_type != config_class.model_type:
            raise ConfigError(f"model_name_or_path={model_args.model_name_or_path!r} is a {config.model_type!r} "
                              f"checkpoint but policy={model_args.policy!r}")
        for name, value in (model_args.model_config or {}).items():
            if not hasattr(config, name):
                raise ConfigError(f"model_config.{name}: the checkpoint's {type(config).__name__} has no such field")
            if name in FINE_TUNE_OVERRIDES:  # changes no weight's shape: the fine-tune's value
                setattr(config, name, value)
                continue
            differs = _first_difference(value, getattr(config, name), f"model_config.{name}")
            if differs:  # a config written for the checkpoint (the same dims) passes; another is not silently dropped
                raise ConfigError(f"{differs}: with model_name_or_path the architecture is the checkpoint's; only "
                                  f"{sorted(FINE_TUNE_OVERRIDES)} can be set for a fine-tune")
        return config
    return config_class(**(model_args.model_config or {}))


def build_model(model_args: ModelArguments, config=None, seed: int | None = None, full_determinism: bool = False):
    """The policy, seeded: every rank (and every run with the same seed) starts from the same weights."""
    import torch
    from transformers import AutoModelForImageTextToText, PI0ForConditionalGeneration, enable_full_determinism, set_seed

    from hf_vla.models.pi05 import PI05ForConditionalGeneration
    from hf_vla.training.engines import built_without_zero3_init

    if seed is not None:  # weights not in a checkpoint (fresh heads, a from-scratch model) come from the seeded RNG
        enable_full_determinism(seed) if full_determinism else set_seed(seed)
    dtype = getattr(torch, model_args.dtype)
    config = config if config is not None else model_config(model_args)
    if model_args.model_name_or_path:
        try:  # the checkpoint's weights with its config as model_config() read it (rtc_max_delay applied)
            return AutoModelForImageTextToText.from_pretrained(
                model_args.model_name_or_path, config=config, dtype=dtype, revision=model_args.model_revision,
                attn_implementation=model_args.attn_implementation
            )
        except OSError as error:
            raise ConfigError(f"model_name_or_path={model_args.model_name_or_path!r}: {error}") from error
    model_class = PI05ForConditionalGeneration if model_args.policy == "pi05" else PI0ForConditionalGeneration
    config._attn_implementation = model_args.attn_implementation
    with built_without_zero3_init():  # whole, then partitioned by DeepSpeed (see its docstring)
        model = model_class(config)
    model.set_attn_implementation(model_args.attn_implementation)
    return model.to(dtype)


def _check_token_objective(config, model_args: ModelArguments, args) -> None:
    """The token loss trains the backbone (under knowledge insulation, nothing else does): a run that freezes it would
    compute a cross-entropy that trains nothing."""
    frozen = {"vlm": "freeze='vlm'", "expert_only": "freeze='expert_only'"}.get(args.freeze)
    if model_args.lora_preset == "expert":
        frozen = "lora_preset='expert' (LoRA on the expert only)"
    if frozen:
        raise ConfigError(f"token_loss with {frozen}: the token loss trains the VLM backbone, which this leaves "
                          "frozen; use lora_preset='all_linear' or freeze 'none' / 'vision_tower'")


def _check_dims(config, mixture, from_scratch: bool):
    for head in mixture.head_names:
        for key, dim in (("state", config.max_state_dim), ("actions", config.max_action_dim)):
            if len(mixture.norm_stats[head][key]["q01"]) > dim:
                raise ConfigError(f"head {head!r}: {key} has {len(mixture.norm_stats[head][key]['q01'])} dims, more "
                                  f"than the model's max_{'state' if key == 'state' else 'action'}_dim={dim}")
    widest = max(len(mixture.norm_stats[head]["actions"]["q01"]) for head in mixture.head_names)
    if from_scratch and widest < config.max_action_dim:
        # Measured on the demo: with 6 padded dims 93% of first moves chose the named target after 5,000 steps, 45%
        # after 3,000; with none 99% (docs/measurements.md, 'The built-in demo').
        logger.warning(
            "training from scratch with max_action_dim=%d but at most %d real action dims: the padded dims of x_t are "
            "pure noise the masked loss never supervises, which slows learning; consider max_action_dim=%d",
            config.max_action_dim, widest, widest)


def main(argv: list[str] | None = None):
    """Train from a config; raises `hf_vla.errors.VLAError` subclasses for bad input (see `cli`)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return None
    if os.environ.get("HF_VLA_CPU_SHARDING") == "1":  # dry-run an FSDP/DeepSpeed launch config on CPU processes
        from hf_vla.training.engines import allow_sharding_on_cpu

        allow_sharding_on_cpu()
    model_args, data_args, training_args = parse_config(argv[0], argv[1:])
    return run_checked(training_args, lambda: _train(model_args, data_args, training_args))


def run_checked(args, run):
    """`run()` after the start-up checks every training command makes: the Hub and wandb (main process, before any
    data is read or model built), logging, and one run per output_dir (the main process holds its lock until the run
    ends, `hf_vla.training.run_lock`); a run that fails before writing anything leaves no empty output directory."""
    if args.process_index == 0:
        from hf_vla.training.preflight import check_services

        check_services(args)
    from hf_vla.cli import setup_logging
    from hf_vla.training.run_lock import RunLock

    setup_logging(logging.INFO if args.should_log else logging.WARNING)
    output = Path(args.output_dir)
    created = not output.exists()
    try:
        with RunLock(args.output_dir) if args.process_index == 0 else contextlib.nullcontext():
            return run()
    except BaseException:
        if created and args.process_index == 0 and output.is_dir() and not any(output.iterdir()):
            output.rmdir()
        raise


def _train(model_args, data_args, training_args):
    # Cheapest first: tokenizer and config, then the data checks and statistics, the weights last.
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
        _check_token_objective(config, model_args, training_args)
    texts = [d.get("name") or d.get("repo_id") or d.get("root") for d in data_args.datasets if d.get("target_text_key")]
    if texts and not getattr(config, "token_loss", False):
        raise ConfigError(f"datasets {texts}: target_text_key is a target of the token objective; set token_loss "
                          "true (or leave target_text_key out)")
    if model_args.policy == "pi0":  # hf_vla's pi0 processor normalises with mean/std, absolute: say so, never ignore
        for dataset in data_args.datasets:
            modes = {str(m).upper() for m in (dataset.get("normalization") or {}).values()} - {"MEAN_STD"}
            if modes or dataset.get("relative_actions"):
                raise ConfigError(f"dataset {dataset.get('name') or dataset.get('repo_id') or dataset.get('root')!r}: "
                                  f"{'normalization ' + str(sorted(modes)) if modes else 'relative_actions'} with "
                                  "policy 'pi0', whose processor normalises with mean/std and absolute actions; use "
                                  "policy 'pi05' for other modes and relative actions")
    if training_args.n_action_steps is not None and training_args.n_action_steps > config.chunk_size:
        raise ConfigError(f"n_action_steps={training_args.n_action_steps}: at most the chunk size "
                          f"({config.chunk_size}); it is how many actions of each predicted chunk are executed")
    if data_args.generate_demo_data:
        from hf_vla.envs.generate import ensure_demo_dataset

        ensure_demo_dataset(data_args.datasets[0]["root"], episodes=data_args.demo_episodes,
                            main_process=training_args.process_index == 0)
    from hf_vla.data import PI0Collator, PI05Collator, WeightedDatasetMixture
    from hf_vla.models.pi05 import PI05Processor
    from hf_vla.training.trainer import VLATrainer

    # The data checks and exact statistics scan run once per node (the local main process first); the other ranks
    # read its cache. An error there reaches every rank.
    with training_args.main_process_first(local=True, desc="dataset checks and statistics"):
        mixture = WeightedDatasetMixture(data_args.datasets, validation_ratio=data_args.validation_ratio,
                                         split_seed=data_args.split_seed, chunk_size=config.chunk_size)
    if data_args.norm_stats_from:
        mixture.norm_stats = saved_norm_stats(data_args.norm_stats_from, mixture.norm_stats)
    _check_dims(config, mixture, from_scratch=model_args.model_name_or_path is None)
    mixture.check_chunks(config.chunk_size)  # before anything reads chunks (the FAST fit, the streams)
    model = build_model(model_args, config, seed=training_args.seed, full_determinism=training_args.full_determinism)
    if source and model_args.model_name_or_path != source:
        model.config._name_or_path = source  # the model card names the Hub id it was fine-tuned from
    if model_args.policy == "pi05":
        processor = PI05Processor.from_config(model.config, tokenizer, norm_stats=mixture.norm_stats,
                                              head_names=mixture.head_names)
        if getattr(model.config, "token_loss", False):  # the FAST targets: loaded, or fitted on the training chunks
            from hf_vla.training.cotraining import fit_fast

            fast_path = model_args.fast_tokenizer
            if fast_path is None and model_args.model_name_or_path:  # continuing a token-loss checkpoint: its FAST
                saved = Path(model_args.model_name_or_path) / "processor_config.json"
                if saved.is_file() and json.loads(saved.read_text()).get("fast_config"):
                    fast_path = model_args.model_name_or_path
            fit_fast(mixture, processor, model.config, path=fast_path,
                     vocab_size=model_args.fast_vocab_size, scale=model_args.fast_scale,
                     max_chunks=model_args.fast_fit_chunks, seed=training_args.seed)
        collator = PI05Collator(processor)
    else:  # transformers' pi0: its prompt layout (image placeholder tokens), mean/std normalization per head
        from hf_vla.models.pi0_adapter import PI0HeadProcessor

        processor = PI0HeadProcessor.from_config(model.config, tokenizer, norm_stats=mixture.norm_stats,
                                                 head_names=mixture.head_names)
        collator = PI0Collator(processor)
    from hf_vla.serving import contract as deployment

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
    if trainer.eval_dataset is not None:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    if training_args.push_to_hub:
        trainer.push_to_hub()  # writes the model card too
    elif training_args.should_save:  # the model card (data, evaluation, closed-loop figures) beside the weights
        trainer.create_model_card()
    if training_args.should_save:
        print(f"saved the trained model to {training_args.output_dir}: load it with "
              f"AutoModel.from_pretrained({training_args.output_dir!r}), or run python -m hf_vla.evaluate --checkpoint "
              f"{training_args.output_dir}", flush=True)
    # every rank leaves together: a rank that exited while the main one still saved was seen to abort in gloo
    trainer.accelerator.wait_for_everyone()
    return trainer


def cli(argv: list[str] | None = None):
    """The console entry: a bad input or a training fault is one line naming the culprit and a non-zero exit.

    Set `HF_VLA_TRACEBACK=1` to see the full traceback as well.
    """
    return launched_cli("hf_vla.train", main, argv)


def launched_cli(prog: str, main, argv: list[str] | None = None):
    """`hf_vla.cli.run(prog, main, argv)`; in a launched multi-process run, each process then leaves through
    `_leave_launched_run` with the run's exit status (`python -m hf_vla.train`, `python -m hf_vla.rl`)."""
    from hf_vla.cli import run

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return run(prog, main, argv)
    code = 1
    try:
        run(prog, main, argv)
        code = 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    _leave_launched_run(code)


def _leave_launched_run(code: int):
    """End a process of a launched (multi-process) run with `code`, skipping the interpreter's teardown.

    On CPU (gloo), a finished rank was seen to abort in its teardown ("terminate called without an active
    exception", SIGABRT: a native thread object destroyed while still joinable), about one run in three on a loaded
    machine, even after the process group was destroyed and every rank had met at a barrier; the launcher then kills
    the other ranks and reports the run failed. Everything the run writes is written and flushed by now, so the
    process group is destroyed, the wandb run (if any) finished and the streams flushed, and the process exits.
    """
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        wandb = sys.modules.get("wandb")
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.finish(exit_code=code)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    cli()
