"""Convert lerobot (and openpi-converted) pi0 / pi0.5 checkpoints to hf_vla pi0.5 / transformers pi0.

    python -m hf_vla.convert --input lerobot_pi05_dir --output hf_pi05_dir [--tokenizer google/paligemma-3b-pt-224]

reads `config.json` + `model.safetensors` (+ lerobot's normalizer state, when present) and writes a directory that
`AutoModel.from_pretrained` / `AutoProcessor.from_pretrained` load: weights, config, processor with normalization stats.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

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


def _rules_for(config):
    model_type = getattr(config, "model_type", None)
    if model_type == "pi05":
        return _PI05_RULES, "model.vlm.language_model.embed_tokens.weight"
    if model_type == "pi0":
        return _PI0_RULES, "model.vlm.language_model.embed_tokens.weight"
    raise ValueError(f"convert_lerobot_state_dict: config.model_type must be 'pi0' or 'pi05', got {model_type!r}")


def convert_lerobot_state_dict(state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Rename a lerobot `PI05Policy` / `PI0Policy` state dict to hf_vla pi0.5 / transformers pi0 keys.

    The lm_head is tied to embed_tokens in the reference and stored once: it becomes the VLM's embed_tokens when
    those are absent. pi0.5's expert has adaRMS norms, so plain `...expert...layernorm.weight` keys (a pi0 expert
    loaded as pi0.5) are refused. Unknown keys raise instead of being silently dropped.
    """
    rules, embed_key = _rules_for(config)
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
        if config.model_type == "pi05" and re.match(r"^model\.expert\.(layers\.\d+\.(input|post_attention)_layernorm|norm)\.weight$", new_name):
            raise ValueError(
                f"{key}: a plain RMSNorm weight in the action expert; pi0.5's expert norms are adaRMS (`.dense`). "
                "Is this a pi0 checkpoint? Convert it with a PI0Config."
            )
        converted[new_name] = value
    if unknown:
        raise ValueError(f"convert_lerobot_state_dict: {len(unknown)} keys have no mapping, e.g. {unknown[:5]}")
    if embed_key not in converted:
        if lm_head is None:
            raise ValueError("checkpoint has neither the VLM's embed_tokens nor the tied lm_head")
        converted[embed_key] = lm_head
    if config.model_type == "pi0" and "model.dit.embed_tokens.weight" not in converted:
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


def config_from_lerobot(lerobot_config: dict):
    """Build the hf_vla/transformers config from a lerobot policy `config.json` (published dims per variant)."""
    from transformers import PI0Config

    from .models.pi05 import PI05Config

    policy_type = lerobot_config.get("type")
    if policy_type not in ("pi0", "pi05"):
        raise ValueError(f"config.json: lerobot policy type {policy_type!r} is not 'pi0' or 'pi05'")
    image_size = (lerobot_config.get("image_resolution") or [224, 224])[0]
    text = dict(_GEMMA_VARIANTS[lerobot_config.get("paligemma_variant", "gemma_2b")])
    expert = dict(_GEMMA_VARIANTS[lerobot_config.get("action_expert_variant", "gemma_300m")])
    vocab = 257152
    vlm_config = {
        "model_type": "paligemma",
        "text_config": {"model_type": "gemma", "vocab_size": vocab, "hidden_act": "gelu_pytorch_tanh", **text},
        "vision_config": {
            "model_type": "siglip_vision_model", **_VISION_DIMS, "image_size": image_size, "vision_use_head": False,
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
    if policy_type == "pi05":
        if "tokenizer_max_length" in lerobot_config:
            common["tokenizer_max_length"] = lerobot_config["tokenizer_max_length"]
        return PI05Config(vlm_config=vlm_config, dit_config=dit_config, **common)
    return PI0Config(vlm_config=vlm_config, dit_config=dit_config, **common)


def read_lerobot_norm_stats(checkpoint_dir: Path) -> dict | None:
    """lerobot saves its normalizer as `*normalizer_processor*.safetensors` with keys `<feature>.<stat>`."""
    files = sorted(p for p in checkpoint_dir.glob("*normalizer*.safetensors") if "unnormalizer" not in p.name)
    if not files:
        return None
    tensors = load_file(str(files[0]))
    stats: dict = {}
    for key, value in tensors.items():
        feature, _, stat = key.rpartition(".")
        target = {"observation.state": "state", "action": "actions"}.get(feature)
        if target:
            stats.setdefault(target, {})[stat] = value.tolist()
    return stats or None


def convert_checkpoint(
    input_dir: str | Path, output_dir: str | Path, tokenizer: str = "google/paligemma-3b-pt-224", head: str = "default"
) -> Path:
    """Convert a lerobot checkpoint directory and write model + processor to `output_dir`."""
    from transformers import AutoTokenizer

    input_dir, output_dir = Path(input_dir), Path(output_dir)
    config_file, weights_file = input_dir / "config.json", input_dir / "model.safetensors"
    for path in (config_file, weights_file):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; a lerobot checkpoint directory holds config.json and model.safetensors")
    config = config_from_lerobot(json.loads(config_file.read_text()))
    state_dict = convert_lerobot_state_dict(load_file(str(weights_file)), config)
    if config.model_type == "pi05":
        from .models.pi05 import PI05ForConditionalGeneration as model_class
    else:
        from transformers import PI0ForConditionalGeneration as model_class
    # Let transformers build the model from config + tensors (buffers, tying, dtype), then save it properly.
    with tempfile.TemporaryDirectory() as staging:
        config.save_pretrained(staging)
        save_file({k: v.contiguous() for k, v in state_dict.items()}, f"{staging}/model.safetensors", metadata={"format": "pt"})
        model, info = model_class.from_pretrained(staging, output_loading_info=True)
    missing = [k for k in info["missing_keys"] if "sinusoid_freq" not in k]
    if missing or info["unexpected_keys"]:
        raise ValueError(f"{weights_file}: converted weights do not fit {model_class.__name__}: "
                         f"missing {missing[:5]}, unexpected {sorted(info['unexpected_keys'])[:5]}")
    model.save_pretrained(output_dir)

    tok = AutoTokenizer.from_pretrained(tokenizer)
    stats = read_lerobot_norm_stats(input_dir)
    if config.model_type == "pi05":
        from .models.pi05 import PI05Processor

        norm_stats = {head: stats} if stats else {}
        PI05Processor.from_config(config, tok, norm_stats=norm_stats).save_pretrained(output_dir)
    else:
        from transformers import PI0ImageProcessor, PI0Processor

        kwargs = {}
        if stats:
            kwargs = {"state_mean": stats["state"]["mean"], "state_std": stats["state"]["std"],
                      "actions_mean": stats["actions"]["mean"], "actions_std": stats["actions"]["std"]}
        PI0Processor(image_processor=PI0ImageProcessor(), tokenizer=tok, max_state_dim=config.max_state_dim,
                     chunk_size=config.chunk_size, **kwargs).save_pretrained(output_dir)
    logger.info("wrote %s (%s)", output_dir, config.model_type)
    return output_dir


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hf_vla.convert", description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="lerobot checkpoint directory (config.json + model.safetensors)")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--tokenizer", default="google/paligemma-3b-pt-224", help="tokenizer id or local path")
    parser.add_argument("--head", default="default", help="normalization head name for the checkpoint's stats")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    convert_checkpoint(args.input, args.output, tokenizer=args.tokenizer, head=args.head)


if __name__ == "__main__":
    main()
