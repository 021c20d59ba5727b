"""Write LeRobot v3.0 datasets with lerobot's own writer (used by the demo generator and the tests)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class DatasetLayout:
    """What a written dataset holds: its fps, cameras (`{key: (height, width)}`), state and action widths and keys,
    robot type and repo id, per-frame string columns (`text_features`, e.g. Meta-World's `locations`) and further
    lerobot feature specs (`extra_features`: a DAgger recording's `intervention`); and how its videos are encoded
    (`vcodec`, `pix_fmt`, `crf`, given to lerobot's encoder; `crf=None`: lerobot's default)."""

    fps: int
    cameras: dict[str, tuple[int, int]]
    state_dim: int
    action_dim: int
    robot_type: str | None = None
    state_key: str = "observation.state"
    action_key: str = "action"
    repo_id: str = "local/generated"
    vcodec: str = "h264"
    pix_fmt: str = "yuv420p"
    crf: int | None = None
    text_features: tuple[str, ...] = ()
    extra_features: dict[str, dict] | None = None


def write_lerobot_dataset(root: str | Path, episodes: Iterable[Iterator[dict]], layout: DatasetLayout):
    """Write episodes (each an iterable of frames) as a LeRobot v3.0 dataset of `layout` at `root`.

    A frame is `{"images": {camera: uint8 HxWx3}, "state": [state_dim], "action": [action_dim], "task": str}`, plus
    `"text": {name: str}` for each of the layout's `text_features` and `"extra": {name: array}` for each of its
    `extra_features`. Returns lerobot's `LeRobotDatasetMetadata` of the finished dataset.
    """
    from lerobot.configs.video import RGBEncoderConfig
    from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata

    fps, cameras, state_dim, action_dim = layout.fps, layout.cameras, layout.state_dim, layout.action_dim
    state_key, action_key, repo_id, robot_type = layout.state_key, layout.action_key, layout.repo_id, layout.robot_type
    vcodec, pix_fmt, crf = layout.vcodec, layout.pix_fmt, layout.crf
    text_features, extra_features = layout.text_features, layout.extra_features

    features = {
        state_key: {"dtype": "float32", "shape": (state_dim,), "names": [f"s{i}" for i in range(state_dim)]},
        action_key: {"dtype": "float32", "shape": (action_dim,), "names": [f"a{i}" for i in range(action_dim)]},
    }
    for name in text_features:
        features[name] = {"dtype": "string", "shape": (1,), "names": None}
    features.update(extra_features or {})
    for camera, (height, width) in cameras.items():
        features[camera] = {"dtype": "video", "shape": (height, width, 3), "names": ["height", "width", "channels"]}
    logging.getLogger("lerobot").setLevel(logging.WARNING)
    dataset = LeRobotDataset.create(
        repo_id, fps=fps, features=features, root=root, robot_type=robot_type, use_videos=True,
        rgb_encoder=RGBEncoderConfig(vcodec=vcodec, pix_fmt=pix_fmt, **({} if crf is None else {"crf": crf})),
    )
    for frames in episodes:
        for frame in frames:
            row = {state_key: np.asarray(frame["state"], np.float32), action_key: np.asarray(frame["action"], np.float32),
                   "task": frame["task"]}
            row.update(frame["images"])
            row.update({name: frame["text"][name] for name in text_features})
            row.update({name: frame["extra"][name] for name in extra_features or {}})
            dataset.add_frame(row)
        dataset.save_episode(parallel_encoding=False)
    dataset.finalize()
    return LeRobotDatasetMetadata(repo_id, root=root)
