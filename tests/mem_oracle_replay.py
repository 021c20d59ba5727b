"""Run under lerobot's main branch (as `mem_oracle.py`): load an export of a MEM checkpoint with lerobot's own
`PI05Policy.from_pretrained` and its saved processors, and replay `mem_oracle.py`'s episode through
`predict_action_chunk` (lerobot's memory queue); the chunks in robot units go to OUT.

python tests/mem_oracle_replay.py EXPORT_DIR EPISODE_NPZ OUT_NPY TOKENIZER_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch


def main(export: Path, episode: Path, out: Path, tokenizer_dir: Path) -> None:
    import lerobot
    import lerobot.policies.pi05.modeling_pi05 as module
    from lerobot.policies.factory import make_pre_post_processors
    from mem_oracle import CAMERA, VISION
    from test_lerobot_export import _PaliGemmaTokenizer
    from transformers import AutoTokenizer

    from hf_vla.models.reference import Dims, _tiny_lerobot

    assert "lerobot-7427f31" in lerobot.__file__, lerobot.__file__
    with _tiny_lerobot(module, Dims(vision=dict(VISION))):
        policy = module.PI05Policy.from_pretrained(export).eval()
    with _PaliGemmaTokenizer(AutoTokenizer.from_pretrained(tokenizer_dir)):
        pre, post = make_pre_post_processors(policy.config, pretrained_path=str(export))
    o = np.load(episode)
    policy.reset()
    chunks = []
    for step in range(len(o["episode_states"])):
        observation = {CAMERA: torch.from_numpy(o["episode_images"][step]).permute(2, 0, 1).float()[None] / 255.0,
                       "observation.state": torch.from_numpy(o["episode_states"][step])[None],
                       "task": ["pick the cube"]}
        with torch.no_grad():
            chunk = policy.predict_action_chunk(pre(observation), noise=torch.from_numpy(o["episode_noise"][step]))
        chunks.append(post(chunk).numpy()[0])
    np.save(out, np.stack(chunks))


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:5]))
