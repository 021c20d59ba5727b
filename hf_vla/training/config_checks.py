"""`model_config` checks that run before any model weight is loaded: its keys against the policy's config class (and
nested `vlm_config` / `dit_config` / `text_config` / `vision_config` against theirs), so a typo is an error instead of
an extra entry in config.json. The value checks every command's options get are `hf_vla.parser`'s.
"""

from __future__ import annotations

import dataclasses

from hf_vla.errors import ConfigError
from hf_vla.parser import _suggest

# Attributes that configs do not declare but modeling code reads with hasattr/getattr (SigLIP's head switch, the
# projection width PaliGemma writes into its vision config): allowed in `model_config` although not fields.
_LEGACY_CONFIG_ATTRIBUTES = {"siglip_vision_model": {"vision_use_head", "projection_dim"}}


# ---- model_config ----------------------------------------------------------------------------------------------------
def _config_fields(config_class) -> set[str]:
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    import inspect

    from transformers import PreTrainedConfig

    names |= {p for p in inspect.signature(config_class.__init__).parameters if p not in ("self", "kwargs")}
    names |= {p for p in inspect.signature(PreTrainedConfig.__init__).parameters if p not in ("self", "kwargs")}
    names |= set(getattr(config_class, "attribute_map", {}))  # aliases, e.g. PaliGemma's image_token_id
    names |= {"model_type", "_attn_implementation", "attn_implementation"}
    return names


def check_model_config(values: dict, config_class, path: str = "model_config", default_sub_types=None):
    """Unknown keys of a config dict (recursively through sub-configs) are errors naming the dotted path."""
    from transformers.models.auto import CONFIG_MAPPING

    known = _config_fields(config_class) | _LEGACY_CONFIG_ATTRIBUTES.get(getattr(config_class, "model_type", ""), set())
    unknown = sorted(set(values) - known)
    if unknown:
        public = sorted(k for k in known if not k.startswith("_"))
        raise ConfigError(f"{path}: unknown key(s) {unknown} for {config_class.__name__}{_suggest(unknown, public)}; "
                          f"known: {public}")
    default_sub_types = default_sub_types or {}
    for key in getattr(config_class, "sub_configs", {}):
        value = values.get(key)
        if not isinstance(value, dict):
            continue
        model_type = value.get("model_type", default_sub_types.get(key))
        if model_type is None:
            continue
        if model_type not in CONFIG_MAPPING:
            raise ConfigError(f"{path}.{key}.model_type: unknown model type {model_type!r}")
        sub_class = CONFIG_MAPPING[model_type]
        defaults = {"text_config": "gemma", "vision_config": "siglip_vision_model"} if model_type == "paligemma" else {}
        check_model_config(value, sub_class, f"{path}.{key}", defaults)


# ---- paths ----------------------------------------------------------------------------------------------------------
__all__ = ["check_model_config"]
