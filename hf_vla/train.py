"""`python -m hf_vla.train CONFIG.json [--key value ...]` (also under `accelerate launch`).

The JSON holds the fields of three dataclasses: `ModelArguments`, `DataArguments` and `VLATrainingArguments`
(transformers' `TrainingArguments` plus hf_vla's). Command-line overrides come on top: `--max_steps 100`,
`--learning_rate 1e-4`, dotted keys reach into dicts (`--model_config.chunk_size 10`); values are JSON-decoded when
they parse (numbers, booleans, lists), strings otherwise. The whole configuration is validated (unknown keys, bad
values, missing datasets) before any model is built or any data is read.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from transformers import HfArgumentParser

from .data.sources import DatasetConfig
from .lora import PRESETS
from .trainer import VLATrainingArguments

logger = logging.getLogger("hf_vla.train")
POLICIES = ("pi05", "pi0")
DTYPES = ("float32", "bfloat16")
TINY_TOKENIZER = "tiny"


@dataclass
class ModelArguments:
    """Which policy to train and from where.

    policy: `pi05` (hf_vla) or `pi0` (transformers' own model).
    model_name_or_path: a converted / hf_vla checkpoint (local dir or Hub id) to start from; without it the policy is
        built from `model_config` with fresh weights.
    model_config: config fields for a policy built from scratch (the demo's tiny dims, for example).
    tokenizer: tokenizer id or path (real runs: `google/paligemma-3b-pt-224`); `"tiny"` builds the small offline one.
    attn_implementation: eager | sdpa | flex_attention | flash_attention_2.
    dtype: float32 | bfloat16 (bf16 trains with fp32 master weights unless `master_weights` is off).
    lora_preset: `expert` or `all_linear` (peft LoRA, see `hf_vla.lora`); none trains the full model.
    """

    policy: str = field(default="pi05", metadata={"help": f"one of {POLICIES}"})
    model_name_or_path: str | None = field(default=None, metadata={"help": "checkpoint to start from"})
    model_config: dict | None = field(default=None, metadata={"help": "config of a policy built from scratch"})
    tokenizer: str = field(default="google/paligemma-3b-pt-224", metadata={"help": "tokenizer id/path or 'tiny'"})
    attn_implementation: str = field(default="sdpa", metadata={"help": "attention backend"})
    dtype: str = field(default="float32", metadata={"help": f"one of {DTYPES}"})
    lora_preset: str | None = field(default=None, metadata={"help": f"one of {sorted(PRESETS)}"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default 2r)"})

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: choose one of {POLICIES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {DTYPES}")
        if self.lora_preset is not None and self.lora_preset not in PRESETS:
            raise ValueError(f"lora_preset={self.lora_preset!r}: choose one of {sorted(PRESETS)}")
        if self.model_name_or_path is None and self.model_config is None and self.policy != "pi05":
            raise ValueError("set model_name_or_path (a checkpoint) or model_config (dims to build from scratch)")


@dataclass
class DataArguments:
    """The LeRobot mixture: `datasets` is a list of `hf_vla.data.DatasetConfig` dicts (feature mapping per dataset).

    validation_ratio: share of each dataset's episodes held out for evaluation (deterministic with `split_seed`).
    generate_demo_data: write the built-in demo dataset to the first dataset's `root` when it is missing.
    """

    datasets: list[dict] = field(default_factory=list, metadata={"help": "list of DatasetConfig dicts"})
    validation_ratio: float = field(default=0.0, metadata={"help": "held-out share of episodes"})
    split_seed: int = field(default=0, metadata={"help": "seed of the episode split"})
    generate_demo_data: bool = field(default=False, metadata={"help": "write the demo dataset when missing"})
    demo_episodes: int = field(default=200, metadata={"help": "episodes of the generated demo dataset"})

    def __post_init__(self):
        if not self.datasets:
            raise ValueError("datasets: at least one LeRobot dataset is needed")
        known = {f.name for f in fields(DatasetConfig)}
        for index, spec in enumerate(self.datasets):
            if not isinstance(spec, dict):
                raise ValueError(f"datasets[{index}] must be an object, got {spec!r}")
            unknown = sorted(set(spec) - known)
            if unknown:
                raise ValueError(f"datasets[{index}]: unknown key(s) {unknown}; known: {sorted(known)}")
            DatasetConfig(**spec)  # field-level validation (weights, cameras, names) without touching data
        if not 0.0 <= self.validation_ratio < 1.0:
            raise ValueError(f"validation_ratio={self.validation_ratio}: must be in [0, 1)")


def _decode(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def parse_config(path: str | Path, overrides: list[str] | None = None):
    """JSON config + `--key value` overrides -> (ModelArguments, DataArguments, VLATrainingArguments), validated."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    config.pop("//", None)  # free-form comment key
    overrides = list(overrides or [])
    while overrides:
        key = overrides.pop(0)
        if not key.startswith("--"):
            raise ValueError(f"override {key!r}: expected --key value")
        key = key[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif overrides and not overrides[0].startswith("--"):
            value = overrides.pop(0)
        else:
            value = "true"  # a bare flag
        key = key.replace("-", "_")
        target, *path_keys = key.split(".")
        if path_keys:
            node = config.setdefault(target, {})
            if not isinstance(node, dict):
                raise ValueError(f"override --{key}: {target!r} is not an object")
            for part in path_keys[:-1]:
                node = node.setdefault(part, {})
            node[path_keys[-1]] = _decode(value)
        else:
            config[target] = _decode(value)
    parser = HfArgumentParser((ModelArguments, DataArguments, VLATrainingArguments))
    known = {f.name for dataclass_type in parser.dataclass_types for f in fields(dataclass_type)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown} (not a model, data or training argument)")
    try:
        return parser.parse_dict(config, allow_extra_keys=False)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: {error}") from error


def build_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == TINY_TOKENIZER:
        from .testing import build_tiny_tokenizer

        return build_tiny_tokenizer()
    return AutoTokenizer.from_pretrained(name)


def build_model(model_args: ModelArguments):
    import torch
    from transformers import AutoModelForImageTextToText, PI0Config, PI0ForConditionalGeneration

    from .models.pi05 import PI05Config, PI05ForConditionalGeneration

    dtype = getattr(torch, model_args.dtype)
    if model_args.model_name_or_path:
        return AutoModelForImageTextToText.from_pretrained(
            model_args.model_name_or_path, dtype=dtype, attn_implementation=model_args.attn_implementation
        )
    config_class, model_class = (PI05Config, PI05ForConditionalGeneration) if model_args.policy == "pi05" else (
        PI0Config, PI0ForConditionalGeneration)
    config = config_class(**(model_args.model_config or {}))
    config._attn_implementation = model_args.attn_implementation
    model = model_class(config)
    model.set_attn_implementation(model_args.attn_implementation)
    return model.to(dtype)


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return None
    model_args, data_args, training_args = parse_config(argv[0], argv[1:])
    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if data_args.generate_demo_data:
        from .envs.generate import ensure_demo_dataset

        ensure_demo_dataset(data_args.datasets[0]["root"], episodes=data_args.demo_episodes,
                            main_process=training_args.process_index == 0)
    from .data import WeightedDatasetMixture
    from .models.pi05 import PI05Processor
    from .trainer import VLATrainer

    mixture = WeightedDatasetMixture(data_args.datasets, validation_ratio=data_args.validation_ratio,
                                     split_seed=data_args.split_seed)
    model = build_model(model_args)
    tokenizer = build_tokenizer(model_args.tokenizer)
    for head in mixture.head_names:
        for key, dim in (("state", model.config.max_state_dim), ("actions", model.config.max_action_dim)):
            if len(mixture.norm_stats[head][key]["q01"]) > dim:
                raise ValueError(f"head {head!r}: {key} has {len(mixture.norm_stats[head][key]['q01'])} dims, more "
                                 f"than the model's max_{'state' if key == 'state' else 'action'}_dim={dim}")
    widest = max(len(mixture.norm_stats[head]["actions"]["q01"]) for head in mixture.head_names)
    if model_args.model_name_or_path is None and widest < model.config.max_action_dim:
        # Measured on the demo: with 6 padded dims 93% of first moves chose the named target after 5,000 steps, 45%
        # after 3,000; with none 99% (README, 'The built-in demo').
        logger.warning(
            "training from scratch with max_action_dim=%d but at most %d real action dims: the padded dims of x_t are "
            "pure noise the masked loss never supervises, which slows learning; consider max_action_dim=%d",
            model.config.max_action_dim, widest, widest)
    if model_args.policy == "pi05":
        processor = PI05Processor.from_config(model.config, tokenizer, norm_stats=mixture.norm_stats,
                                              head_names=mixture.head_names)
        collator = None  # the trainer's default: PI05Collator(processor)
    else:  # transformers' pi0: mean/std normalization, image placeholders in the prompt
        from .data import PI0Collator

        processor = tokenizer
        collator = PI0Collator(tokenizer, mixture.norm_stats, mixture.head_names, model.config)
    if model_args.lora_preset:
        from peft import get_peft_model

        from .lora import lora_config

        model = get_peft_model(model, lora_config(model_args.lora_preset, r=model_args.lora_r, alpha=model_args.lora_alpha))
    trainer = VLATrainer(model, training_args, mixture=mixture, processing_class=processor, data_collator=collator)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
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
        trainer.push_to_hub()
    return trainer


if __name__ == "__main__":
    main()
