"""pi0.5 as a transformers model.

Written in the style of transformers' `PI0ForConditionalGeneration` and with its argument names. What pi0.5 adds:

- the action expert's norms are adaRMSNorms conditioned on an MLP of the sin/cos time embedding (scale, shift and a
  gate on each residual branch, zero-initialised), so time enters through the norms instead of the action tokens;
- no state projection: the state is discretized into the prompt by the processor;
- the suffix is one bidirectional block of `chunk_size` action tokens after the prefix.

Both towers share attention layer by layer: at layer i the VLM projects the prefix to Q/K/V and attends over the
prefix; the expert projects the suffix to Q/K/V and attends over [prefix K/V; suffix K/V]. Because the prefix never
attends to the suffix, this is the same computation as one joint attention with the big_vision block mask, and the
prefix K/V can be cached (`sample_actions` runs the prefix once). Attention goes through `ALL_ATTENTION_FUNCTIONS`,
so eager, sdpa, flex_attention and flash_attention_2 all compute it; each call needs only a key-padding mask.

The towers are stepped layer by layer here, not by two `GemmaModel.forward` calls: transformers'
`GradientCheckpointingLayer` drops `past_key_values` under gradient checkpointing, cutting the expert off from the
prefix in training. Each step goes through its layer's `forward` (`PI05VLMDecoderLayer` is a `GemmaDecoderLayer` that
can also return its keys/values), so FSDP units gather, ZeRO-3 hooks fire and checkpointing wraps whole layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, DynamicCache, PreTrainedModel
from transformers import initialization as init
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma.modeling_gemma import (
    GemmaAttention,
    GemmaDecoderLayer,
    GemmaMLP,
    GemmaPreTrainedModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.models.pi0.modeling_pi0 import PI0TimestepEmbeddings

from hf_vla.models.common.flow import sample_time
from hf_vla.models.common.remote_code import SharedCodeMixin
from hf_vla.models.common.rtc import euler_integrate
from hf_vla.models.common.rtc_config import RTCConfig  # noqa: F401  (direct: a remote module gets only its direct relative imports)
from hf_vla.models.common.sampling_config import SamplingConfig

from .configuration_pi05 import PI05Config
from .losses import chunked_token_losses
from .memory import encode_frames, use_memory_layers
from .value_head import PI05ValueHead

# Backends whose attention call accepts an arbitrary key-padding mask, which is all pi0.5 needs per call.
SUPPORTED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


class PI05AdaRMS(nn.Module):
    """adaRMSNorm: RMS-normalise, then scale/shift from the condition; also returns the residual gate.

    (Named without "RMSNorm" so Gemma's init, which zeroes `.weight` of RMSNorm modules, leaves it alone.)
    """

    def __init__(self, hidden_size: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * hidden_size)

    def forward(self, hidden_states: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        modulation = self.dense(cond.to(self.dense.weight.dtype)).float()
        if modulation.ndim == 2:  # one condition per sample ([B, D]); per token it is [B, T, D]
            modulation = modulation[:, None, :]
        scale, shift, gate = modulation.chunk(3, dim=-1)
        normed = normed * (1.0 + scale) + shift
        return normed.to(hidden_states.dtype), gate.to(hidden_states.dtype)


class PI05ExpertDecoderLayer(GradientCheckpointingLayer):
    """A Gemma decoder layer whose two norms are adaRMS and whose residuals are gated; it attends over the VLM's
    prefix keys/values of the same layer and its own suffix keys/values."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = GemmaAttention(config=config, layer_idx=layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = PI05AdaRMS(config.hidden_size, config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = PI05AdaRMS(config.hidden_size, config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, cond, prefix_key, prefix_value, attention_mask=None, position_embeddings=None):
        hidden_states = hidden_states.to(self.mlp.up_proj.weight.dtype)  # the residual stream in the expert's dtype
        cos, sin = (t.to(hidden_states.dtype) for t in position_embeddings)
        normed, gate = self.input_layernorm(hidden_states, cond)
        query, key, value = _project_qkv(self.self_attn, normed, cos, sin)
        key = torch.cat([prefix_key.to(key.dtype), key], dim=2)
        value = torch.cat([prefix_value.to(value.dtype), value], dim=2)
        hidden_states = hidden_states + gate * _attend(self.self_attn, query, key, value, attention_mask)
        normed, gate = self.post_attention_layernorm(hidden_states, cond)
        return hidden_states + gate * self.mlp(normed)


class PI05VLMDecoderLayer(GemmaDecoderLayer):
    """The VLM's Gemma layer (same parameters and names). Called with `return_kv=True` it runs pi0.5's prefix step:
    attention over the prefix with its padding mask, returning the hidden states and this layer's prefix keys/values
    for the expert (with `kv_only`, the last layer, only the keys/values: nothing reads its prefix output); with
    `past_kv` (earlier keys/values), the hidden states attend to those and to their own (a decode step). Otherwise it
    is exactly `GemmaDecoderLayer`. Every step goes through the module's call, so FSDP's hooks see it."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, return_kv: bool = False, kv_only: bool = False, past_kv=None, **kwargs):
        if not return_kv:
            return super().forward(hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                                   position_embeddings, **kwargs)
        cos, sin = (t.to(hidden_states.dtype) for t in position_embeddings)
        query, key, value = _project_qkv(self.self_attn, self.input_layernorm(hidden_states), cos, sin)
        if kv_only:
            return hidden_states, key, value
        keys, values = (key, value) if past_kv is None else (torch.cat([past_kv[0], key], dim=2),
                                                             torch.cat([past_kv[1], value], dim=2))
        hidden_states = hidden_states + _attend(self.self_attn, query, keys, values, attention_mask)
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, key, value


@dataclass
class PI05Output(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` (`logits` = the velocity). With `labels` (the token objective): `token_losses` `[B, L_t]`
    (float32), each target's next-token cross-entropy (0 where the label is -100), in pieces of `token_loss_chunk`;
    with `output_token_logits=True` also `token_logits` `[B, L_t, vocab]` (the model's dtype; large at a real vocab)."""

    token_losses: torch.FloatTensor | None = None
    token_logits: torch.FloatTensor | None = None


class PI05ActionExpert(GemmaPreTrainedModel):
    """The Gemma action expert of pi0.5: decoder layers and final norm, no token embeddings, no rotary of its own."""

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(PI05ExpertDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = PI05AdaRMS(config.hidden_size, config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PI05AdaRMS):  # adaLN-zero: the expert starts as identity residual branches
            init.zeros_(module.dense.weight)
            init.zeros_(module.dense.bias)


def _project_qkv(attn: GemmaAttention, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    query = attn.q_proj(hidden).view(shape).transpose(1, 2)
    key = attn.k_proj(hidden).view(shape).transpose(1, 2)
    value = attn.v_proj(hidden).view(shape).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    return query, key, value


def _attend(attn: GemmaAttention, query, key, value, mask) -> torch.Tensor:
    implementation = attn.config._attn_implementation
    interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    out, _ = interface(attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling, is_causal=False)
    out = out.reshape(*query.shape[:1], query.shape[2], -1).contiguous()
    return attn.o_proj(out)


def _memory_mask(memory: dict | None, batch_size: int, frames: int, device) -> torch.Tensor:
    """MEM's `[B, T]` real-observation mask from `memory` (all real when not given)."""
    mask = (memory or {}).get("memory_mask")
    if mask is None:
        return torch.ones(batch_size, frames, dtype=torch.bool, device=device)
    if tuple(mask.shape) != (batch_size, frames):
        raise ValueError(f"memory_mask must be [B={batch_size}, memory_frames={frames}], got {tuple(mask.shape)}")
    return mask.bool()


def present_module_classes(model: nn.Module, names) -> set[str]:
    """The class names in `names` that some submodule of `model` has."""
    present = {type(module).__name__ for module in model.modules()}
    return {name for name in (names or ()) if name in present}


class PI05PreTrainedModel(SharedCodeMixin, PreTrainedModel):
    config: PI05Config
    config_class = PI05Config
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # the per-layer FSDP units / ZeRO-3 modules: every layer of the VLM, the expert and the vision tower
    _no_split_modules = ["PI05VLMDecoderLayer", "PI05ExpertDecoderLayer", "SiglipEncoderLayer", "PI05MemoryEncoderLayer"]
    input_modalities = ("image", "text")
    # As the reference does in bf16: the vision path, every (ada)RMS norm and the action/time heads stay fp32.
    _keep_in_fp32_modules_strict = [
        "vision_tower",
        "multi_modal_projector",
        "layernorm",
        "norm.",
        "action_in_proj",
        "action_out_proj",
        "time_mlp_in",
        "time_mlp_out",
        "value_head",
    ]

    def post_init(self):
        super().post_init()
        # transformers unions the sub-models' `_no_split_modules`, naming classes this model does not contain (SigLIP's
        # pooling head, the Gemma layer class pi0.5 replaces); FSDP's per-layer wrapping refuses unknown class names.
        self._no_split_modules = present_module_classes(self, self._no_split_modules)

    def set_attn_implementation(self, attn_implementation, **kwargs):
        # transformers marks every sub-model config it switched with `_attn_was_changed` but clears the mark only on
        # the direct sub-configs; PaliGemma's nested text/vision configs would keep it and ignore every later switch.
        for module in self.modules():
            if isinstance(module, PreTrainedModel) and hasattr(module.config, "_attn_was_changed"):
                del module.config._attn_was_changed
        super().set_attn_implementation(attn_implementation, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, PI0TimestepEmbeddings):
            init.copy_(module.sinusoid_freq, module.compute_freqs(module.config))
        if isinstance(module, PI05ValueHead):
            init.zeros_(module.out.weight)
            init.zeros_(module.out.bias)
        if module is getattr(self, "advantage_embedding", None):
            init.zeros_(module.weight)  # the indicator starts as no change to the policy


class PI05Model(PI05PreTrainedModel):
    """PaliGemma (prefix) + adaRMS Gemma action expert (suffix)."""

    def __init__(self, config: PI05Config):
        super().__init__(config)
        self.vlm = AutoModel.from_config(config.vlm_config)
        text = self.vlm.language_model
        text.layers = nn.ModuleList(PI05VLMDecoderLayer(text.config, i) for i in range(len(text.layers)))
        if config.use_visual_memory:  # MEM: every n-th SigLIP layer can also attend across frames (memory.py)
            use_memory_layers(self.vlm.vision_tower.vision_model, config.memory_temporal_attention_every)
        # MEM's proprioceptive memory: each past (and the current) state as one prefix token (lerobot's name)
        self.proprio_history_proj = (nn.Linear(config.max_state_dim, text.config.hidden_size)
                                     if config.use_proprioceptive_memory else None)
        self.expert = PI05ActionExpert(config.dit_config)
        self.gradient_checkpointing = False
        self.post_init()
        for module in self.unused_modules():  # built from a config: ready to train what it runs
            module.requires_grad_(False)

    def unused_modules(self) -> list[nn.Module]:
        """Modules pi0.5 never runs (the last VLM layer only gives the expert its keys/values): its q/o projections,
        MLP and post-attention norm, and the VLM's final norm. Kept in the checkpoint (the published layout) and frozen
        here; `from_pretrained` makes them trainable again and training's structure (`hf_vla.training.structure`)
        freezes them, so no optimizer state, DDP unused-parameter error or FSDP state-loading gap arises."""
        if getattr(self.config, "token_loss", False) or getattr(self.config, "subtask_layout", None):
            return []  # target tokens (or a subtask) read the last layer's output: all of it trains
        text = self.vlm.language_model
        last = text.layers[-1]
        return [last.self_attn.q_proj, last.self_attn.o_proj, last.mlp, last.post_attention_layernorm, text.norm]

    def get_input_embeddings(self):
        return self.vlm.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.vlm.set_input_embeddings(value)

    @property
    def text_model(self):
        return self.vlm.language_model

    def _check_attention(self):
        for cfg in (self.config.vlm_config.text_config, self.config.dit_config):
            implementation = cfg._attn_implementation or "eager"
            if implementation not in SUPPORTED_ATTENTION:
                raise ValueError(f"pi0.5 cannot run with attn_implementation={implementation!r}: its prefix/suffix "
                                 "attention needs a per-key padding mask, which this backend does not express. Use "
                                 f"one of {SUPPORTED_ATTENTION}.")

    def prefix_mask(self, pixel_attention_mask: torch.Tensor, attention_mask: torch.Tensor,
                    memory: dict | None = None) -> torch.Tensor:
        """[B, n_cams * image_tokens (+ memory_frames state tokens) + L] bool: which prefix tokens are real."""
        image_mask = pixel_attention_mask.bool().repeat_interleave(self.config.num_image_tokens, dim=1)
        parts = [image_mask, attention_mask.bool()]
        if self.proprio_history_proj is not None:  # the past states before the episode's start are padding
            parts.insert(1, _memory_mask(memory, len(attention_mask), self.config.memory_frames, attention_mask.device))
        return torch.cat(parts, dim=1)

    def embed_prefix(self, input_ids, pixel_values, pixel_attention_mask=None, memory: dict | None = None) -> torch.Tensor:
        """Image tokens of every camera slot (absent ones are masked, not dropped), MEM's state tokens (proprioceptive
        memory), then language tokens. With visual memory `pixel_values` is `[B, n_cams, T, 3, H, W]` (oldest frame
        first): each camera's frames pass through SigLIP together and only the current frame's tokens come out."""
        batch_size, num_cameras = pixel_values.shape[:2]
        vision_dtype = self.vlm.vision_tower.get_input_embeddings().weight.dtype
        if self.config.use_visual_memory:
            if pixel_values.ndim != 6 or pixel_values.shape[2] != self.config.memory_frames:
                raise ValueError(f"visual memory: pixel_values must be [B, n_cams, memory_frames="
                                 f"{self.config.memory_frames}, 3, H, W], got {tuple(pixel_values.shape)}")
            frame_mask = _memory_mask(memory, batch_size, self.config.memory_frames, pixel_values.device)
            tokens = encode_frames(self.vlm.vision_tower.vision_model, pixel_values.flatten(0, 1).to(vision_dtype),
                                   frame_mask.repeat_interleave(num_cameras, dim=0),
                                   self.config.memory_temporal_attention_every)
            features = self.vlm.multi_modal_projector(tokens)
        else:
            if pixel_values.ndim != 5:
                raise ValueError(f"pixel_values must be [B, n_cams, 3, H, W] (this model has no visual memory), got "
                                 f"{tuple(pixel_values.shape)}")
            features = self.vlm.get_image_features(pixel_values.flatten(0, 1).to(vision_dtype)).pooler_output
        text_embeds = self.vlm.get_input_embeddings()(input_ids)  # Gemma scales by sqrt(width) here
        parts = [features.to(text_embeds.dtype).reshape(batch_size, num_cameras * features.shape[1], -1), text_embeds]
        if self.proprio_history_proj is not None:
            states = (memory or {}).get("memory_state")
            if states is None or states.ndim != 3 or states.shape[1] != self.config.memory_frames:
                raise ValueError(f"proprioceptive memory: pass memory_state [B, memory_frames={self.config.memory_frames}"
                                 f", max_state_dim] (the processor builds it), got "
                                 f"{None if states is None else tuple(states.shape)}")
            weight = self.proprio_history_proj.weight
            parts.insert(1, self.proprio_history_proj(states.to(weight.dtype)).to(text_embeds.dtype))
        return torch.cat(parts, dim=1)

    def _masks(self, prefix_valid: torch.Tensor, prefix_embeds, suffix_embeds, target_valid=None, span_valid=None):
        text_config, expert_config = self.config.vlm_config.text_config, self.config.dit_config
        prefix_mask = None
        if prefix_embeds is not None and target_valid is not None:
            # big_vision's rule over [prefix; targets]: the prefix is one bidirectional block (ar = 0), each target
            # opens a block of its own (ar = 1), so a target sees the prefix and earlier targets, the prefix no target
            blocks = torch.cat([torch.zeros_like(prefix_valid, dtype=torch.long),
                                torch.ones_like(target_valid, dtype=torch.long).cumsum(-1)], dim=1)

            def causal_targets(batch_idx, head_idx, q_idx, kv_idx):
                return blocks[batch_idx, kv_idx] <= blocks[batch_idx, q_idx]

            prefix_mask = create_bidirectional_mask(
                config=text_config, inputs_embeds=prefix_embeds, attention_mask=torch.cat([prefix_valid, target_valid], 1),
                and_mask_function=causal_targets)
        elif prefix_embeds is not None:
            prefix_mask = create_bidirectional_mask(
                config=text_config, inputs_embeds=prefix_embeds, attention_mask=prefix_valid
            )
        suffix_mask = None
        if suffix_embeds is not None:
            batch_size, chunk = suffix_embeds.shape[:2]
            context = prefix_valid if span_valid is None else torch.cat([prefix_valid, span_valid.bool()], dim=1)
            key_valid = torch.cat([context, prefix_valid.new_ones(batch_size, chunk)], dim=1)
            keys = suffix_embeds.new_empty(batch_size, key_valid.shape[1], 1)
            suffix_mask = create_bidirectional_mask(
                config=expert_config, inputs_embeds=suffix_embeds, attention_mask=key_valid, encoder_hidden_states=keys
            )
        return prefix_mask, suffix_mask

    def forward(
        self,
        suffix_embeds: torch.Tensor | None,
        adarms_cond: torch.Tensor | None,
        prefix_valid: torch.Tensor,
        prefix_embeds: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool = False,
        target_valid: torch.Tensor | None = None,
        span_valid: torch.Tensor | None = None,
        prefix_hidden: bool = False,
    ) -> tuple:
        """Run the towers. Prefix only (fills a cache), suffix only (reads `past_key_values`), or both jointly.

        Returns the expert's normalised suffix hidden states (or None) and the prefix cache (when one was used).

        `span_valid` `[B, S]`: S slots right after the prompt that the expert attends to as well (a subtask, causal):
        the first S target slots with `target_valid`, else the last S keys of `past_key_values`. `prefix_hidden`:
        also return the VLM's final-normed hidden state of each row's last real prompt token `[B, width]` (what
        predicts the first token after the prompt).

        With `target_valid` `[B, L_t]` (the token objective), `prefix_embeds` ends with `L_t` target-token embeddings:
        they attend to the prefix and causally to each other, the expert attends to the prefix without them (through
        stop-gradient keys/values under `config.knowledge_insulation`), and the last element returned is the VLM's
        final-normed hidden states that predict each target (next-token) `[B, L_t, width]`.
        """
        self._check_attention()
        if prefix_embeds is None and past_key_values is None:
            raise ValueError("PI05Model needs the prefix: pass prefix_embeds or a prefix past_key_values cache.")
        text = self.text_model
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        targets = 0 if target_valid is None else target_valid.shape[1]
        span = 0 if span_valid is None else span_valid.shape[1]
        if targets and prefix_embeds is None:
            raise ValueError("target tokens need the prefix embeddings (they are a training objective)")
        if targets and use_cache and span != targets:
            raise ValueError("a prefix cache with target tokens holds a subtask span alone (span_valid)")
        prefix_mask, suffix_mask = self._masks(prefix_valid, prefix_embeds, suffix_embeds, target_valid, span_valid)
        # targets continue the positions right after the last real prompt token (the prompt's padding has none)
        all_valid = prefix_valid if not targets else torch.cat([prefix_valid, target_valid], dim=1)
        prefix_positions = all_valid.long().cumsum(-1) - 1
        if prefix_embeds is not None:
            prefix_cos, prefix_sin = text.rotary_emb(prefix_embeds, position_ids=prefix_positions)
        if suffix_embeds is not None:
            offset = prefix_valid.long().sum(-1, keepdim=True)
            if span:  # the subtask's tokens continue the prompt's positions; the actions follow them
                offset = offset + span_valid.long().sum(-1, keepdim=True)
            suffix_positions = offset + torch.arange(suffix_embeds.shape[1], device=suffix_embeds.device)
            suffix_cos, suffix_sin = text.rotary_emb(suffix_embeds, position_ids=suffix_positions)

        hidden_prefix, hidden_suffix = prefix_embeds, suffix_embeds
        last = len(text.layers) - 1
        insulate = targets and self.config.knowledge_insulation
        for index, (vlm_layer, expert_layer) in enumerate(zip(text.layers, self.expert.layers)):
            # each step through the layer module's forward: FSDP/ZeRO-3 hooks and gradient checkpointing see it
            if hidden_prefix is not None:
                hidden_prefix, key, value = vlm_layer(
                    hidden_prefix, attention_mask=prefix_mask, position_embeddings=(prefix_cos, prefix_sin),
                    return_kv=True, kv_only=index == last and not targets and not prefix_hidden)
                if use_cache:
                    past_key_values.update(key, value, index)
                if targets:  # the expert attends to the prefix (and a subtask span), never to the other targets
                    keep = key.shape[2] - targets + span
                    key, value = key[:, :, :keep], value[:, :, :keep]
                if insulate:  # knowledge insulation: the flow loss does not reach the backbone
                    key, value = key.detach(), value.detach()
            else:
                key, value = past_key_values.layers[index].keys, past_key_values.layers[index].values
            if hidden_suffix is not None:
                hidden_suffix = expert_layer(hidden_suffix, adarms_cond, key, value, attention_mask=suffix_mask,
                                             position_embeddings=(suffix_cos, suffix_sin))
        if hidden_suffix is not None:
            hidden_suffix, _ = self.expert.norm(hidden_suffix, adarms_cond)
        out = (hidden_suffix, past_key_values)
        if prefix_hidden:
            length = prefix_valid.shape[1]
            last_real = length - 1 - prefix_valid.flip(-1).long().argmax(-1)
            out += (text.norm(hidden_prefix[torch.arange(len(last_real), device=last_real.device), last_real]),)
        if targets:
            # next-token prediction: target k is read from the position before it, target 0 from the last real prompt
            # token (the prompt is right-padded, so that is the last valid prefix position)
            length = prefix_valid.shape[1]
            last_real = length - 1 - prefix_valid.flip(-1).long().argmax(-1)
            first = hidden_prefix[torch.arange(len(last_real), device=last_real.device), last_real][:, None]
            out += (text.norm(torch.cat([first, hidden_prefix[:, length:length + targets - 1]], dim=1)),)
        return out


    def decode_step(self, token_ids: torch.Tensor, past_key_values: DynamicCache, key_valid: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        """One token per row `[B]` through the VLM, attending to the cache's keys where `key_valid` `[B, K]` says and
        to itself, at rotary positions `[B]`; its keys/values are appended to the cache. Returns the final-normed
        hidden state `[B, width]` (what predicts the next token): the step of a causal decode after the prompt, the
        same computation as a target token of the training forward."""
        text = self.text_model
        hidden = self.get_input_embeddings()(token_ids[:, None])
        cos, sin = (t.to(hidden.dtype) for t in text.rotary_emb(hidden, position_ids=positions[:, None]))
        keys_valid = torch.cat([key_valid.bool(), key_valid.new_ones(len(key_valid), 1, dtype=torch.bool)], dim=1)
        mask = create_bidirectional_mask(config=self.config.vlm_config.text_config, inputs_embeds=hidden,
                                         attention_mask=keys_valid,
                                         encoder_hidden_states=hidden.new_empty(len(hidden), keys_valid.shape[1], 1))
        for index, layer in enumerate(text.layers):
            cached = past_key_values.layers[index]
            hidden, key, value = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), return_kv=True,
                                       past_kv=(cached.keys, cached.values))
            past_key_values.update(key, value, index)
        return text.norm(hidden[:, 0])


def repeat_rows(rows: torch.Tensor | None, times: int, halves: int = 1) -> torch.Tensor | None:
    """Each row repeated `times` times in place (`[r0, r0, r1, r1, ...]`), within each of `halves` equal blocks of
    rows (guidance's conditioned and unconditioned halves stay apart)."""
    if rows is None or times == 1:
        return rows
    return torch.cat([block.repeat_interleave(times, dim=0) for block in rows.chunk(halves)])


def repeat_cache(cache: DynamicCache, times: int, halves: int = 1) -> DynamicCache:
    """A prefix cache whose rows are repeated as `repeat_rows` repeats them: the prefix of N candidates computed
    once."""
    repeated = DynamicCache()
    for index, layer in enumerate(cache.layers):
        repeated.update(repeat_rows(layer.keys, times, halves), repeat_rows(layer.values, times, halves), index)
    return repeated


# `sample_actions`' model inputs besides the prompt's ids, the images and their masks (the processor's outputs); the
# state is accepted for transformers' pi0 signature (pi0.5 reads it as tokens)
SAMPLE_INPUTS = ("state", "uncond_input_ids", "uncond_attention_mask", "advantage_ids", "uncond_advantage_ids",
                 "memory_state", "memory_mask", "subtask_ids", "subtask_mask")


@dataclass
class SubtaskDecode:
    """A decoded subtask: `ids` / `mask` `[B, S]` (the tokens and which are real: each row's tokens up to and with
    EOS), each token's log-probability `log_probs` `[B, S]` (how sure the model was), and the prefix cache holding the
    prompt and them, which `sample_actions(subtask=...)` re-uses."""

    ids: torch.LongTensor
    mask: torch.BoolTensor
    log_probs: torch.FloatTensor
    cache: DynamicCache


class PI05ForConditionalGeneration(PI05PreTrainedModel):
    """pi0.5: predicts the flow-matching velocity of an action chunk; `sample_actions` integrates it."""

    def __init__(self, config: PI05Config):
        super().__init__(config)
        self.model = PI05Model(config)
        width = config.dit_config.hidden_size
        self.time_embed = PI0TimestepEmbeddings(config)
        self.action_in_proj = nn.Linear(config.max_action_dim, width)
        self.action_out_proj = nn.Linear(width, config.max_action_dim)
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)
        # RECAP's indicator read by the expert (none / negative / positive), zero at the start: the policy unchanged
        self.advantage_embedding = nn.Embedding(3, width) if config.advantage_indicator == "embedding" else None
        # the critic of PPO fine-tuning, held (and saved) with the policy; `hf_vla.rl.critic` adds, runs and trains it
        self.value_head = PI05ValueHead(config) if config.value_head else None
        self.post_init()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        # The token objective's LM head is the input embedding's weight, tied (PaliGemma); saying so keeps FSDP2 from
        # giving the embedding a unit that reshards before the head reads it. A holder of the weight outside the
        # module tree (a unit takes each module once; the checkpoint holds the weight once). Flow-only: no head.
        if not self.config.token_loss:
            return None
        embedding = self.model.get_input_embeddings()
        head = self.__dict__.get("_tied_head")
        if head is None or head.weight is not embedding.weight:
            head = nn.Module()
            head.weight = embedding.weight
            self.__dict__["_tied_head"] = head  # outside the module tree
        return head

    @staticmethod
    def _default_masks(input_ids, pixel_values, attention_mask, pixel_attention_mask):
        """All prompt tokens and all camera slots present unless masks say otherwise."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if pixel_attention_mask is None:
            if pixel_values is None:
                raise ValueError("Pass pixel_values, or pixel_attention_mask together with past_key_values.")
            pixel_attention_mask = torch.ones(pixel_values.shape[:2], dtype=torch.bool, device=input_ids.device)
        return attention_mask, pixel_attention_mask

    def embed_suffix(self, noise: torch.Tensor, timestep: torch.Tensor,
                     advantage_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Action tokens from x_t (each expert layer casts them to its dtype), and the adaRMS condition from the time
        embedding: `[B, width]` for one time per sample (`timestep [B]`), `[B, chunk, width]` for one time per action
        token (`timestep [B, chunk]`, training-time real-time chunking: a committed prefix is clean, time 0); with
        `config.advantage_indicator="embedding"`, the indicator's embedding (`advantage_ids` `[B]`: 0 none, 1
        negative, 2 positive) is added before the last activation."""
        action_embeds = self.action_in_proj(noise.to(self.action_in_proj.weight.dtype))
        time = timestep.float()
        time_embeds = self.time_embed(time.reshape(-1)).reshape(*time.shape, -1).to(self.time_mlp_in.weight.dtype)
        hidden = self.time_mlp_out(F.silu(self.time_mlp_in(time_embeds)))
        if self.advantage_embedding is not None:
            if advantage_ids is None:
                advantage_ids = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
            indicator = self.advantage_embedding(advantage_ids.long()).to(hidden.dtype)
            hidden = hidden + (indicator[:, None] if hidden.ndim == 3 else indicator)
        elif advantage_ids is not None and bool((advantage_ids != 0).any()):
            raise ValueError("advantage_ids need a model with config.advantage_indicator='embedding'")
        return action_embeds, F.silu(hidden)

    def sample_time(self, batch_size: int, device) -> torch.Tensor:
        """t ~ Beta(alpha, beta) * scale + offset (as published), from the global RNG (`hf_vla.models.common.flow`)."""
        return sample_time(self.config, batch_size, device)

    def forward(
        self,
        noise: torch.FloatTensor | None = None,
        timestep: torch.FloatTensor | None = None,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.FloatTensor | None = None,
        pixel_attention_mask: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        actions: torch.FloatTensor | None = None,
        state: torch.FloatTensor | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool = False,
        labels: torch.LongTensor | None = None,
        output_token_logits: bool = False,
        subtask_ids: torch.LongTensor | None = None,
        subtask_mask: torch.BoolTensor | None = None,
        memory_state: torch.FloatTensor | None = None,
        memory_mask: torch.BoolTensor | None = None,
        advantage_ids: torch.LongTensor | None = None,
        **kwargs,
    ) -> PI05Output:
        r"""
        noise (`[B, chunk, max_action_dim]`): x_t at `timestep` when `actions` is None; otherwise the noise that is
            mixed with `actions` (sampled when omitted).
        timestep (`[B]`): flow-matching time in [0, 1] (sampled from the configured Beta when omitted with `actions`);
            `[B, chunk]` gives every action token its own time (training-time real-time chunking: 0 on a committed
            prefix, which x_t then holds clean).
        input_ids / attention_mask (`[B, L]`): the prompt (`Task: ..., State: ...;\nAction: `), right-padded.
        pixel_values (`[B, n_cams, 3, H, W]`), pixel_attention_mask (`[B, n_cams]`): camera images and presence.
        actions (`[B, chunk, max_action_dim]`): normalised target chunk; when given, `loss` is the mean flow-matching
            MSE (the trainer computes its own masked, aggregated loss from `logits` instead).
        state: accepted for a uniform policy signature and unused: pi0.5 reads the state from the prompt.
        past_key_values: a prefix cache from a previous call (`use_cache=True`); the prefix is then not recomputed.
        labels (`[B, L_t]`, token objective, `config.token_loss`): target token ids after the prompt (FAST action
            tokens, then text), -100 where there is none (right-padded). The backbone reads them causally after the
            prefix and returns each target's next-token cross-entropy `token_losses`; the expert never sees them and,
            under `config.knowledge_insulation`, reads the backbone's keys/values through a stop-gradient. With
            `actions`, `loss` adds the mean cross-entropy over the targets to the flow MSE.
        output_token_logits: with `labels`, also return the targets' logits `token_logits` `[B, L_t, vocab]`.
        subtask_ids / subtask_mask (`[B, S]`, `config.subtask_layout="joint"`): the subtask's tokens after the prompt
            (ending in `Subtask: `), EOS included, right-padded (`subtask_mask` False); a row without a subtask is all
            False (its prompt then ends in `Action: `). They are attended causally; the expert attends to them; the
            backbone predicts each (cross-entropy, the leading `S` columns of `token_losses`, before `labels`' own).
            With `past_key_values`, only `subtask_mask`: the cache then holds the prompt and the S slots.
        memory_state (`[B, T, max_state_dim]`, `config.use_proprioceptive_memory`): the normalised states of the T =
            `memory_frames` observations `memory_stride` frames apart, oldest first, the current one last.
        memory_mask (`[B, T]`, MEM): which of those observations are real (False: before the episode's start; their
            images and states are ignored). Default: all. With visual memory `pixel_values` is
            `[B, n_cams, T, 3, H, W]` in the same order.
        advantage_ids (`[B]`, `config.advantage_indicator="embedding"`): RECAP's indicator the expert reads (0 none,
            1 negative, 2 positive; default none).

        Returns `logits` = predicted velocity `[B, chunk, max_action_dim]` (fp32).
        """
        if input_ids is None:
            raise ValueError("PI05ForConditionalGeneration.forward needs input_ids (and attention_mask).")
        batch_size = input_ids.shape[0]
        attention_mask, pixel_attention_mask = self._default_masks(
            input_ids, pixel_values, attention_mask, pixel_attention_mask
        )
        shape = (batch_size, self.config.chunk_size, self.config.max_action_dim)
        if actions is not None:
            if timestep is None:
                timestep = self.sample_time(batch_size, input_ids.device)
            if noise is None:
                noise = torch.randn(shape, device=input_ids.device, dtype=torch.float32)
            t = (timestep[..., None] if timestep.ndim == 2 else timestep[:, None, None]).to(actions.dtype)
            x_t = t * noise + (1 - t) * actions
        else:
            if noise is None or timestep is None:
                raise ValueError("Without actions, pass noise (x_t) and timestep: the model predicts the velocity there.")
            x_t = noise

        prefix_embeds = None
        memory = {"memory_state": memory_state, "memory_mask": memory_mask}
        if past_key_values is None:
            if pixel_values is None:
                raise ValueError("pixel_values are needed unless a prefix past_key_values cache is passed.")
            prefix_embeds = self.model.embed_prefix(input_ids, pixel_values, pixel_attention_mask, memory)
        suffix_embeds, cond = self.embed_suffix(x_t, timestep, advantage_ids)
        prefix_valid = self.model.prefix_mask(pixel_attention_mask, attention_mask, memory)
        target_valid = span_valid = None
        if subtask_mask is not None or subtask_ids is not None:
            if not self.config.subtask_layout:
                raise ValueError("subtask_ids need a model trained with subtasks (config.subtask_layout); this one has "
                                 "none")
            span_valid = (subtask_mask if subtask_mask is not None else torch.ones_like(subtask_ids)).bool()
            if subtask_ids is not None:
                if prefix_embeds is None:
                    raise ValueError("subtask_ids go with the prefix (pixel_values); with a past_key_values cache pass "
                                     "only subtask_mask")
                span_labels = subtask_ids.masked_fill(~span_valid, -100)
                labels = span_labels if labels is None else torch.cat([span_labels, labels], dim=1)
        if labels is not None:
            if not (self.config.token_loss or (span_valid is not None and labels.shape[1] == span_valid.shape[1])):
                raise ValueError("labels (target tokens) need config.token_loss=True: flow-only, the VLM's last layer "
                                 "is frozen and nothing predicts tokens")
            if prefix_embeds is None:
                raise ValueError("labels need the prefix (pixel_values), not a past_key_values cache")
            target_valid = labels != -100
            targets = self.model.get_input_embeddings()(labels.masked_fill(~target_valid, 0))
            prefix_embeds = torch.cat([prefix_embeds, targets.to(prefix_embeds.dtype)], dim=1)
        hidden, cache, *target_hidden = self.model(
            suffix_embeds,
            cond,
            prefix_valid=prefix_valid,
            prefix_embeds=prefix_embeds,
            past_key_values=past_key_values,
            use_cache=use_cache,
            target_valid=target_valid,
            span_valid=span_valid,
        )
        token_logits = token_losses = None
        if labels is not None:  # the LM head is the input embedding, tied (PaliGemma)
            target_hidden = target_hidden[0]
            embedding = self.model.get_input_embeddings().weight
            token_losses = chunked_token_losses(target_hidden, embedding, labels, self.config.token_loss_chunk)
            if output_token_logits:
                token_logits = F.linear(target_hidden.to(embedding.dtype), embedding)
        velocity = self.action_out_proj(hidden[:, -self.config.chunk_size :].to(self.action_out_proj.weight.dtype))
        velocity = velocity.float()
        loss = None
        if actions is not None:
            loss = F.mse_loss(velocity, (noise - actions).float())
            if token_losses is not None and target_valid.any():
                loss = loss + token_losses[target_valid].mean()
        return PI05Output(loss=loss, logits=velocity, past_key_values=cache, token_losses=token_losses,
                          token_logits=token_logits)

    @torch.no_grad()
    def prefix_cache(self, input_ids, pixel_values, pixel_attention_mask=None, attention_mask=None,
                     subtask: tuple | None = None, memory: dict | None = None) -> DynamicCache:
        """Run the VLM once over the prefix and return its per-layer keys/values; with `subtask` (its ids and mask
        `[B, S]`), over the prompt and the subtask after it, attended causally (as in training). `memory`: MEM's
        `memory_state` / `memory_mask` (see `forward`)."""
        attention_mask, pixel_attention_mask = self._default_masks(
            input_ids, pixel_values, attention_mask, pixel_attention_mask
        )
        prefix_embeds = self.model.embed_prefix(input_ids, pixel_values, pixel_attention_mask, memory)
        span_valid = None
        if subtask is not None:
            ids, span_valid = subtask[0], subtask[1].bool()
            span = self.model.get_input_embeddings()(ids.masked_fill(~span_valid, 0))
            prefix_embeds = torch.cat([prefix_embeds, span.to(prefix_embeds.dtype)], dim=1)
        _, cache, *_ = self.model(
            None,
            None,
            prefix_valid=self.model.prefix_mask(pixel_attention_mask, attention_mask, memory),
            prefix_embeds=prefix_embeds,
            use_cache=True,
            target_valid=span_valid,
            span_valid=span_valid,
        )
        return cache

    @torch.no_grad()
    def generate_subtask(self, input_ids, pixel_values, pixel_attention_mask=None, attention_mask=None,
                         max_new_tokens: int | None = None, eos_token_id: int | None = None,
                         **memory) -> SubtaskDecode:
        """Decode each row's subtask greedily after its prompt (ending in `Subtask: `), with the VLM's key/value cache:
        one prefix pass, then one token per step (`PI05Model.decode_step`) until EOS (kept, as training's span ends
        in it) or `max_new_tokens` (default `config.subtask_max_tokens`). Returns the tokens and the cache of the
        prompt and them, for `sample_actions(subtask=...)`."""
        if not self.config.subtask_layout:
            raise ValueError("this checkpoint was not trained to predict subtasks (config.subtask_layout is None): it "
                             "cannot decode one; pass the subtask's text, or none")
        eos = self.config.subtask_eos_token_id if eos_token_id is None else eos_token_id
        if eos is None:
            raise ValueError("generate_subtask needs the tokenizer's EOS id (eos_token_id=, or config.subtask_eos_token_id)")
        attention_mask, pixel_attention_mask = self._default_masks(
            input_ids, pixel_values, attention_mask, pixel_attention_mask
        )
        prefix_valid = self.model.prefix_mask(pixel_attention_mask, attention_mask, memory)
        prefix_embeds = self.model.embed_prefix(input_ids, pixel_values, pixel_attention_mask, memory)
        _, cache, hidden = self.model(None, None, prefix_valid=prefix_valid, prefix_embeds=prefix_embeds,
                                      use_cache=True, prefix_hidden=True)
        embedding = self.model.get_input_embeddings().weight
        positions, key_valid = prefix_valid.long().sum(-1), prefix_valid
        done = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
        ids, valid, log_probs = [], [], []
        for _ in range(max_new_tokens or self.config.subtask_max_tokens):
            scores = F.linear(hidden.to(embedding.dtype), embedding).float().log_softmax(-1)
            token = scores.argmax(-1)
            live = ~done
            ids.append(token.masked_fill(done, 0))
            valid.append(live)
            log_probs.append(scores.gather(-1, token[:, None])[:, 0].masked_fill(done, 0.0))
            hidden = self.model.decode_step(token, cache, key_valid, positions)  # its keys/values join the cache
            key_valid = torch.cat([key_valid, live[:, None]], dim=1)
            positions = positions + live.long()
            done = done | (token == eos)
            if bool(done.all()):
                break
        return SubtaskDecode(torch.stack(ids, dim=1), torch.stack(valid, dim=1), torch.stack(log_probs, dim=1), cache)

    @torch.no_grad()
    def sample_actions(
        self,
        input_ids: torch.LongTensor,
        pixel_values: torch.FloatTensor,
        pixel_attention_mask: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        noise: torch.FloatTensor | None = None,
        sampling_config: SamplingConfig | None = None,
        **kwargs,
    ) -> torch.FloatTensor:
        """Integrate the velocity from t=1 (noise) to t=0 with Euler steps; the prefix runs once.

        How it samples is one `SamplingConfig` passed whole (steps, guidance, real-time chunking, the subtask mode),
        as `generate` takes a `GenerationConfig`; any of its fields passed by name overrides it for this call
        (`sample_actions(**inputs, num_steps=5)`). The other keyword arguments are model inputs, from the processor
        (`SAMPLE_INPUTS`); an unknown name raises.

        Subtasks (`config.subtask_layout="joint"`): `subtask="auto"` decodes each row's subtask first
        (`generate_subtask`, the prompt ending in `Subtask: `) and acts on it; a `SubtaskDecode` from
        `generate_subtask` acts on it, re-using its cache; `subtask_ids` / `subtask_mask` (a given subtask's tokens,
        `PI05Processor(subtask=...)`) act on that text. Without, the prompt is acted on as it is.

        Classifier-free guidance (RECAP, pi*0.6): with `uncond_input_ids` / `uncond_attention_mask` (the prompt without
        the advantage indicator; `PI05Processor` adds them, and `cfg_beta`, where `cfg_beta` is not 1) the velocity is
        `v_u + cfg_beta * (v_c - v_u)`, both from one forward over the conditioned and unconditioned rows stacked (one
        prefix cache of 2B rows, one expert call per step).

        Real-time chunking (`rtc.py`): with `prev_chunk_left_over` (`[B, T, d]` or `[T, d]`, normalised, the
        previous chunk's actions not executed when this observation was taken; T <= chunk, d <= max_action_dim), the
        first `inference_delay` actions continue it (they execute while this call runs). `rtc_config.method`:
        `guidance` (inference-time RTC) guides them to equal it and blends the next ones, up to `execution_horizon`
        (default `rtc_config.execution_horizon`), with it; `prefix` (training-time RTC, for a model trained with
        `rtc_max_delay` >= `inference_delay`) holds them clean at time 0 and integrates only the rest; `auto` picks
        `prefix` when the model was trained for the delay.

        MEM (`memory_state`, `memory_mask`, and `pixel_values` with a frame axis): as in `forward`.

        The embedding indicator (`config.advantage_indicator="embedding"`): `advantage_ids` as in `forward`; guidance's
        other half reads `uncond_advantage_ids` (none) with the same prompt, so the prefix is computed once.
        """
        sampling, inputs = (sampling_config or SamplingConfig()).update(**kwargs)
        unknown = sorted(set(inputs) - set(SAMPLE_INPUTS))
        if unknown:
            raise TypeError(f"sample_actions: unknown argument(s) {unknown}; its inputs are {sorted(SAMPLE_INPUTS)} "
                            f"and its options (SamplingConfig) {list(SamplingConfig.names())}")
        num_steps = sampling.num_steps or self.config.num_inference_steps
        cfg_beta, subtask = sampling.cfg_beta, sampling.subtask
        rtc = (sampling.prev_chunk_left_over, sampling.inference_delay, sampling.execution_horizon, sampling.rtc_config)
        uncond_input_ids, uncond_attention_mask = inputs.get("uncond_input_ids"), inputs.get("uncond_attention_mask")
        memory_state, memory_mask = inputs.get("memory_state"), inputs.get("memory_mask")
        advantage_ids, uncond_advantage_ids = inputs.get("advantage_ids"), inputs.get("uncond_advantage_ids")
        batch_size, device = input_ids.shape[0], input_ids.device
        attention_mask, pixel_attention_mask = self._default_masks(
            input_ids, pixel_values, attention_mask, pixel_attention_mask
        )
        candidates = int(sampling.num_candidates)
        shape = (batch_size, *((candidates,) if candidates > 1 else ()), self.config.chunk_size,
                 self.config.max_action_dim)
        if noise is None:
            noise = torch.randn(shape, device=device)
        elif tuple(noise.shape) != shape:
            raise ValueError(f"noise of shape {tuple(noise.shape)}; {shape} expected (rows"
                             + (", candidates" if candidates > 1 else "") + ", chunk, max_action_dim)")
        noise = noise.reshape(batch_size * candidates, *shape[-2:])  # candidates of a row are adjacent rows
        if candidates > 1 and rtc[0] is not None and rtc[0].ndim == 3:  # each candidate continues its row's chunk
            rtc = (rtc[0].repeat_interleave(candidates, dim=0), *rtc[1:])
        subtask_ids, subtask_mask = inputs.get("subtask_ids"), inputs.get("subtask_mask")
        memory = {"memory_state": memory_state, "memory_mask": memory_mask}
        if subtask == "auto":
            subtask = self.generate_subtask(input_ids, pixel_values, pixel_attention_mask, attention_mask, **memory)
        elif subtask is not None and not isinstance(subtask, SubtaskDecode):
            raise ValueError(f"subtask={subtask!r}: 'auto', a SubtaskDecode, or None (a given text goes in as "
                             "subtask_ids / subtask_mask, from the processor)")
        if uncond_input_ids is not None:
            if subtask is not None or subtask_ids is not None:
                raise ValueError("classifier-free guidance with a subtask is not supported: pass cfg_beta=1")
            memory["advantage_ids"] = (advantage_ids, uncond_advantage_ids)
            chunks = self._sample_guided((input_ids, pixel_values, pixel_attention_mask, attention_mask, memory),
                                         (uncond_input_ids, uncond_attention_mask), cfg_beta, noise, num_steps, rtc,
                                         candidates)
            return chunks if candidates == 1 else chunks.view(shape)
        if subtask is not None:
            cache, span_mask = subtask.cache, subtask.mask
        elif subtask_ids is not None:
            span_mask = (subtask_mask if subtask_mask is not None else torch.ones_like(subtask_ids)).bool()
            cache = self.prefix_cache(input_ids, pixel_values, pixel_attention_mask, attention_mask,
                                      subtask=(subtask_ids, span_mask), memory=memory)
        else:
            cache = self.prefix_cache(input_ids, pixel_values, pixel_attention_mask, attention_mask, memory=memory)
            span_mask = None
        if candidates > 1:  # the prefix once per observation; its keys / values and masks repeated per candidate
            cache = repeat_cache(cache, candidates)
            input_ids, pixel_attention_mask, attention_mask, memory_mask, advantage_ids, span_mask = (
                repeat_rows(x, candidates) for x in (input_ids, pixel_attention_mask, attention_mask, memory_mask,
                                                     advantage_ids, span_mask))
        span = {} if span_mask is None or not span_mask.shape[1] else {"subtask_mask": span_mask}

        def velocity(x, timestep):
            return self(noise=x, timestep=timestep, input_ids=input_ids, pixel_attention_mask=pixel_attention_mask,
                        attention_mask=attention_mask, past_key_values=cache, memory_mask=memory_mask,
                        advantage_ids=advantage_ids, **span).logits

        chunks = euler_integrate(velocity, noise.float(), num_steps, self.config.rtc_max_delay, *rtc)
        return chunks if candidates == 1 else chunks.view(shape)

    def _sample_guided(self, prefix: tuple, unconditioned_prompt: tuple, cfg_beta, noise, num_steps,
                       rtc: tuple, candidates: int = 1) -> torch.FloatTensor:
        """`sample_actions` with classifier-free guidance: rows [0, B) conditioned on `prefix` (input_ids,
        pixel_values, pixel_attention_mask, attention_mask), [B, 2B) on `unconditioned_prompt` (its input_ids and
        attention_mask, the same images); with `candidates` > 1, each half's rows repeated per candidate after the
        prefix (`noise` `[B * candidates, T, d]`, every candidate guided)."""
        input_ids, pixel_values, pixel_attention_mask, attention_mask, memory = prefix
        memory = dict(memory)
        advantage_ids, uncond_advantage_ids = memory.pop("advantage_ids", (None, None))
        uncond_input_ids, uncond_attention_mask = unconditioned_prompt
        batch_size = input_ids.shape[0]
        both_advantages = None
        if advantage_ids is not None:  # the embedding indicator: the other half reads none (0) unless told
            other = uncond_advantage_ids if uncond_advantage_ids is not None else torch.zeros_like(advantage_ids)
            both_advantages = torch.cat([advantage_ids, other])
        if uncond_input_ids.shape[0] != batch_size:
            raise ValueError(f"uncond_input_ids has {uncond_input_ids.shape[0]} rows for {batch_size} prompts")
        if uncond_attention_mask is None:
            uncond_attention_mask = torch.ones_like(uncond_input_ids, dtype=torch.bool)
        length = max(input_ids.shape[1], uncond_input_ids.shape[1])

        def right_pad(ids, mask):
            extra = length - ids.shape[1]
            return torch.nn.functional.pad(ids, (0, extra)), torch.nn.functional.pad(mask.bool(), (0, extra))

        ids_c, mask_c = right_pad(input_ids, attention_mask)
        ids_u, mask_u = right_pad(uncond_input_ids, uncond_attention_mask)
        both_ids, both_mask = torch.cat([ids_c, ids_u]), torch.cat([mask_c, mask_u])
        both_pixels = torch.cat([pixel_values, pixel_values])
        both_cameras = torch.cat([pixel_attention_mask, pixel_attention_mask])
        both_memory = {key: None if value is None else torch.cat([value, value]) for key, value in memory.items()}
        if torch.equal(ids_c, ids_u) and torch.equal(mask_c, mask_u):  # one prompt (the expert reads the indicator)
            half = self.prefix_cache(ids_c, pixel_values, pixel_attention_mask, mask_c, memory=memory)
            cache = DynamicCache()
            for index, layer in enumerate(half.layers):  # the prefix once, its keys/values for both halves
                cache.update(torch.cat([layer.keys, layer.keys]), torch.cat([layer.values, layer.values]), index)
        else:
            cache = self.prefix_cache(both_ids, both_pixels, both_cameras, both_mask, memory=both_memory)
        beta = torch.as_tensor(1.0 if cfg_beta is None else cfg_beta, dtype=torch.float32, device=noise.device)
        beta = beta.expand(batch_size) if beta.ndim == 0 else beta
        if candidates > 1:  # after the prefix: each half's rows repeated per candidate
            cache = repeat_cache(cache, candidates, halves=2)
            both_ids, both_mask, both_cameras, both_advantages = (
                repeat_rows(x, candidates, halves=2) for x in (both_ids, both_mask, both_cameras, both_advantages))
            both_memory = {key: repeat_rows(value, candidates, halves=2) for key, value in both_memory.items()}
            beta, batch_size = beta.repeat_interleave(candidates), batch_size * candidates
        beta = beta.view(batch_size, *([1] * (noise.ndim - 1)))

        def velocity(x, timestep):
            v = self(noise=torch.cat([x, x]), timestep=torch.cat([timestep, timestep]), input_ids=both_ids,
                     pixel_attention_mask=both_cameras, attention_mask=both_mask, past_key_values=cache,
                     memory_mask=both_memory["memory_mask"], advantage_ids=both_advantages).logits
            conditioned, unconditioned = v[:batch_size].float(), v[batch_size:].float()
            return unconditioned + beta * (conditioned - unconditioned)

        return euler_integrate(velocity, noise.float(), num_steps, self.config.rtc_max_delay, *rtc)


PI05ForConditionalGeneration.register_for_auto_class("AutoModel")  # the auto_map of a saved checkpoint (trust_remote_code)

__all__ = ["PI05PreTrainedModel", "PI05Model", "PI05ForConditionalGeneration", "PI05Output", "PI05ValueHead",
           "SamplingConfig", "SubtaskDecode"]
