"""Configuration checks that run before any model weight or data frame is loaded.

- Every value is checked against its dataclass field's annotation. A string given where a number, boolean, list or
  dict is expected is decoded as JSON first, which is exactly what the command line does with `--key value`: so
  `"learning_rate": "1e-3"` in a JSON file means 0.001, as `--learning_rate 1e-3` does, while `"max_steps": "abc"` is
  an error naming the key and the expected type.
- `model_config` keys are checked against the policy's config class (and nested `vlm_config` / `dit_config` /
  `text_config` / `vision_config` against theirs), so a typo is an error instead of an extra entry in config.json.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any

from hf_vla.errors import ConfigError

_MISSING = object()
# Attributes that configs do not declare but modeling code reads with hasattr/getattr (SigLIP's head switch, the
# projection width PaliGemma writes into its vision config): allowed in `model_config` although not fields.
_LEGACY_CONFIG_ATTRIBUTES = {"siglip_vision_model": {"vision_use_head", "projection_dim"}}


def _describe(annotation) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            return f"one of {[m.value for m in annotation]}"
        return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
                list: "a list"}.get(annotation, annotation.__name__)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        return f"a list of {_describe(item)}" if item is not Any else "a list"
    if origin is dict:
        return "an object"
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(annotation))}"
    return str(annotation)


def _convert(value, annotation):
    """`value` as `annotation` expects it, or _MISSING. Never coerces across kinds (no bool -> int, no str -> int)."""
    if annotation is Any or annotation is typing.Any:
        return value
    if annotation is type(None):
        return None if value is None else _MISSING
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            converted = _convert(value, option)
            if converted is not _MISSING:
                return converted
        return _MISSING
    if origin is typing.Literal:
        return value if value in typing.get_args(annotation) else _MISSING
    if origin is list or annotation is list:
        if not isinstance(value, list):
            return _MISSING
        (item,) = typing.get_args(annotation) or (Any,)
        items = [_convert(v, item) for v in value]
        return _MISSING if any(i is _MISSING for i in items) else items
    if origin is dict or annotation is dict:
        return value if isinstance(value, dict) else _MISSING
    if isinstance(annotation, type):
        if issubclass(annotation, enum.Enum):
            if isinstance(value, annotation):
                return value
            return value if value in {m.value for m in annotation} else _MISSING
        if annotation is bool:
            return value if isinstance(value, bool) else _MISSING
        if annotation is int:
            return value if isinstance(value, int) and not isinstance(value, bool) else _MISSING
        if annotation is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                return _MISSING
            return float(value)
        if annotation is str:
            return value if isinstance(value, str) else _MISSING
        return value if isinstance(value, annotation) else _MISSING
    return value  # an annotation we do not model: the dataclass validates it


def _suggest(unknown: list[str], known) -> str:
    import difflib

    hints = [f"{key!r} -> {match[0]!r}" for key in unknown
             if (match := difflib.get_close_matches(key, list(known), n=1, cutoff=0.75))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def _accepts_str(annotation) -> bool:
    return _convert("", annotation) is not _MISSING or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType)
        and any(isinstance(a, type) and issubclass(a, enum.Enum) for a in typing.get_args(annotation))
    )


def check_value(key: str, value, annotation, where: str = ""):
    """`value` converted for a field annotated `annotation`; a ConfigError naming `where.key` otherwise."""
    converted = _convert(value, annotation)
    if converted is _MISSING and isinstance(value, str) and not _accepts_str(annotation):
        try:  # the command line's rule: a value is JSON when it parses
            decoded = json.loads(value)
        except json.JSONDecodeError:
            decoded = _MISSING
        if decoded is not _MISSING:
            converted = _convert(decoded, annotation)
    if converted is _MISSING:
        name = f"{where}.{key}" if where else key
        raise ConfigError(f"{name}: expected {_describe(annotation)}, got {value!r} ({type(value).__name__})")
    return converted


def field_annotations(dataclass_type) -> dict[str, Any]:
    hints = typing.get_type_hints(dataclass_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(dataclass_type) if f.init}


def check_fields(values: dict, dataclass_types, where: str = "") -> dict:
    """Type-check (and convert) every key of `values` against the fields of `dataclass_types`."""
    annotations = {}
    for dataclass_type in dataclass_types:
        annotations.update(field_annotations(dataclass_type))
    unknown = sorted(set(values) - set(annotations))
    if unknown:
        raise ConfigError(f"{where + ': ' if where else ''}unknown key(s) {unknown}{_suggest(unknown, annotations)}; "
                          f"known: {sorted(annotations)}")
    return {key: check_value(key, value, annotations[key], where) for key, value in values.items()}


def check_dataset_specs(specs: list, key: str = "datasets") -> list[dict]:
    """`specs` (the `datasets` of training, RL's `bc_datasets`) checked field by field against `DatasetConfig` without
    touching data: a `ConfigError` naming `key[index]` and the field; the specs with their values converted."""
    from hf_vla.data.dataset_config import DatasetConfig

    checked = []
    for index, spec in enumerate(specs):
        if not isinstance(spec, dict):
            raise ConfigError(f"{key}[{index}] must be an object, got {spec!r}")
        spec = check_fields(spec, [DatasetConfig], where=f"{key}[{index}]")
        DatasetConfig(**spec)  # field-level validation (weights, cameras, names)
        checked.append(spec)
    return checked


def normalize_training_config(config: dict) -> None:
    """The values every training command (train, rl) reads its own way, rewritten in place before the type checks."""
    import os

    resume = config.get("resume_from_checkpoint")
    if isinstance(resume, bool) or str(resume).lower() in ("true", "false"):  # `--resume_from_checkpoint true`
        config["resume_from_checkpoint"] = "true" if resume in (True, "true", "True") else None
    deepspeed = config.get("deepspeed") or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if deepspeed and config.get("dtype") == "bfloat16" and "bf16" not in config and not config.get("fp16"):
        # a bfloat16 model under DeepSpeed trains in its bf16 mode (fp32 master partitions); the DeepSpeed plugin
        # takes its precision when the training arguments are built, so it is set here
        config["bf16"] = True


def is_bool_field(annotation) -> bool:
    """True for `bool` and `bool | None` (the fields a bare `--flag` may set)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (
        annotation,)
    return bool in options and all(o in (bool, type(None)) for o in options)


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
__all__ = ["check_fields", "check_model_config", "check_value", "is_bool_field"]
