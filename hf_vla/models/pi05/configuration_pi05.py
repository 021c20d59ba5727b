"""pi0.5 configuration, written like transformers' `PI0Config` and with the same argument names."""

import math

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto import CONFIG_MAPPING

# Image / language / expert defaults reproduce the published pi0.5 (PaliGemma 3B + Gemma 300M expert).
PALIGEMMA_VOCAB_SIZE = 257152


SUBTASK_LAYOUTS = (None, "joint", "factorised")
# MEM's fields, lerobot's names: the training arguments, the lerobot conversion and its export name them all
MEMORY_FIELDS = ("use_visual_memory", "use_proprioceptive_memory", "memory_frames", "memory_stride",
                 "memory_temporal_attention_every")


# RECAP's indicator form when a run trains with one and the config names none: the decoy test chose it
# (docs/recap.md, docs/measurements.md)
ADVANTAGE_INDICATOR_DEFAULT = "embedding"

# hf_vla's pi0.5 has a model type of its own: transformers (5.25+) ships its own pi0.5 as "pi05", with other weight
# names, and a checkpoint of either read as the other would load with random tensors (docs/transformers.md).
MODEL_TYPE = "hf_vla_pi05"
# what hf_vla wrote before: read as MODEL_TYPE where the file has fields only hf_vla's config writes
LEGACY_MODEL_TYPE = "pi05"
_OWN_FIELDS = ("discrete_state_input", "state_bins", "tokenizer_max_length")


def upgrade_config_dict(config_dict: dict, where: str = "config.json") -> dict:
    """`config_dict` as hf_vla's pi0.5 reads it: a checkpoint hf_vla wrote as "pi05" (before its own model type) gets
    `MODEL_TYPE`; transformers' own pi0.5 (model type "pi05" without hf_vla's fields) is refused in one line, since
    its weights have other names (it would load with random tensors)."""
    if not isinstance(config_dict, dict) or config_dict.get("model_type") != LEGACY_MODEL_TYPE:
        return config_dict
    if not any(name in config_dict for name in _OWN_FIELDS):
        raise ValueError(f"{where}: transformers' own pi0.5 (model_type 'pi05' without hf_vla's fields), whose "
                         "weights have other names: convert it first (python -m hf_vla.convert --input DIR --output "
                         "OUT, with its processor saved beside it), or run it with transformers' "
                         "PI05ForConditionalGeneration (transformers >= 5.25)")
    return {**config_dict, "model_type": MODEL_TYPE}


