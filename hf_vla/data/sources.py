"""One LeRobot v3.0 dataset as a source of episode blocks.

lerobot's own metadata class reads `meta/info.json`, the tasks and `meta/stats.json`. The per-episode table is read
with pyarrow, only the columns used, into numpy arrays: no per-episode Python objects, nothing formatted row by row,
so start-up is linear in episodes and forked DataLoader workers share the arrays copy-on-write.

Checks that need no decoding run at construction (layout, features, keep-ranges, files present); the checks that read
every state/action row and every video's container (`hf_vla.data.scan`) run once per dataset version and are cached.
Every error names the dataset and the file, episode or key at fault.
"""

from __future__ import annotations

import json
import logging
import string
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hf_vla.data.blocks import Block, BlockList, kept_blocks, load_keep_ranges_spec  # noqa: F401  (public here)
from hf_vla.data.dataset_config import NUMERIC_DTYPES, DatasetConfig  # noqa: F401
from hf_vla.data.scan import MAX_STATS_FRAMES, vector_column
from hf_vla.data.video import VideoReader  # noqa: F401
from hf_vla.errors import ConfigError, DataError, FeatureKeyError, MissingFileError

logger = logging.getLogger("hf_vla.data")


def _names(feature: dict) -> list[str] | None:
    """A feature's per-dim names (lerobot writes a list, or a dict of one list), or None."""
    names = feature.get("names")
    if isinstance(names, dict):
        names = next(iter(names.values()), None)
    return [str(n) for n in names] if isinstance(names, list) and names else None


def _joint(name: str) -> str:
    """A state or action name without lerobot's unit suffixes (`shoulder.pos` and `shoulder` are one joint)."""
    name = name.lower()
    for suffix in (".pos", "_pos", ".position", "_position"):
        name = name.removesuffix(suffix)
    return name


def _lerobot_metadata_class():
    import lerobot.datasets.dataset_metadata as dm

    class Metadata(dm.LeRobotDatasetMetadata):
        """lerobot's metadata (info, tasks, stats, path templates) without its episodes table: that one goes through
        `datasets` (an Arrow cache conversion and per-row formatting, minutes at DROID's size); hf_vla reads the
        columns it needs with pyarrow instead."""

        def _load_metadata(self):
            self.info = dm.load_info(self.root)
            dm.check_version_compatibility(self.repo_id, self._version, dm.CODEBASE_VERSION)
            self.tasks = dm.load_tasks(self.root) if self.total_tasks > 0 else None
            self.episodes = None
            self.stats = dm.load_stats(self.root)

        def __del__(self):  # read-only: nothing to flush (lerobot's flush fails noisily at interpreter exit)
            pass

    return Metadata



LANGUAGE_PERSISTENT = "language_persistent"  # lerobot's per-episode language rows (its codex/pi052 branch's annotations)


def subtask_column(table: pa.Table, key: str) -> list[str | None]:
    """Each frame's subtask from `key`: a string column as it is; lerobot's `language_persistent` column, a list of
    `{role, content, style, timestamp, ...}` rows per frame, as lerobot's `active_at(t, style=subtask)` resolves it:
    the `subtask` row with the latest timestamp at or before the frame's `timestamp` (None before the first)."""
    values = table[key].to_pylist()
    if key != LANGUAGE_PERSISTENT:
        return [None if v is None else str(v) for v in values]
    out = []
    for rows, time in zip(values, table["timestamp"].to_pylist()):
        active = [r for r in rows or () if r.get("style") == "subtask" and r.get("timestamp") is not None
                  and float(r["timestamp"]) <= float(time) + 1e-6 and r.get("content")]
        out.append(max(active, key=lambda r: float(r["timestamp"]))["content"] if active else None)
    return out

