"""lerobot's own pi0 / pi0.5 built at tiny dims, as a numerical reference for hf_vla (tests and benchmarks; needs
`lerobot[pi]`, the test extra).

lerobot's constructors hard-code the SigLIP So400m widths, the projector width (2048) and, in the joint attention,
8 heads; we patch the two config factories it calls (`get_gemma_config` and the PaliGemma wrapper) so the same
architecture is built at tiny dims. Heads stay 8 because lerobot reshapes with a literal 8.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from unittest import mock

import torch

VOCAB = 257152  # lerobot hard-codes PaliGemma's vocabulary
TEXT = dict(width=64, depth=2, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=8)
EXPERT = dict(width=32, depth=2, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=8)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, patch_size=8)
# one vision head (32 dims): a conversion cannot read the head count from the weights and assumes SigLIP's 64-dim heads
# (at least one) for a tower that is not So400m; the MEM oracles build 2 heads and convert with --vision_heads 2
IMAGE_SIZE = 32
CHUNK, MAX_STATE, MAX_ACTION = 5, 8, 6


@dataclass
class Dims:
    """One tiny architecture, built identically by lerobot and hf_vla."""

    text: dict = field(default_factory=lambda: dict(TEXT))
    expert: dict = field(default_factory=lambda: dict(EXPERT))
    vision: dict = field(default_factory=lambda: dict(VISION))
    image_size: int = IMAGE_SIZE
    chunk: int = CHUNK
    max_state: int = MAX_STATE
    max_action: int = MAX_ACTION


def _vlm_config(d: Dims):
    TEXT, VISION, IMAGE_SIZE = d.text, d.vision, d.image_size  # noqa: N806
    return {
        "model_type": "paligemma",
        "text_config": {
            "model_type": "gemma", "hidden_size": TEXT["width"], "num_hidden_layers": TEXT["depth"],
            "intermediate_size": TEXT["mlp_dim"], "num_attention_heads": TEXT["num_heads"],
            "num_key_value_heads": TEXT["num_kv_heads"], "head_dim": TEXT["head_dim"], "vocab_size": VOCAB,
            "hidden_act": "gelu_pytorch_tanh",
        },
        "vision_config": {
            "model_type": "siglip_vision_model", **VISION, "image_size": IMAGE_SIZE, "vision_use_head": False,
            "projection_dim": TEXT["width"], "projector_hidden_act": "gelu_fast",
        },
        "projection_dim": TEXT["width"],
        "image_token_id": VOCAB,
    }


def _dit_config(d: Dims):
    EXPERT = d.expert  # noqa: N806
    return {
        "model_type": "gemma", "hidden_size": EXPERT["width"], "num_hidden_layers": EXPERT["depth"],
        "intermediate_size": EXPERT["mlp_dim"], "num_attention_heads": EXPERT["num_heads"],
        "num_key_value_heads": EXPERT["num_kv_heads"], "head_dim": EXPERT["head_dim"], "vocab_size": VOCAB,
        "hidden_act": "gelu_pytorch_tanh",
    }


def hf_pi05_config(d: Dims | None = None):
    from hf_vla.models.pi05 import PI05Config

    d = d or Dims()
    return PI05Config(vlm_config=_vlm_config(d), dit_config=_dit_config(d), chunk_size=d.chunk,
                      max_state_dim=d.max_state, max_action_dim=d.max_action)


def hf_pi0_config(d: Dims | None = None):
    from transformers import PI0Config

    d = d or Dims()
    return PI0Config(vlm_config=_vlm_config(d), dit_config=_dit_config(d), chunk_size=d.chunk,
                     max_state_dim=d.max_state, max_action_dim=d.max_action)


@contextlib.contextmanager
def _tiny_lerobot(module, d: Dims):
    from lerobot.policies.pi05.modeling_pi05 import GemmaConfig as LeGemmaConfig

    def tiny_variant(variant):
        dims = d.text if variant == "gemma_2b" else d.expert
        return LeGemmaConfig(dims["width"], dims["depth"], dims["mlp_dim"], dims["num_heads"], dims["num_kv_heads"],
                             dims["head_dim"])

    original = module.PaliGemmaForConditionalGenerationWithPiGemma

    def tiny_paligemma(config):
        for key, value in d.vision.items():
            setattr(config.vision_config, key, value)
        config.vision_config.projection_dim = d.text["width"]
        return original(config=config)

    with (
        mock.patch.object(module, "get_gemma_config", tiny_variant),
        mock.patch.object(module, "PaliGemmaForConditionalGenerationWithPiGemma", tiny_paligemma),
    ):
        yield


def _randomize(model: torch.nn.Module, seed: int):
    """Random weights everywhere (the zero-initialised adaRMS gates would otherwise hide the expert)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _build_lerobot(policy: str, seed: int, d: Dims | None):
    import importlib

    module = importlib.import_module(f"lerobot.policies.{policy}.modeling_{policy}")
    prefix = policy.upper()
    config_class = getattr(importlib.import_module(f"lerobot.policies.{policy}.configuration_{policy}"), f"{prefix}Config")
    d = d or Dims()
    config = config_class(chunk_size=d.chunk, n_action_steps=d.chunk, max_state_dim=d.max_state,
                          max_action_dim=d.max_action, image_resolution=(d.image_size, d.image_size), dtype="float32",
                          device="cpu")
    with _tiny_lerobot(module, d):
        model = getattr(module, f"{prefix}Pytorch")(config)
    _randomize(model, seed)
    return model.eval()


def build_lerobot_pi05(seed: int = 0, d: Dims | None = None):
    """lerobot's PI05Pytorch at tiny dims, random weights."""
    return _build_lerobot("pi05", seed, d)


def build_lerobot_pi0(seed: int = 0, d: Dims | None = None):
    """lerobot's PI0Pytorch at tiny dims, random weights."""
    return _build_lerobot("pi0", seed, d)


def sample_inputs(batch_size: int = 2, num_cameras: int = 2, seq_len: int = 7, seed: int = 1, d: Dims | None = None):
    """Identical raw inputs for both implementations: images in [-1, 1], right-padded tokens, a missing camera."""
    d = d or Dims()
    CHUNK, MAX_ACTION, MAX_STATE = d.chunk, d.max_action, d.max_state  # noqa: N806
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(batch_size, num_cameras, 3, d.image_size, d.image_size, generator=generator) * 2 - 1
    camera_mask = torch.ones(batch_size, num_cameras, dtype=torch.bool)
    camera_mask[-1, -1] = False
    tokens = torch.randint(2, 1000, (batch_size, seq_len), generator=generator)
    token_mask = torch.ones(batch_size, seq_len, dtype=torch.bool)
    token_mask[-1, seq_len - 3 :] = False
    tokens[~token_mask] = 0
    actions = torch.randn(batch_size, CHUNK, MAX_ACTION, generator=generator)
    noise = torch.randn(batch_size, CHUNK, MAX_ACTION, generator=generator)
    state = torch.randn(batch_size, MAX_STATE, generator=generator)
    time = torch.rand(batch_size, generator=generator) * 0.9 + 0.05
    return dict(images=images, camera_mask=camera_mask, tokens=tokens, token_mask=token_mask, actions=actions,
                noise=noise, state=state, time=time)
