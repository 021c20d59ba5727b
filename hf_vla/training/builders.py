"""What `python -m hf_vla.train` builds from its arguments, cheapest first: the tokenizer, the policy's config (a
checkpoint's, with a fine-tune's overrides), the model, and the start-up checks between them and the data."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hf_vla.errors import ConfigError
from hf_vla.registry import families_with, get_policy
from hf_vla.training.arguments import FINE_TUNE_OVERRIDES, MEMORY_FIELDS, ModelArguments

logger = logging.getLogger("hf_vla.train")
TINY_TOKENIZER = "tiny"
TINY_LOC_TOKENIZER = "tiny_loc"  # with <loc0000>..<loc1023> (a model vocabulary of 2560)


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


def check_subtasks(config, data_args, training_args) -> None:
    """Subtask training needs annotated data and annotated data a subtask-trained model; one line otherwise."""
    annotated = [d.get("name") or d.get("repo_id") or d.get("root") for d in data_args.datasets if d.get("subtask_key")]
    layout = getattr(config, "subtask_layout", None)
    if layout and not annotated:
        raise ConfigError(f"subtask_layout={layout!r}: no dataset names its subtasks; set subtask_key in a dataset "
                          "entry (a string column, or lerobot's language_persistent)")
    if annotated and not layout:
        raise ConfigError(f"datasets {annotated}: subtask_key trains pi0.5's subtask prediction; set "
                          "subtask_layout 'joint' (or leave subtask_key out)")
    if not 0.0 <= training_args.subtask_dropout < 1.0:
        raise ConfigError(f"subtask_dropout={training_args.subtask_dropout}: a share in [0, 1)")


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
    if getattr(model_args, "subtask_layout", None) is not None:
        config.subtask_layout = model_args.subtask_layout
    memory = {name: getattr(model_args, name) for name in MEMORY_FIELDS if getattr(model_args, name, None) is not None}
    if memory:
        for name, value in memory.items():
            setattr(config, name, value)
        try:
            config.validate_architecture()
        except ValueError as error:
            raise ConfigError(str(error)) from None
    return config


def _base_model_config(model_args: ModelArguments):
    family = get_policy(model_args.policy)
    config_class = family.load("config")
    if model_args.model_name_or_path:
        from hf_vla.hub.resolve import load_config
        from hf_vla.registry import find_policy

        try:
            config = load_config(model_args.model_name_or_path, model_args.model_revision)
        except (OSError, ValueError) as error:
            raise ConfigError(f"model_name_or_path={model_args.model_name_or_path!r}: no loadable config ({error})") \
                from error
        source = find_policy(config.model_type)
        if source is not None and source.name in family.starts_from:
            # e.g. a value model from a pi0.5 checkpoint: its backbone's config (the weights follow in build_model)
            fields = {k: v for k, v in config.to_dict().items() if k in config_class.__dataclass_fields__ and k not in (
                "model_type", "transformers_version", "architectures", "auto_map", "discrete_state_input")
                and not (k in MEMORY_FIELDS and not family.memory)}  # a family without MEM reads one observation
            config = config_class(**{**fields, **(model_args.model_config or {})})  # model_config's fields win
            return config
        if source is not family:
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
    from transformers import enable_full_determinism, set_seed

    from hf_vla.training.engines import built_without_zero3_init

    if seed is not None:  # weights not in a checkpoint (fresh heads, a from-scratch model) come from the seeded RNG
        enable_full_determinism(seed) if full_determinism else set_seed(seed)
    dtype = getattr(torch, model_args.dtype)
    config = config if config is not None else model_config(model_args)
    model_class = get_policy(model_args.policy).load("model")
    if model_args.model_name_or_path:
        try:  # the checkpoint's weights with its config as model_config() read it (rtc_max_delay applied); a family
            # that starts from another's checkpoint (the value model from pi0.5's) reads the weights it shares
            return keep_fp32_modules(model_class.from_pretrained(
                model_args.model_name_or_path, config=config, dtype=dtype, revision=model_args.model_revision,
                attn_implementation=model_args.attn_implementation
            ))
        except OSError as error:
            raise ConfigError(f"model_name_or_path={model_args.model_name_or_path!r}: {error}") from error
    config._attn_implementation = model_args.attn_implementation
    with built_without_zero3_init():  # whole, then partitioned by DeepSpeed (see its docstring)
        model = model_class(config)
    model.set_attn_implementation(model_args.attn_implementation)
    return keep_fp32_modules(model.to(dtype))


def keep_fp32_modules(model):
    """The parameters a model keeps in fp32 (`_keep_in_fp32_modules_strict`, matched as transformers matches them) in
    fp32 after a load in another dtype: transformers casts the loaded ones, but builds the ones missing from the
    checkpoint (a value model's readout started from a policy, MEM's projection from a memory-free checkpoint) in the
    load dtype, and their first matmul then meets an fp32 input."""
    import re

    import torch

    patterns = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    if not patterns:
        return model
    keep = re.compile("|".join(re.escape(pattern) for pattern in patterns))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != torch.float32 and keep.search(name):
                param.data = param.data.float()
    return model


def check_token_objective(config, model_args: ModelArguments, args, what: str = "token_loss") -> None:
    """The token loss (and a subtask's) trains the backbone (under knowledge insulation, nothing else does): a run
    that freezes it would compute a cross-entropy that trains nothing."""
    frozen = {"vlm": "freeze='vlm'", "expert_only": "freeze='expert_only'"}.get(args.freeze)
    if model_args.lora_preset == "expert":
        frozen = "lora_preset='expert' (LoRA on the expert only)"
    if frozen:
        raise ConfigError(f"{what} with {frozen}: its cross-entropy trains the VLM backbone, which this leaves "
                          "frozen; use lora_preset='all_linear' or freeze 'none' / 'vision_tower'")


def check_data_for_policy(config, model_args: ModelArguments, data_args) -> None:
    """Dataset fields the policy cannot honour are refused, never ignored: a text target without the token objective;
    normalisation modes and relative actions with pi0 (its processor normalises with mean/std, absolute)."""
    texts = [d.get("name") or d.get("repo_id") or d.get("root") for d in data_args.datasets if d.get("target_text_key")]
    if texts and not getattr(config, "token_loss", False):
        raise ConfigError(f"datasets {texts}: target_text_key is a target of the token objective; set token_loss "
                          "true (or leave target_text_key out)")
    family = get_policy(model_args.policy)
    conditioned = [d.get("name") or d.get("repo_id") or d.get("root") for d in data_args.datasets if d.get("advantage")]
    if conditioned and not family.advantage_prompt:
        raise ConfigError(f"datasets {conditioned}: an advantage indicator (RECAP) goes into the policy's prompt; "
                          f"policy {model_args.policy!r} has no such prompt: use policy "
                          f"{families_with('advantage_prompt')}, or leave advantage out")
    allowed = family.normalization_modes
    for dataset in data_args.datasets:  # a mode or relative actions the processor would not apply: refused
        modes = {str(m).upper() for m in (dataset.get("normalization") or {}).values()} - set(allowed or ())
        culprit = ("normalization " + str(sorted(modes)) if allowed is not None and modes else
                   "relative_actions" if dataset.get("relative_actions") and not family.relative_actions else None)
        if culprit:
            applies = f"{'/'.join(allowed)}" if allowed is not None else "any mode"
            raise ConfigError(f"dataset {dataset.get('name') or dataset.get('repo_id') or dataset.get('root')!r}: "
                              f"{culprit} with policy {model_args.policy!r}, whose processor normalises with "
                              f"{applies} and {'relative or ' if family.relative_actions else ''}absolute actions; "
                              f"use policy {families_with('relative_actions')} for other modes and relative actions")


def check_dims(config, mixture, from_scratch: bool, given: dict | None = None):
    """The data's widths against the model's `max_state_dim` / `max_action_dim`. A model built from a config whose
    `model_config` leaves one of them out (`given`) is built as wide as the data's widest head, said in one line."""
    if from_scratch:
        for key, name in (("state", "max_state_dim"), ("actions", "max_action_dim")):
            if name in (given or {}) or not hasattr(config, name):
                continue
            widest = max(len(mixture.norm_stats[head][key]["q01"]) for head in mixture.head_names)
            if widest != getattr(config, name):
                logger.info("%s=%d: the widest %s of the data (model_config does not set it)", name, widest, key)
                setattr(config, name, widest)
    for head in mixture.head_names:
        for key, dim in (("state", config.max_state_dim), ("actions", config.max_action_dim)):
            width = len(mixture.norm_stats[head][key]["q01"])
            if width > dim:
                name = f"max_{'state' if key == 'state' else 'action'}_dim"
                fix = (f"build it wider: --model_config.{name} {width}" if from_scratch else
                       "a pretrained model's width is fixed: choose a checkpoint with room for it, or fewer dims")
                raise ConfigError(f"head {head!r}: {key} has {width} dims, more than the model's {name}={dim}; {fix}")
    widest = max(len(mixture.norm_stats[head]["actions"]["q01"]) for head in mixture.head_names)
    if from_scratch and widest < config.max_action_dim:
        # padded dims slow learning (docs/measurements.md, 'The built-in demo')
        logger.warning(
            "training from scratch with max_action_dim=%d but at most %d real action dims: the padded dims of x_t are "
            "pure noise the masked loss never supervises, which slows learning; consider max_action_dim=%d",
            config.max_action_dim, widest, widest)



def pi05_setup(processor, model, mixture, model_args, data_args, training_args) -> None:
    """pi0.5 before training: the FAST targets of the token objective (loaded, or fitted on the training chunks), and
    RECAP's advantage indicator (docs/recap.md): datasets with one make the policy advantage-conditioned, and it then
    asks for "Advantage: positive" at inference (the processor and the contract say so)."""
    if getattr(model.config, "token_loss", False):
        from hf_vla.training.cotraining import fit_fast

        fast_path = model_args.fast_tokenizer
        if fast_path is None and model_args.model_name_or_path:  # continuing a token-loss checkpoint: its FAST
            saved = Path(model_args.model_name_or_path) / "processor_config.json"
            if saved.is_file() and json.loads(saved.read_text()).get("fast_config"):
                fast_path = model_args.model_name_or_path
        fit_fast(mixture, processor, model.config, path=fast_path, vocab_size=model_args.fast_vocab_size,
                 scale=model_args.fast_scale, max_chunks=model_args.fast_fit_chunks, seed=training_args.seed)
    processor.advantage_conditioned = any(d.get("advantage") for d in data_args.datasets)


def value_setup(processor, model, mixture, model_args, data_args, training_args) -> None:
    """RECAP's value model learns the normalised returns of the episodes' outcomes; its config records each task's
    episode limit and the failure cost (annotation's advantages use the same scale) and a cross-fitting fold."""
    limits = mixture.use_returns(failure_cost=data_args.failure_cost, allow_unlabelled=data_args.allow_unlabelled)
    model.config.episode_limits, model.config.failure_cost = dict(limits), data_args.failure_cost
    folds = {tuple(s.config.hold_out_fold) for s in mixture.sources if s.config.hold_out_fold is not None}
    if len(folds) > 1:
        raise ConfigError(f"datasets: hold_out_fold differs between datasets {sorted(folds)}; a value model holds out "
                          "one fold (train one model per fold)")
    if folds:
        fold, count = next(iter(folds))
        model.config.held_out_fold = {"fold": fold, "folds": count, "datasets": [
            str(s.root.resolve()) for s in mixture.sources if s.config.hold_out_fold is not None]}


def build_trainer(model_args: ModelArguments, data_args, training_args):
    """The `VLATrainer` of a training run, as `python -m hf_vla.train` builds it from its three argument groups:
    cheapest first (tokenizer and config, then the data checks and statistics, the weights last), the registered
    family's processor, collator and setup, the deployment contract every checkpoint carries, the training and
    held-out streams, LoRA when asked for. The trainer saves `norm_stats.json` beside the final model."""
    from hf_vla.data import WeightedDatasetMixture
    from hf_vla.training.trainer import VLATrainer

    family = get_policy(model_args.policy)
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
    if any(d.get("advantage") for d in data_args.datasets) and hasattr(config, "advantage_indicator") and \
            config.advantage_indicator is None:  # RECAP's indicator in the form the decoy test chose
        from hf_vla.models.pi05.configuration_pi05 import ADVANTAGE_INDICATOR_DEFAULT

        config.advantage_indicator = ADVANTAGE_INDICATOR_DEFAULT
    check_subtasks(config, data_args, training_args)
    if getattr(config, "subtask_layout", None):
        check_token_objective(config, model_args, training_args, what=f"subtask_layout={config.subtask_layout!r}")
    if getattr(config, "subtask_layout", None):  # a decoded subtask ends at the tokenizer's EOS
        config.subtask_eos_token_id = tokenizer.eos_token_id
    if training_args.n_action_steps is not None and training_args.n_action_steps > config.chunk_size:
        raise ConfigError(f"n_action_steps={training_args.n_action_steps}: at most the chunk size "
                          f"({config.chunk_size}); it is how many actions of each predicted chunk are executed")
    if data_args.generate_demo_data:
        from hf_vla.envs.generate import ensure_demo_dataset

        ensure_demo_dataset(data_args.datasets[0]["root"], episodes=data_args.demo_episodes,
                            main_process=training_args.process_index == 0)

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
    if getattr(config, "subtask_layout", None):
        collator.subtask_dropout, collator.seed = training_args.subtask_dropout, training_args.seed
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
                                                            chunk_size=model.config.chunk_size,
                                                            memory=getattr(processor, "memory", None))
    peft_config = None
    if model_args.lora_preset:
        from hf_vla.training.lora import lora_config

        # the adapters are drawn from the RNG the seeded build left: every rank draws the same ones
        peft_config = lora_config(model_args.lora_preset, r=model_args.lora_r, alpha=model_args.lora_alpha, model=model)
    trainer = VLATrainer(model, training_args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         data_collator=collator, processing_class=processor, peft_config=peft_config)
    trainer.norm_stats = {"head_names": mixture.head_names, "norm_stats": mixture.norm_stats}
    return trainer


__all__ = ["TINY_LOC_TOKENIZER", "TINY_TOKENIZER", "build_model", "build_trainer", "build_tokenizer", "check_data_for_policy", "check_dims",
           "check_token_objective", "model_config", "pi05_setup", "saved_norm_stats", "value_setup"]