class LeRobotSource:
    """Metadata, blocks and frame reading for one dataset (`source_index` = its position in the mixture)."""

    def __init__(self, config: DatasetConfig, source_index: int, episode_offset: int = 0):
        self.config = config
        self.name = config.name
        self.source_index = source_index
        self.episode_offset = episode_offset
        if config.root is not None:
            self._check_local_root(config.name, Path(config.root))
        self.meta = self._metadata(config)
        self.root = Path(self.meta.root)
        features = self.meta.features
        for role, key in [("state_key", config.state_key), ("action_key", config.action_key)] + [
            ("cameras", key) for key in config.cameras if key is not None
        ]:
            if key not in features:
                raise FeatureKeyError(
                    f"dataset {self.name!r} ({self.root / 'meta/info.json'}): {role} {key!r} is not a feature; "
                    f"available: {sorted(features)}"
                )
        for role, key in (("state_key", config.state_key), ("action_key", config.action_key)):
            feature = features[key]
            if feature["dtype"] not in NUMERIC_DTYPES or len(feature["shape"]) != 1:
                raise DataError(f"dataset {self.name!r}: {role} {key!r} is {feature['dtype']} of shape "
                                f"{feature['shape']}; state and actions must be numeric vectors")
        if config.target_text_key is not None:
            # configuration faults (exit 2, as the token objective's other start-up refusals): the key names the
            # wrong column
            if config.target_text_key not in features:
                raise ConfigError(f"dataset {self.name!r} ({self.root / 'meta/info.json'}): target_text_key "
                                  f"{config.target_text_key!r} is not a feature; available: {sorted(features)}")
            if features[config.target_text_key]["dtype"] != "string":
                raise ConfigError(f"dataset {self.name!r}: target_text_key {config.target_text_key!r} is "
                                  f"{features[config.target_text_key]['dtype']}; target text must be a string column")
        if config.subtask_key is not None:
            feature = features.get(config.subtask_key)
            if feature is None:
                raise ConfigError(f"dataset {self.name!r} ({self.root / 'meta/info.json'}): subtask_key "
                                  f"{config.subtask_key!r} is not a feature; available: {sorted(features)}")
            if feature["dtype"] not in ("string", "language"):
                raise ConfigError(f"dataset {self.name!r}: subtask_key {config.subtask_key!r} is {feature['dtype']}; "
                                  "a subtask is a string column or lerobot's language_persistent column")
        self.advantage_key = (config.advantage or {}).get("key")
        if self.advantage_key is not None:
            feature = features.get(self.advantage_key)
            where = f"dataset {self.name!r} ({self.root / 'meta/info.json'}): advantage key {self.advantage_key!r}"
            if feature is None:
                raise ConfigError(f"{where} is not a feature; available: {sorted(features)} (write it with python -m "
                                  "hf_vla.recap annotate)")
            if feature["dtype"] not in ("bool", "int8", "int16", "int32", "int64", "uint8") or int(
                    np.prod(feature.get("shape") or [1])) != 1:
                raise DataError(f"{where} is {feature['dtype']} of shape {feature.get('shape')}: the indicator is one "
                                "bool (or 0/1) per frame")
        self.chunk_steps = None  # steps per frame of the action_chunk_key column
        if config.action_chunk_key is not None:
            feature = features.get(config.action_chunk_key)
            where = f"dataset {self.name!r} ({self.root / 'meta/info.json'}): action_chunk_key {config.action_chunk_key!r}"
            if feature is None:
                raise ConfigError(f"{where} is not a feature; available: {sorted(features)}")
            action_dim = int(features[config.action_key]["shape"][0])
            size = int(np.prod(feature["shape"]))
            if feature["dtype"] not in NUMERIC_DTYPES or len(feature["shape"]) != 1 or size % action_dim:
                raise DataError(f"{where} is {feature['dtype']} of shape {feature['shape']}: it must be a numeric "
                                f"vector of whole chunks of {action_dim}-dim actions ({config.action_key!r})")
            self.chunk_steps = size // action_dim
        for key in config.cameras:
            if key is not None and features[key]["dtype"] not in ("video", "image"):
                raise DataError(f"dataset {self.name!r}: camera {key!r} has dtype {features[key]['dtype']!r}")
            if key is not None and features[key]["dtype"] == "image":
                raise NotImplementedError(f"dataset {self.name!r}: camera {key!r} stores images, only video is supported")
        if config.fps is not None and abs(config.fps - self.meta.fps) > 1e-6:
            raise ConfigError(f"dataset {self.name!r}: config fps={config.fps} but the dataset records {self.meta.fps} fps")
        self.fps = float(self.meta.fps)
        self.state_dim = int(features[config.state_key]["shape"][0])
        self.action_dim = int(features[config.action_key]["shape"][0])
        self.robot_type = config.robot_type or self.meta.robot_type
        if self.robot_type and config.control_mode:
            self.norm_key = f"{self.robot_type}::{config.control_mode}"
        else:
            self.norm_key = self.name
        self.tasks = {}
        if self.meta.tasks is not None:
            self.tasks = {int(i): str(t) for t, i in zip(self.meta.tasks.index, self.meta.tasks["task_index"])}
        self._read_episodes()
        self.stats = {"state": self._stat(config.state_key), "actions": self._stat(config.action_key)}
        self.relative_mask = self._relative_mask(features)
        self.keep_ranges = None  # True when a keep_ranges filter selects the blocks
        self.ranges = self._block_ranges()
        if self.config.hold_out_fold is not None:  # cross-fitting (RECAP): this fold's episodes are another model's
            fold, folds = self.config.hold_out_fold
            self.ranges = self.ranges[self.ranges[:, 0] % folds != fold]
            if not len(self.ranges):
                raise DataError(f"dataset {self.name!r}: hold_out_fold {[fold, folds]} leaves no episode")
        self._check_files()
        self._parquet_metadata: OrderedDict[Path, tuple] = OrderedDict()
        self.episode_rows = None  # set by the start-up scan when its cache holds every used episode's rows
        self.content_fingerprint: str | None = None  # set by the start-up scan: a hash of the kept rows' values
        self.content_detail: dict | None = None  # the same per data file and episode (`scan.content_difference`)

    # ---- metadata ------------------------------------------------------------------------------------------------
    def _metadata(self, config: DatasetConfig):
        """lerobot's metadata of a local root, or of a repo_id in lerobot's cache (fetched from the Hub if absent)."""
        from lerobot.datasets.utils import CompatibilityError

        root = config.root
        if root is None and config.repo_id:
            from hf_vla.hub.resolve import lerobot_home

            root = lerobot_home() / config.repo_id  # lerobot's layout for a dataset in its cache
            if (root / "meta" / "info.json").is_file():
                self._check_local_root(config.name, root)
        try:
            return _lerobot_metadata_class()(config.repo_id or config.name, root=root, revision=config.revision)
        except CompatibilityError as error:
            raise DataError(f"dataset {self.name!r}: {' '.join(str(error).split())[:300]}; convert it with `python -m "
                            f"lerobot.scripts.convert_dataset_v21_to_v30 --repo-id={config.repo_id}`") from error
        except FileNotFoundError as error:
            raise MissingFileError(f"dataset {self.name!r}: cannot read LeRobot metadata ({error})") from error
        except Exception as error:  # the Hub: unknown id or revision, offline with nothing cached
            from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

            if config.repo_id and isinstance(error, HfHubHTTPError | LocalEntryNotFoundError | OfflineModeIsEnabled):
                from hf_vla.hub.resolve import hub_error

                raise hub_error(error, f"dataset {config.repo_id!r}", config.revision) from error
            raise

    @staticmethod
    def _check_local_root(name: str, root: Path):
        from hf_vla.storage import read_json

        info_file = root / "meta" / "info.json"
        info = read_json(info_file, f"dataset {name!r}:", missing="not found (is root a LeRobot dataset?)", kind=dict)
        if (root / "meta" / "stats.json").is_file():  # lerobot's metadata reads it next, and fails on a list
            read_json(root / "meta" / "stats.json", f"dataset {name!r}:", kind=dict)
        version = info.get("codebase_version")
        if version != "v3.0":
            raise DataError(
                f"dataset {name!r} ({info_file}): codebase_version {version!r}; hf_vla reads LeRobot v3.0 "
                "datasets; convert it with `python -m lerobot.scripts.convert_dataset_v21_to_v30 --repo-id=... --root=...`"
            )
        episodes_dir = root / "meta" / "episodes"
        if not episodes_dir.is_dir() or not any(episodes_dir.glob("*/*.parquet")):
            raise MissingFileError(f"dataset {name!r}: {episodes_dir} is missing or holds no parquet file: root "
                                   "is not a complete LeRobot v3.0 dataset (the episode table is needed)")
        if info.get("total_tasks", 0) > 0 and not (root / "meta" / "tasks.parquet").is_file():
            raise MissingFileError(f"dataset {name!r}: {root / 'meta' / 'tasks.parquet'} not found")

    def _episode_columns(self) -> list[str]:
        columns = ["episode_index", "length", "data/chunk_index", "data/file_index", "dataset_from_index",
                   "dataset_to_index"]
        for key in self.config.cameras:
            if key is not None:
                columns += [f"videos/{key}/{name}" for name in ("chunk_index", "file_index", "from_timestamp",
                                                                 "to_timestamp")]
        return columns

    def episode_files(self) -> list[Path]:
        return sorted((self.root / "meta" / "episodes").glob("*/*.parquet"))

    def _read_episode_table(self, columns: list[str], required: bool = True) -> pa.Table:
        tables = []
        for path in self.episode_files():
            try:
                present = pq.read_schema(path).names
                missing = [c for c in columns if c not in present]
                if missing and required:
                    raise DataError(f"dataset {self.name!r}: {path} lacks the episode column(s) {missing}")
                tables.append(pq.read_table(path, columns=[c for c in columns if c in present]))
            except (pa.ArrowException, OSError) as error:
                raise DataError(f"dataset {self.name!r}: {path} is not a readable parquet file ({error})") from error
        if not tables:
            raise MissingFileError(f"dataset {self.name!r}: no episode metadata under {self.root / 'meta/episodes'}")
        return pa.concat_tables(tables)

    def _read_episodes(self):
        table = self._read_episode_table(self._episode_columns())
        self.episodes = {name: table[name].to_numpy() for name in table.column_names}
        self.num_episodes = len(self.episodes["episode_index"])
        order = np.argsort(self.episodes["episode_index"], kind="stable")
        if (order != np.arange(self.num_episodes)).any():
            self.episodes = {k: v[order] for k, v in self.episodes.items()}
        index = self.episodes["episode_index"]
        if self.num_episodes and len(np.unique(index)) != self.num_episodes:
            raise DataError(f"dataset {self.name!r}: meta/episodes lists an episode index more than once")
        # each episode's first row inside its data file (rows of a file are its episodes in order)
        file_id = self.episodes["data/chunk_index"].astype(np.int64) * (1 << 32) + self.episodes["data/file_index"]
        files, inverse = np.unique(file_id, return_inverse=True)
        first = np.full(len(files), np.iinfo(np.int64).max)
        np.minimum.at(first, inverse, self.episodes["dataset_from_index"])
        self.episodes["file_row"] = self.episodes["dataset_from_index"] - first[inverse]
        self.file_of_row = inverse  # the index of each row's episode file
        self._shuffled_tasks = None
        if self.config.shuffle_tasks_seed is not None:
            tasks = self._read_episode_table(["tasks"])["tasks"].to_pylist()
            firsts = [str(t[0]) if t else "" for t in tasks]
            firsts = [firsts[i] for i in order]
            self._shuffled_tasks = np.asarray(firsts, dtype=object)[
                np.random.default_rng(self.config.shuffle_tasks_seed).permutation(len(firsts))]

    def _relative_mask(self, features: dict) -> list[bool] | None:
        """The dataset's relative-action mask (`relative_actions`), checked against its state and action features."""
        config = self.config
        if not config.relative_actions:
            return None
        where = f"dataset {self.name!r} ({self.root / 'meta/info.json'}): relative_actions"
        action_names, state_names = (_names(features[key]) for key in (config.action_key, config.state_key))
        if isinstance(config.relative_actions, list):
            mask = list(config.relative_actions)
            if len(mask) > self.action_dim:
                raise ConfigError(f"{where}: the mask has {len(mask)} entries, the actions {self.action_dim} dims")
        else:
            from hf_vla.models.common.normalization import mask_from_names

            given = config.relative_exclude_joints
            exclude = ["gripper"] if given is None else given
            if given and action_names is None:
                raise ConfigError(f"{where}: relative_exclude_joints {given} cannot be matched: the action feature "
                                  f"{config.action_key!r} has no names; give relative_actions as a mask instead")
            for name in given or []:
                if action_names is not None and not any(name.lower() in str(a).lower() for a in action_names):
                    raise ConfigError(f"{where}: relative_exclude_joints {name!r} matches no action name; the action "
                                      f"names are {list(action_names)}")
            mask = mask_from_names(action_names, exclude, self.action_dim)
            if state_names is not None and action_names is not None:  # an offset is from the same joint's state
                at = {_joint(name): index for index, name in enumerate(state_names)}
                for dim, relative in enumerate(mask):
                    found = at.get(_joint(action_names[dim])) if relative and dim < len(action_names) else None
                    if found is not None and found != dim:
                        raise ConfigError(
                            f"{where}: action dim {dim} is {action_names[dim]!r}, which is state dim {found} "
                            f"({state_names[found]!r}), not {dim} ({state_names[dim] if dim < len(state_names) else None!r}): "
                            "a relative action is an offset from the same joint's state at the same index; reorder the "
                            "state, exclude the dim (relative_exclude_joints), or give an explicit mask")
        last = max((i for i, m in enumerate(mask) if m), default=-1)
        if last >= self.state_dim:
            raise ConfigError(f"{where}: action dim {last} is relative but the state {config.state_key!r} has "
                              f"{self.state_dim} dims: an offset needs a state value at the same index")
        return mask if any(mask) else None

    def row(self, episode: int) -> int:
        """Row of `episode` in the episode arrays."""
        index = self.episodes["episode_index"]
        row = int(np.searchsorted(index, episode))
        if row >= len(index) or index[row] != episode:
            raise DataError(f"dataset {self.name!r}: episode {episode} is not in meta/episodes")
        return row

    def _stat(self, key: str) -> dict:
        """meta/stats.json's statistics of `key` (what the head's normalisation needs of them is checked by the
        mixture, which computes exact quantiles itself unless `quantile_stats: metadata`)."""
        stats = self.meta.stats.get(key) if self.meta.stats else None
        if not stats or not {"mean", "std", "min", "max"} <= set(stats):
            raise DataError(f"dataset {self.name!r}: meta/stats.json has no mean/std/min/max for {key!r}; recompute "
                            "the dataset's statistics with lerobot (LeRobotDataset writes them)")
        if self.config.quantile_stats == "metadata" and ("q01" not in stats or "q99" not in stats):
            raise DataError(
                f"dataset {self.name!r}: meta/stats.json has no q01/q99 for {key!r} (pi0.5 normalizes with quantiles); "
                "compute them with lerobot's `augment_dataset_quantile_stats`, or use quantile_stats: exact"
            )
        out = {k: np.asarray(v, dtype=np.float64) for k, v in stats.items()}
        out["count"] = np.asarray(stats.get("count", [self.meta.total_frames])).reshape(-1)[:1]
        return out

    # ---- keep ranges ---------------------------------------------------------------------------------------------
    def episode_keys(self) -> list[str]:
        """The keep-ranges key of every episode (row order), from `keep_ranges_key`."""
        fmt = self.config.keep_ranges_key
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(fmt) if f}
        except ValueError as error:
            raise ConfigError(f"dataset {self.name!r}: keep_ranges_key {fmt!r} is not a format string ({error})") \
                from error
        available = set(pq.read_schema(self.episode_files()[0]).names) - {"tasks"}
        available = {c for c in available if not c.startswith(("stats/", "meta/"))} | {"episode_index", "repo_id",
                                                                                        "name"}
        unknown = sorted(fields - available)
        if unknown:
            raise FeatureKeyError(
                f"dataset {self.name!r}: keep_ranges_key {fmt!r} uses {unknown}, which is not an episode metadata "
                f"column; available: {sorted(available)}"
            )
        columns = sorted(fields - {"episode_index", "repo_id", "name"})
        values = {}
        if columns:
            table = self._read_episode_table(["episode_index", *columns])
            order = np.argsort(table["episode_index"].to_numpy(), kind="stable").tolist()
            for column in columns:
                listed = table[column].to_pylist()  # once per column (not per episode)
                values[column] = [listed[i] for i in order]
        constants = {"repo_id": self.config.repo_id, "name": self.name}
        episodes = self.episodes["episode_index"].tolist()
        keys = []
        for row, episode in enumerate(episodes):  # one format call per episode: linear, on plain lists
            keys.append(fmt.format(episode_index=episode, **constants, **{c: values[c][row] for c in columns}))
        return keys

    def _block_ranges(self) -> np.ndarray:
        """`[n, 3]` (episode, start, end) of the blocks: whole episodes, or the kept ranges (validated)."""
        lengths = self.episodes["length"].astype(np.int64)
        if self.config.keep_ranges is None:
            return np.stack([self.episodes["episode_index"].astype(np.int64), np.zeros_like(lengths), lengths], axis=1)
        self.keep_ranges = True
        spec = load_keep_ranges_spec(self.config.keep_ranges, self.name)
        ranges, self.keep_range_report = kept_blocks(self.name, spec, self.episode_keys(), lengths,
                                                     self.episodes["episode_index"], self.config.keep_ranges_key)
        return ranges

    # ---- files ---------------------------------------------------------------------------------------------------
    def data_path(self, episode: int) -> Path:
        return self._data_path_of_row(self.row(episode))

    def _data_path_of_row(self, row: int) -> Path:
        return self.root / self.meta.data_path.format(
            chunk_index=int(self.episodes["data/chunk_index"][row]), file_index=int(self.episodes["data/file_index"][row])
        )

    def video_path(self, episode: int, camera: str) -> tuple[Path, float]:
        row = self.row(episode)
        return self._video_path_of_row(row, camera), float(self.episodes[f"videos/{camera}/from_timestamp"][row])

    def _video_path_of_row(self, row: int, camera: str) -> Path:
        return self.root / self.meta.video_path.format(
            video_key=camera,
            chunk_index=int(self.episodes[f"videos/{camera}/chunk_index"][row]),
            file_index=int(self.episodes[f"videos/{camera}/file_index"][row]),
        )

    def used_rows(self) -> np.ndarray:
        """Rows (episode-table order) of the episodes that have at least one block."""
        return np.unique(np.searchsorted(self.episodes["episode_index"], self.ranges[:, 0]))

    @staticmethod
    def _group(rows: np.ndarray, ids: np.ndarray) -> list[np.ndarray]:
        """`rows` split by `ids` (one sort, not one pass per group), groups in id order."""
        order = np.argsort(ids, kind="stable")
        bounds = np.flatnonzero(np.diff(ids[order])) + 1
        return np.split(rows[order], bounds)

    def data_files(self) -> dict[Path, np.ndarray]:
        """Data file -> rows of the used episodes it holds (one path format per file, not per episode)."""
        rows = self.used_rows()
        return {self._data_path_of_row(int(group[0])): group for group in self._group(rows, self.file_of_row[rows])}

    def video_files(self, camera: str) -> dict[Path, np.ndarray]:
        rows = self.used_rows()
        ids = self.episodes[f"videos/{camera}/chunk_index"][rows].astype(np.int64) * (1 << 32) + self.episodes[
            f"videos/{camera}/file_index"][rows]
        return {self._video_path_of_row(int(group[0]), camera): group for group in self._group(rows, ids)}

    def _check_files(self):
        paths = list(self.data_files())
        for camera in self.config.cameras:
            if camera:
                paths += list(self.video_files(camera))
        missing = sorted(str(p) for p in paths if not p.is_file())
        if missing and self.config.repo_id and self.config.root is None:
            # in lerobot's cache: fetch exactly the files of the used episodes and cameras
            from hf_vla.hub.resolve import download_dataset_files

            download_dataset_files(self.config.repo_id, self.meta.revision, self.root,
                                   [str(Path(p).relative_to(self.root)) for p in missing])
            missing = sorted(str(p) for p in paths if not p.is_file())
        if missing:
            hint = ""
            if self.config.repo_id and self.config.root is None:
                hint = f"; the Hub repository {self.config.repo_id!r} did not provide them"
            raise MissingFileError(
                f"dataset {self.name!r}: {len(missing)} data/video files are missing, e.g. {missing[:3]}{hint}"
            )

    # ---- blocks --------------------------------------------------------------------------------------------------
    def blocks(self, episodes) -> BlockList:
        """Blocks of the given episodes: whole episodes, or each kept range when a keep_ranges filter is set."""
        episodes = np.unique(np.asarray(list(episodes) if not isinstance(episodes, np.ndarray) else episodes,
                                        dtype=np.int64))
        return BlockList(self.source_index, self.ranges[np.isin(self.ranges[:, 0], episodes)])

    def usable_episodes(self) -> list[int]:
        return np.unique(self.ranges[:, 0]).tolist()

    # ---- reading -------------------------------------------------------------------------------------------------
    def _parquet(self, path: Path) -> tuple:
        """(footer metadata, first row of each row group) of a data file, kept for the last few files: a footer
        with one row group per episode is large, and re-parsing it at every block opening would cost more than the
        rows read."""
        cached = self._parquet_metadata.get(path)
        if cached is None:
            metadata = pq.read_metadata(path)
            sizes = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
            cached = self._parquet_metadata[path] = (metadata, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
            while len(self._parquet_metadata) > 4:
                self._parquet_metadata.popitem(last=False)
        return cached

    def episode_table(self, episode: int) -> dict:
        """state [n, ds], actions [n, da], task_index [n] of one episode.

        From the start-up scan's cached rows when there are (one positioned read); otherwise from parquet, reading only
        the row groups that hold its rows (lerobot's recorder writes one row group per episode), not the whole file.
        """
        row = self.row(episode)
        length = int(self.episodes["length"][row])
        if self.episode_rows is not None:
            try:
                table = self.episode_rows.read(row, length)
            except (OSError, ValueError) as error:
                raise DataError(f"dataset {self.name!r}: cannot read episode {episode} from the scan cache "
                                f"{self.episode_rows.directory}: {error}") from error
            # strings and per-frame chunks are not in the cache: from the parquet rows, in one read
            extra = [key for key in (self.config.target_text_key, self.config.action_chunk_key, self.advantage_key,
                                     self.config.subtask_key) if key is not None]
            if self.config.subtask_key == LANGUAGE_PERSISTENT:
                extra.append("timestamp")
            if extra:
                rows = self._episode_rows(episode, row, length, [*extra, "episode_index"])
                if self.config.target_text_key is not None:
                    table["target_text"] = rows[self.config.target_text_key].to_pylist()
                if self.config.subtask_key is not None:
                    table["subtask"] = subtask_column(rows, self.config.subtask_key)
                if self.advantage_key is not None:
                    table["advantage"] = _indicator_column(rows[self.advantage_key])
                if self.config.action_chunk_key is not None:
                    table["action_chunks"] = self._action_chunks(rows, episode, row)
            return table
        columns = [self.config.state_key, self.config.action_key, "task_index", "episode_index"]
        if self.config.target_text_key is not None:
            columns.append(self.config.target_text_key)
        if self.config.action_chunk_key is not None:
            columns.append(self.config.action_chunk_key)
        if self.advantage_key is not None:
            columns.append(self.advantage_key)
        if self.config.subtask_key is not None:
            columns += [self.config.subtask_key] + (["timestamp"] if self.config.subtask_key == LANGUAGE_PERSISTENT
                                                    else [])
        table = self._episode_rows(episode, row, length, columns)
        where = f"dataset {self.name!r}: {self._data_path_of_row(row)} episode {episode}"
        out = {
            "task_index": table["task_index"].to_numpy(),
            "state": vector_column(table[self.config.state_key], self.state_dim,
                                   f"{where} column {self.config.state_key!r}").astype(np.float32),
            "actions": vector_column(table[self.config.action_key], self.action_dim,
                                     f"{where} column {self.config.action_key!r}").astype(np.float32),
        }
        if self.config.target_text_key is not None:
            out["target_text"] = table[self.config.target_text_key].to_pylist()
        if self.config.subtask_key is not None:
            out["subtask"] = subtask_column(table, self.config.subtask_key)
        if self.config.action_chunk_key is not None:
            out["action_chunks"] = self._action_chunks(table, episode, row)
        if self.advantage_key is not None:
            out["advantage"] = _indicator_column(table[self.advantage_key])
        return out

    def _action_chunks(self, table: pa.Table, episode: int, row: int) -> np.ndarray:
        """`[n, chunk_steps, action_dim]` float32 from the `action_chunk_key` column; NaN/inf refused naming the
        frame (the start-up scan checks it too; this catches a file changed since)."""
        key = self.config.action_chunk_key
        where = f"dataset {self.name!r}: {self._data_path_of_row(row)} episode {episode} column {key!r}"
        values = vector_column(table[key], self.chunk_steps * self.action_dim, where).astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
        if len(bad):
            raise DataError(f"{where}: frame {int(bad[0])} holds NaN or inf ({len(bad)} frames)")
        return values.reshape(len(values), self.chunk_steps, self.action_dim)

    def _episode_rows(self, episode: int, row: int, length: int, columns: list[str]) -> pa.Table:
        """`columns` of one episode's rows, reading only the row groups that hold them."""
        path = self._data_path_of_row(row)
        first = int(self.episodes["file_row"][row])
        try:
            metadata, starts = self._parquet(path)
            if first + length > starts[-1]:
                raise DataError(f"dataset {self.name!r}: {path} has {starts[-1]} rows, but episode {episode} needs rows "
                                f"{first}..{first + length - 1} (meta/episodes)")
            groups = list(range(int(np.searchsorted(starts, first, "right")) - 1,
                                int(np.searchsorted(starts, first + length, "left"))))
            table = pq.ParquetFile(path, metadata=metadata).read_row_groups(groups, columns=columns)
            table = table.slice(first - int(starts[groups[0]]), length)
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"dataset {self.name!r}: cannot read episode {episode} from {path}: {error}") from error
        episodes = table["episode_index"].to_numpy()
        if len(episodes) != length or (episodes != episode).any():
            raise DataError(f"dataset {self.name!r}: {path} rows {first}..{first + length - 1} do not hold episode "
                            f"{episode} as meta/episodes says")
        return table

    # ---- outcomes and returns (RECAP's value model) ----------------------------------------------------------------
    def episode_outcomes(self, allow_unlabelled: bool = False) -> np.ndarray:
        """Each episode's success as float (1 success, 0 failure, NaN unknown), in episode-table order: the dataset
        field `success`, else lerobot's per-frame `next.success` (any frame), else a `serve --record` run summary's
        per-episode `success`, else an `hf_vla.record` expert recording (kept only when successful). An unknown outcome is refused naming the episode, unless `allow_unlabelled`."""
        cached = getattr(self, "_outcomes", None)
        if cached is not None:
            return cached
        outcomes = np.full(self.num_episodes, np.nan)
        features = self.meta.features
        if self.config.success is not None:
            outcomes[:] = float(self.config.success)
        elif "next.success" in features:
            for row, episode in enumerate(self.episodes["episode_index"]):
                if int(self.episodes["length"][row]) == 0:  # no frame: no outcome, and none needed
                    continue
                table = self._episode_rows(int(episode), row, int(self.episodes["length"][row]),
                                           ["next.success", "episode_index"])
                outcomes[row] = _episode_success(table["next.success"], f"dataset {self.name!r}: episode "
                                                 f"{int(episode)}'s next.success")
        elif (self.root / "meta" / "hf_vla_serve_record.json").is_file():  # serve --record: success per episode
            outcomes = self._served_outcomes(outcomes)
        else:
            from hf_vla.deployment.contract import RECORD_MARKER

            marker = self.root / "meta" / RECORD_MARKER
            try:
                record = json.loads(marker.read_text()) if marker.is_file() else {}
            except (OSError, ValueError):
                record = {}
            if record and record.get("strategy", "expert") == "expert":
                outcomes[:] = 1.0
        unknown = np.flatnonzero(np.isnan(outcomes) & (np.asarray(self.episodes["length"]) > 0))
        if len(unknown) and not allow_unlabelled:
            examples = [int(self.episodes["episode_index"][r]) for r in unknown[:5]]
            raise DataError(f"dataset {self.name!r}: episode(s) {examples}{' ...' if len(unknown) > 5 else ''} "
                            f"({len(unknown)} of {self.num_episodes}) have no outcome (no next.success column, no "
                            "hf_vla.record marker): set the dataset field success (true for demonstrations), or skip "
                            "them with allow_unlabelled")
        self._outcomes = outcomes
        return outcomes

    def _served_outcomes(self, outcomes: np.ndarray) -> np.ndarray:
        """A joined `serve --record` dataset: its run summary lists the finished episodes in the order the join
        wrote them, each with the `success` its client sent (None where none was sent)."""
        path = self.root / "meta" / "hf_vla_serve_record.json"
        try:
            episodes = sorted(json.loads(path.read_text()).get("episodes") or [], key=lambda e: e["episode"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise DataError(f"dataset {self.name!r}: {path} is not a serve recording's summary ({error})") from None
        if len(episodes) != self.num_episodes:
            raise DataError(f"dataset {self.name!r}: {path} lists {len(episodes)} episodes for the dataset's "
                            f"{self.num_episodes} (a recording joined into one dataset per camera shape?); set the "
                            "dataset field success, or add next.success")
        for row, entry in enumerate(episodes):
            if entry.get("success") is not None:
                outcomes[row] = float(bool(entry["success"]))
        return outcomes

    def declared_limit(self) -> tuple[int | None, str]:
        """The episode limit this dataset declares, and where: its field `max_episode_steps`, else its recording's
        (`hf_vla.record`); (None, "") when neither."""
        if self.config.max_episode_steps is not None:
            return int(self.config.max_episode_steps), "its max_episode_steps field"
        from hf_vla.deployment.contract import benchmark_of

        recorded = (benchmark_of(self.root) or {}).get("max_episode_steps")
        return (int(recorded), "its recording") if recorded else (None, "")

    def episode_task(self, row: int) -> str:
        """The task of the episode in meta/episodes row `row` (its first task; the field `task` when set)."""
        if self.config.task is not None:
            return self.config.task
        if self._shuffled_tasks is not None:
            return str(self._shuffled_tasks[row])
        if getattr(self, "_episode_tasks", None) is None:  # meta/episodes' own order, sorted as `episodes` is
            table = self._read_episode_table(["episode_index", "tasks"])
            order = np.argsort(table["episode_index"].to_numpy(), kind="stable").tolist()
            tasks = table["tasks"].to_pylist()
            self._episode_tasks = [str(tasks[i][0]) if tasks[i] else "" for i in order]
        return self._episode_tasks[row]

    def episode_limit(self, episode: int | None = None) -> int:
        """The episode limit an episode's returns are normalised by: its task's across the mixture
        (`resolve_episode_limits`), else this dataset's field `max_episode_steps` or recording's, else its longest
        episode."""
        limits = getattr(self, "task_limits", None)
        if limits and episode is not None:
            task = self.episode_task(self.row(episode))
            if task in limits:
                return int(limits[task])
        declared, _ = self.declared_limit()
        if declared is not None:
            longest = int(self.episodes["length"].max()) if self.num_episodes else 1
            return max(declared, longest)
        return int(self.episodes["length"].max()) if self.num_episodes else 1

    def frame_returns(self, episode: int, failure_cost: float | None = None) -> np.ndarray | None:
        """The normalised returns of an episode's frames (`hf_vla.models.value.returns`), None for an unknown outcome."""
        from hf_vla.models.value.returns import episode_returns

        row = self.row(episode)
        outcome = self.episode_outcomes(allow_unlabelled=True)[row]
        if np.isnan(outcome):
            return None
        return episode_returns(int(self.episodes["length"][row]), bool(outcome), self.episode_limit(episode),
                               failure_cost)

    def task(self, task_index: int, episode: int | None = None) -> str:
        if self.config.task is not None:
            return self.config.task
        if self._shuffled_tasks is not None:
            return str(self._shuffled_tasks[self.row(int(episode))])
        try:
            return self.tasks[int(task_index)]
        except KeyError:
            raise DataError(f"dataset {self.name!r}: task_index {int(task_index)} (episode {episode}) is not in "
                            f"{self.root / 'meta/tasks.parquet'}") from None

    # ---- statistics ----------------------------------------------------------------------------------------------
    def scan(self, max_frames: int = MAX_STATS_FRAMES, seed: int = 0):
        """The start-up scan of this dataset (`hf_vla.data.scan.scan_source`: every row and video checked, the
        quantile sample), taken: its content hash kept for the training stream's resume check, and its cached rows
        (when the cache holds them) read by `episode_table` from then on."""
        from hf_vla.data.scan import scan_source

        result = scan_source(self, max_frames=max_frames, seed=seed)
        self.episode_rows = result.rows
        self.content_fingerprint, self.content_detail = result.content, result.detail
        return result

    def column_values(self, max_frames: int = MAX_STATS_FRAMES, seed: int = 0) -> dict[str, np.ndarray]:
        """state / actions of (a seeded subsample of) the used frames, read from parquet only (see `scan`)."""
        result = self.scan(max_frames=max_frames, seed=seed)
        return {"state": result.state, "actions": result.actions, "frames": result.frames}


def resolve_episode_limits(sources: list, given: dict | None = None) -> dict[str, int]:
    """One episode limit per task across `sources` (each source's `task_limits` set): the limit its datasets declare
    (`LeRobotSource.declared_limit`), which must agree (two values for one task are refused, naming both), else the
    `given` one (a value model's own, at annotation), else the task's longest episode in any of them. Returns of a
    task's demonstrations and rollouts are then on one scale."""
    declared: dict[str, dict[str, tuple[int, str]]] = {}
    longest: dict[str, int] = {}
    for source in sources:
        limit, how = source.declared_limit()
        for row in range(source.num_episodes):
            task = source.episode_task(row)
            length = int(source.episodes["length"][row])
            longest[task] = max(longest.get(task, 0), length)
            if limit is not None:
                declared.setdefault(task, {})[source.name] = (limit, how)
    limits: dict[str, int] = {}
    for task in longest:
        found = declared.get(task, {})
        values = sorted({limit for limit, _ in found.values()})
        if len(values) > 1:
            (a, (x, how_a)), (b, (y, how_b)) = [next((n, v) for n, v in found.items() if v[0] == value)
                                                for value in values[:2]]
            raise ConfigError(f"task {task!r}: dataset {a!r} has episode limit {x} ({how_a}) and dataset {b!r} {y} "
                              f"({how_b}); the returns of one task need one limit: set max_episode_steps in the "
                              "dataset entries to the limit the policy runs under")
        if values:
            limits[task] = values[0]
        elif given and task in given:
            limits[task] = int(given[task])
        else:
            limits[task] = longest[task]
        limits[task] = max(limits[task], longest[task])  # an episode longer than the limit (a recording's slack)
    for source in sources:
        source.task_limits = limits
    return limits


def _episode_success(column, where: str) -> float:
    """An episode's outcome from its per-frame `next.success` (bool or 0/1, scalar or 1-element lists): 1.0 where a
    frame says success, 0.0 where every frame says no, NaN (unknown) where no frame says success and some are missing
    (None or NaN: `bool(nan)` is True, so a missing value must never count as a success); other values refused."""
    values = np.asarray([np.nan if v is None else float(v[0] if isinstance(v, list | tuple) else v)
                         for v in column.to_pylist()], dtype=np.float64)
    known = values[np.isfinite(values)]
    odd = known[(known != 0) & (known != 1)]
    if len(odd):
        raise DataError(f"{where}: value {odd[0]:g}; success is 0/1 or a bool per frame")
    if (known == 1).any():
        return 1.0
    return 0.0 if len(known) == len(values) else float("nan")


def _indicator_column(column) -> np.ndarray:
    """A per-frame bool indicator column (bool or 0/1, scalar or a 1-element list per frame) as bool `[n]`."""
    values = [v[0] if isinstance(v, list | tuple) else v for v in column.to_pylist()]
    if any(v is None or (isinstance(v, float) and not np.isfinite(v)) for v in values):  # bool(nan) is True
        raise DataError("an indicator column (advantage) has a missing or NaN value; each frame needs true/false (0/1)")
    return np.asarray([bool(v) for v in values], dtype=bool)
