"""hf_vla pi0.5 checkpoints in transformers' own pi0.5 format (`python -m hf_vla.convert --to transformers`), and
transformers' own pi0.5 checkpoints into hf_vla (`python -m hf_vla.convert --input TRANSFORMERS_DIR`).

transformers 5.25 ships `PI05ForConditionalGeneration` (model type `pi05`): the same model as hf_vla's on the same
weights, with other weight names and config fields. The export writes its `config.json` (a PaliGemma `vlm_config`, a
Gemma `dit_config`, the flow settings), the weights under the names its `save_pretrained` writes, and for its
`PI05Processor` one head's statistics (`state_q01` ... or `state_mean` ...), SigLIP's image settings and the checkpoint's
tokenizer. Nothing here imports transformers 5.25: the files are written as it reads them, and
`tests/test_transformers_pi05.py` loads them with transformers 5.25 itself (strictly: no key missing or unexpected).

What transformers' pi0.5 cannot express is refused in one line naming it (its actions would differ: MEM, subtask
decoding, RECAP's advantage indicator, relative actions, normalisation modes other than QUANTILES and MEAN_STD, a
prompt without the state), or dropped with one logged line where acting never reads it (the PPO critic, the token
objective's and training-time RTC's settings). transformers' processor does not un-normalise actions: its
`processor_config.json` holds the statistics that do it (`actions_q01` / `actions_q99`, or mean and std).

The import reads what transformers' `save_pretrained` wrote (its `config.json`, weights, `PI05Processor` files) and
writes an hf_vla checkpoint of one head: the statistics of its processor, its tokenizer, its prompt length (200, its
processor's default), the state written into the prompt in 256 bins (its processor's only prompt).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hf_vla.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# (hf_vla key prefix, transformers' as its save_pretrained writes it); the flow heads keep their names
_PREFIXES = [
    ("model.vlm.language_model.", "paligemma_with_expert.paligemma.model.language_model.model."),
    ("model.vlm.multi_modal_projector.", "paligemma_with_expert.paligemma.model.multi_modal_projector."),
    ("model.vlm.vision_tower.vision_model.", "paligemma_with_expert.paligemma.model.vision_tower."),
    ("model.expert.", "paligemma_with_expert.gemma_expert.model."),
]
_HEADS = ("action_in_proj.", "action_out_proj.", "time_mlp_in.", "time_mlp_out.")
# transformers' on-disk lm_head, which its pi0.5 never reads (nor hf_vla's: acting reads the embedding)
_LM_HEADS = ("paligemma_with_expert.paligemma.lm_head.", "paligemma_with_expert.gemma_expert.lm_head.")


def _renamed(key: str, pairs) -> str | None:
    if key.startswith(_HEADS):
        return key
    for source, target in pairs:
        if key.startswith(source):
            return target + key[len(source):]
    return None
_FLOW_FIELDS = ("chunk_size", "max_action_dim", "num_inference_steps", "time_sampling_beta_alpha",
                "time_sampling_beta_beta", "time_sampling_scale", "time_sampling_offset", "min_period", "max_period")
_MODES = {"QUANTILES": ("q01", "q99"), "MEAN_STD": ("mean", "std")}


def transformers_state_dict(state_dict: dict) -> tuple[dict, list[str]]:
    """hf_vla pi0.5 weights under transformers' pi0.5 names, and the keys dropped (the PPO critic)."""
    converted, dropped, unknown = {}, [], []
    for key, value in state_dict.items():
        new_key = _renamed(key, _PREFIXES)
        if key.startswith("value_head."):
            dropped.append(key)
        elif new_key is None:
            unknown.append(key)
        else:
            converted[new_key] = value
    if unknown:
        raise DataError(f"transformers export: {len(unknown)} weights have no place in transformers' pi0.5, e.g. "
                        f"{unknown[:5]}")
    return converted, dropped


