"""RECAP's value model (pi*0.6, arXiv 2511.14759, Sec. IV-A; its model card as lerobot's `feat/add-recap` branch
documents it): a vision-language backbone reads the cameras and the task, a learned value-query token after the prompt
attends to all of it, and a 2-layer MLP on the query's last hidden state predicts a distribution over `num_bins` bins
of the normalised return on [-1, 0]; `value()` is its expectation.

The backbone is pi0.5's (`model.vlm`, the same module names as `PI05ForConditionalGeneration`), so
`PI05ValueModel.from_pretrained(pi05_checkpoint, config=PI05ValueConfig(...))` starts from a pi0.5 checkpoint's
vision-language weights (its action expert is not read). The image and prompt tokens attend to each other
bidirectionally (PaliGemma's prefix), the query token to everything and nothing to the query."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModel, PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask
from transformers.utils import ModelOutput

from .configuration_value import PI05ChunkCriticConfig, PI05ValueConfig


@dataclass
class PI05ValueOutput(ModelOutput):
    """logits: `[B, num_bins]`; value: the expected normalised return `[B]`; loss: the mean cross-entropy when targets
    are given; per_sample_loss: `[B]` cross-entropies (what the trainer aggregates)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    value: torch.FloatTensor | None = None
    per_sample_loss: torch.FloatTensor | None = None


class PI05ValueBackbone(nn.Module):
    def __init__(self, config: PI05ValueConfig):
        super().__init__()
        self.vlm = AutoModel.from_config(config.vlm_config)


class PI05ValueModel(PreTrainedModel):
    """The value model; `forward(..., value_targets=...)` returns the cross-entropy too. `value_targets`: the
    normalised returns `[B]` (turned into bins by `config.value_targets`) or target distributions `[B, num_bins]`."""

    config_class = PI05ValueConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["GemmaDecoderLayer", "SiglipEncoderLayer"]
    input_modalities = ("image", "text")
    _keep_in_fp32_modules_strict = ["vision_tower", "multi_modal_projector", "layernorm", "norm.", "value_readout",
                                    "value_query"]
    _keys_to_ignore_on_load_unexpected = [r"^model\.expert\.", r"^action_", r"^time_mlp", r"^value_head\."]

    def __init__(self, config: PI05ValueConfig):
        super().__init__(config)
        self.model = PI05ValueBackbone(config)
        width = config.vlm_config.text_config.hidden_size
        self.value_query = nn.Embedding(1, width)  # a module: LoRA's modules_to_save trains it in full
        self.value_readout = nn.Sequential(nn.Linear(width, width), nn.GELU(approximate="tanh"),
                                           nn.Linear(width, config.num_bins))
        self.register_buffer("bin_values", torch.linspace(-1.0, 0.0, config.num_bins), persistent=False)
        self._build_inputs(config, width)
        self.post_init()

    def _build_inputs(self, config, width: int) -> None:
        """Modules of inputs beyond the cameras and the prompt (the chunk critic's chunk)."""

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is getattr(self, "value_query", None):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, PI05ValueModel):
            with torch.no_grad():
                module.bin_values.copy_(torch.linspace(-1.0, 0.0, module.config.num_bins))

    def get_input_embeddings(self):
        return self.model.vlm.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.vlm.set_input_embeddings(value)

    def _embed(self, input_ids, pixel_values, pixel_attention_mask, attention_mask):
        """[image tokens of every camera slot, prompt tokens] and which of them are real."""
        vlm = self.model.vlm
        batch_size, num_cameras = pixel_values.shape[:2]
        vision_dtype = vlm.vision_tower.get_input_embeddings().weight.dtype
        features = vlm.get_image_features(pixel_values.flatten(0, 1).to(vision_dtype)).pooler_output
        text = vlm.get_input_embeddings()(input_ids)  # Gemma scales by sqrt(width) here
        features = features.to(text.dtype).reshape(batch_size, num_cameras * features.shape[1], -1)
        image_valid = pixel_attention_mask.bool().repeat_interleave(features.shape[1] // num_cameras, dim=1)
        return torch.cat([features, text], dim=1), torch.cat([image_valid, attention_mask.bool()], dim=1)

    def _prefix(self, input_ids, pixel_values, attention_mask=None, pixel_attention_mask=None):
        """`_embed` with the masks' defaults (every token and camera real)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if pixel_attention_mask is None:
            pixel_attention_mask = torch.ones(pixel_values.shape[:2], dtype=torch.bool, device=pixel_values.device)
        return self._embed(input_ids, pixel_values, pixel_attention_mask, attention_mask)

    def _returns(self, input_ids, pixel_values, attention_mask, pixel_attention_mask, value_targets,
                 suffix: tuple[torch.Tensor, torch.Tensor] | None = None,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> PI05ValueOutput:
        """The return distribution read by the value query after the prefix and `suffix` (tokens `[B, S, width]`
        and which are real, a block after the prefix: they attend to it and to each other, it not to them).
        `prefix`: the prefix's embeddings and validity when already computed (`_prefix`)."""
        prefix, prefix_valid = prefix or self._prefix(input_ids, pixel_values, attention_mask, pixel_attention_mask)
        batch_size = prefix.shape[0]
        query = self.value_query.weight.to(prefix.dtype).expand(batch_size, 1, -1)
        tokens, valid = [prefix, query], [prefix_valid, prefix_valid.new_ones(batch_size, 1)]
        if suffix is not None:
            tokens.insert(1, suffix[0].to(prefix.dtype))
            valid.insert(1, suffix[1].bool())
        embeds, valid = torch.cat(tokens, dim=1), torch.cat(valid, dim=1)
        # the prefix is one bidirectional block, the suffix and the query a block after it (big_vision's ar rule)
        blocks = torch.ones_like(valid, dtype=torch.long)
        blocks[:, : prefix.shape[1]] = 0

        def query_last(batch_idx, head_idx, q_idx, kv_idx):
            return blocks[batch_idx, kv_idx] <= blocks[batch_idx, q_idx]

        text_model = self.model.vlm.language_model
        mask = create_bidirectional_mask(config=text_model.config, inputs_embeds=embeds, attention_mask=valid,
                                         and_mask_function=query_last)
        positions = valid.long().cumsum(-1) - 1  # the query right after the last real token
        hidden = text_model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).last_hidden_state
        logits = self.value_readout(hidden[:, -1].float())
        value = logits.softmax(-1) @ self.bin_values.float()  # a load in bf16 casts the buffer too
        loss = per_sample = None
        if value_targets is not None:
            target = self.target_distribution(value_targets)
            per_sample = -(target * logits.log_softmax(-1)).sum(-1)
            loss = per_sample.mean()
        return PI05ValueOutput(loss=loss, logits=logits, value=value, per_sample_loss=per_sample)

    def forward(self, input_ids: torch.LongTensor, pixel_values: torch.FloatTensor,
                attention_mask: torch.Tensor | None = None, pixel_attention_mask: torch.Tensor | None = None,
                value_targets: torch.Tensor | None = None, **kwargs) -> PI05ValueOutput:
        return self._returns(input_ids, pixel_values, attention_mask, pixel_attention_mask, value_targets)

    def target_distribution(self, targets: torch.Tensor) -> torch.Tensor:
        """Returns `[B]` -> target distributions `[B, num_bins]` (`config.value_targets`); distributions pass as they
        are."""
        if targets.ndim == 2:
            return targets.float()
        from hf_vla.models.value.returns import hl_gauss_targets, value_to_bin

        returns = targets.detach().double().cpu().numpy()
        if self.config.value_targets == "hl_gauss":
            dist = hl_gauss_targets(returns, self.config.num_bins, self.config.hl_gauss_sigma)
            return torch.from_numpy(dist).float().to(targets.device)
        bins = torch.from_numpy(value_to_bin(returns, self.config.num_bins)).to(targets.device)
        return nn.functional.one_hot(bins, self.config.num_bins).float()

    @torch.no_grad()
    def value(self, **inputs) -> torch.FloatTensor:
        """The expected normalised return `[B]` of processor outputs (the action keys are ignored)."""
        keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")
        return self(**{k: inputs[k] for k in keys if k in inputs}).value


