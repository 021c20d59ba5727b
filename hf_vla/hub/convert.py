"""lerobot (and openpi-converted) pi0 / pi0.5 checkpoints to hf_vla pi0.5 / transformers pi0: the key mapping
(`convert_lerobot_state_dict`), the dims read from the weights, lerobot's normaliser statistics, and the whole
checkpoint written atomically (`convert_checkpoint`). `python -m hf_vla.convert` is the command; training, evaluation
and serving call this on load (`hf_vla.hub.resolve`)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from hf_vla.cli import check_writable_dir
from hf_vla.errors import ConfigError, DataError, MissingFileError
from hf_vla.models.pi05.configuration_pi05 import MEMORY_FIELDS

logger = logging.getLogger(__name__)

# (pattern, replacement) applied in order to each key once the leading "model." is stripped.
_VLM_RULES = [
    (r"^paligemma_with_expert\.paligemma\.model\.", "model.vlm."),
    # openpi-converted / transformers-4 PaliGemma naming
    (r"^paligemma_with_expert\.paligemma\.language_model\.model\.", "model.vlm.language_model."),
    (r"^paligemma_with_expert\.paligemma\.language_model\.(?!model\.)", "model.vlm.language_model."),
    (r"^paligemma_with_expert\.paligemma\.vision_tower\.", "model.vlm.vision_tower."),
    (r"^paligemma_with_expert\.paligemma\.multi_modal_projector\.", "model.vlm.multi_modal_projector."),
]
_PI05_RULES = _VLM_RULES + [
    (r"^paligemma_with_expert\.gemma_expert\.model\.", "model.expert."),
    (r"^action_time_mlp_(in|out)\.", r"time_mlp_\1."),
    (r"^(action_in_proj|action_out_proj|time_mlp_in|time_mlp_out)\.", r"\1."),
    (r"^proprio_history_proj\.", "model.proprio_history_proj."),  # MEM's proprioceptive memory
]
_PI0_RULES = _VLM_RULES + [
    (r"^paligemma_with_expert\.gemma_expert\.model\.", "model.dit."),
    (r"^(action_in_proj|state_proj|action_time_mlp_in|action_time_mlp_out)\.", r"embed_action_time.\1."),
    (r"^action_out_proj\.", "action_out_proj."),
]
_LM_HEAD = re.compile(r"^paligemma_with_expert\.paligemma\.lm_head\.weight$")
_DROPPED = [
    re.compile(r"^paligemma_with_expert\.gemma_expert\.lm_head\."),  # the expert never decodes tokens
    re.compile(r"\.rotary_emb\."),
    re.compile(r"^paligemma_with_expert\.gemma_expert\.model\.embed_tokens\."),
]


_EMBED_KEY = "model.vlm.language_model.embed_tokens.weight"


@dataclass(frozen=True)
class LerobotFormat:
    """How the checkpoints of one lerobot policy type convert (the registered family `family` of the same name
    becomes their model type).

    rules: the key renames; adarms_expert: the expert's norms are adaRMS, so plain RMSNorm weights there mean another
    type; expert_embed: the converted model keeps an (unused) expert token embedding lerobot drops; config: the
    config class; fields: the lerobot fields read beyond the common ones; default_modes: lerobot's default
    normalisation of state and actions; any_mode: whether other modes and relative actions convert (else refused).
    """

    rules: list
    adarms_expert: bool
    expert_embed: bool
    config: str
    fields: bool
    default_modes: dict
    any_mode: bool


LEROBOT_FORMATS = {
    "pi05": LerobotFormat(_PI05_RULES, adarms_expert=True, expert_embed=False,
                          config="hf_vla.models.pi05.configuration_pi05:PI05Config", fields=True,
                          default_modes={"state": "QUANTILES", "actions": "QUANTILES"}, any_mode=True),
    "pi0": LerobotFormat(_PI0_RULES, adarms_expert=False, expert_embed=True, config="transformers:PI0Config",
                         fields=False, default_modes={"state": "MEAN_STD", "actions": "MEAN_STD"}, any_mode=False),
}


def lerobot_format(policy_type, where: str) -> LerobotFormat:
    """The conversion of lerobot's `policy_type`; a `DataError` naming `where` for a type hf_vla does not convert."""
    if policy_type not in LEROBOT_FORMATS:
        raise DataError(f"{where}: lerobot policy type {policy_type!r} is not {' or '.join(map(repr, LEROBOT_FORMATS))}")
    return LEROBOT_FORMATS[policy_type]