def transformers_config(config, image_token_id: int | None = None) -> dict:
    """transformers' `PI05Config` fields for hf_vla's `config`; `image_token_id`: where transformers' processor puts
    the `<image>` placeholders (hf_vla's prompts hold no image tokens, so its config's value is never read)."""
    dit = config.dit_config.to_dict()
    for name in ("is_causal", "use_bidirectional_attention", "transformers_version"):
        dit.pop(name, None)  # transformers' PI05Config sets the towers' attention itself
    vlm = config.vlm_config.to_dict()
    vlm.pop("transformers_version", None)
    if image_token_id is not None:
        vlm["image_token_id"] = int(image_token_id)
    return {"architectures": ["PI05ForConditionalGeneration"], "model_type": "pi05", "vlm_config": vlm,
            "dit_config": dit, **{name: getattr(config, name) for name in _FLOW_FIELDS}, "loss_reduction": "mean",
            "dtype": "float32"}


def _refusals(config, stats: dict, where: str) -> None:
    from hf_vla.models.common.normalization import mode_of, relative_mask

    cannot = [(config.use_visual_memory or config.use_proprioceptive_memory, "MEM observation memory"),
              (config.subtask_layout is not None, f"subtask decoding (subtask_layout={config.subtask_layout!r})"),
              (config.advantage_indicator is not None,
               f"RECAP's advantage indicator (advantage_indicator={config.advantage_indicator!r})"),
              (not config.discrete_state_input, "a prompt without the state (discrete_state_input=false)"),
              (config.state_bins != 256, f"state_bins={config.state_bins} (transformers' prompt writes 256 bins)"),
              (relative_mask(stats["actions"]) is not None, "relative actions (its processor has none)")]
    for key in ("state", "actions"):
        mode = mode_of(stats[key])
        cannot.append((mode not in _MODES, f"the {key}' normalisation mode {mode} (its processor has QUANTILES and "
                                           "MEAN_STD)"))
    for refused, what in cannot:
        if refused:
            raise ConfigError(f"{where}: transformers' pi0.5 cannot express {what}; its actions would differ")


def _image_token_id(tokenizer) -> int:
    """The id transformers' `PI05Processor` gives `<image>` with this tokenizer: its own where the vocabulary has it
    (PaliGemma's: 257152), else the next free one (the processor adds it)."""
    known = tokenizer.convert_tokens_to_ids("<image>")
    return int(known) if known is not None and known != tokenizer.unk_token_id else len(tokenizer)


