"""The arguments of `python -m hf_vla.train`: `ModelArguments` and `DataArguments` (beside `VLATrainingArguments`,
transformers' `TrainingArguments` plus hf_vla's), and `parse_config`, the config file and overrides through the one
parser (`hf_vla.parser.CommandParser`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from hf_vla.cli import check_writable_dir
from hf_vla.errors import ConfigError
from hf_vla.models.pi05.configuration_pi05 import MEMORY_FIELDS
from hf_vla.parser import CommandParser, HelpStyle, check_dataset_specs, normalize_training_config
from hf_vla.registry import families_with, get_policy
from hf_vla.training.config_checks import check_model_config
from hf_vla.training.lora import PRESETS
from hf_vla.training.trainer import VLATrainingArguments

DTYPES = ("float32", "bfloat16")
ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass
class ModelArguments:
    """Which policy to train and from where.

    policy: `pi05` (hf_vla), `pi0` (transformers' own model), or `pi05_value`: RECAP's value model (pi0.5's backbone
        and a distribution over the normalised return, trained on episode outcomes; docs/recap.md). A pi05_value
        run may start from a pi0.5 checkpoint: its vision-language weights are read, the value readout is new.
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
        Meant for fine-tuning a trained policy: from scratch the prefix shows the way and the instruction goes
        unlearned (docs/measurements.md).
    rtc_prefix_noise: with `rtc_max_delay`, the std of one offset per sample on its committed prefix (normalised
        units; see `PI05Config`). Overrides the checkpoint's value and is saved with the model; a noisy prefix
        teaches the policy not to trust its own earlier output blindly (docs/measurements.md).
    token_loss: pi0.5's token objective (pi05; docs/cotraining.md): the backbone also predicts each chunk's FAST
        action tokens (cross-entropy beside `flow_loss_weight` x the flow MSE). Saved with the model; inference is
        unchanged.
    knowledge_insulation: with `token_loss`, the expert reads stop-gradient backbone keys/values, so the backbone
        learns from the tokens only (KI, arXiv 2505.23705). Saved with the model.
    subtask_layout: pi0.5's high-level inference (pi05; docs/subtasks.md): `joint` trains the annotated subtask
        (each dataset's `subtask_key`) after the prompt, predicted by the backbone and read by the expert, so the
        policy decodes its own subtask at inference; `factorised` trains task -> subtask samples beside subtask ->
        action samples (lerobot's blend recipes). Saved with the model.
    use_visual_memory / use_proprioceptive_memory / memory_frames / memory_stride / memory_temporal_attention_every:
        MEM's observation memory (pi05; docs/memory.md), lerobot's names: past frames through SigLIP with temporal
        attention, past states as prefix tokens; `memory_stride` counts dataset frames. Unset: the config's (off).
        Saved with the model.
    fast_tokenizer: a FAST tokenizer to use (`fast_tokenizer.json`, its folder, or a checkpoint trained with the
        token loss); unset, one is fitted at start-up on the training mixture's chunks.
    fast_vocab_size / fast_scale / fast_fit_chunks: the fit's BPE vocabulary, DCT coefficient scale, and how many
        chunks of the training mixture it reads.
    """

    policy: str = field(default="pi05", metadata={
        "help": "a registered policy family: pi05, pi0, pi05_value or a plugin's (hf_vla.registry)"})
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
    subtask_layout: str | None = field(default=None, metadata={
        "choices": ("joint", "factorised"), "help": "pi0.5's subtask prediction: joint (the paper's single sequence) or "
        "factorised (task -> subtask beside subtask -> action samples) (default: the config's)"})
    use_visual_memory: bool | None = field(default=None, metadata={
        "help": "MEM visual memory: past frames through SigLIP with temporal attention (default: the config's, off)"})
    use_proprioceptive_memory: bool | None = field(default=None, metadata={
        "help": "MEM proprioceptive memory: past states as prefix tokens, none in the prompt (default: the config's)"})
    memory_frames: int | None = field(default=None, metadata={
        "help": "MEM: observations per sample, the current one included (default: the config's, 6)"})
    memory_stride: int | None = field(default=None, metadata={
        "help": "MEM: dataset frames between them (default: the config's, 30: one second at 30 fps)"})
    memory_temporal_attention_every: int | None = field(default=None, metadata={
        "help": "MEM: every n-th SigLIP layer attends across frames (default: the config's, 4)"})
    fast_tokenizer: str | None = field(default=None, metadata={"help": "FAST tokenizer to load (default: fit one)"})
    fast_vocab_size: int = field(default=1024, metadata={"help": "FAST BPE vocabulary when fitted"})
    fast_scale: float = field(default=10.0, metadata={"help": "FAST DCT coefficient scale when fitted"})
    fast_fit_chunks: int = field(default=20_000, metadata={"help": "training chunks the FAST fit reads"})

    def __post_init__(self):
        family = get_policy(self.policy)
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
            if getattr(self, name) is not None and not family.rtc_training:
                raise ConfigError(f"{name}={getattr(self, name)}: training-time RTC needs policy "
                                  f"{families_with('rtc_training')} (an action expert that takes a time per action "
                                  f"token), not {self.policy!r}")
        for name in ("token_loss", "knowledge_insulation", "fast_tokenizer", "subtask_layout"):
            if getattr(self, name) not in (None, False) and not family.token_objective:
                raise ConfigError(f"{name}={getattr(self, name)!r}: the token objective needs policy "
                                  f"{families_with('token_objective')}, not {self.policy!r}")
        memory = [name for name in MEMORY_FIELDS if getattr(self, name) not in (None, False)]
        if memory and not family.memory:
            raise ConfigError(f"{memory[0]}={getattr(self, memory[0])!r}: observation memory (MEM) needs policy "
                              f"{families_with('memory')}, not {self.policy!r}")
        for name in MEMORY_FIELDS[2:]:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.fast_vocab_size <= 0 or self.fast_fit_chunks <= 0:
            raise ConfigError(f"fast_vocab_size={self.fast_vocab_size}, fast_fit_chunks={self.fast_fit_chunks}: "
                              "must be positive")
        if not (math.isfinite(self.fast_scale) and self.fast_scale > 0):
            raise ConfigError(f"fast_scale={self.fast_scale}: must be a finite number > 0")
        if self.rtc_prefix_noise is not None and not (math.isfinite(self.rtc_prefix_noise)
                                                      and self.rtc_prefix_noise >= 0):
            raise ConfigError(f"rtc_prefix_noise={self.rtc_prefix_noise}: must be a finite number >= 0")
        if self.model_name_or_path is None and self.model_config is None and family.needs_model_config:
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
                       "time_sampling_offset",
                       # RECAP's indicator form: "embedding" adds a zero-initialised module, the checkpoint's unchanged
                       "advantage_indicator"}


def policy_config_class(policy: str):
    """The config class of the registered policy family `policy`."""
    return get_policy(policy).load("config")


@dataclass
class DataArguments:
    """The LeRobot mixture: `datasets` is a list of `hf_vla.data.DatasetConfig` dicts (feature mapping per dataset).

    validation_ratio: share of each dataset's episodes held out for evaluation (deterministic with `split_seed`).
    generate_demo_data: write the built-in demo dataset to the first dataset's `root` when it is missing.
    norm_stats_from: a checkpoint directory (or its `norm_stats.json`) whose normalisation statistics replace the
        mixture's for every head: a policy trained further on grown data (DAgger rounds added to its expert data)
        keeps the normalisation it learned with, instead of one re-computed over the new mixture.
    """

    datasets: list[dict] = field(default_factory=list, metadata={"help": "the LeRobot datasets, each an object "
                                 "{\"root\" or \"repo_id\", \"cameras\": [...], ...}; every field: docs/dataset_fields.md"})
    validation_ratio: float = field(default=0.0, metadata={"help": "held-out share of episodes"})
    split_seed: int = field(default=0, metadata={"help": "seed of the episode split"})
    generate_demo_data: bool = field(default=False, metadata={"help": "write the demo dataset when missing"})
    demo_episodes: int = field(default=200, metadata={"help": "episodes of the generated demo dataset"})
    norm_stats_from: str | None = field(default=None, metadata={
        "help": "checkpoint dir or norm_stats.json whose normalisation replaces the mixture's"})
    failure_cost: float | None = field(default=None, metadata={
        "help": "policy pi05_value: the reward of a failed episode's last step, in steps (RECAP; docs/recap.md); "
        "default the task's episode limit"})
    allow_unlabelled: bool = field(default=False, metadata={
        "help": "policy pi05_value: leave out episodes with no outcome (counted in the log) instead of refusing them"})

    def __post_init__(self):
        if not self.datasets:
            raise ConfigError("datasets: at least one LeRobot dataset is needed")
        self.datasets[:] = check_dataset_specs(self.datasets)
        if not 0.0 <= self.validation_ratio < 1.0:
            raise ConfigError(f"validation_ratio={self.validation_ratio}: must be in [0, 1)")
        if self.demo_episodes <= 0:
            raise ConfigError(f"demo_episodes={self.demo_episodes}: must be positive")
        if self.failure_cost is not None and not (math.isfinite(self.failure_cost) and self.failure_cost > 0):
            raise ConfigError(f"failure_cost={self.failure_cost}: must be a finite number > 0 (steps), or null (the "
                              "task's episode limit)")


def _sections(parser: CommandParser):
    """`--help`'s groups: model, data, hf_vla training, transformers' TrainingArguments (an hf_vla default that differs
    from transformers' is said)."""
    from transformers import TrainingArguments

    inherited = {f.name: f for f in dataclasses.fields(TrainingArguments)}

    def fields(kind, from_transformers=None):
        return [f for f in dataclasses.fields(kind) if f.init and not f.name.startswith("_") and (
            from_transformers is None or (f.name in inherited) == from_transformers)]

    def ours(item, default):
        original = inherited.get(item.name)
        if original is None or original.default is dataclasses.MISSING:
            return ""
        theirs = getattr(original.default, "value", original.default)
        return f"; hf_vla's default, transformers' is {theirs}" if theirs != default else ""

    return [("model (ModelArguments)", fields(ModelArguments), None),
            ("data (DataArguments)", fields(DataArguments), None),
            ("hf_vla training (VLATrainingArguments)", fields(VLATrainingArguments, False), None),
            ("transformers TrainingArguments (all apply)", fields(VLATrainingArguments, True), ours)]


def training_parser(description: str = "python -m hf_vla.train CONFIG.json [--key value ...]") -> CommandParser:
    return CommandParser("python -m hf_vla.train", (ModelArguments, DataArguments, VLATrainingArguments), description,
                         config_file="required", style=HelpStyle(help_exits=False, sections=_sections,
                                                                 what="a model, data or training argument"))


def parse_config(path: str | Path, overrides: list[str] | None = None):
    """JSON config + `--key value` overrides -> (ModelArguments, DataArguments, VLATrainingArguments), validated.

    Nothing is loaded or created: a bad key, type or value raises `ConfigError` naming it.
    """
    parser = training_parser()
    config = read_config(parser, Path(path), overrides)
    model_args, data_args, training_args = parser.build(config, str(path))
    _check_combination(model_args, data_args, training_args)
    return model_args, data_args, training_args


def read_config(parser: CommandParser, path: Path, overrides: list[str] | None) -> dict:
    """The config file with the overrides applied, and the values every training command reads its own way."""
    config = parser.read(path, overrides or [])
    normalize_training_config(config)
    return config


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


__all__ = ["ATTENTION", "DTYPES", "DataArguments", "FINE_TUNE_OVERRIDES", "ModelArguments", "parse_config", "policy_config_class", "training_parser"]
