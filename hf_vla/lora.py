"""LoRA presets for pi0 / pi0.5 through peft (the public door; the code is `hf_vla.training.lora`):

    from peft import get_peft_model
    model = get_peft_model(model, hf_vla.lora.lora_config("expert", r=16, model=model))
"""

from hf_vla.training.lora import (  # noqa: F401  (public here)
    ADAPTER_DIR,
    ADAPTER_FILES,
    PRESETS,
    lora_config,
    merged_state_dict,
    trainable_parameters,
)

__all__ = ["ADAPTER_DIR", "ADAPTER_FILES", "PRESETS", "lora_config", "merged_state_dict", "trainable_parameters"]
