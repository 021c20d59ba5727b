"""Scripted-expert demonstrations of ColorReach written as a LeRobot v3.0 dataset with lerobot's own writer."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..data.writer import write_lerobot_dataset
from .reach import ColorReachEnv, expert_action

logger = logging.getLogger(__name__)
CAMERA, STATE, ACTION = "observation.image", "observation.state", "action"
ROBOT_TYPE = "color_reach"
# Bumped whenever the env or the recording changes, so `ensure_demo_dataset` rebuilds stale data.
DEMO_DATA_VERSION = 2


def _episodes(count: int, seed: int, env_kwargs: dict):
    env = ColorReachEnv(**env_kwargs)
    rng = np.random.default_rng(seed)
    for episode in tqdm(range(count), desc="demo episodes", unit="ep"):
        observation, info = env.reset(seed=seed * 100_003 + episode)
        frames, done = [], False
        while not done:
            action = expert_action(env, rng)
            frames.append({"images": {CAMERA: observation[CAMERA]}, "state": observation[STATE], "action": action,
                           "task": info["task"]})
            observation, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
        yield frames


def generate_demo_dataset(root: str | os.PathLike, episodes: int = 200, seed: int = 0, **env_kwargs) -> Path:
    root = Path(root)
    if root.exists():
        raise FileExistsError(f"{root} exists; delete it to regenerate")
    start = time.perf_counter()
    env = ColorReachEnv(**env_kwargs)
    # Lossless video (full-resolution chroma, crf 0): at 32 px, lerobot's default yuv420p/crf 30 shifts the small
    # targets' colours by 6 levels on average and up to 149, so training frames would differ from the env's renders.
    write_lerobot_dataset(root, _episodes(episodes, seed, env_kwargs), fps=env.metadata["render_fps"],
                          cameras={CAMERA: (env.image_size, env.image_size)}, state_dim=2, action_dim=2,
                          robot_type=ROBOT_TYPE, state_key=STATE, action_key=ACTION, repo_id="local/color_reach",
                          pix_fmt="yuv444p", crf=0)
    logger.info("wrote %d demo episodes to %s in %.1fs", episodes, root, time.perf_counter() - start)
    return root


_WRITER_TEMP = re.compile(r"tmp[a-z0-9_]{8}")


def ensure_demo_dataset(root: str | os.PathLike, episodes: int = 200, seed: int = 0, main_process: bool = True) -> Path:
    """Generate the demo dataset at `root` unless a complete, current one is there.

    A partial dataset, or one written with other settings or by an older version of the generator, is rebuilt.
    """
    root = Path(root)
    marker = root / "meta" / "hf_vla_demo.json"
    expected = {"episodes": episodes, "seed": seed, "version": DEMO_DATA_VERSION}

    def current() -> bool:
        try:
            return json.loads(marker.read_text()) == expected
        except (OSError, ValueError):
            return False

    if current():
        return root
    if not main_process:
        while not current():  # other ranks wait for rank 0
            time.sleep(1)
        return root
    if root.exists():
        # lerobot's writer encodes each video in a `tempfile.mkdtemp(dir=root)` folder: a run killed while encoding
        # leaves one behind, which belongs to the partial dataset
        foreign = sorted(p.name for p in root.iterdir()
                         if p.name not in ("meta", "data", "videos", "images") and not _WRITER_TEMP.fullmatch(p.name))
        if foreign:  # never delete a folder that is not a (partial) LeRobot dataset
            raise FileExistsError(f"{root} is not a demo dataset (it holds {foreign}); pick another demo data root")
        logger.info("rebuilding the demo dataset at %s (missing, partial or stale)", root)
        shutil.rmtree(root)
    generate_demo_dataset(root, episodes=episodes, seed=seed)
    marker.write_text(json.dumps(expected))
    return root
