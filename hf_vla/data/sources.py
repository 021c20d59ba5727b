"""One LeRobot v3.0 dataset as a source of episode blocks, read through lerobot's own metadata."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
import pyarrow.parquet as pq
import torch


@dataclass
class DatasetConfig:
    """How one LeRobot dataset feeds the model (its feature mapping). Everything is configuration, no code.

    repo_id: Hub id (e.g. `lerobot/droid_1.0.1`); root: local dataset directory (either or both).
    name: display name for metrics (`eval_by_dataset/<name>/mse`); defaults to the repo id or directory name.
    weight: mixture weight (relative frequency of its frames in training batches).
    cameras: source camera key for each model camera slot, in slot order; `null` leaves a slot empty
        (`pixel_attention_mask=False`).
    state_key / action_key: the dataset's state and action features.
    robot_type / control_mode: the normalization head is `robot_type::control_mode` (robot_type defaults to the
        dataset's metadata). Without both, the head is the dataset name.
    fps: expected frame rate; a mismatch with the metadata is an error (chunks are in dataset frames).
    task: override the task string of every frame.
    keep_ranges: `{"<episode key>": [[start, end], ...]}` (a dict or a JSON file path): only these frame ranges are
        used, each as its own block; episodes absent from it are dropped.
    keep_ranges_key: how an episode's key is derived: a format string over the episode's metadata columns plus
        `episode_index`, `repo_id` and `name` (default `"{episode_index}"`).
    shuffle_tasks_seed: a language-blind control: every episode gets the task of another episode (a seeded
        permutation), so instructions carry no information about the episode.
    quantile_stats: `"exact"` (default) computes q01/q99 from the state/action columns (no video is read; at most
        2M frames, subsampled with a fixed seed); `"metadata"` uses `meta/stats.json`, whose quantiles lerobot builds
        as a frame-weighted mean of per-episode quantiles (too narrow when episodes cover different ranges).
    """

    repo_id: str | None = None
    root: str | None = None
    name: str | None = None
    weight: float = 1.0
    cameras: list[str | None] = field(default_factory=list)
    state_key: str = "observation.state"
    action_key: str = "action"
    robot_type: str | None = None
    control_mode: str | None = None
    fps: float | None = None
    task: str | None = None
    keep_ranges: str | dict | None = None
    keep_ranges_key: str = "{episode_index}"
    shuffle_tasks_seed: int | None = None
    quantile_stats: str = "exact"

    def __post_init__(self):
        if self.quantile_stats not in ("exact", "metadata"):
            raise ValueError(f"dataset {self.name or self.repo_id!r}: quantile_stats must be 'exact' or 'metadata', "
                             f"got {self.quantile_stats!r}")
        if self.repo_id is None and self.root is None:
            raise ValueError("DatasetConfig needs repo_id or root")
        if self.name is None:
            self.name = self.repo_id or Path(self.root).name
        if not self.weight > 0:
            raise ValueError(f"dataset {self.name!r}: weight must be > 0, got {self.weight}")
        if not self.cameras or not any(self.cameras):
            raise ValueError(f"dataset {self.name!r}: `cameras` must map at least one model camera slot to a camera key")


@dataclass(frozen=True)
class Block:
    """A contiguous frame range [start, end) of one episode: the unit of shuffling and of sequential decoding."""

    source: int
    episode: int  # the dataset's own episode index
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class LeRobotSource:
    """Metadata, blocks and frame reading for one dataset (`source_index` = its position in the mixture)."""

    def __init__(self, config: DatasetConfig, source_index: int, episode_offset: int = 0):
        from lerobot.datasets.lerobot_dataset import LeRobotDatasetMetadata

        self.config = config
        self.name = config.name
        self.source_index = source_index
        self.episode_offset = episode_offset
        self._check_version(config)
        try:
            self.meta = LeRobotDatasetMetadata(config.repo_id or config.name, root=config.root)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"dataset {self.name!r}: cannot read LeRobot metadata ({error})") from error
        self.root = Path(self.meta.root)
        features = self.meta.features
        for role, key in [("state_key", config.state_key), ("action_key", config.action_key)] + [
            ("cameras", key) for key in config.cameras if key is not None
        ]:
            if key not in features:
                raise KeyError(
                    f"dataset {self.name!r} ({self.root / 'meta/info.json'}): {role} {key!r} is not a feature; "
                    f"available: {sorted(features)}"
                )
        for key in config.cameras:
            if key is not None and features[key]["dtype"] not in ("video", "image"):
                raise ValueError(f"dataset {self.name!r}: camera {key!r} has dtype {features[key]['dtype']!r}")
            if key is not None and features[key]["dtype"] == "image":
                raise NotImplementedError(f"dataset {self.name!r}: camera {key!r} stores images, only video is supported")
        if config.fps is not None and abs(config.fps - self.meta.fps) > 1e-6:
            raise ValueError(f"dataset {self.name!r}: config fps={config.fps} but the dataset records {self.meta.fps} fps")
        self.fps = float(self.meta.fps)
        self.state_dim = int(features[config.state_key]["shape"][0])
        self.action_dim = int(features[config.action_key]["shape"][0])
        self.robot_type = config.robot_type or self.meta.robot_type
        if self.robot_type and config.control_mode:
            self.norm_key = f"{self.robot_type}::{config.control_mode}"
        else:
            self.norm_key = self.name
        columns = ["episode_index", "length", "data/chunk_index", "data/file_index", "dataset_from_index"]
        for key in config.cameras:
            if key is not None:
                columns += [f"videos/{key}/chunk_index", f"videos/{key}/file_index", f"videos/{key}/from_timestamp"]
        episodes = self.meta.episodes
        self.episodes = {name: np.asarray(episodes[name]) for name in columns}
        self._key_fields = None  # episode metadata columns for keep_ranges_key, materialised once on first use
        self.num_episodes = len(self.episodes["episode_index"])
        self._row = {int(e): i for i, e in enumerate(self.episodes["episode_index"])}
        self.tasks = {int(i): str(t) for t, i in zip(self.meta.tasks.index, self.meta.tasks["task_index"])}
        self._shuffled_tasks = None
        if config.shuffle_tasks_seed is not None:
            firsts = [str(tasks[0]) for tasks in episodes["tasks"]]
            order = np.random.default_rng(config.shuffle_tasks_seed).permutation(len(firsts))
            self._shuffled_tasks = {int(e): firsts[j] for e, j in zip(self.episodes["episode_index"], order)}
        self.stats = {
            "state": self._stat(config.state_key),
            "actions": self._stat(config.action_key),
        }
        self.keep_ranges = self._load_keep_ranges()
        self._check_files()
        self._tables: OrderedDict[Path, dict] = OrderedDict()

    # ---- metadata ------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_version(config: DatasetConfig):
        if config.root is None:
            return
        info_file = Path(config.root) / "meta" / "info.json"
        if not info_file.is_file():
            raise FileNotFoundError(f"dataset {config.name!r}: {info_file} not found (is root a LeRobot dataset?)")
        version = json.loads(info_file.read_text()).get("codebase_version")
        if version != "v3.0":
            raise ValueError(
                f"dataset {config.name!r} ({info_file}): codebase_version {version!r}; hf_vla reads LeRobot v3.0 "
                "datasets. Convert it with lerobot's `convert_dataset_v21_to_v30` first."
            )

    def _stat(self, key: str) -> dict:
        stats = self.meta.stats.get(key) if self.meta.stats else None
        if not stats or "q01" not in stats or "q99" not in stats:
            raise KeyError(
                f"dataset {self.name!r}: meta/stats.json has no q01/q99 for {key!r} (pi0.5 normalizes with quantiles); "
                "compute them with lerobot's `augment_dataset_quantile_stats`"
            )
        out = {k: np.asarray(v, dtype=np.float64) for k, v in stats.items()}
        out["count"] = np.asarray(stats.get("count", [self.meta.total_frames])).reshape(-1)[:1]
        return out

    def column_values(self, max_frames: int = 2_000_000, seed: int = 0) -> dict[str, np.ndarray]:
        """state / actions of (a seeded subsample of) the usable frames, read from parquet only."""
        files = sorted({self.data_path(e) for e in self.usable_episodes()})
        columns = [self.config.state_key, self.config.action_key, "episode_index", "frame_index"]
        usable = set(self.usable_episodes())
        states, actions = [], []
        for path in files:
            raw = pq.read_table(path, columns=columns)
            keep = np.isin(raw["episode_index"].to_numpy(), list(usable))
            if self.keep_ranges is not None:  # vectorised per kept range, not a Python loop over rows
                episodes, frames = raw["episode_index"].to_numpy(), raw["frame_index"].to_numpy()
                in_range = np.zeros_like(keep)
                for episode in np.unique(episodes[keep]):
                    rows = episodes == episode
                    for start, end in self.keep_ranges[int(episode)]:
                        in_range |= rows & (frames >= start) & (frames < end)
                keep &= in_range
            states.append(np.stack(raw[self.config.state_key].to_numpy(zero_copy_only=False)[keep]))
            actions.append(np.stack(raw[self.config.action_key].to_numpy(zero_copy_only=False)[keep]))
        values = {"state": np.concatenate(states).astype(np.float64), "actions": np.concatenate(actions).astype(np.float64)}
        count = len(values["state"])
        if count > max_frames:
            rows = np.sort(np.random.default_rng(seed).choice(count, size=max_frames, replace=False))
            values = {k: v[rows] for k, v in values.items()}
        values["frames"] = count
        return values

    def episode_key(self, row: int) -> str:
        if self._key_fields is None:  # indexing a datasets column copies all of it: do that once, not per episode
            meta = self.meta.episodes
            self._key_fields = {name: meta[name] for name in meta.column_names
                                if not name.startswith(("stats/", "meta/"))}
        fields = {name: column[row] for name, column in self._key_fields.items()}
        fields.update(episode_index=int(self.episodes["episode_index"][row]), repo_id=self.config.repo_id,
                      name=self.name)
        try:
            return self.config.keep_ranges_key.format(**fields)
        except KeyError as error:
            raise KeyError(
                f"dataset {self.name!r}: keep_ranges_key {self.config.keep_ranges_key!r} uses {error}, which is not an "
                f"episode metadata column; available: {sorted(fields)}"
            ) from error

    def _load_keep_ranges(self) -> dict | None:
        spec = self.config.keep_ranges
        if spec is None:
            return None
        if isinstance(spec, str | os.PathLike):
            path = Path(spec)
            if not path.is_file():
                raise FileNotFoundError(f"dataset {self.name!r}: keep_ranges file {path} not found")
            spec = json.loads(path.read_text())
        ranges: dict[int, list[tuple[int, int]]] = {}
        for row in range(self.num_episodes):
            key = self.episode_key(row)
            if key in spec:
                length = int(self.episodes["length"][row])
                kept = []
                for start, end in spec[key]:
                    start, end = max(0, int(start)), min(length, int(end))
                    if end > start:
                        kept.append((start, end))
                if kept:
                    ranges[int(self.episodes["episode_index"][row])] = kept
        if not ranges:
            sample = list(spec)[:3]
            raise ValueError(
                f"dataset {self.name!r}: the keep_ranges filter matches no episode (filter keys like {sample}, "
                f"episode keys like {[self.episode_key(r) for r in range(min(3, self.num_episodes))]}); check "
                "keep_ranges_key"
            )
        return ranges

    def data_path(self, episode: int) -> Path:
        row = self._row[episode]
        return self.root / self.meta.data_path.format(
            chunk_index=int(self.episodes["data/chunk_index"][row]), file_index=int(self.episodes["data/file_index"][row])
        )

    def video_path(self, episode: int, camera: str) -> tuple[Path, float]:
        row = self._row[episode]
        path = self.root / self.meta.video_path.format(
            video_key=camera,
            chunk_index=int(self.episodes[f"videos/{camera}/chunk_index"][row]),
            file_index=int(self.episodes[f"videos/{camera}/file_index"][row]),
        )
        return path, float(self.episodes[f"videos/{camera}/from_timestamp"][row])

    def _check_files(self):
        missing = set()
        for episode in self.episodes["episode_index"]:
            episode = int(episode)
            if self.keep_ranges is not None and episode not in self.keep_ranges:
                continue
            paths = [self.data_path(episode)] + [self.video_path(episode, c)[0] for c in self.config.cameras if c]
            missing.update(str(p) for p in paths if not p.is_file())
        if missing:
            raise FileNotFoundError(
                f"dataset {self.name!r}: {len(missing)} data/video files are missing, e.g. {sorted(missing)[:3]}"
            )

    # ---- blocks --------------------------------------------------------------------------------------------------
    def blocks(self, episodes) -> list[Block]:
        """Blocks of the given episodes: whole episodes, or each kept range when a keep_ranges filter is set."""
        out = []
        for episode in sorted(int(e) for e in episodes):
            if self.keep_ranges is not None:
                out += [Block(self.source_index, episode, s, e) for s, e in self.keep_ranges.get(episode, [])]
            else:
                out.append(Block(self.source_index, episode, 0, int(self.episodes["length"][self._row[episode]])))
        return out

    def usable_episodes(self) -> list[int]:
        if self.keep_ranges is not None:
            return sorted(self.keep_ranges)
        return [int(e) for e in self.episodes["episode_index"]]

    # ---- reading -------------------------------------------------------------------------------------------------
    def episode_table(self, episode: int) -> dict:
        """state [n, ds], actions [n, da], task_index [n] of one episode (parquet files are cached, 2 at a time)."""
        path = self.data_path(episode)
        table = self._tables.get(path)
        if table is None:
            columns = [self.config.state_key, self.config.action_key, "episode_index", "task_index"]
            raw = pq.read_table(path, columns=columns)
            table = {
                "episode_index": raw["episode_index"].to_numpy(),
                "task_index": raw["task_index"].to_numpy(),
                "state": np.stack(raw[self.config.state_key].to_numpy(zero_copy_only=False)).astype(np.float32),
                "actions": np.stack(raw[self.config.action_key].to_numpy(zero_copy_only=False)).astype(np.float32),
            }
            self._tables[path] = table
            while len(self._tables) > 2:
                self._tables.popitem(last=False)
        rows = table["episode_index"] == episode
        return {key: value[rows] for key, value in table.items() if key != "episode_index"}

    def task(self, task_index: int, episode: int | None = None) -> str:
        if self.config.task is not None:
            return self.config.task
        if self._shuffled_tasks is not None:
            return self._shuffled_tasks[int(episode)]
        return self.tasks[int(task_index)]


class VideoReader:
    """Sequential decoding of one camera of one block, resized with aspect-preserving padding while decoding."""

    def __init__(self, path: Path, start_time: float, fps: float, image_size: int):
        self.path = path
        self.fps = fps
        self.image_size = image_size
        try:
            self.container = av.open(str(path))
        except (FileNotFoundError, av.error.FileNotFoundError) as error:
            raise FileNotFoundError(f"video file {path} is missing") from error
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"
        self.start_time = start_time
        self._frames = None
        self._last = None
        self._scaled = None

    def _seek(self, timestamp: float):
        self.container.seek(int(max(0.0, timestamp - 0.5) / self.stream.time_base), stream=self.stream, backward=True)
        self._frames = self.container.decode(self.stream)
        self._last = None

    def _scale(self, height: int, width: int):
        if self._scaled is None:
            ratio = max(width / self.image_size, height / self.image_size)
            self._scaled = (int(height / ratio), int(width / ratio))
        return self._scaled

    def frame(self, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Frame `index` (episode frame, from its start) as uint8 [3, S, S], written into `out` when given.

        Indices must not go back within a block. Scaling happens in swscale while converting to RGB; the padding is
        centred and black. swscale's AREA filter is used: of its filters it comes closest to the processor's
        `resize_with_pad` (torch bilinear) at inference, and it is exact when no scaling is needed. (FAST_BILINEAR
        corrupts colour at sharp edges even without scaling: errors up to 160 levels on the 32 px demo frames.)
        """
        target = self.start_time + index / self.fps
        if self._frames is None or (self._last is not None and target < self._last[0] - 1e-6):
            self._seek(target)
        tolerance = 0.5 / self.fps
        while self._last is None or self._last[0] < target - tolerance:
            try:
                decoded = next(self._frames)
            except StopIteration:
                if self._last is not None and abs(self._last[0] - target) < 2 * tolerance:
                    break
                raise RuntimeError(f"{self.path}: no frame at {target:.3f}s (video ends at {self._last and self._last[0]})") from None
            self._last = (float(decoded.time), decoded)
        decoded = self._last[1]
        height, width = self._scale(decoded.height, decoded.width)
        array = decoded.to_ndarray(format="rgb24", width=width, height=height, interpolation="AREA")
        if out is None:
            out = torch.zeros(3, self.image_size, self.image_size, dtype=torch.uint8)
        top, left = (self.image_size - height) // 2, (self.image_size - width) // 2
        out[:, top : top + height, left : left + width] = torch.from_numpy(array).permute(2, 0, 1)
        return out

    def close(self):
        self.container.close()
