"""LoRA presets for pi0 / pi0.5 through peft; the policy names its own targets.

    from peft import get_peft_model
    model = get_peft_model(model, hf_vla.lora.lora_config("expert", r=16, model=model))

- "expert": LoRA on every linear layer of the action expert (attention, MLP and, for pi0.5, the adaRMS modulation);
  the VLM is untouched.
- "all_linear": LoRA on every linear layer the policy runs in the VLM's language model and in the expert; the SigLIP
  tower stays frozen.
The small action/time heads train in full (`modules_to_save`). Targets and heads come from the model itself
(`lora_target_modules`, `trained_heads`: pi0.5's methods, or `hf_vla.models.pi0_adapter.PI0Structure` for pi0).
"""

from __future__ import annotations

from peft import LoraConfig

from .models.pi0_adapter import policy_structure

PRESETS = ("expert", "all_linear")


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