class PI05ChunkCritic(PI05ValueModel):
    """Best-of-N's chunk critic `Q(observation, prompt, chunk)`: the value model with the action chunk as tokens
    between the prompt and the value query (one a step: a linear map of its normalised actions plus a learned
    position), so the query reads the chunk against what the cameras and the prompt say. Trained on the return that
    followed each frame's executed chunk (`hf_vla.train` with policy `pi05_chunk_critic`); `chunk_values` scores a
    policy's candidate chunks (`hf_vla.serving.selection`, selector `critic`).

    The chunk is a block after the prompt: the prompt does not attend to it. Padded chunk steps (`action_is_pad`, past
    an episode's end) are left out of attention; `chunk_values` zeroes a policy's padded action dims
    (`action_dim_mask`)."""

    config_class = PI05ChunkCriticConfig
    reads_chunk = True
    _keep_in_fp32_modules_strict = [*PI05ValueModel._keep_in_fp32_modules_strict, "chunk_in", "chunk_position"]

    def _build_inputs(self, config, width: int) -> None:
        self.chunk_in = nn.Linear(config.max_action_dim, width)
        self.chunk_position = nn.Embedding(config.chunk_size, width)

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is getattr(self, "chunk_position", None):
            nn.init.normal_(module.weight, std=0.02)

    def _chunk_tokens(self, actions, action_is_pad=None):
        if actions.shape[1:] != (self.config.chunk_size, self.config.max_action_dim):
            raise ValueError(f"actions: a chunk of shape [B, {self.config.chunk_size}, {self.config.max_action_dim}] "
                             f"(chunk_size, max_action_dim), got {list(actions.shape)}")
        actions = actions.float()
        tokens = self.chunk_in(actions) + self.chunk_position.weight.float()[None]
        valid = torch.ones(actions.shape[:2], dtype=torch.bool, device=actions.device) if action_is_pad is None \
            else ~action_is_pad.bool()
        return tokens, valid

    def forward(self, input_ids: torch.LongTensor, pixel_values: torch.FloatTensor, actions: torch.Tensor,
                attention_mask: torch.Tensor | None = None, pixel_attention_mask: torch.Tensor | None = None,
                action_is_pad: torch.Tensor | None = None, value_targets: torch.Tensor | None = None,
                **kwargs) -> PI05ValueOutput:
        """`actions`: the chunk `[B, chunk_size, max_action_dim]`, normalised as the policy's processor does (its
        padded action dims zero, as the processor pads them). In training with `config.negative_chunks`, that share
        of the rows reads another row's chunk against the worst return (`_negatives`)."""
        if self.training and value_targets is not None and self.config.negative_chunks > 0 and len(actions) > 1:
            actions, action_is_pad, value_targets = self._negatives(actions, action_is_pad, value_targets)
        suffix = self._chunk_tokens(actions, action_is_pad)
        return self._returns(input_ids, pixel_values, attention_mask, pixel_attention_mask, value_targets, suffix)

    def _negatives(self, actions, action_is_pad, value_targets):
        """Rows drawn with probability `negative_chunks` take the previous row's chunk (and its padding) and the target -1
        (a chunk that does not fit the observation is taken to fail)."""
        swap = torch.rand(len(actions), device=actions.device) < self.config.negative_chunks
        other = torch.roll(torch.arange(len(actions), device=actions.device), 1)
        actions = torch.where(swap[:, None, None], actions[other], actions)
        if action_is_pad is not None:
            action_is_pad = torch.where(swap[:, None], action_is_pad[other], action_is_pad)
        targets = self.target_distribution(value_targets)
        worst = self.target_distribution(torch.full((1,), -1.0, device=targets.device))
        return actions, action_is_pad, torch.where(swap[:, None], worst, targets)

    @torch.no_grad()
    def chunk_values(self, candidates: torch.Tensor, action_dim_mask: torch.Tensor | None = None,
                     **inputs) -> torch.FloatTensor:
        """The expected normalised return `[B, N]` of each of `candidates` `[B, N, chunk_size, max_action_dim]` for
        the observations of processor outputs `inputs`: the cameras and the prompt run once per observation (their
        key/value cache repeated for its candidates), then each candidate's chunk and the value query read it."""
        from transformers import DynamicCache

        from hf_vla.models.pi05.modeling_pi05 import repeat_cache

        batch_size, count = candidates.shape[:2]
        keys = ("input_ids", "pixel_values", "attention_mask", "pixel_attention_mask")
        prefix, prefix_valid = self._prefix(*(inputs.get(k) for k in keys))
        if action_dim_mask is not None:  # a policy's candidates carry values in its padded dims: zeroed
            candidates = candidates * action_dim_mask.to(candidates.dtype)[:, None, None, :]
        text_model = self.model.vlm.language_model
        always = lambda batch_idx, head_idx, q_idx, kv_idx: q_idx >= 0  # noqa: E731  (never the causal default)
        cache = DynamicCache()
        mask = create_bidirectional_mask(config=text_model.config, inputs_embeds=prefix, attention_mask=prefix_valid,
                                         and_mask_function=always)
        text_model(inputs_embeds=prefix, attention_mask=mask, position_ids=prefix_valid.long().cumsum(-1) - 1,
                   past_key_values=cache, use_cache=True)
        cache = repeat_cache(cache, count)
        chunk, chunk_valid = self._chunk_tokens(candidates.flatten(0, 1))
        query = self.value_query.weight.to(prefix.dtype).expand(len(chunk), 1, -1)
        suffix = torch.cat([chunk.to(prefix.dtype), query], dim=1)
        suffix_valid = torch.cat([chunk_valid, chunk_valid.new_ones(len(chunk), 1)], dim=1)
        prefix_valid = prefix_valid.repeat_interleave(count, dim=0)
        keys_valid = torch.cat([prefix_valid, suffix_valid], dim=1)
        mask = create_bidirectional_mask(config=text_model.config, inputs_embeds=suffix, attention_mask=keys_valid,
                                         encoder_hidden_states=suffix.new_empty(len(suffix), keys_valid.shape[1], 1),
                                         and_mask_function=always)
        positions = prefix_valid.long().sum(-1, keepdim=True) + suffix_valid.long().cumsum(-1) - 1
        hidden = text_model(inputs_embeds=suffix, attention_mask=mask, position_ids=positions, past_key_values=cache,
                            use_cache=True).last_hidden_state
        logits = self.value_readout(hidden[:, -1].float())
        return (logits.softmax(-1) @ self.bin_values.float()).reshape(batch_size, count)


__all__ = ["PI05ChunkCritic", "PI05ValueModel", "PI05ValueOutput"]
