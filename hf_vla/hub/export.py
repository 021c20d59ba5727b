"""hf_vla pi0.5 checkpoints to lerobot's native `pi05` directory (`python -m hf_vla.convert --to lerobot`).

The inverse of `hf_vla.hub.convert`: weights in `PI05Policy`'s key layout, lerobot's `config.json` (`PI05Config`, with
the head's cameras in slot order, state and action features, `chunk_size`, `n_action_steps`, the normalisation mapping
and relative actions) and the pre/post-processor files lerobot's own `make_pi05_pre_post_processors` writes with that
head's statistics. lerobot's `PI05Policy.from_pretrained` and `make_pre_post_processors(pretrained_path=DIR)` load the
result with no hf_vla code. The key set is checked against lerobot's own model, built on the meta device (no memory).

What lerobot's format cannot hold is refused or dropped in one line each (`export_lerobot`'s docstring).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import torch

from hf_vla.errors import ConfigError, DataError
from hf_vla.hub.convert import (  # lerobot's variants and SigLIP So400m, as the import reads them
    _GEMMA_VARIANTS,
    _VISION_DIMS,
)
from hf_vla.models.pi05.configuration_pi05 import MEMORY_FIELDS

logger = logging.getLogger(__name__)

PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"  # what lerobot's pi0.5 processor tokenizes with, by name
VOCAB = 257152  # lerobot builds PaliGemma's vocabulary
# (hf_vla key pattern, lerobot key) once the weights are hf_vla pi0.5's; the inverse of convert._PI05_RULES
_EXPORT_RULES = [
    (r"^model\.proprio_history_proj\.", "model.proprio_history_proj."),  # MEM's proprioceptive memory
    (r"^model\.vlm\.", "model.paligemma_with_expert.paligemma.model."),
    (r"^model\.expert\.", "model.paligemma_with_expert.gemma_expert.model."),
    (r"^(action_in_proj|action_out_proj|time_mlp_in|time_mlp_out)\.", r"model.\1."),
]
_EMBED = "model.vlm.language_model.embed_tokens.weight"
_LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"
_EXPERT_LM_HEAD = "model.paligemma_with_expert.gemma_expert.lm_head.weight"


def lerobot_state_dict(state_dict: dict[str, torch.Tensor], config) -> tuple[dict[str, torch.Tensor], list[str]]:
    """hf_vla pi0.5 weights renamed to lerobot `PI05Policy` keys, and the keys dropped (the critic of PPO, which
    lerobot's policy has no place for). lerobot's tied `lm_head` is the VLM's embedding; its expert's `lm_head`, which
    nothing reads, is written as zeros because lerobot loads strictly."""
    converted, dropped, unknown = {}, [], []
    for key, value in state_dict.items():
        if key.startswith("value_head."):
            dropped.append(key)
            continue
        for pattern, replacement in _EXPORT_RULES:
            new_key, count = re.subn(pattern, replacement, key)
            if count:
                converted[new_key] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise DataError(f"lerobot export: {len(unknown)} weights have no place in lerobot's PI05Policy, e.g. "
                        f"{unknown[:5]}")
    embed = state_dict[_EMBED]
    converted[_LM_HEAD] = embed  # tied: lerobot's file holds it once, its loader copies it to embed_tokens
    converted[_EXPERT_LM_HEAD] = torch.zeros(embed.shape[0], config.dit_config.hidden_size, dtype=embed.dtype)
    return converted, dropped


def _dims(config) -> dict:
    text, expert, vision = config.vlm_config.text_config, config.dit_config, config.vlm_config.vision_config
    pick = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim")
    return {"text": {k: getattr(text, k) for k in pick}, "expert": {k: getattr(expert, k) for k in pick},
            "vision": {k: getattr(vision, k) for k in _VISION_DIMS}, "image_size": int(vision.image_size)}


def standard_dims(config) -> bool:
    """Whether lerobot builds this architecture as it stands (PaliGemma 2B + Gemma 300M expert + SigLIP So400m)."""
    d = _dims(config)
    return (d["text"] == _GEMMA_VARIANTS["gemma_2b"] and d["expert"] == _GEMMA_VARIANTS["gemma_300m"]
            and d["vision"] == _VISION_DIMS)


@contextlib.contextmanager
def lerobot_at_dims(config):
    """lerobot's pi0.5 classes built at `config`'s tower dims (patched config factories, as `hf_vla.models.reference`
    does): what loads an export of a checkpoint that is not the published architecture (a tiny test model)."""
    import lerobot.policies.pi05.modeling_pi05 as module

    from hf_vla.models.reference import Dims, _tiny_lerobot

    if standard_dims(config):
        yield
        return
    d = _dims(config)

    def gemma(dims):
        return dict(width=dims["hidden_size"], depth=dims["num_hidden_layers"], mlp_dim=dims["intermediate_size"],
                    num_heads=dims["num_attention_heads"], num_kv_heads=dims["num_key_value_heads"],
                    head_dim=dims["head_dim"])

    with _tiny_lerobot(module, Dims(text=gemma(d["text"]), expert=gemma(d["expert"]), vision=d["vision"],
                                    image_size=d["image_size"])):
        yield


def _refusals(config, where: str) -> None:
    text_vocab = config.vlm_config.text_config.vocab_size
    if text_vocab != VOCAB:
        raise ConfigError(f"{where}: lerobot's pi0.5 has PaliGemma's {VOCAB:,}-token vocabulary; this checkpoint's "
                          f"has {text_vocab:,}: lerobot cannot build it (a checkpoint trained from a PaliGemma base can "
                          "be exported)")
    heads = {config.vlm_config.text_config.num_attention_heads, config.dit_config.num_attention_heads}
    if heads != {8}:
        raise ConfigError(f"{where}: {sorted(heads)} attention heads; lerobot's pi0.5 attention is written for 8")
    if not config.discrete_state_input:
        raise ConfigError(f"{where}: discrete_state_input=false (a prompt without the state, openpi's pi05_libero); "
                          "lerobot's pi0.5 always writes the state into the prompt, so it would act otherwise")
    if config.state_bins != 256:
        raise ConfigError(f"{where}: state_bins={config.state_bins}; lerobot's pi0.5 discretises the state into 256")
    if getattr(config, "advantage_indicator", "text") == "embedding":
        raise ConfigError(f"{where}: advantage_indicator='embedding' (RECAP's indicator read by the expert); "
                          "lerobot's pi0.5 has no such input: run it in lerobot through the plugin (--to lerobot_plugin)")


def _features(spec: dict, image_size: int):
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs, empty = {}, 0
    for camera in spec["cameras"]:
        if camera["key"] is None:  # an empty slot: lerobot's empty_cameras pads it
            empty += 1
            continue
        shape = (3, camera.get("height") or image_size, camera.get("width") or image_size)
        inputs[camera["key"]] = PolicyFeature(FeatureType.VISUAL, shape)
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (int(spec["state"]["dim"]),))
    return inputs, {"action": PolicyFeature(FeatureType.ACTION, (int(spec["action"]["dim"]),))}, empty


def _relative_names(mask: list[bool] | None, dim: int) -> dict:
    """lerobot's relative actions as names its processor turns back into `mask`: the absolute dims are excluded by a
    token only their names hold."""
    if not mask or not any(mask):
        return {"use_relative_actions": False}
    # hf_vla keeps the dims past a shorter mask absolute; lerobot's mask covers every named dim, so they are named
    # absolute here (before, a mask [True] for 2 dims came back from lerobot as [True, True])
    mask = [bool(m) for m in mask[:dim]] + [False] * max(0, dim - len(mask))
    names = [f"joint_{i}" if relative else f"absolute_{i}" for i, relative in enumerate(mask)]
    return {"use_relative_actions": True, "action_feature_names": names,
            "relative_exclude_joints": ["absolute_"] if not all(mask) else []}


def _lerobot_stats(stats: dict, state_key: str = "observation.state") -> dict:
    out = {}
    for ours, theirs in (("state", state_key), ("actions", "action")):
        values = {name: torch.tensor(value, dtype=torch.float32) for name, value in stats.get(ours, {}).items()
                  if name not in ("mode", "relative_mask") and isinstance(value, list)}
        if values:
            out[theirs] = values
    return out


def export_lerobot(checkpoint: str | Path, output: str | Path, head: str | None = None,
                   overwrite: bool = False, n_action_steps: int | None = None) -> Path:
    """Write hf_vla pi0.5 `checkpoint` as a lerobot `pi05` directory at `output`; returns it.

    Refused, in one line each: LoRA adapters (export the run's merged output), pi0 (transformers' pi0 layout is not
    exported), a multi-head checkpoint without `head`, no deployment contract, a vocabulary, head count, prompt or
    state discretisation lerobot's pi0.5 cannot reproduce. Dropped, with one logged line: a PPO critic (never used to
    act) and the token objective's training settings (inference samples with the flow head in both). A checkpoint of
    non-published dims is written, and loads in lerobot under `lerobot_at_dims`.
    """
    from huggingface_hub import save_torch_state_dict
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    from hf_vla.deployment import contract as contracts
    from hf_vla.hub.convert import _check_paths, checkpoint_model_type
    from hf_vla.hub.resolve import load_pretrained
    from hf_vla.storage import replace_dir, staging_dir, write_marker

    checkpoint, output = Path(checkpoint), Path(output)
    where = f"--input {str(checkpoint)!r}"
    if (checkpoint / "adapter_config.json").is_file():
        raise ConfigError(f"{where}: LoRA adapters; export the run's merged output (its output directory, or "
                          "python -m hf_vla.convert --input ADAPTERS --output MERGED first)")
    model_type = checkpoint_model_type(checkpoint, where)
    from hf_vla.registry import find_policy

    family = find_policy(model_type)
    if family is None or not family.lerobot_export:
        raise ConfigError(f"{where}: model_type {model_type!r}; --to lerobot exports hf_vla pi0.5 checkpoints "
                          "(for pi0 or any other, run it in lerobot through the plugin: --to lerobot_plugin)")
    _check_paths(checkpoint, output, overwrite, kind="lerobot_export", what="lerobot export")
    deployment = contracts.read(checkpoint)
    if deployment is None:
        raise ConfigError(f"{where}: no deployment_config.json (its cameras and features); write it with hf_vla.train")
    if head is None and len(deployment.heads) > 1:
        raise ConfigError(f"{where}: {len(deployment.heads)} heads {sorted(deployment.heads)}; lerobot's format holds "
                          "one robot's statistics: pass --head NAME (one export per head)")
    try:
        spec = deployment.head(head)
    except KeyError:
        raise ConfigError(f"--head {head!r}: the checkpoint has the heads {sorted(deployment.heads)}") from None
    head = head or deployment.default_head or next(iter(deployment.heads))
    if n_action_steps is not None and not 1 <= n_action_steps <= deployment.chunk_size:
        raise ConfigError(f"--n_action_steps {n_action_steps}: must be 1..{deployment.chunk_size} (the checkpoint's "
                          "chunk_size; actions executed from each chunk)")
    model, processor = load_pretrained(checkpoint)
    config = model.config
    _refusals(config, where)
    stats = processor.norm_stats.get(head)
    if stats is None:
        raise ConfigError(f"{where}: the processor has no statistics for head {head!r} (it has "
                          f"{sorted(processor.norm_stats)})")
    state_dict, dropped = lerobot_state_dict(model.state_dict(), config)
    if dropped:
        logger.warning("not exported: the PPO critic (%d weights); lerobot's pi0.5 has no value head, and acting "
                       "never reads it", len(dropped))
    if config.token_loss:
        logger.warning("not exported: the token objective's training settings (token_loss, FAST); lerobot's pi0.5 "
                       "samples actions with the flow head, as hf_vla does, so its actions are the same")
    inputs, outputs, empty = _features(spec, processor.image_size)
    from hf_vla.models.common.normalization import mode_of, relative_mask

    modes = {"VISUAL": "IDENTITY", "STATE": mode_of(stats["state"]), "ACTION": mode_of(stats["actions"])}
    lerobot_config = PI05Config(
        paligemma_variant="gemma_2b", action_expert_variant="gemma_300m", dtype="float32", device="cpu", push_to_hub=False,
        chunk_size=config.chunk_size, n_action_steps=n_action_steps or deployment.n_action_steps, max_state_dim=config.max_state_dim,
        max_action_dim=config.max_action_dim, num_inference_steps=config.num_inference_steps,
        time_sampling_beta_alpha=config.time_sampling_beta_alpha, time_sampling_beta_beta=config.time_sampling_beta_beta,
        time_sampling_scale=config.time_sampling_scale, time_sampling_offset=config.time_sampling_offset,
        min_period=config.min_period, max_period=config.max_period,
        image_resolution=(processor.image_size, processor.image_size), empty_cameras=empty,
        tokenizer_max_length=processor.prompt_max_length, normalization_mapping=modes, input_features=inputs,
        output_features=outputs, **_relative_names(relative_mask(stats["actions"]), int(spec["action"]["dim"])),
        **({"rtc_training_max_delay": config.rtc_max_delay} if config.rtc_max_delay else {}))
    with lerobot_at_dims(config), torch.device("meta"):
        lerobot_config.device = "meta"  # the key set and shapes only
        expected = {key: tuple(value.shape) for key, value in PI05Policy(lerobot_config).state_dict().items()}
    lerobot_config.device = "cpu"
    memory = _memory_fields(config)
    if config.use_proprioceptive_memory and "model.proprio_history_proj.weight" not in expected:
        # a lerobot release before MEM builds the policy here: its main branch adds the projection (a Linear)
        width = config.vlm_config.text_config.hidden_size
        expected |= {"model.proprio_history_proj.weight": (width, config.max_state_dim),
                     "model.proprio_history_proj.bias": (width,)}
    ours = {key: tuple(value.shape) for key, value in state_dict.items()}
    if ours != expected:
        wrong = sorted(set(ours) ^ set(expected)) or [k for k in ours if ours[k] != expected[k]]
        raise DataError(f"lerobot export: the weights do not fit lerobot's PI05Policy ({len(wrong)} keys differ, e.g. "
                        f"{wrong[:4]})")
    staging = staging_dir(output, "exporting")
    staging.mkdir(parents=True)
    # as lerobot's own PreTrainedPolicy._save_pretrained writes a gathered state dict: its config, then one
    # model.safetensors with shared tensors (the tied embedding) stored once
    lerobot_config._save_pretrained(staging)
    tensors = {k: v.detach().contiguous() for k, v in state_dict.items()}
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())
    save_torch_state_dict(tensors, str(staging), max_shard_size=max(total, 1))
    pre, post = lerobot_processors(lerobot_config, _lerobot_stats(stats), processor.tokenizer)
    pre.save_pretrained(staging)
    post.save_pretrained(staging)
    if memory:
        _write_memory_fields(staging, memory)
    write_marker(staging, "lerobot_export", source=str(checkpoint), head=head)
    written = replace_dir(staging, output)
    logger.info("wrote %s: lerobot's PI05Policy.from_pretrained(%r) loads it (head %s)", written, str(written), head)
    return written


def _memory_fields(config) -> dict:
    """MEM's settings as lerobot's main branch names them (empty without memory)."""
    if not (config.use_visual_memory or config.use_proprioceptive_memory):
        return {}
    return {key: getattr(config, key) for key in MEMORY_FIELDS}


def _write_memory_fields(directory: Path, memory: dict) -> None:
    """MEM's fields into the exported config.json, and the prompt without the state into the pre-processor's state
    step with proprioceptive memory (`include_state_in_prompt`, which lerobot's own save leaves out: its reloaded
    pipeline would put the state back into the prompt, unlike the one it trained with)."""
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | memory, indent=4))
    if not memory["use_proprioceptive_memory"]:
        return
    path = directory / "policy_preprocessor.json"
    pipeline = json.loads(path.read_text())
    for step in pipeline["steps"]:
        if step.get("registry_name") == "pi05_prepare_state_tokenizer_processor_step":
            step.setdefault("config", {})["include_state_in_prompt"] = False
    path.write_text(json.dumps(pipeline, indent=2))


def lerobot_processors(lerobot_config, stats: dict, tokenizer=None):
    """lerobot's own pi0.5 pre/post-processors for `stats`. lerobot's pipeline names PaliGemma's tokenizer, which it
    loads when it reads the files; here the checkpoint's tokenizer stands in for it (nothing is downloaded) and the
    saved files still name PaliGemma's."""
    from unittest import mock

    import lerobot.policies.pi05.processor_pi05 as processor_module
    from lerobot.processor import TokenizerProcessorStep

    def named(tokenizer_name=None, **kwargs):
        step = TokenizerProcessorStep(tokenizer=tokenizer, **kwargs)
        step.tokenizer, step.tokenizer_name = None, tokenizer_name or PALIGEMMA_TOKENIZER  # saved by name
        return step

    patch = mock.patch.object(processor_module, "TokenizerProcessorStep", named) if tokenizer is not None else (
        contextlib.nullcontext())
    with patch:
        return processor_module.make_pi05_pre_post_processors(lerobot_config, dataset_stats=stats)


__all__ = ["export_lerobot", "lerobot_at_dims", "lerobot_processors", "lerobot_state_dict", "standard_dims"]
