"""hf_vla pi0.5 checkpoints in transformers' own pi0.5 format (`python -m hf_vla.convert --to transformers`).

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
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from hf_vla.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# (hf_vla key pattern, transformers' key as its save_pretrained writes it)
_RULES = [
    (r"^model\.vlm\.language_model\.", "paligemma_with_expert.paligemma.model.language_model.model."),
    (r"^model\.vlm\.multi_modal_projector\.", "paligemma_with_expert.paligemma.model.multi_modal_projector."),
    (r"^model\.vlm\.vision_tower\.vision_model\.", "paligemma_with_expert.paligemma.model.vision_tower."),
    (r"^model\.expert\.", "paligemma_with_expert.gemma_expert.model."),
    (r"^(action_in_proj|action_out_proj|time_mlp_in|time_mlp_out)\.", r"\1."),
]
_FLOW_FIELDS = ("chunk_size", "max_action_dim", "num_inference_steps", "time_sampling_beta_alpha",
                "time_sampling_beta_beta", "time_sampling_scale", "time_sampling_offset", "min_period", "max_period")
_MODES = {"QUANTILES": ("q01", "q99"), "MEAN_STD": ("mean", "std")}


def transformers_state_dict(state_dict: dict) -> tuple[dict, list[str]]:
    """hf_vla pi0.5 weights under transformers' pi0.5 names, and the keys dropped (the PPO critic)."""
    converted, dropped, unknown = {}, [], []
    for key, value in state_dict.items():
        if key.startswith("value_head."):
            dropped.append(key)
            continue
        for pattern, replacement in _RULES:
            new_key, count = re.subn(pattern, replacement, key)
            if count:
                converted[new_key] = value
                break
        else:
            unknown.append(key)
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
    if family is None or family.name != "pi05":
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


__all__ = ["export_transformers", "transformers_config", "transformers_state_dict"]
