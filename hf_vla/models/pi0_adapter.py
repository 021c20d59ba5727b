"""What hf_vla needs to know about transformers' `PI0ForConditionalGeneration`, which it trains unchanged.

- Unused modules: pi0 runs the whole VLM over the prefix but only its keys/values reach the action expert, so the last
  VLM layer's query/output projections, MLP and post-attention norm and the VLM's final norm never get a gradient, nor
  does the expert's token embedding (the expert takes `inputs_embeds`; 263M parameters at the published size). They
  are frozen: their function is unchanged, and they hold no optimizer state or masters.
- `PI0HeadProcessor`: transformers' `PI0Processor` conventions (prompt = image tokens for each present camera, then
  BOS, the task and a newline; mean/std normalization with its 1e-8) with one normalization head per row, constant
  dimensions mapped to 0 instead of exploding, and `unnormalize_actions` for inference.
- FSDP2: the last VLM layer's keys/values leave it through the KV cache, while its own output gets no gradient, so a
  per-layer unit of its own would never be re-gathered for backward. It stays in the root unit (the same module and
  parameters under another class name, which the per-layer wrapping does not match); FSDP2 keeps the root gathered
  from forward to backward.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import BatchFeature, ProcessorMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer

from hf_vla.models.common.contract_io import DeploymentContractMixin


class PI0RootKeptLayer(GradientCheckpointingLayer):
    """pi0's last VLM layer under FSDP2: the same module and parameters running `GemmaDecoderLayer.forward`, under a
    class the per-layer wrapping does not match (it matches `GemmaDecoderLayer` and its subclasses by isinstance)."""

    forward = GemmaDecoderLayer.forward


class PI0HeadProcessor(DeploymentContractMixin, ProcessorMixin):
    r"""
    Model inputs for transformers' pi0, per normalization head; the one batch path of training and inference.

    norm_stats (`dict`): `{head: {"state": {"mean": [...], "std": [...]}, "actions": {...}}}`; head_names in
        `dataset_index` order. image_seq_length: image tokens per camera; image_token_id: their id.
    """

    attributes = ["tokenizer"]
    tokenizer_class = "AutoTokenizer"
    epsilon = 1e-8  # transformers' PI0Processor divides by std + 1e-8
    degenerate = 1e-6  # below this std a dimension is constant: it maps to 0

    def __init__(self, tokenizer=None, norm_stats: dict | None = None, head_names: list | None = None,
                 image_size: int = 224, image_seq_length: int = 256, image_token_id: int = 257152,
                 max_state_dim: int = 32, max_action_dim: int = 32, chunk_size: int = 50, prompt_max_length: int = 48,
                 **kwargs):
        self.norm_stats = norm_stats or {}
        self.head_names = list(head_names) if head_names is not None else list(self.norm_stats)
        self.image_size, self.image_seq_length, self.image_token_id = image_size, image_seq_length, image_token_id
        self.max_state_dim, self.max_action_dim, self.chunk_size = max_state_dim, max_action_dim, chunk_size
        self.prompt_max_length = prompt_max_length
        super().__init__(tokenizer, **kwargs)

    @classmethod
    def from_config(cls, config, tokenizer, norm_stats: dict | None = None, head_names=None) -> PI0HeadProcessor:
        vision = config.vlm_config.vision_config
        return cls(tokenizer=tokenizer, norm_stats=norm_stats, head_names=head_names, image_size=vision.image_size,
                   image_seq_length=(vision.image_size // vision.patch_size) ** 2,
                   image_token_id=config.vlm_config.image_token_id, max_state_dim=config.max_state_dim,
                   max_action_dim=config.max_action_dim, chunk_size=config.chunk_size)

    def _head(self, head) -> str:
        if head is None:
            if len(self.head_names) != 1:
                raise ValueError(f"Pass a normalization head: this processor has {self.head_names}.")
            return self.head_names[0]
        if isinstance(head, int | np.integer):
            return self.head_names[int(head)]
        if head not in self.norm_stats:
            raise KeyError(f"unknown normalization head {head!r}; known: {sorted(self.norm_stats)}")
        return head

    def _moments(self, head, key: str):
        stats = self.norm_stats[self._head(head)][key]
        return torch.tensor(stats["mean"], dtype=torch.float32), torch.tensor(stats["std"], dtype=torch.float32)

    def normalize(self, values, key: str, head=None) -> torch.Tensor:
        values = torch.as_tensor(np.asarray(values, dtype=np.float32)) if not torch.is_tensor(values) else values.float()
        mean, std = self._moments(head, key)
        constant = std < self.degenerate
        return torch.where(constant, torch.zeros_like(values), (values - mean) / (std + self.epsilon))

    def unnormalize_actions(self, actions, head=None) -> torch.Tensor:
        actions = torch.as_tensor(actions, dtype=torch.float32)
        mean, std = self._moments(head, "actions")
        actions = actions[..., : mean.shape[-1]]
        return torch.where(std < self.degenerate, mean.expand_as(actions), actions * (std + self.epsilon) + mean)

    def __call__(self, images=None, text=None, state=None, actions=None, head=None, camera_mask=None, **kwargs):
        """images `[B, n_cams, 3, H, W]` (uint8 or float in [0, 1]), text, raw state per row, optional raw action
        chunks per row, one head for all rows or one per row, camera presence `[B, n_cams]`."""
        from hf_vla.models.common.images import as_image_batch, resize_with_pad

        texts = [text] if isinstance(text, str) else list(text)
        images = as_image_batch(images, len(texts))
        mask = torch.ones(images.shape[:2], dtype=torch.bool) if camera_mask is None else \
            torch.as_tensor(camera_mask, dtype=torch.bool)
        heads = head.tolist() if torch.is_tensor(head) else head
        heads = list(heads) if isinstance(heads, list | tuple) else [heads] * len(texts)
        bos = self.tokenizer.bos_token or ""
        words = self.tokenizer([bos + t + "\n" for t in texts], add_special_tokens=False, truncation=True,
                               max_length=self.prompt_max_length)["input_ids"]
        rows = [[self.image_token_id] * (self.image_seq_length * int(m.sum())) + w for m, w in zip(mask, words)]
        length = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        data = {"input_ids": torch.tensor([r + [pad] * (length - len(r)) for r in rows], dtype=torch.long),
                "attention_mask": torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows], dtype=torch.long),
                "pixel_values": resize_with_pad(images, self.image_size), "pixel_attention_mask": mask}
        if state is not None:
            data["state"] = torch.zeros(len(texts), self.max_state_dim)
            for row, (value, h) in enumerate(zip(state, heads)):
                normalized = self.normalize(value, "state", h)
                data["state"][row, : normalized.shape[-1]] = normalized
        if actions is not None:
            data["actions"] = torch.zeros(len(texts), self.chunk_size, self.max_action_dim)
            data["action_dim_mask"] = torch.zeros(len(texts), self.max_action_dim, dtype=torch.bool)
            for row, (value, h) in enumerate(zip(actions, heads)):
                normalized = self.normalize(value, "actions", h)
                data["actions"][row, :, : normalized.shape[-1]] = normalized
                data["action_dim_mask"][row, : normalized.shape[-1]] = True
        return BatchFeature(data=data)

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "state"]


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


__all__ = ["PI0HeadProcessor", "PI0RootKeptLayer", "pi0_unused_modules", "prepare_pi0"]
