"""MEM's short-horizon visual memory inside SigLIP (arXiv 2603.03596, as lerobot's pi0.5 has it).

A camera input holds T frames, oldest first, the current one last. Every `every`-th encoder layer replaces its spatial
attention with MEM's space-time attention: the values are first mixed causally across the frames of each patch
(temporal attention), then attended spatially within each frame, with the layer's own q/k/v/out projections (the
paper's eq. 3: no new parameter, and one frame reduces it to the stock layer). Both stages read the layer input plus a
fixed sin/cos embedding of the frame's age (zero for the current frame). After the last such layer nothing mixes
frames any more, so only the current frame's tokens go on: the rest of the tower and the backbone see as many tokens
as without memory.

The layers that attend across frames are `PI05MemoryEncoderLayer`s (a `SiglipEncoderLayer` with the same weights and
names), called through their own module call, so FSDP's per-layer units and gradient checkpointing see them. Both
stages dispatch through the attention interface of the vision config (eager, sdpa, flex, flash); the temporal stage
(T <= a few frames per patch, with an additive causal and padding mask) runs on sdpa under flex and flash: flash takes
no additive mask, and flex's CPU kernel turns a row block with every key masked into NaN.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer, eager_attention_forward


def temporal_embedding(num_frames: int, width: int, device, dtype) -> torch.Tensor:
    """`[T, width]` sin/cos of each frame's age (positions 1-T .. 0), with the cosines shifted by -1 so that the current
    frame's embedding is exactly zero (a one-frame input is the stock tower)."""
    positions = torch.arange(1 - num_frames, 1, device=device, dtype=torch.float32)[:, None]
    frequencies = torch.exp(torch.arange(0, width, 2, device=device, dtype=torch.float32)
                            * (-math.log(10_000.0) / width))[None]
    angles = positions * frequencies
    embedding = torch.empty(num_frames, width, device=device, dtype=torch.float32)
    embedding[:, 0::2] = torch.sin(angles)
    embedding[:, 1::2] = torch.cos(angles) - 1.0
    return embedding.to(dtype)


def temporal_mask(frame_mask: torch.Tensor, num_patches: int, dtype) -> torch.Tensor:
    """Additive `[B * P, 1, T, T]` mask of the temporal stage: frame i attends to real frames j <= i; a padded frame
    (before the episode's start) is no key, and attends to itself alone (its output is never read)."""
    batch, frames = frame_mask.shape
    allowed = torch.ones(frames, frames, dtype=torch.bool, device=frame_mask.device).tril()[None] & frame_mask[:, None].bool()
    allowed |= torch.eye(frames, dtype=torch.bool, device=frame_mask.device)[None]
    mask = torch.zeros(batch, 1, frames, frames, dtype=dtype, device=frame_mask.device)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return mask.repeat_interleave(num_patches, dim=0)


def _interface(attention: nn.Module, masked: bool):
    implementation = attention.config._attn_implementation or "eager"
    if masked and (implementation.startswith("flash") or implementation == "flex_attention"):
        implementation = "sdpa"  # the temporal stage's additive mask: see the module docstring
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)


def space_time_attention(attention: nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MEM's composed attention on `[B, T, P, D]` (already normed, with the temporal embedding added): temporal
    attention per patch over frames (`mask`), then spatial attention per frame whose values are the temporally mixed
    ones, then the layer's `out_proj` once."""
    batch, frames, patches, _ = hidden.shape
    heads, head_dim = attention.num_heads, attention.head_dim
    shape = (batch, frames, patches, heads, head_dim)
    queries, keys, values = (proj(hidden).view(shape) for proj in (attention.q_proj, attention.k_proj, attention.v_proj))
    dropout = attention.dropout if attention.training else 0.0

    def over_frames(x):  # [B, T, P, h, d] -> [B * P, h, T, d]
        return x.permute(0, 2, 3, 1, 4).reshape(batch * patches, heads, frames, head_dim)

    def over_patches(x):  # [B, T, P, h, d] -> [B * T, h, P, d]
        return x.permute(0, 1, 3, 2, 4).reshape(batch * frames, heads, patches, head_dim)

    mixed, _ = _interface(attention, True)(attention, over_frames(queries), over_frames(keys), over_frames(values), mask,
                                           scaling=attention.scale, dropout=dropout, is_causal=False)
    mixed = mixed.reshape(batch, patches, frames, heads, head_dim).transpose(1, 2)  # [B, T, P, h, d]
    out, _ = _interface(attention, False)(attention, over_patches(queries), over_patches(keys), over_patches(mixed), None,
                                          scaling=attention.scale, dropout=dropout, is_causal=False)
    return attention.out_proj(out.reshape(batch, frames, patches, heads * head_dim))


class PI05MemoryEncoderLayer(SiglipEncoderLayer):
    """A SigLIP encoder layer that, given `memory` (the temporal embedding `[1, T, 1, D]` and mask), runs MEM's
    space-time attention over `[B, T, P, D]`; without it, the stock layer."""

    def forward(self, hidden_states, attention_mask=None, memory: tuple | None = None, **kwargs):
        if memory is None:
            return super().forward(hidden_states, attention_mask, **kwargs)
        positions, mask = memory
        # both stages read z + e(t); the residual is the layer input, so the embedding does not pile up across layers
        hidden = hidden_states + space_time_attention(self.self_attn, self.layer_norm1(hidden_states + positions), mask)
        return hidden + self.mlp(self.layer_norm2(hidden))


def use_memory_layers(vision_model: nn.Module, every: int) -> None:
    """Make every `every`-th encoder layer of `vision_model` a `PI05MemoryEncoderLayer` (same parameters, same names)."""
    layers = vision_model.encoder.layers
    for index in range(every - 1, len(layers), every):
        layer = layers[index]
        if not isinstance(layer, PI05MemoryEncoderLayer):
            memory_layer = PI05MemoryEncoderLayer(layer.self_attn.config)
            memory_layer.load_state_dict(layer.state_dict())
            layers[index] = memory_layer.to(next(layer.parameters()).device)


def encode_frames(vision_model: nn.Module, pixel_values: torch.Tensor, frame_mask: torch.Tensor, every: int) -> torch.Tensor:
    """`pixel_values` `[N, T, 3, H, W]` (oldest first, current last), `frame_mask` `[N, T]` (real frames) -> the
    current frame's final tokens `[N, P, D]` (after the post-layernorm, before the projector)."""
    count, frames = pixel_values.shape[:2]
    hidden = vision_model.embeddings(pixel_values.flatten(0, 1))
    patches, width = hidden.shape[1:]
    hidden = hidden.reshape(count, frames, patches, width)
    layers = vision_model.encoder.layers
    temporal = [i for i in range(len(layers)) if (i + 1) % every == 0] if frames > 1 else []
    memory = None
    if temporal:
        memory = (temporal_embedding(frames, width, hidden.device, hidden.dtype)[None, :, None],
                  temporal_mask(frame_mask, patches, hidden.dtype))
    for index, layer in enumerate(layers):
        live = hidden.shape[1]
        if index in temporal:
            hidden = layer(hidden, None, memory=memory)
            if index == temporal[-1]:
                hidden = hidden[:, -1:]  # nothing mixes frames above this layer: the past frames' tokens go
        else:
            hidden = layer(hidden.reshape(count * live, patches, width), None).reshape(count, live, patches, width)
    return vision_model.post_layernorm(hidden[:, -1])


__all__ = ["PI05MemoryEncoderLayer", "encode_frames", "space_time_attention", "temporal_embedding", "temporal_mask",
           "use_memory_layers"]