def convert_lerobot_state_dict(state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Rename a lerobot `PI05Policy` / `PI0Policy` state dict to hf_vla pi0.5 / transformers pi0 keys.

    The lm_head is tied to embed_tokens in the reference and stored once: it becomes the VLM's embed_tokens when
    those are absent. pi0.5's expert has adaRMS norms, so plain `...expert...layernorm.weight` keys (a pi0 expert
    loaded as pi0.5) are refused. Unknown keys raise instead of being silently dropped.
    """
    from hf_vla.registry import find_policy

    family = find_policy(getattr(config, "model_type", None))  # hf_vla's pi0.5 (hf_vla_pi05) converts lerobot's pi05
    form = lerobot_format(family.lerobot_type if family is not None else getattr(config, "model_type", None),
                          "convert_lerobot_state_dict: config.model_type")
    rules, embed_key = form.rules, _EMBED_KEY
    converted: dict[str, torch.Tensor] = {}
    lm_head = None
    unknown = []
    for key, value in state_dict.items():
        name = key[len("model.") :] if key.startswith("model.") else key
        if _LM_HEAD.match(name):
            lm_head = value
            continue
        if any(p.search(name) for p in _DROPPED):
            continue
        for pattern, replacement in rules:
            new_name, count = re.subn(pattern, replacement, name)
            if count:
                break
        else:
            unknown.append(key)
            continue
        if form.adarms_expert and re.match(r"^model\.expert\.(layers\.\d+\.(input|post_attention)_layernorm|norm)\.weight$", new_name):
            raise DataError(
                f"{key}: a plain RMSNorm weight in the action expert; pi0.5's expert norms are adaRMS (`.dense`). "
                "Is this a pi0 checkpoint? Convert it with a PI0Config."
            )
        converted[new_name] = value
    if unknown:
        raise DataError(f"convert_lerobot_state_dict: {len(unknown)} keys have no mapping, e.g. {unknown[:5]}")
    if embed_key not in converted:
        if lm_head is None:
            raise DataError("checkpoint has neither the VLM's embed_tokens nor the tied lm_head")
        converted[embed_key] = lm_head
    if form.expert_embed and "model.dit.embed_tokens.weight" not in converted:
        # transformers' pi0 keeps an (unused) token embedding in the expert; lerobot drops it.
        converted["model.dit.embed_tokens.weight"] = torch.zeros(
            config.dit_config.vocab_size, config.dit_config.hidden_size, dtype=converted[embed_key].dtype
        )
    return converted


_GEMMA_VARIANTS = {
    "gemma_300m": dict(hidden_size=1024, num_hidden_layers=18, intermediate_size=4096, num_attention_heads=8,
                       num_key_value_heads=1, head_dim=256),
    "gemma_2b": dict(hidden_size=2048, num_hidden_layers=18, intermediate_size=16384, num_attention_heads=8,
                     num_key_value_heads=1, head_dim=256),
}


# SigLIP So400m/14 as used by pi0 / pi0.5 (image_size comes from the checkpoint's image_resolution).
_VISION_DIMS = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, patch_size=14)


def dims_from_weights(shapes: dict[str, tuple]) -> dict:
    """Tower dims read from a lerobot pi0 / pi0.5 state dict's tensor shapes (names as lerobot or openpi store them).

    Returns `text`, `expert` (hidden, layers, intermediate, heads, head_dim), `vision` (hidden, layers, intermediate,
    patch size, image size), `vocab_size` and `max_action_dim`, for what the shapes determine. Attention head counts
    do not show in a shape (only heads x head_dim does): the KV heads of the Gemma towers and SigLIP's heads come from
    the published architecture, and the query heads follow from them.
    """
    def layers(pattern: str) -> int:
        found = {int(m.group(1)) for key in shapes if (m := re.search(pattern, key))}
        return max(found) + 1 if found else 0

    def first(pattern: str):
        return next((shape for key, shape in shapes.items() if re.search(pattern, key)), None)

    dims: dict = {}
    for tower, where, variant in (("text", r"paligemma\.(?:model\.)?language_model\.(?:model\.)?", "gemma_2b"),
                                  ("expert", r"gemma_expert\.model\.", "gemma_300m")):
        q = first(where + r"layers\.0\.self_attn\.q_proj\.weight$")
        k = first(where + r"layers\.0\.self_attn\.k_proj\.weight$")
        gate = first(where + r"layers\.0\.mlp\.gate_proj\.weight$")
        if q is None or k is None or gate is None:
            continue
        kv_heads = _GEMMA_VARIANTS[variant]["num_key_value_heads"]
        head_dim = k[0] // kv_heads
        dims[tower] = dict(hidden_size=q[1], num_hidden_layers=layers(where + r"layers\.(\d+)\."),
                           intermediate_size=gate[0], num_attention_heads=q[0] // head_dim,
                           num_key_value_heads=kv_heads, head_dim=head_dim)
    patch = first(r"vision_model\.embeddings\.patch_embedding\.weight$")
    positions = first(r"vision_model\.embeddings\.position_embedding\.weight$")
    fc1 = first(r"vision_model\.encoder\.layers\.0\.mlp\.fc1\.weight$")
    if patch is not None and positions is not None and fc1 is not None:
        side = round(positions[0] ** 0.5)
        dims["vision"] = dict(hidden_size=patch[0], patch_size=patch[-1], image_size=side * patch[-1],
                              intermediate_size=fc1[0],
                              num_hidden_layers=layers(r"vision_model\.encoder\.layers\.(\d+)\."))
    embed = first(r"paligemma\.(?:lm_head|(?:model\.)?language_model\.(?:model\.)?embed_tokens)\.weight$")
    if embed is not None:
        dims["vocab_size"] = embed[0]
    action_in = first(r"(?:^|\.)action_in_proj\.weight$")
    if action_in is not None:
        dims["max_action_dim"] = action_in[1]
    return dims


def _unreadable(path, error) -> DataError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return DataError(f"{path}: not a complete safetensors file ({first}); a download or copy cut off? fetch it again")


def check_weight_files(directory: str | Path) -> None:
    """A local checkpoint's weights are there and whole, read from the safetensors headers and file sizes (nothing is
    loaded): `MissingFileError` naming the directory when there are none, `DataError` naming a file cut off (a
    download or copy that stopped); a Hub id or a `.bin` checkpoint passes unchecked."""
    directory = Path(directory).expanduser()
    if not directory.is_dir() or (directory / "adapter_config.json").is_file():
        return
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        if not any(directory.glob("*.bin")):
            raise MissingFileError(f"{directory}: no model.safetensors (the weights) in the checkpoint directory; a "
                                   "copy or download left them out?")
        return
    for path in files:
        size = path.stat().st_size
        try:
            with path.open("rb") as handle:
                header_size = int.from_bytes(handle.read(8), "little")
                if size < 8 or header_size > size - 8:
                    raise ValueError(f"the header claims {header_size} bytes, the file has {size}")
                header = json.loads(handle.read(header_size))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError) as error:
            raise _unreadable(path, error) from None
        if 8 + header_size + end > size:
            raise _unreadable(path, f"its tensors end at byte {8 + header_size + end}, the file has {size}")


def weight_shapes(path: str | Path) -> dict[str, tuple]:
    """Tensor shapes of a safetensors file, read from its header (no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise _unreadable(path, error) from error


def read_weights(path: str | Path) -> dict:
    """`safetensors.torch.load_file`, with a truncated or damaged file as one `DataError` naming it."""
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise _unreadable(path, error) from error


def config_from_lerobot(lerobot_config: dict, shapes: dict[str, tuple] | None = None, vision_heads: int | None = None,
                        where: str = "config.json"):
    """Build the hf_vla/transformers config from a lerobot policy `config.json`, with the tower dims read from the
    weights' shapes when given (`dims_from_weights`); without them, the published dims of the named variants.

    SigLIP's head count is in neither the weights nor lerobot's config: So400m's 16 for its width, else
    `vision_heads` (`--vision_heads`), else heads of 64 dims (SigLIP's base and large towers) with a warning. A
    config the model refuses (e.g. MEM's temporal layers beyond the tower's depth) is one `ConfigError` naming
    `where` (the file)."""
    from hf_vla.registry import load_object

    form = lerobot_format(lerobot_config.get("type"), "config.json")
    image_size = (lerobot_config.get("image_resolution") or [224, 224])[0]
    text = dict(_GEMMA_VARIANTS[lerobot_config.get("paligemma_variant", "gemma_2b")])
    expert = dict(_GEMMA_VARIANTS[lerobot_config.get("action_expert_variant", "gemma_300m")])
    vision = dict(_VISION_DIMS, image_size=image_size)
    vocab = 257152
    measured = dims_from_weights(shapes) if shapes else {}
    text.update(measured.get("text", {}))
    expert.update(measured.get("expert", {}))
    if "vision" in measured:
        width = measured["vision"]["hidden_size"]
        if vision_heads is not None:
            vision["num_attention_heads"] = int(vision_heads)
        elif width != vision["hidden_size"]:  # not So400m: the heads are not in the weights
            vision["num_attention_heads"] = max(1, width // 64)
            logger.warning("%s: a SigLIP tower %d wide is not pi0's So400m; its attention heads are not stored, so %d "
                           "heads of 64 dims are assumed: pass --vision_heads N (vision_heads=) if it has others",
                           where, width, vision["num_attention_heads"])
        vision.update(measured["vision"])
        if width % vision["num_attention_heads"]:
            raise ConfigError(f"--vision_heads {vision['num_attention_heads']}: does not divide the vision tower's "
                              f"width {width} ({where})")
    elif vision_heads is not None:
        vision["num_attention_heads"] = int(vision_heads)
    vocab = measured.get("vocab_size", vocab)
    vlm_config = {
        "model_type": "paligemma",
        "text_config": {"model_type": "gemma", "vocab_size": vocab, "hidden_act": "gelu_pytorch_tanh", **text},
        "vision_config": {
            "model_type": "siglip_vision_model", **vision, "vision_use_head": False,
            "projection_dim": text["hidden_size"],
        },
        "projection_dim": text["hidden_size"],
        "image_token_id": vocab,
    }
    dit_config = {"model_type": "gemma", "vocab_size": vocab, "hidden_act": "gelu_pytorch_tanh", **expert}
    common = {
        key: lerobot_config[key]
        for key in ("chunk_size", "max_state_dim", "max_action_dim", "num_inference_steps", "time_sampling_beta_alpha",
                    "time_sampling_beta_beta", "time_sampling_scale", "time_sampling_offset", "min_period", "max_period")
        if key in lerobot_config
    }
    if "max_action_dim" in measured:
        if "max_action_dim" in common and common["max_action_dim"] != measured["max_action_dim"]:
            raise DataError(f"config.json says max_action_dim={common['max_action_dim']} but the weights' "
                            f"action_in_proj takes {measured['max_action_dim']}")
        common["max_action_dim"] = measured["max_action_dim"]
    if form.fields:
        if "tokenizer_max_length" in lerobot_config:
            common["tokenizer_max_length"] = lerobot_config["tokenizer_max_length"]
        if lerobot_config.get("rtc_training_max_delay"):  # trained with training-time RTC: its committed prefixes
            common["rtc_max_delay"] = int(lerobot_config["rtc_training_max_delay"])
        for key in MEMORY_FIELDS:  # MEM's observation memory, lerobot's names
            if key in lerobot_config:
                common[key] = lerobot_config[key]
    from huggingface_hub.errors import StrictDataclassError

    try:
        return load_object(form.config)(vlm_config=vlm_config, dit_config=dit_config, **common)
    except (ValueError, TypeError, StrictDataclassError) as error:  # the config's own validation (MEM's layers)
        cause = error.__cause__ if isinstance(error, StrictDataclassError) and error.__cause__ else error
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise ConfigError(f"{where}: {first}") from error


def read_lerobot_norm_stats(checkpoint_dir: Path) -> dict | None:
    """lerobot saves its normalizer as `*normalizer_processor*.safetensors` with keys `<feature>.<stat>`."""
    files = sorted(p for p in checkpoint_dir.glob("*normalizer*.safetensors") if "unnormalizer" not in p.name)
    if not files:
        return None
    tensors = read_weights(files[0])
    stats: dict = {}
    for key, value in tensors.items():
        feature, _, stat = key.rpartition(".")
        target = {"observation.state": "state", "action": "actions"}.get(feature)
        if target:
            stats.setdefault(target, {})[stat] = value.tolist()
    return stats or None


# Every field of lerobot's pi0 / pi0.5 config.json and what the conversion does with it (docs/lerobot_fields.md).
# honoured: read into the model config, the processor's statistics or the deployment contract.
HONOURED = {"type", "paligemma_variant", "action_expert_variant", "chunk_size", "n_action_steps", "max_state_dim",
            "max_action_dim", "num_inference_steps", "time_sampling_beta_alpha", "time_sampling_beta_beta",
            "time_sampling_scale", "time_sampling_offset", "min_period", "max_period", "image_resolution",
            "empty_cameras", "tokenizer_max_length", "normalization_mapping", "use_relative_actions",
            "relative_exclude_joints", "action_feature_names", "rtc_training_max_delay", "input_features",
            "output_features", *MEMORY_FIELDS}
# no effect on the actions a checkpoint computes: training settings, compute placement and logging
IGNORED = {"dtype", "device", "use_amp", "gradient_checkpointing", "compile_model", "compile_mode",
           "freeze_vision_encoder", "train_expert_only", "optimizer_lr", "optimizer_betas", "optimizer_eps",
           "optimizer_weight_decay", "optimizer_grad_clip_norm", "scheduler_warmup_steps", "scheduler_decay_steps",
           "scheduler_decay_lr", "push_to_hub", "repo_id", "private", "tags", "license", "pretrained_path",
           "pretrained_revision",
           "use_peft", "n_obs_steps", "rtc_config"}
# change what the policy does and hf_vla cannot do it: refused rather than converted into a policy that acts otherwise
REFUSED: dict[str, str] = {}



def lerobot_pipeline(lerobot_config: dict, stats: dict | None, where: str) -> dict | None:
    """The normaliser statistics of a lerobot checkpoint with how its pipeline applies them: each quantity's mode
    (`normalization_mapping`; pi0.5's default QUANTILES, pi0's MEAN_STD) and, with `use_relative_actions`, the
    relative mask lerobot builds from `action_feature_names` and `relative_exclude_joints`. A behaviour-changing field
    hf_vla cannot honour, or an unknown one, is refused in one line naming it."""
    from hf_vla.models.common.normalization import mask_from_names, missing_stats, parse_mapping

    for key, what in REFUSED.items():
        if lerobot_config.get(key):
            raise ConfigError(f"{where}: {key}={lerobot_config[key]!r} ({what}) changes what the policy does and "
                              "hf_vla cannot run it; this checkpoint is not converted")
    if int(lerobot_config.get("n_obs_steps") or 1) != 1:
        raise ConfigError(f"{where}: n_obs_steps={lerobot_config['n_obs_steps']}: pi0/pi0.5 read one observation "
                          "step; hf_vla cannot run a policy trained on more")
    steps, chunk = lerobot_config.get("n_action_steps"), lerobot_config.get("chunk_size")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= int(chunk or
                                                                                                          steps)):
        raise ConfigError(f"{where}: n_action_steps={steps!r} must be 1..{chunk} (chunk_size: actions executed from "
                          "each chunk); lerobot refuses it too")
    unknown = sorted(set(lerobot_config) - HONOURED - IGNORED - set(REFUSED))
    if unknown:
        raise ConfigError(f"{where}: field(s) {unknown} are unknown to this hf_vla, so what they change cannot be "
                          "honoured; upgrade hf_vla (docs/lerobot_fields.md lists the fields it reads)")
    form = LEROBOT_FORMATS.get(lerobot_config.get("type"), LEROBOT_FORMATS["pi05"])
    default = dict(form.default_modes)
    try:
        modes = default | parse_mapping(lerobot_config.get("normalization_mapping"), f"{where}: normalization_mapping")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    relative = bool(lerobot_config.get("use_relative_actions"))
    if not form.any_mode and (modes != default or relative):
        raise ConfigError(f"{where}: a pi0 checkpoint with normalization_mapping {modes} or relative actions; hf_vla's "
                          "pi0 normalises state and actions with mean/std, absolute: not converted")
    if stats is None:
        return None
    file = "the normaliser file (*normalizer_processor*.safetensors)"
    widths = {"state": _feature_width(lerobot_config.get("input_features"), "observation.state"),
              "actions": _feature_width(lerobot_config.get("output_features"), "action")}
    for key, values in stats.items():
        lerobot_key = {"state": "observation.state", "actions": "action"}[key]
        for stat, value in values.items():
            array = np.asarray(value, dtype=np.float64)
            if not np.isfinite(array).all():
                raise ConfigError(f"{where}: {file} has non-finite {lerobot_key}.{stat} ({array.tolist()}): the "
                                  "policy would act on NaN or a garbage state; fix or recompute the statistics")
            per_dim = stat in ("mean", "std", "min", "max") or (stat[:1] == "q" and stat[1:].isdigit())
            if per_dim and widths[key] is not None and array.ndim == 1 and array.shape[0] != widths[key]:
                raise ConfigError(f"{where}: {file} has {lerobot_key}.{stat} {array.shape[0]} wide, but the config's "
                                  f"feature {lerobot_key} has {widths[key]} dims: statistics of another robot?")
    for key, mode in modes.items():
        if key not in stats:
            continue
        absent = missing_stats(stats[key], mode)
        if absent:
            raise ConfigError(f"{where}: {mode} normalisation of {key} needs {' and '.join(absent)}, which the "
                              f"checkpoint's normaliser file lacks (it has {sorted(stats[key])})")
        if mode != "QUANTILES" and form.any_mode:
            stats[key]["mode"] = mode
    if relative and "actions" in stats:
        dim = len(stats["actions"].get("mean") or stats["actions"].get("q01") or stats["actions"]["min"])
        names = lerobot_config.get("action_feature_names")
        exclude = lerobot_config.get("relative_exclude_joints", ["gripper"])
        for name in exclude or []:
            if names and not any(str(name).lower() in str(a).lower() for a in names):
                raise ConfigError(f"{where}: relative_exclude_joints {name!r} matches no action_feature_names "
                                  f"{names}")
        stats["actions"]["relative_mask"] = mask_from_names(names, exclude, dim)
    return stats


def checkpoint_model_type(directory: Path, where: str) -> str | None:
    """`directory/config.json`'s model_type (None without a config or a model_type), or one line naming the file
    when it is not JSON (`where`: how the message names the checkpoint, e.g. `--input '...'`)."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        return None
    try:
        content = json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError(f"{where}: {config} is not valid JSON ({error})") from None
    return content.get("model_type") if isinstance(content, dict) else None


def _feature_width(features, key: str) -> int | None:
    """The width of lerobot feature `key` in a config's input/output features (None where it does not say)."""
    try:
        shape = (features or {})[key]["shape"]
        return int(shape[-1]) if shape else None
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def _check_paths(input_dir: Path, output_dir: Path, overwrite: bool, kind: str = "hf_vla_checkpoint",
                 inputs: dict | None = None, legacy=None, what: str = "checkpoint"):
    """convert's outputs follow the one output rule (`hf_vla.storage.check_output`): never the input, above it or in
    it (nor any other input: a local tokenizer, a LoRA base), replaced only with `overwrite` and only when hf_vla
    wrote an output of the same `kind` there; the output's place must be writable."""
    from hf_vla.storage import check_creatable, check_output

    check_output("--output", output_dir, overwrite, inputs={"--input": input_dir, **(inputs or {})}, kind=kind,
                 legacy=legacy, what=what)
    check_writable_dir("--output", output_dir.parent if not output_dir.exists() else output_dir)
    check_creatable("--output", output_dir)  # /proc/x passes every permission check and fails only at mkdir


def convert_checkpoint(
    input_dir: str | Path, output_dir: str | Path, tokenizer="google/paligemma-3b-pt-224", head: str = "default",
    overwrite: bool = False, require_stats: bool = True, vision_heads: int | None = None,
) -> Path:
    """Convert a lerobot checkpoint directory and write model + processor to `output_dir`.

    Everything (config, weights, tokenizer, normalisation stats) is read and converted before anything is written;
    the result is written into a temporary directory beside `output_dir` and renamed into place at the end, so a
    failure leaves no output and never touches the input. `output_dir` must not be, contain or lie inside the input,
    and an existing non-empty one is replaced only with `overwrite`. `require_stats`: refuse a checkpoint without
    the normaliser statistics its modes need (the command's conversion: the result must act); a base checkpoint
    converted on load for fine-tuning gets its statistics from the data. `vision_heads`: SigLIP's attention heads
    where the tower is not So400m (`config_from_lerobot`).
    """
    from transformers import AutoTokenizer

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    config_file, weights_file = input_dir / "config.json", input_dir / "model.safetensors"
    for path in (config_file, weights_file):
        if not path.is_file():
            raise MissingFileError(f"{path}: missing; a lerobot checkpoint directory holds config.json and "
                                   "model.safetensors")
    local_tokenizer = tokenizer if isinstance(tokenizer, str | os.PathLike) and Path(tokenizer).is_dir() else None
    _check_paths(input_dir, output_dir, overwrite, inputs={"--tokenizer": local_tokenizer})
    try:
        lerobot_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{config_file}: not valid JSON ({error})") from error
    config = config_from_lerobot(lerobot_config, weight_shapes(weights_file), vision_heads, str(config_file))
    if isinstance(tokenizer, str | os.PathLike):
        try:
            tok = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ConfigError(f"--tokenizer {tokenizer!r} could not be loaded: {first}") from error
    else:  # a tokenizer object (hf_vla.train passes the one it trains with)
        tok = tokenizer
    stats = lerobot_pipeline(lerobot_config, read_lerobot_norm_stats(input_dir), str(config_file))
    if stats is None and require_stats:
        modes = {k: v for k, v in (lerobot_config.get("normalization_mapping") or {}).items() if k != "VISUAL"}
        if not modes or any(str(mode).upper() != "IDENTITY" for mode in modes.values()):
            raise ConfigError(f"{input_dir}: no normaliser statistics (no *normalizer_processor*.safetensors beside "
                              f"config.json), while its normalization_mapping {modes or 'default'} needs them to act; "
                              "copy the checkpoint with its processor files (a base checkpoint to fine-tune needs no "
                              "conversion: pass it to train --model_name_or_path)")
    state_dict = convert_lerobot_state_dict(read_weights(weights_file), config)
    from hf_vla.registry import get_policy

    # the registered family of the converted model type: its model, and its processor as training saves it (for pi0
    # hf_vla's, with transformers' prompt layout and mean/std normalisation per head): evaluation, serving and RL load
    # every converted checkpoint the same way
    family = get_policy(config.model_type, f"{config_file}: model type")
    model_class = family.load("model")
    processor = family.load("processor").from_config(config, tok, norm_stats={head: stats} if stats else {})
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.converting-", dir=output_dir.parent))
    try:
        # Let transformers build the model from config + tensors (buffers, tying, dtype), then save it properly.
        raw = staging / "raw"
        config.save_pretrained(raw)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(raw / "model.safetensors"),
                  metadata={"format": "pt"})
        del state_dict
        model, info = model_class.from_pretrained(raw, output_loading_info=True)
        missing = [k for k in info["missing_keys"] if "sinusoid_freq" not in k]
        if missing or info["unexpected_keys"]:
            raise DataError(f"{weights_file}: converted weights do not fit {model_class.__name__}: "
                            f"missing {missing[:5]}, unexpected {sorted(info['unexpected_keys'])[:5]}")
        result = staging / "result"
        model.save_pretrained(result)
        processor.save_pretrained(result)
        from hf_vla.deployment import (
            contract,  # how to run it: lerobot's n_action_steps, cameras and normalisation mode
        )

        contract.from_lerobot(lerobot_config, head, image_size=getattr(processor, "image_size", None) or 224,
                                chunk_size=config.chunk_size, source=str(input_dir), norm_stats=stats).save(result)
        from hf_vla.storage import replace_dir, write_marker

        write_marker(result, "hf_vla_checkpoint", source=str(input_dir))

        replace_dir(result, output_dir)  # --overwrite: the old output goes only once the new one is complete
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("wrote %s (%s)", output_dir, config.model_type)
    return output_dir
