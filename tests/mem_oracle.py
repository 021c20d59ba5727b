"""Run under lerobot's main branch (`../shared/oracles/lerobot-7427f31/src` first on PYTHONPATH): a tiny pi0.5 with
MEM's visual and proprioceptive memory, written by lerobot's own `save_pretrained` with its pre/post-processors, and
what lerobot computes with it: one training batch's element-wise flow loss (fixed noise and time) and the action chunks
`predict_action_chunk` returns in robot units over one episode (its own memory queue). `test_memory.py` converts the
checkpoint and compares hf_vla's with these.

python tests/mem_oracle.py OUT_DIR TOKENIZER_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

CAMERA, STATE_DIM, ACTION_DIM = "observation.images.cam", 3, 2
FRAMES, STRIDE, EVERY = 3, 2, 2
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, patch_size=8)
STEPS = 7  # episode length of the inference comparison: the memory fills (horizon 4) and then slides


def stats(rng):
    out = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        low, high = rng.uniform(-2, -0.5, dim), rng.uniform(0.5, 2, dim)
        out[key] = {"min": low - 0.5, "max": high + 0.5, "mean": (low + high) / 2 + 0.1, "std": (high - low) / 3,
                    "q01": low, "q10": low + 0.2, "q90": high - 0.2, "q99": high, "count": np.array([1000])}
        out[key] = {k: torch.tensor(v, dtype=torch.float32) for k, v in out[key].items()}
    return out


def saved_policy(config, d, out: Path, tokenizer_dir: Path, seed: int):
    """lerobot's tiny PI05Policy of `config` at dims `d`, random weights from `seed`, its pre/post-processors with the
    tiny tokenizer and `stats`, all saved to `out` by lerobot's own `save_pretrained`. -> (policy, pre, post)"""
    import lerobot.policies.pi05.modeling_pi05 as module
    import lerobot.policies.pi05.processor_pi05 as processor_module
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
    from lerobot.processor import TokenizerProcessorStep
    from transformers import AutoTokenizer

    from hf_vla.models.reference import _randomize, _tiny_lerobot

    with _tiny_lerobot(module, d):
        policy = module.PI05Policy(config)
    _randomize(policy.model, seed)
    policy.eval()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def tiny(tokenizer_name=None, **kwargs):  # the tiny tokenizer instead of PaliGemma's (no download here)
        return TokenizerProcessorStep(tokenizer=tokenizer, **kwargs)

    with mock.patch.object(processor_module, "TokenizerProcessorStep", tiny):
        pre, post = make_pi05_pre_post_processors(config, dataset_stats=stats(np.random.default_rng(seed)))
    for part in (policy, pre, post):
        part.save_pretrained(out)
    return policy, pre, post


def main(out: Path, tokenizer_dir: Path) -> None:
    import lerobot
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    from hf_vla.models.reference import Dims

    assert "lerobot-7427f31" in lerobot.__file__, lerobot.__file__  # the oracle, not the installed release
    d = Dims(vision=dict(VISION))
    config = PI05Config(chunk_size=d.chunk, n_action_steps=d.chunk, max_state_dim=d.max_state,
                        max_action_dim=d.max_action, image_resolution=(d.image_size, d.image_size), dtype="float32",
                        device="cpu", tokenizer_max_length=48, use_visual_memory=True, use_proprioceptive_memory=True,
                        memory_frames=FRAMES, memory_stride=STRIDE, memory_temporal_attention_every=EVERY,
                        input_features={CAMERA: PolicyFeature(FeatureType.VISUAL, (3, d.image_size, d.image_size)),
                                        "observation.state": PolicyFeature(FeatureType.STATE, (STATE_DIM,))},
                        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))})
    policy, pre, post = saved_policy(config, d, out / "lerobot", tokenizer_dir, 11)

    rng = np.random.default_rng(5)
    results = {}
    # one training batch: 2 samples, the first at its episode's start (its two past observations padded)
    images = rng.integers(0, 256, (2, FRAMES, 3, d.image_size, d.image_size)).astype(np.float32) / 255.0
    states = rng.uniform(-1.5, 1.5, (2, FRAMES, STATE_DIM)).astype(np.float32)
    is_pad = np.array([[True, True, False], [False, False, False]])
    actions = rng.uniform(-1.5, 1.5, (2, d.chunk, ACTION_DIM)).astype(np.float32)
    noise = rng.standard_normal((2, d.chunk, d.max_action)).astype(np.float32)
    time = np.array([0.3, 0.8], np.float32)
    batch = {CAMERA: torch.from_numpy(images), f"{CAMERA}_is_pad": torch.from_numpy(is_pad),
             "observation.state": torch.from_numpy(states), "observation.state_is_pad": torch.from_numpy(is_pad),
             "action": torch.from_numpy(actions), "task": ["pick the cube", "open the drawer"]}
    processed = pre(batch)
    with torch.no_grad():
        images_in, image_masks = policy._preprocess_images(processed)
        memory_states, state_masks = policy._prepare_memory_states(processed)
        losses = policy.model.forward(images_in, image_masks, processed["observation.language.tokens"],
                                      processed["observation.language.attention_mask"],
                                      policy.prepare_action(processed), torch.from_numpy(noise), torch.from_numpy(time),
                                      states=memory_states, state_masks=state_masks)
    results.update(train_images=images, train_states=states, train_is_pad=is_pad, train_actions=actions,
                   train_noise=noise, train_time=time, train_losses=losses.numpy(),
                   train_tokens=processed["observation.language.tokens"].numpy())

    # one episode through predict_action_chunk: lerobot keeps the past observations itself
    episode_images = rng.integers(0, 256, (STEPS, d.image_size, d.image_size, 3), dtype=np.uint8)
    episode_states = rng.uniform(-1.5, 1.5, (STEPS, STATE_DIM)).astype(np.float32)
    episode_noise = rng.standard_normal((STEPS, 1, d.chunk, d.max_action)).astype(np.float32)
    policy.reset()
    chunks = []
    for step in range(STEPS):
        observation = {CAMERA: torch.from_numpy(episode_images[step]).permute(2, 0, 1).float()[None] / 255.0,
                       "observation.state": torch.from_numpy(episode_states[step])[None], "task": ["pick the cube"]}
        with torch.no_grad():
            chunk = policy.predict_action_chunk(pre(observation), noise=torch.from_numpy(episode_noise[step]))
        chunks.append(post(chunk).numpy()[0])
    results.update(episode_images=episode_images, episode_states=episode_states, episode_noise=episode_noise,
                   episode_chunks=np.stack(chunks))
    np.savez(out / "oracle.npz", **results)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