def _processor_files(processor, config, stats: dict, directory: Path) -> None:
    """transformers' `PI05Processor` files: the head's statistics, SigLIP's image settings, the tokenizer."""
    fields = {"processor_class": "PI05Processor", "max_state_dim": int(config.max_state_dim),
              "chunk_size": int(config.chunk_size)}
    for key in ("state", "actions"):
        from hf_vla.models.common.normalization import mode_of

        for name in _MODES[mode_of(stats[key])]:
            fields[f"{key}_{name}"] = [float(v) for v in stats[key][name]]
    (directory / "processor_config.json").write_text(json.dumps(fields, indent=2) + "\n")
    size = int(processor.image_size)
    image = {"image_processor_type": "SiglipImageProcessor", "processor_class": "PI05Processor",
             "do_resize": True, "size": {"height": size, "width": size}, "resample": 2, "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
             "image_seq_length": int(config.num_image_tokens)}
    (directory / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    processor.tokenizer.save_pretrained(directory)


def export_transformers(checkpoint: str | Path, output: str | Path, head: str | None = None,
                        overwrite: bool = False) -> Path:
    """Write hf_vla pi0.5 `checkpoint` in transformers' own pi0.5 format at `output`; returns it. One head's
    statistics go to the processor (`head`, required where the checkpoint has several)."""
    from huggingface_hub import save_torch_state_dict

    from hf_vla.hub.convert import _check_paths, checkpoint_model_type
    from hf_vla.hub.resolve import load_pretrained
    from hf_vla.registry import find_policy
    from hf_vla.storage import replace_dir, staging_dir, write_marker

    checkpoint, output = Path(checkpoint), Path(output)
    where = f"--input {str(checkpoint)!r}"
    if (checkpoint / "adapter_config.json").is_file():
        raise ConfigError(f"{where}: LoRA adapters; export the run's merged output (its output directory, or "
                          "python -m hf_vla.convert --input ADAPTERS --output MERGED first)")
    family = find_policy(checkpoint_model_type(checkpoint, where))
    if family is None or not family.transformers_export:
        raise ConfigError(f"{where}: --to transformers writes hf_vla pi0.5 checkpoints (pi0 is transformers' own "
                          "model already)")
    _check_paths(checkpoint, output, overwrite, kind="transformers_export", what="transformers export")
    model, processor = load_pretrained(checkpoint)
    heads = sorted(processor.norm_stats)
    if head is None and len(heads) > 1:
        raise ConfigError(f"{where}: {len(heads)} heads {heads}; transformers' processor holds one robot's "
                          "statistics: pass --head NAME (one export per head)")
    head = head if head is not None else heads[0]
    if head not in processor.norm_stats:
        raise ConfigError(f"--head {head!r}: the checkpoint has the heads {heads}")
    stats = processor.norm_stats[head]
    config = model.config
    _refusals(config, stats, where)
    state_dict, dropped = transformers_state_dict(model.state_dict())
    if dropped:
        logger.warning("not exported: the PPO critic (%d weights); transformers' pi0.5 has no value head, and acting "
                       "never reads it", len(dropped))
    if config.token_loss or config.rtc_max_delay:
        logger.warning("not exported: training settings (the token objective, training-time RTC); transformers' "
                       "pi0.5 samples with the flow head, as hf_vla does")
    staging = staging_dir(output, "exporting")
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(json.dumps(transformers_config(config, _image_token_id(processor.tokenizer)),
                                                    indent=2) + "\n")
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())
    save_torch_state_dict(tensors, str(staging), max_shard_size=max(total, 1))
    _processor_files(processor, config, stats, staging)
    write_marker(staging, "transformers_export", source=str(checkpoint), head=head)
    written = replace_dir(staging, output)
    logger.info("wrote %s: transformers' PI05ForConditionalGeneration.from_pretrained(%r) loads it (head %s)",
                written, str(written), head)
    return written


def is_transformers_pi05(config_dict) -> bool:
    """Whether a config.json's content is transformers' own pi0.5 (model type `pi05` without hf_vla's fields)."""
    from hf_vla.models.pi05.configuration_pi05 import LEGACY_MODEL_TYPE, upgrade_config_dict

    if not isinstance(config_dict, dict) or config_dict.get("model_type") != LEGACY_MODEL_TYPE:
        return False
    try:
        upgrade_config_dict(config_dict)
    except ValueError:
        return True
    return False


def hf_vla_state_dict(state_dict: dict) -> dict:
    """transformers' pi0.5 weights (as its `save_pretrained` writes them) under hf_vla's names."""
    inverse = [(theirs, ours) for ours, theirs in _PREFIXES]
    converted, unknown = {}, []
    for key, value in state_dict.items():
        new_key = _renamed(key, inverse)
        if new_key is not None:
            converted[new_key] = value
        elif not key.startswith(_LM_HEADS):
            unknown.append(key)
    if unknown:
        raise DataError(f"transformers import: {len(unknown)} weights have no place in hf_vla's pi0.5, e.g. "
                        f"{unknown[:5]}")
    return converted


