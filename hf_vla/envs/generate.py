"""Scripted-expert demonstrations of ColorReach written as a LeRobot v3.0 dataset with lerobot's own writer."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)
CAMERA, STATE, ACTION = "observation.image", "observation.state", "action"
# Bumped whenever the env or the recording changes, so `ensure_demo_dataset` rebuilds stale data.
DEMO_DATA_VERSION = 2


def generate_demo_dataset(root: str | os.PathLike, episodes: int = 200, seed: int = 0, **env_kwargs) -> Path:
    """The demo's data: `python -m hf_vla.record --env color_reach` (the same recorder as every sim env), with the
    demo's episode seeds `seed * 100_003 + i` (for seed 0: the recorder's own 0, 1, 2, ...)."""
    import itertools

    from hf_vla.envs.recording import RecordArguments, record

    root = Path(root)
    if root.exists():
        raise FileExistsError(f"{root} exists; delete it to regenerate")
    start = time.perf_counter()
    record(RecordArguments(env="color_reach", output=str(root), episodes=episodes, seed=seed), env_kwargs,
           seeds=lambda first: (first * 100_003 + i for i in itertools.count()))
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
