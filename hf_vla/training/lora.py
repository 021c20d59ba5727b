"""LoRA presets for pi0 / pi0.5 through peft; the policy names its own targets.

    from peft import get_peft_model
    model = get_peft_model(model, hf_vla.lora.lora_config("expert", r=16, model=model))

- "expert": LoRA on every linear layer of the action expert (attention, MLP and, for pi0.5, the adaRMS modulation);
  the VLM is untouched.
- "all_linear": LoRA on every linear layer the policy runs in the VLM's language model and in the expert; the SigLIP
  tower stays frozen.
The small action/time heads train in full (`modules_to_save`). Targets and heads come from the model itself
(`lora_target_modules`, `trained_heads`: `hf_vla.training.structure`'s `PI05Structure` / `PI0Structure`).

What a LoRA run saves for use (its output directory, rollout snapshots): the merged model at the root (base weights
with the adapters folded in, the trained heads in place), which `AutoModel.from_pretrained`, `hf_vla.evaluate` and
`hf_vla.serve` load as any checkpoint, and the adapters alone in `adapter/` (`PeftModel.from_pretrained(base, dir,
subfolder="adapter")`). Checkpoints (`checkpoint-N`) keep the Trainer's layout (adapters at the root) to resume from;
`hf_vla.hub.resolve.resolve_pretrained` merges such a directory with its base when it is evaluated, served or converted.
"""

from __future__ import annotations

import torch
from peft import LoraConfig

from hf_vla.training.structure import policy_structure

PRESETS = ("expert", "all_linear")
ADAPTER_DIR = "adapter"  # the adapters of a merged save
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def lora_config(preset: str = "expert", r: int = 16, alpha: int | None = None, dropout: float = 0.0, *,
                model=None, **kwargs) -> LoraConfig:
    """A `peft.LoraConfig` for one of `PRESETS` on `model` (task_type None: the policy is not a causal LM)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown LoRA preset {preset!r}; choose one of {list(PRESETS)}")
    if model is None:
        raise TypeError("lora_config needs the model: the policy names its own LoRA targets and heads")
    policy = policy_structure(model)
    return LoraConfig(
        task_type=None,
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=dropout,
        target_modules=policy.lora_target_modules(preset),
        modules_to_save=policy.trained_heads(),
        **kwargs,
    )


def merged_state_dict(model, state_dict: dict | None = None, adapter: str = "default") -> dict[str, torch.Tensor]:
    """The state dict of the base model with the LoRA adapters folded in (W + scaling * B @ A, in float32, cast back)
    and the trained heads (`modules_to_save`) in place of the originals: what `merge_and_unload()` would leave,
    computed from `state_dict` (the PeftModel's own by default; a full gathered one under FSDP / DeepSpeed) without
    touching the live model. Keys are the base model's."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    scalings = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            if module.use_dora.get(adapter):
                raise ValueError(f"{name}: DoRA adapters are not merged here; use peft's merge_and_unload()")
            scalings[name.removeprefix(prefix)] = module.scaling[adapter]
    state_dict = model.state_dict() if state_dict is None else state_dict
    unprefixed = {key.removeprefix(prefix): value for key, value in state_dict.items()}
    merged = {}
    for key, value in unprefixed.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        if f".modules_to_save.{adapter}." in key:
            merged[key.replace(f".modules_to_save.{adapter}.", ".")] = value
            continue
        if ".base_layer." not in key:
            merged.setdefault(key, value)
            continue
        owner, param = key.split(".base_layer.", 1)
        if param == "weight" and owner in scalings:
            a, b = unprefixed[f"{owner}.lora_A.{adapter}.weight"], unprefixed[f"{owner}.lora_B.{adapter}.weight"]
            value = (value.float() + scalings[owner] * (b.float() @ a.float())).to(value.dtype)
        merged[f"{owner}.{param}"] = value
    return merged


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, all) parameter counts (what peft's print_trainable_parameters reports)."""
    if hasattr(model, "get_nb_trainable_parameters"):
        return model.get_nb_trainable_parameters()
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total