def _imported_stats(fields: dict, where: str) -> dict:
    """transformers' processor statistics as one hf_vla head's (QUANTILES where it has quantiles, as it does)."""
    stats = {}
    for key in ("state", "actions"):
        for mode, names in _MODES.items():
            if all(fields.get(f"{key}_{name}") is not None for name in names):
                stats[key] = {"mode": mode, **{name: [float(v) for v in fields[f"{key}_{name}"]] for name in names}}
                break
        else:
            raise ConfigError(f"{where}: no statistics for {key} ({key}_q01 and {key}_q99, or {key}_mean and "
                              f"{key}_std): transformers' processor cannot normalise it either")
    return stats


def _bos_first(tokenizer):
    """The tokenizer as hf_vla's prompts need it: starting each text with BOS, as PaliGemma's does (transformers'
    processor turns that off and writes BOS into its prompt itself)."""
    if tokenizer.bos_token_id is None or tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]:
        return tokenizer
    if hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = True
    if tokenizer("x")["input_ids"][:1] != [tokenizer.bos_token_id]:
        from tokenizers import processors

        tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokenizer.bos_token} $A", special_tokens=[(tokenizer.bos_token, tokenizer.bos_token_id)])
    return tokenizer


def import_transformers(source: str | Path, output: str | Path, head: str | None = None,
                        overwrite: bool = False) -> Path:
    """Write transformers' own pi0.5 checkpoint `source` (its model and `PI05Processor` saved together) as an hf_vla
    checkpoint at `output` with one head (`head`, default "default"); returns it."""
    from transformers import AutoTokenizer

    from hf_vla.hub.convert import _check_paths, read_weights
    from hf_vla.models.pi05 import PI05Config, PI05ForConditionalGeneration, PI05Processor
    from hf_vla.storage import replace_dir, staging_dir, write_marker

    source, output, head = Path(source), Path(output), head or "default"
    where = f"--input {str(source)!r}"
    files = {name: source / name for name in ("config.json", "processor_config.json")}
    missing = [name for name, path in files.items() if not path.is_file()]
    weights = source / "model.safetensors"
    if not weights.is_file():
        missing.append("model.safetensors (one file: merge shards first)")
    if missing:
        raise ConfigError(f"{where}: transformers' pi0.5 saved with its processor holds config.json, "
                          f"processor_config.json and model.safetensors; missing {', '.join(missing)}")
    _check_paths(source, output, overwrite)
    config_dict, fields = (json.loads(files[name].read_text()) for name in ("config.json", "processor_config.json"))
    stats = _imported_stats(fields, str(files["processor_config.json"]))
    flow = {name: config_dict[name] for name in _FLOW_FIELDS if name in config_dict}
    config = PI05Config(vlm_config=config_dict.get("vlm_config"), dit_config=config_dict.get("dit_config"),
                        max_state_dim=int(fields.get("max_state_dim", 32)), tokenizer_max_length=200,
                        discrete_state_input=True, state_bins=256, **flow)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{where}: its tokenizer could not be loaded ({str(error).splitlines()[0]})") from None
    processor = PI05Processor.from_config(config, _bos_first(tokenizer), norm_stats={head: stats}, head_names=[head])
    state_dict = hf_vla_state_dict(read_weights(weights))
    model = PI05ForConditionalGeneration(config)
    missing_keys, unexpected = model.load_state_dict(state_dict, strict=False)
    missing_keys = [k for k in missing_keys if "sinusoid_freq" not in k]
    if missing_keys or unexpected:
        raise DataError(f"{weights}: transformers' weights do not fit hf_vla's pi0.5: missing {missing_keys[:5]}, "
                        f"unexpected {sorted(unexpected)[:5]}")
    staging = staging_dir(output, "importing")
    model.save_pretrained(staging)
    processor.save_pretrained(staging)
    write_marker(staging, "hf_vla_checkpoint", source=str(source), head=head)
    written = replace_dir(staging, output)
    logger.info("wrote %s from transformers' pi0.5 %s (head %s)", written, source, head)
    return written


__all__ = ["export_transformers", "hf_vla_state_dict", "import_transformers", "is_transformers_pi05", "transformers_config",
           "transformers_state_dict"]
