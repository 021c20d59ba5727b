"""Run under lerobot's main branch (`../shared/oracles/lerobot-7427f31/src` first on PYTHONPATH): a tiny pi0.5 with
MEM's visual and proprioceptive memory and two cameras (declared in non-alphabetical order), saved by lerobot's own
`save_pretrained` with its pre/post-processors, run as lerobot-eval runs it: `select_action` at every control step
through the processors, a chunk every `n_action_steps` steps, lerobot's own memory queue. Its noise comes from a
generator seeded with `NOISE_SEED`, drawn once per chunk as hf_vla's runner draws it, so a runner reset with that seed
samples the same noise. `test_memory_loops.py` runs hf_vla's loops over the same observations and compares the actions.

python tests/mem_loop_oracle.py OUT_DIR TOKENIZER_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

# slot order (lerobot's input_features order) is not alphabetical: the converted checkpoint must keep it
CAMERAS = ("observation.images.wrist", "observation.images.base")
STATE_DIM, ACTION_DIM = 3, 2
FRAMES, STRIDE, EVERY = 4, 3, 2
CHUNK, N_ACTION_STEPS = 8, 5
STEPS = 42  # chunks at steps 0, 5, ..., 40; the past fills (horizon 9) and slides
NOISE_SEED = 7
TASK = "pick the cube"
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, patch_size=8)


def main(out: Path, tokenizer_dir: Path) -> None:
    import lerobot
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from mem_oracle import saved_policy  # built, randomised and saved as that oracle's (the same state/action dims)

    from hf_vla.models.reference import Dims

    assert "lerobot-7427f31" in lerobot.__file__, lerobot.__file__  # the oracle, not the installed release
    d = Dims(vision=dict(VISION), chunk=CHUNK)
    size = d.image_size
    features = {camera: PolicyFeature(FeatureType.VISUAL, (3, size, size)) for camera in CAMERAS}
    config = PI05Config(chunk_size=CHUNK, n_action_steps=N_ACTION_STEPS, max_state_dim=d.max_state,
                        max_action_dim=d.max_action, image_resolution=(size, size), dtype="float32", device="cpu",
                        tokenizer_max_length=48, use_visual_memory=True, use_proprioceptive_memory=True,
                        memory_frames=FRAMES, memory_stride=STRIDE, memory_temporal_attention_every=EVERY,
                        input_features={**features,
                                        "observation.state": PolicyFeature(FeatureType.STATE, (STATE_DIM,))},
                        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))})
    policy, pre, post = saved_policy(config, d, out / "lerobot", tokenizer_dir, 13)

    rng = np.random.default_rng(17)
    images = rng.integers(0, 256, (STEPS, len(CAMERAS), size, size, 3), dtype=np.uint8)
    states = rng.uniform(-1.5, 1.5, (STEPS, STATE_DIM)).astype(np.float32)
    generator = torch.Generator().manual_seed(NOISE_SEED)
    policy.model.sample_noise = lambda shape, device: torch.randn(shape, generator=generator).to(device)
    policy.reset()
    executed, pasts = [], []
    original = policy._stack_inference_memory

    def stack(batch):  # what lerobot feeds as the past at each step: the normalised states and their padding
        result = original(batch)
        pasts.append((result["observation.state"][0].numpy().copy(),
                      result["observation.state_is_pad"][0].numpy().copy()))
        return result

    policy._stack_inference_memory = stack
    for step in range(STEPS):
        observation = {camera: torch.from_numpy(images[step, i]).permute(2, 0, 1).float()[None] / 255.0
                       for i, camera in enumerate(CAMERAS)}
        observation.update({"observation.state": torch.from_numpy(states[step])[None], "task": [TASK]})
        with torch.no_grad():
            executed.append(post(policy.select_action(pre(observation))).numpy()[0])
    # lerobot against itself: the same episode in a batch of two rows (the same noise in each), whose float32
    # arithmetic runs in another order: the floor of any comparison in float32
    policy._stack_inference_memory = original
    generator.manual_seed(NOISE_SEED)
    policy.model.sample_noise = lambda shape, device: torch.randn((1, *shape[1:]), generator=generator).expand(
        shape).contiguous().to(device)
    policy.reset()
    batched = []
    for step in range(STEPS):
        observation = {camera: torch.from_numpy(images[step, i]).permute(2, 0, 1).float()[None].expand(2, -1, -1, -1)
                       / 255.0 for i, camera in enumerate(CAMERAS)}
        observation.update({"observation.state": torch.from_numpy(states[step])[None].expand(2, -1),
                            "task": [TASK, TASK]})
        with torch.no_grad():
            batched.append(post(policy.select_action(pre(observation))).numpy())
    np.savez(out / "oracle.npz", images=images, states=states, executed=np.stack(executed),
             executed_batch_of_two=np.stack(batched), past_states=np.stack([p[0] for p in pasts]),
             past_is_pad=np.stack([p[1] for p in pasts]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
