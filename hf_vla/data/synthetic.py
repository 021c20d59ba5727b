"""DROID-shaped synthetic LeRobot v3.0 datasets, written in minutes at DROID's size (92k episodes, 26.7M frames).

    python -m hf_vla.data.synthetic OUT_DIR --episodes 92000 [--row_groups episode|file] [--video_size 32 32]

What it writes is the v3.0 layout lerobot's own writer produces, so `LeRobotDataset` loads it:
- `data/chunk-XXX/file-YYY.parquet`, rotated by size (DROID's ~100 MB files hold about a million frames):
  `observation.state`, `action` (fixed-size float32 lists), `timestamp`, `frame_index`, `episode_index`, `index`,
  `task_index`, with one row group per episode (`--row_groups episode`, as lerobot's recorder writes) or a million
  rows per row group (`--row_groups file`, as its v2.1 -> v3.0 converter does, which is how DROID was published);
- `meta/episodes/chunk-000/file-YYY.parquet`: one row per episode with lerobot's columns (`tasks`, `length`,
  `data/*`, `dataset_from_index`/`dataset_to_index`, `videos/<camera>/{chunk_index,file_index,from_timestamp,
  to_timestamp}`, `meta/episodes/*`, per-episode `stats/*`) plus DROID's `recording_folderpath` and `file_path`;
- `meta/info.json`, `meta/stats.json` (with q01/q99), `meta/tasks.parquet`;
- `videos/<camera>/chunk-XXX/file-YYY.mp4`: each file holds `--episodes_per_video` episodes back to back, referenced
  by timestamp ranges. All files of a camera are hard links of one small video long enough for any of them, so 92k
  episodes cost a few megabytes of video (decoding is cheap by design: this measures the data pipeline);
- `keep_ranges.json`: an openpi-style idle filter, `{"<recording_folderpath>--<file_path>": [[start, end], ...]}`
  keeping one to three ranges of most episodes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DROID_CAMERAS = ("observation.images.exterior_1_left", "observation.images.exterior_2_left",
                 "observation.images.wrist_left")
TASKS = ("put the marker in the cup", "open the drawer", "move the bowl to the left", "close the laptop lid",
         "pick up the spoon", "stack the blocks", "wipe the table", "put the lid on the pot")
CHUNKS_SIZE = 1000  # files per chunk directory, lerobot's default


def _chunk_file(index: int) -> tuple[int, int]:
    return index // CHUNKS_SIZE, index % CHUNKS_SIZE


def _fixed_list(values: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1), pa.float32()), values.shape[1])


def _write_template_video(path: Path, frames: int, fps: int, size: tuple[int, int]):
    """One small H.264 video whose frame i shows grey level i % 256 (so a test can tell frames apart)."""
    import av

    height, width = size
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"g": "30", "crf": "10", "preset": "ultrafast"}  # near-lossless: frames stay readable
        image = np.zeros((height, width, 3), np.uint8)
        for index in range(frames):
            image[:] = index % 256
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _feature(dtype: str, shape, names=None) -> dict:
    return {"dtype": dtype, "shape": list(shape), "names": names}


def _stats(values: np.ndarray) -> dict:
    return {"min": values.min(0).tolist(), "max": values.max(0).tolist(), "mean": values.mean(0).tolist(),
            "std": values.std(0).tolist(), "count": [len(values)], "q01": np.quantile(values, 0.01, 0).tolist(),
            "q99": np.quantile(values, 0.99, 0).tolist()}


@dataclass
class DroidLike:
    """The shape of a synthetic dataset (defaults: DROID's): episodes and their mean length, fps, state and action
    widths, cameras and their video size, how the files rotate (frames per data file, row groups, episodes per video
    and per metadata file), and the seed of its random content."""

    episodes: int = 92_000
    mean_length: int = 290
    fps: int = 15
    state_dim: int = 8
    action_dim: int = 8
    cameras: tuple[str, ...] = DROID_CAMERAS
    video_size: tuple[int, int] = (32, 32)
    frames_per_data_file: int = 1_000_000
    row_groups: str = "episode"
    episodes_per_video: int = 100
    episodes_per_meta_file: int = 50_000
    seed: int = 0


def write_droid_like(root: str | os.PathLike, shape: DroidLike | None = None, progress: bool = True) -> Path:
    """Write the dataset of `shape` (default: DROID's) to `root` (which must not exist) and return it. See the module
    docstring."""
    from hf_vla.cli import progress_bar

    shape = shape or DroidLike()
    episodes, mean_length, fps, state_dim, action_dim = (shape.episodes, shape.mean_length, shape.fps, shape.state_dim,
                                                         shape.action_dim)
    cameras, video_size, frames_per_data_file, row_groups = (shape.cameras, shape.video_size,
                                                             shape.frames_per_data_file, shape.row_groups)
    episodes_per_video, episodes_per_meta_file, seed = (shape.episodes_per_video, shape.episodes_per_meta_file,
                                                        shape.seed)

    root = Path(root)
    if root.exists():
        raise FileExistsError(f"{root} exists: write the synthetic dataset to a new directory")
    if row_groups not in ("episode", "file"):
        raise ValueError(f"row_groups must be 'episode' or 'file', got {row_groups!r}")
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    lengths = np.clip(rng.normal(mean_length, mean_length / 4, episodes), 30, 3 * mean_length).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    total = int(lengths.sum())
    task_of_episode = rng.integers(0, len(TASKS), episodes)
    (root / "meta").mkdir(parents=True)

    # ---- data files: random-walk state, actions = next state, rotated every ~frames_per_data_file frames --------
    file_of_episode = np.minimum(starts // frames_per_data_file, (total - 1) // frames_per_data_file)
    state_stats, action_stats = [], []
    bar = progress_bar(total, "synthetic DROID frames", "frames", enabled=progress, unit_scale=True)
    for file_index in np.unique(file_of_episode):
        members = np.flatnonzero(file_of_episode == file_index)
        rows = int(lengths[members].sum())
        first_row = int(starts[members[0]])
        episode_column = np.repeat(members, lengths[members])
        frame_column = np.arange(rows) - np.repeat(starts[members] - first_row, lengths[members])
        steps = rng.normal(0, 0.02, (rows, state_dim)).astype(np.float32)
        state = np.cumsum(steps, axis=0, dtype=np.float32)
        state -= np.repeat(state[starts[members] - first_row], lengths[members], axis=0)  # each episode from 0
        state += np.repeat(rng.normal(0, 0.5, (len(members), state_dim)).astype(np.float32), lengths[members], 0)
        action = np.roll(state, -1, axis=0)[:, :action_dim]
        if action_dim > state_dim:
            action = np.pad(action, ((0, 0), (0, action_dim - state_dim)))
        state_stats.append(state[:: max(1, rows // 20000)])
        action_stats.append(action[:: max(1, rows // 20000)])
        table = pa.table({
            "observation.state": _fixed_list(state), "action": _fixed_list(action),
            "timestamp": pa.array(frame_column / fps, pa.float32()), "frame_index": pa.array(frame_column, pa.int64()),
            "episode_index": pa.array(episode_column, pa.int64()),
            "index": pa.array(np.arange(first_row, first_row + rows), pa.int64()),
            "task_index": pa.array(np.repeat(task_of_episode[members], lengths[members]), pa.int64()),
        })
        chunk, file = _chunk_file(int(file_index))
        path = root / "data" / f"chunk-{chunk:03d}" / f"file-{file:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        if row_groups == "file":
            pq.write_table(table, path)
        else:
            with pq.ParquetWriter(path, table.schema) as writer:
                offset = 0
                for length in lengths[members]:
                    writer.write_table(table.slice(offset, int(length)))
                    offset += int(length)
        bar.update(rows)
    bar.close()

    # ---- videos: hard links of one template long enough for any file -------------------------------------------
    video_file_of_episode = np.arange(episodes) // episodes_per_video
    # frame of each episode's start inside its video file (episodes fill the files in order)
    video_offsets = starts - starts[video_file_of_episode * episodes_per_video]
    longest = int((video_offsets + lengths).max())
    template = root / ".template.mp4"
    _write_template_video(template, longest, fps, tuple(video_size))
    for camera in cameras:
        for group in np.unique(video_file_of_episode):
            chunk, file = _chunk_file(int(group))
            path = root / "videos" / camera / f"chunk-{chunk:03d}" / f"file-{file:03d}.mp4"
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(template, path)
    template.unlink()

    # ---- episode metadata ---------------------------------------------------------------------------------------
    labs = np.array(["AUTOLab", "CLVR", "GuptaLab", "ILIAD", "IPRL", "IRIS", "PennPAL", "RAD", "REAL", "RPL"])
    folder = [f"gs://gresearch/robotics/droid_raw/1.0.1/{labs[i % len(labs)]}/success/2023-{1 + i % 12:02d}-"
              f"{1 + i % 28:02d}/Fri_{i:06d}" for i in range(episodes)]
    file_path = [f"{f}/trajectory.h5" for f in folder]
    meta_file = np.arange(episodes) // episodes_per_meta_file
    columns = {
        "episode_index": pa.array(np.arange(episodes), pa.int64()),
        "tasks": pa.array([[TASKS[t]] for t in task_of_episode], pa.list_(pa.string())),
        "length": pa.array(lengths, pa.int64()),
        "data/chunk_index": pa.array(file_of_episode // CHUNKS_SIZE, pa.int64()),
        "data/file_index": pa.array(file_of_episode % CHUNKS_SIZE, pa.int64()),
        "dataset_from_index": pa.array(starts, pa.int64()),
        "dataset_to_index": pa.array(starts + lengths, pa.int64()),
    }
    for camera in cameras:
        columns[f"videos/{camera}/chunk_index"] = pa.array(video_file_of_episode // CHUNKS_SIZE, pa.int64())
        columns[f"videos/{camera}/file_index"] = pa.array(video_file_of_episode % CHUNKS_SIZE, pa.int64())
        columns[f"videos/{camera}/from_timestamp"] = pa.array(video_offsets / fps, pa.float64())
        columns[f"videos/{camera}/to_timestamp"] = pa.array((video_offsets + lengths) / fps, pa.float64())
    columns["meta/episodes/chunk_index"] = pa.array(meta_file // CHUNKS_SIZE, pa.int64())
    columns["meta/episodes/file_index"] = pa.array(meta_file % CHUNKS_SIZE, pa.int64())
    for key in ("observation.state", "action"):  # per-episode stats as lerobot writes them (approximate values)
        dim = state_dim if key == "observation.state" else action_dim
        for stat in ("min", "max", "mean", "std"):
            base = {"min": -1.0, "max": 1.0, "mean": 0.0, "std": 0.5}[stat]
            columns[f"stats/{key}/{stat}"] = pa.FixedSizeListArray.from_arrays(
                pa.array(np.full(episodes * dim, base), pa.float64()), dim)
        columns[f"stats/{key}/count"] = pa.FixedSizeListArray.from_arrays(pa.array(lengths, pa.int64()), 1)
    columns["recording_folderpath"] = pa.array(folder, pa.string())
    columns["file_path"] = pa.array(file_path, pa.string())
    episodes_table = pa.table(columns)
    for group in np.unique(meta_file):
        chunk, file = _chunk_file(int(group))
        path = root / "meta" / "episodes" / f"chunk-{chunk:03d}" / f"file-{file:03d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        members = np.flatnonzero(meta_file == group)
        pq.write_table(episodes_table.slice(int(members[0]), len(members)), path)

    # ---- info, stats, tasks --------------------------------------------------------------------------------------
    features = {
        "observation.state": _feature("float32", (state_dim,), [f"joint_{i}" for i in range(state_dim)]),
        "action": _feature("float32", (action_dim,), [f"action_{i}" for i in range(action_dim)]),
    }
    for camera in cameras:
        features[camera] = {**_feature("video", (*video_size, 3), ["height", "width", "channels"]), "info": {
            "video.height": video_size[0], "video.width": video_size[1], "video.codec": "h264",
            "video.pix_fmt": "yuv420p", "video.fps": fps, "video.channels": 3, "has_audio": False}}
    features.update({"timestamp": _feature("float32", (1,)), "frame_index": _feature("int64", (1,)),
                     "episode_index": _feature("int64", (1,)), "index": _feature("int64", (1,)),
                     "task_index": _feature("int64", (1,))})
    info = {
        "codebase_version": "v3.0", "robot_type": "franka", "total_episodes": episodes, "total_frames": total,
        "total_tasks": len(TASKS), "chunks_size": CHUNKS_SIZE, "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 500, "fps": fps, "splits": {"train": f"0:{episodes}"},
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4", "features": features,
    }
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    state_sample, action_sample = np.concatenate(state_stats), np.concatenate(action_stats)
    frame_stats = {"min": [0.0], "max": [float(lengths.max() - 1)], "mean": [float(mean_length / 2)],
                   "std": [float(mean_length / 4)], "count": [total], "q01": [0.0], "q99": [float(mean_length)]}
    stats = {"observation.state": _stats(state_sample), "action": _stats(action_sample),
             "frame_index": frame_stats, "index": frame_stats, "episode_index": frame_stats,
             "timestamp": frame_stats, "task_index": frame_stats}
    for camera in cameras:
        stats[camera] = {name: [[[value]]] * 3 for name, value in (("min", 0.0), ("max", 1.0), ("mean", 0.5),
                                                                   ("std", 0.3), ("q01", 0.0), ("q99", 1.0))}
        stats[camera]["count"] = [total]
    (root / "meta" / "stats.json").write_text(json.dumps(stats))
    import pandas as pd

    pd.DataFrame({"task_index": np.arange(len(TASKS))}, index=pd.Index(TASKS, name="task")).to_parquet(
        root / "meta" / "tasks.parquet")

    # ---- openpi-style keep ranges: drop idle stretches, keep 1-3 ranges of ~85% of episodes -----------------------
    keep = {}
    for index in range(episodes):
        if rng.random() < 0.15:
            continue
        length = int(lengths[index])
        cuts = np.sort(rng.integers(0, length, 2 * int(rng.integers(1, 4))))
        ranges = [[int(a), int(b)] for a, b in zip(cuts[::2], cuts[1::2]) if b - a >= 10]
        if ranges:
            keep[f"{folder[index]}--{file_path[index]}"] = ranges
    (root / "keep_ranges.json").write_text(json.dumps(keep))
    if progress:
        print(f"wrote {episodes} episodes, {total} frames to {root} in {time.perf_counter() - started:.1f} s")
    return root


def droid_dataset_config(root: str | os.PathLike, keep_ranges: bool = True) -> dict:
    """The `DatasetConfig` dict of `configs/pi05_droid.json` pointed at a synthetic dataset."""
    root = Path(root)
    config = {"root": str(root), "name": "droid", "cameras": list(DROID_CAMERAS), "state_key": "observation.state",
              "action_key": "action", "robot_type": "franka", "control_mode": "joint_position", "fps": 15}
    if keep_ranges:
        config |= {"keep_ranges": str(root / "keep_ranges.json"),
                   "keep_ranges_key": "{recording_folderpath}--{file_path}"}
    return config


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m hf_vla.data.synthetic", description=__doc__.split("\n")[0])
    parser.add_argument("root")
    parser.add_argument("--episodes", type=int, default=92_000)
    parser.add_argument("--mean_length", type=int, default=290)
    parser.add_argument("--row_groups", choices=("episode", "file"), default="episode")
    parser.add_argument("--video_size", type=int, nargs=2, default=(32, 32))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if args.overwrite and Path(args.root).exists():
        shutil.rmtree(args.root)
    write_droid_like(args.root, DroidLike(episodes=args.episodes, mean_length=args.mean_length,
                                          row_groups=args.row_groups, video_size=tuple(args.video_size),
                                          seed=args.seed))


if __name__ == "__main__":
    main()
