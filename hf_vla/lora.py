"""LoRA presets for pi0 / pi0.5 through peft.

    from peft import get_peft_model
    model = get_peft_model(model, hf_vla.lora.lora_config("expert", r=16))

- "expert": LoRA on every linear layer of the action expert (attention, MLP and the adaRMS modulation); the VLM is
  untouched. The small action/time heads are trained in full (`modules_to_save`).
- "all_linear": LoRA on every linear layer of the VLM's language model and of the expert; the SigLIP tower stays
  frozen. Heads trained in full.
"""

from __future__ import annotations

from peft import LoraConfig

_LINEAR = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
_EXPERT = rf"model\.(expert|dit)\.layers\.\d+\.({_LINEAR}|(input|post_attention)_layernorm\.dense)"
_VLM = rf"model\.vlm\.language_model\.layers\.\d+\.{_LINEAR}"
# pi0.5 heads / transformers pi0 heads
_HEADS = ["action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out", "embed_action_time"]

PRESETS = {
    "expert": rf"^(base_model\.model\.)?{_EXPERT}$",
    "all_linear": rf"^(base_model\.model\.)?({_EXPERT}|{_VLM})$",
}


def lora_config(preset: str = "expert", r: int = 16, alpha: int | None = None, dropout: float = 0.0, **kwargs) -> LoraConfig:
    """A `peft.LoraConfig` for one of `PRESETS` (task_type None: the policy is not a causal LM)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown LoRA preset {preset!r}; choose one of {sorted(PRESETS)}")
    return LoraConfig(
        task_type=None,
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=dropout,
        target_modules=PRESETS[preset],
        modules_to_save=list(_HEADS),
        **kwargs,
    )
