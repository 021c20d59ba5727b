"""What hf_vla needs to know about transformers' `PI0ForConditionalGeneration`, which it trains unchanged.

- Unused modules: pi0 runs the whole VLM over the prefix but only its keys/values reach the action expert, so the last
  VLM layer's query/output projections, MLP and post-attention norm and the VLM's final norm never get a gradient, nor
  does the expert's token embedding (the expert takes `inputs_embeds`; 263M parameters at the published size). They
  are frozen: their function is unchanged, and they hold no optimizer state or masters.
- FSDP2: the last VLM layer's keys/values leave it through the KV cache, while its own output gets no gradient, so a
  per-layer unit of its own would never be re-gathered for backward. It stays in the root unit (the same module and
  parameters under another class name, which the per-layer wrapping does not match); FSDP2 keeps the root gathered
  from forward to backward.
"""

from __future__ import annotations

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer


class PI0RootKeptLayer(GradientCheckpointingLayer):
    """pi0's last VLM layer under FSDP2: the same module and parameters running `GemmaDecoderLayer.forward`, under a
    class the per-layer wrapping does not match (it matches `GemmaDecoderLayer` and its subclasses by isinstance)."""

    forward = GemmaDecoderLayer.forward


def is_pi0(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "pi0"


def pi0_unused_modules(model: nn.Module) -> list[nn.Module]:
    core = model.model
    text = core.vlm.language_model
    last = text.layers[-1]
    return [last.self_attn.q_proj, last.self_attn.o_proj, last.mlp, last.post_attention_layernorm, text.norm,
            core.dit.embed_tokens]


def prepare_pi0(model: nn.Module, engine: str) -> None:
    """Freeze pi0's unused modules; under FSDP2 keep its last VLM layer in the root unit."""
    for module in pi0_unused_modules(model):
        module.requires_grad_(False)
    if engine == "fsdp2":
        last = model.model.vlm.language_model.layers[-1]
        if type(last) is GemmaDecoderLayer:
            last.__class__ = PI0RootKeptLayer


__all__ = ["PI0RootKeptLayer", "is_pi0", "pi0_unused_modules", "prepare_pi0"]