@strict
class PI05Config(PreTrainedConfig):
    r"""
    Configuration for [`PI05ForConditionalGeneration`].

    vlm_config (`dict` or `PaliGemmaConfig`, *optional*):
        The vision-language backbone (PaliGemma: SigLIP + Gemma 2B by default).
    dit_config (`dict` or `GemmaConfig`, *optional*):
        The action expert (Gemma 300M by default). Every norm of it becomes an adaRMSNorm conditioned on the
        flow-matching time. It must have the same depth, head_dim and number of key/value heads as the VLM's
        language model, because both towers attend over each other's keys/values layer by layer.
    chunk_size (`int`, defaults to 50): action steps predicted per chunk.
    max_state_dim (`int`, defaults to 32): state vectors are zero-padded to this size (then discretized into the prompt).
    max_action_dim (`int`, defaults to 32): action vectors are zero-padded to this size.
    num_inference_steps (`int`, defaults to 10): Euler steps of `sample_actions`.
    time_sampling_beta_alpha / time_sampling_beta_beta / time_sampling_scale / time_sampling_offset:
        t ~ Beta(alpha, beta) * scale + offset during training.
    min_period / max_period (`float`): periods of the sin/cos time embedding.
    state_bins (`int`, defaults to 256): bins of the state discretization in the prompt.
    discrete_state_input (`bool`, defaults to `True`): the discretized state in the prompt (pi0.5's
        `Task: ..., State: ...;\nAction: `). False: the prompt is the task alone, then a newline token, and the
        policy does not read the state (openpi's `discrete_state_input=False`, its `pi05_libero` recipe).
    tokenizer_max_length (`int`, defaults to 200): prompt length the processor pads/truncates to.
    rtc_max_delay (`int`, defaults to 0): training-time real-time chunking ("Training-Time Action Conditioning for
        Efficient Real-Time Chunking", Black, Ren, Equi, Levine 2025). When > 0, the trainer gives every training
        sample a committed prefix of d ~ Uniform{0..rtc_max_delay} actions: clean in x_t, at time 0, left out of the
        loss. The model then learns to continue actions the robot executes while it infers; `sample_actions` holds
        such a prefix fixed instead of guiding towards it (`RTCConfig.method`). 0 trains the published objective.
    rtc_prefix_noise (`float`, defaults to 0.0): with `rtc_max_delay`, the std of one Gaussian offset per training
        sample (normalised action units) added to its committed prefix. At inference the prefix is the policy's own
        earlier output, errors included, not a demonstration; a clean prefix in training teaches the model to
        continue it blindly. 0 is the paper's objective.
    value_head (`bool`, defaults to `False`): a critic for PPO fine-tuning (`hf_vla.rl`, `algorithm="ppo"`): a small
        MLP on the mean of the prefix's hidden states entering the VLM's last layer, predicting the return. Sampling
        never runs it; a loaded checkpoint keeps it frozen until the RL trainer trains it.
    token_loss (`bool`, defaults to `False`): pi0.5's token objective (docs/cotraining.md). Training batches carry
        `labels`, target tokens after the prompt (FAST action tokens, then text), which the backbone predicts with
        causal attention over the prefix and over earlier targets; the expert never attends to them. The VLM's last
        layer and final norm then run and train (flow-only, they are frozen: nothing reads them). Inference is
        unchanged: no target is generated.
    knowledge_insulation (`bool`, defaults to `True`): with target tokens, the expert reads stop-gradient keys/values
        of the backbone (Driess et al. 2025, "Knowledge Insulating VLA models"): the flow loss trains the expert only
        and the backbone learns from the token loss. Without target tokens it has no effect.
    token_loss_chunk (`int`, defaults to 1024): target tokens per piece of the LM head and its cross-entropy: one
        piece's logits (`[chunk, vocab]`) exist at a time and are recomputed in the backward pass, so PaliGemma's
        257,152-entry vocabulary costs chunk x vocab x 4 bytes (1 GiB at 1024) instead of every target's logits.
        0: all at once.
    subtask_layout (`str`, defaults to `None`): pi0.5's high-level inference (docs/subtasks.md). `"joint"` (the paper's
        single sequence): the prompt ends in `Subtask: `, the subtask's tokens and EOS follow it, attended causally;
        the backbone predicts them (cross-entropy) and the expert attends to them, so one forward trains both and
        `generate_subtask` decodes them at inference. `"factorised"`: task -> subtask samples beside subtask ->
        action samples (the subtask in the task's place), as lerobot's `pi052` blend recipes. The VLM's last layer
        and final norm run and train (they predict the subtask). None: no subtask.
    subtask_max_tokens (`int`, defaults to 32): the most tokens `generate_subtask` decodes (EOS included).
    subtask_eos_token_id (`int`, defaults to `None`): the tokenizer's EOS id, which ends a subtask (set by training).
    use_visual_memory (`bool`, defaults to `False`): MEM's short-horizon visual memory (arXiv 2603.03596, lerobot's
        field of the same name): each camera input holds `memory_frames` frames, `memory_stride` dataset frames apart
        and ending with the current one; every `memory_temporal_attention_every`-th SigLIP layer attends causally
        across them as well (the same projections, no new parameter), and the past frames' tokens are dropped after
        the last such layer, so the backbone sees as many image tokens as without memory (docs/memory.md).
    use_proprioceptive_memory (`bool`, defaults to `False`): MEM's proprioceptive memory: the `memory_frames` states
        (past and current) enter the prefix after the images as one linear token each (`proprio_history_proj`), and
        the prompt no longer holds the discretized state (`Task: {task};\nAction: `, as lerobot).
    memory_frames (`int`, defaults to 6), memory_stride (`int`, defaults to 30, in dataset frames: one second at 30
        fps), memory_temporal_attention_every (`int`, defaults to 4): MEM's settings, lerobot's names and defaults.
    advantage_indicator (`str`, *optional*): how RECAP's advantage indicator reaches an advantage-conditioned policy
        (docs/recap.md): `"embedding"`, a learned embedding of `advantage_ids` (none / negative / positive,
        zero-initialised) added to the expert's adaRMS time conditioning, which the expert reads without the tokenizer
        (guidance then shares the prompt); `"text"`, a prompt segment of its own (the processor places it). None (the
        default): a policy trained without the indicator; training with it chooses `ADVANTAGE_INDICATOR_DEFAULT`, the
        form the decoy test chose (docs/measurements.md).
    image_size (`int`, defaults to 224): side of the square model image (taken from the vision config).
    """

    model_type = MODEL_TYPE
    sub_configs = {"vlm_config": AutoConfig, "dit_config": AutoConfig}

    vlm_config: dict | PreTrainedConfig | None = None
    dit_config: dict | PreTrainedConfig | None = None
    chunk_size: int = 50
    max_state_dim: int = 32
    max_action_dim: int = 32
    num_inference_steps: int = 10
    time_sampling_beta_alpha: float = 1.5
    time_sampling_beta_beta: float = 1.0
    time_sampling_scale: float = 0.999
    time_sampling_offset: float = 0.001
    min_period: float = 4e-3
    max_period: float = 4.0
    state_bins: int = 256
    discrete_state_input: bool = True
    tokenizer_max_length: int = 200
    rtc_max_delay: int = 0
    rtc_prefix_noise: float = 0.0
    value_head: bool = False
    token_loss: bool = False
    knowledge_insulation: bool = True
    token_loss_chunk: int = 1024
    subtask_layout: str | None = None
    subtask_max_tokens: int = 32
    subtask_eos_token_id: int | None = None
    use_visual_memory: bool = False
    use_proprioceptive_memory: bool = False
    memory_frames: int = 6
    memory_stride: int = 30
    memory_temporal_attention_every: int = 4
    advantage_indicator: str | None = None

    def __post_init__(self, **kwargs):
        if isinstance(self.vlm_config, dict):
            self.vlm_config = CONFIG_MAPPING[self.vlm_config.get("model_type", "paligemma")](**self.vlm_config)
        elif self.vlm_config is None:
            self.vlm_config = CONFIG_MAPPING["paligemma"](
                text_config={
                    "model_type": "gemma",
                    "hidden_size": 2048,
                    "num_hidden_layers": 18,
                    "intermediate_size": 16384,
                    "num_attention_heads": 8,
                    "num_key_value_heads": 1,
                    "head_dim": 256,
                    "hidden_act": "gelu_pytorch_tanh",
                    "vocab_size": PALIGEMMA_VOCAB_SIZE,
                },
                vision_config={
                    "model_type": "siglip_vision_model",
                    "intermediate_size": 4304,
                    "hidden_size": 1152,
                    "patch_size": 14,
                    "image_size": 224,
                    "num_hidden_layers": 27,
                    "num_attention_heads": 16,
                    "vision_use_head": False,
                    "projection_dim": 2048,
                },
                projection_dim=2048,
                image_token_id=PALIGEMMA_VOCAB_SIZE,
            )
        if isinstance(self.dit_config, dict):
            self.dit_config = CONFIG_MAPPING[self.dit_config.get("model_type", "gemma")](**self.dit_config)
        elif self.dit_config is None:
            self.dit_config = CONFIG_MAPPING["gemma"](
                hidden_size=1024,
                num_hidden_layers=18,
                intermediate_size=4096,
                num_attention_heads=8,
                num_key_value_heads=1,
                head_dim=256,
                hidden_act="gelu_pytorch_tanh",
                vocab_size=self.vlm_config.text_config.vocab_size,
            )
        # Both towers are bidirectional; the block structure is expressed by which keys each call sees.
        self.dit_config.is_causal = False
        self.dit_config.use_bidirectional_attention = True
        self.vlm_config.text_config.use_bidirectional_attention = True
        super().__post_init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        return upgrade_config_dict(config_dict, f"{pretrained_model_name_or_path}/config.json"), kwargs

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        return super().from_dict(upgrade_config_dict(config_dict), **kwargs)

    def to_dict(self):
        output = super().to_dict()
        auto_map = output.get("auto_map")
        if isinstance(auto_map, dict) and str(auto_map.get("AutoModel", "")).endswith(".PI05ForConditionalGeneration"):
            # transformers maps the policy class to AutoModelForImageTextToText (as its pi0): without this entry, a
            # remote-code config named PI05Config would resolve by name to transformers' own pi0.5 there
            output["auto_map"] = {**auto_map, "AutoModelForImageTextToText": auto_map["AutoModel"]}
        return output

    @property
    def image_size(self) -> int:
        return self.vlm_config.vision_config.image_size

    @property
    def uses_memory(self) -> bool:
        """Whether the policy reads past observations (MEM: visual or proprioceptive memory)."""
        return bool(self.use_visual_memory or self.use_proprioceptive_memory)

    @property
    def memory_offsets(self) -> list[int]:
        """The frames each sample reads, relative to the current one, oldest first (lerobot's delta indices)."""
        horizon = (self.memory_frames - 1) * self.memory_stride
        return list(range(-horizon, 1, self.memory_stride))

    @property
    def num_image_tokens(self) -> int:
        vision = self.vlm_config.vision_config
        return (vision.image_size // vision.patch_size) ** 2

    def validate_architecture(self):
        """Part of `@strict` validation: the two towers must be able to share attention layer by layer."""
        text, expert = self.vlm_config.text_config, self.dit_config
        for name in ("num_hidden_layers", "head_dim", "num_key_value_heads"):
            if getattr(text, name) != getattr(expert, name):
                raise ValueError(
                    f"PI05Config: vlm_config.text_config.{name}={getattr(text, name)} != dit_config.{name}="
                    f"{getattr(expert, name)}; the expert attends to the VLM's keys/values per layer, so they must match."
                )
        if not 0 <= self.rtc_max_delay < self.chunk_size:
            raise ValueError(f"PI05Config: rtc_max_delay={self.rtc_max_delay} must be in [0, chunk_size={self.chunk_size}) "
                             "(a committed prefix shorter than the chunk)")
        if not (math.isfinite(self.rtc_prefix_noise) and self.rtc_prefix_noise >= 0):
            raise ValueError(f"PI05Config: rtc_prefix_noise={self.rtc_prefix_noise} must be a finite number >= 0")
        if self.subtask_layout not in SUBTASK_LAYOUTS:
            raise ValueError(f"PI05Config: subtask_layout={self.subtask_layout!r} must be one of {SUBTASK_LAYOUTS}")
        if self.advantage_indicator not in (None, "text", "embedding"):
            raise ValueError(f"PI05Config: advantage_indicator={self.advantage_indicator!r} must be 'text', "
                             "'embedding' or null")
        if self.subtask_max_tokens < 1:
            raise ValueError(f"PI05Config: subtask_max_tokens={self.subtask_max_tokens} must be positive")
        for name in ("memory_frames", "memory_stride", "memory_temporal_attention_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"PI05Config: {name}={getattr(self, name)} must be at least 1")
        vision_layers = self.vlm_config.vision_config.num_hidden_layers
        if self.use_visual_memory and self.memory_temporal_attention_every > vision_layers:
            raise ValueError(f"PI05Config: memory_temporal_attention_every={self.memory_temporal_attention_every} "
                             f"exceeds the vision tower's {vision_layers} layers: no layer would attend across frames")
        if self.use_visual_memory and self.vlm_config.vision_config.hidden_size % 2:
            raise ValueError(f"PI05Config: vision hidden_size={self.vlm_config.vision_config.hidden_size} must be even "
                             "for visual memory (sin/cos temporal embedding)")
        if expert.hidden_size % 2:
            raise ValueError(f"PI05Config: dit_config.hidden_size={expert.hidden_size} must be even (sin/cos time embedding).")


# save_pretrained writes an auto_map (and copies this file), so a checkpoint loads with trust_remote_code=True where
# hf_vla is not installed; set where the class is defined, so every path that saves one writes it
PI05Config.register_for_auto_class()

class LegacyPI05Config(PI05Config):
    """Registered with `AutoConfig` as "pi05" only where transformers has no pi0.5 of its own: a checkpoint hf_vla
    wrote before its own model type loads through the Auto classes as a `PI05Config` (never an instance of this)."""

    model_type = LEGACY_MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        return PI05Config.from_dict(config_dict, **kwargs)


__all__ = ["ADVANTAGE_INDICATOR_DEFAULT", "LEGACY_MODEL_TYPE", "MEMORY_FIELDS", "MODEL_TYPE", "LegacyPI05Config",
           "PI05Config", "upgrade_config_dict"]
