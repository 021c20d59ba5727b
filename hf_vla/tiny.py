"""Tiny, offline building blocks: a small real tokenizer and tiny pi0/pi0.5 configs.

Used by the test suite, the built-in demo and the notebooks, where no Hub download is possible. Real runs use
`google/paligemma-3b-pt-224`'s tokenizer and the published dims (the configs' defaults).
"""

from __future__ import annotations

import os
from pathlib import Path

TINY_VOCAB_SIZE = 1024
# The tiny tokenizer with PaliGemma's location tokens (`build_tiny_tokenizer(locations=True)`, config "tiny_loc"):
# its 475 text tokens, 1024 reserved ids (`<unused0000>`..: where FAST ids land, just below `<loc0000>`, as with
# PaliGemma's vocabulary), then `<loc0000>`..`<loc1023>`; a model vocabulary of 2560 holds them.
TINY_LOC_VOCAB_SIZE = 2560
LOCATION_TOKENS = 1024


def _corpus() -> list[str]:
    colors = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
    verbs = ["move to", "pick up", "push", "reach", "place", "open", "close", "grasp"]
    objects = ["target", "cube", "block", "drawer", "cup", "door", "ball", "bowl"]
    lines = [f"Task: {v} the {c} {o}, State: " for v in verbs for c in colors for o in objects]
    lines += [" ".join(str(i) for i in range(start, start + 16)) + ";\nAction: " for start in range(0, 256, 16)]
    lines += ["Robot arm task with gripper, joint positions and camera images."] * 4
    return lines


def build_tiny_tokenizer(save_dir: str | os.PathLike | None = None, locations: bool = False):
    """Train a small SentencePiece-style BPE tokenizer offline with `tokenizers` and wrap it for transformers.

    Every state bin 0..255 is a single token, like in the PaliGemma tokenizer. With `locations`, 1024 reserved ids and
    PaliGemma's `<loc0000>`..`<loc1023>` follow the text tokens (`TINY_LOC_VOCAB_SIZE`): location targets are then one
    token per coordinate and FAST ids go below `<loc0000>` as with the real vocabulary. Returns a
    `PreTrainedTokenizerFast`; saved to `save_dir` when given (then loadable with `AutoTokenizer`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    numbers = [f"▁{i}" for i in range(256)]
    # show_progress=False: its bars print a blank line each on a log that is not a terminal
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE, special_tokens=specials, initial_alphabet=list("0123456789"),
                                  show_progress=False)
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens(numbers)
    if locations:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(f"<unused{i:04d}>", special=False) for i in range(LOCATION_TOKENS)])
        tokenizer.add_tokens([AddedToken(f"<loc{i:04d}>", special=False) for i in range(LOCATION_TOKENS)])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )
    limit = TINY_LOC_VOCAB_SIZE if locations else TINY_VOCAB_SIZE
    if len(wrapped) > limit:
        raise RuntimeError(f"tiny tokenizer has {len(wrapped)} tokens > {limit}")
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        wrapped.save_pretrained(save_dir)
    return wrapped


def tiny_vlm_config(
    width: int = 64, depth: int = 2, heads: int = 4, head_dim: int = 16, image_size: int = 32, patch: int = 8
) -> dict:
    return {
        "model_type": "paligemma",
        "text_config": tiny_dit_config(width, depth, heads, head_dim),  # the same Gemma shape as the expert's
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": image_size,
            "patch_size": patch,
            "vision_use_head": False,
            "projection_dim": width,
        },
        "projection_dim": width,
        "image_token_id": TINY_VOCAB_SIZE - 1,
    }


def tiny_dit_config(width: int = 32, depth: int = 2, heads: int = 4, head_dim: int = 16) -> dict:
    return {
        "model_type": "gemma",
        "hidden_size": width,
        "num_hidden_layers": depth,
        "intermediate_size": 2 * width,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_act": "gelu_pytorch_tanh",
    }


def _tiny_policy_kwargs() -> dict:
    return {"vlm_config": tiny_vlm_config(), "dit_config": tiny_dit_config(), "chunk_size": 5, "max_state_dim": 8,
            "max_action_dim": 6}


def tiny_pi05_config(**overrides):
    """A pi0.5 config of ~150k parameters with the real architecture (two cameras' worth of 16 image tokens)."""
    from hf_vla.models.pi05 import PI05Config

    return PI05Config(**(_tiny_policy_kwargs() | {"tokenizer_max_length": 48} | overrides))


def tiny_pi0_config(**overrides):
    """transformers' `PI0Config` at the same tiny dims."""
    from transformers import PI0Config

    return PI0Config(**(_tiny_policy_kwargs() | overrides))
