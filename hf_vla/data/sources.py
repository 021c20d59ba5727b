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
import os
import string
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from av.video.reformatter import VideoReformatter

from hf_vla.data.scan import vector_column
from hf_vla.errors import ConfigError, DataError, FeatureKeyError, MissingFileError

logger = logging.getLogger("hf_vla.data")
NUMERIC_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")


@dataclass
class DatasetConfig:
    """How one LeRobot dataset feeds the model (its feature mapping). Everything is configuration, no code.

    repo_id: Hub id (e.g. `lerobot/droid_1.0.1`); root: local dataset directory (either or both). With a repo_id
        and no root the dataset lives in lerobot's cache (`$HF_LEROBOT_HOME/<repo_id>`): its metadata is fetched
        first, then only the data and video files of the episodes and cameras the run uses (resumable, with a
        progress bar; with `HF_HUB_OFFLINE=1` a dataset already there trains offline).
    revision: the Hub revision (branch, tag or commit) of a repo_id dataset (default: lerobot's codebase version tag).
    name: display name for metrics (`eval_by_dataset/<name>/mse`); defaults to the repo id or directory name.
    weight: mixture weight (relative frequency of its frames in training batches).
    cameras: source camera key for each model camera slot, in slot order; `null` leaves a slot empty
        (`pixel_attention_mask=False`).
    state_key / action_key: the dataset's state and action features (numeric vectors).
    robot_type / control_mode: the normalization head is `robot_type::control_mode` (robot_type defaults to the
        dataset's metadata). Without both, the head is the dataset name.
    fps: expected frame rate; a mismatch with the metadata is an error (chunks are in dataset frames).
    task: override the task string of every frame.
    keep_ranges: `{"<episode key>": [[start, end], ...]}` (a dict, a JSON file path, `hf://[datasets/]ns/name/path`
        or an http(s) URL, fetched once and cached): only these frame ranges
        (`start` inclusive, `end` exclusive) are used, each as its own block; episodes absent from it are dropped.
        Reversed, empty and out-of-episode ranges and malformed entries are reported (a warning naming counts and
        examples while some ranges survive; an error when none does); ranges reaching past an episode's end are
        clipped to it.
    keep_ranges_key: how an episode's key is derived: a format string over the episode's metadata columns plus
        `episode_index`, `repo_id` and `name` (default `"{episode_index}"`).
    shuffle_tasks_seed: a language-blind control: every episode gets the task of another episode (a seeded
        permutation), so instructions carry no information about the episode.
    quantile_stats: `"exact"` (default) computes q01/q99 from the state/action columns (no video is read; at most
        2M frames, subsampled with a fixed seed); `"metadata"` uses `meta/stats.json`, whose quantiles lerobot builds
        as a frame-weighted mean of per-episode quantiles (too narrow when episodes cover different ranges). Either
        way the start-up scan checks every state/action value for NaN/inf.
    target_text_key: a per-frame string column (e.g. a subtask annotation) the backbone learns to predict after the
        chunk's FAST tokens under `token_loss` (docs/cotraining.md); a training target only (never a model input).
        Checked at start-up in every used row: present, a string.
    action_chunk_key: a per-frame column holding the frame's whole target chunk, `[H x action_dim]` flattened (H at
        least the model's chunk size; its first chunk-size steps are used, none padded), instead of the chunk being
        read from the next frames' actions: a DAgger recording's `action_plan`, the expert's own chunk from each
        visited state (hf_vla.envs.dagger). Same units as the actions (normalised with their statistics).
    normalization: how the head's state and actions are normalised, `{"state": MODE, "actions": MODE}` with lerobot's
        modes (`QUANTILES`, pi0.5's default; `MEAN_STD`, lerobot's pi0.5 LIBERO recipe; `MIN_MAX`, `QUANTILE10`,
        `IDENTITY`); lerobot's `normalization_mapping` keys (`STATE`, `ACTION`, `VISUAL`: IDENTITY only) work too.
        Saved with the processor and in the deployment contract; datasets of one head must agree.
    relative_actions: actions as offsets from the frame's state (openpi's `DeltaActions`, lerobot's
        `use_relative_actions`): `true` (every action dim but those `relative_exclude_joints` names, lerobot's rule),
        or an explicit mask as openpi's `make_bool_mask` (`[true] * 7 + [false]`: 7 joints delta, gripper absolute;
        dims past the mask are absolute). Every step of a chunk is relative to the frame's own state; the action
        statistics are computed at start-up over the relative chunks trained on (`chunk_size` steps), never taken
        from `meta/stats.json`. Inference adds the observation's state back (recorded with the checkpoint).
    relative_exclude_joints: with `relative_actions: true`, action names kept absolute (default `["gripper"]`; a dim
        is excluded when a name equals its action name or is a substring of it, case-insensitively). A name given
        here that matches no action name is refused.
    outlier_widths: the start-up scan refuses a state/action value farther than this many q01..q99 widths outside
        that range (per dim; the width is at least 1e-3 of the dim's magnitude, so a constant dim tolerates its own
        scale): bit rot in a parquet page body decodes to values like 1e38 that pass every format check. `null`
        turns the check off for data whose rare extremes are real.
    """

    repo_id: str | None = None
    root: str | None = None
    revision: str | None = None
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
    outlier_widths: float | None = 1e4
    target_text_key: str | None = None
    action_chunk_key: str | None = None
    normalization: dict | None = None
    relative_actions: bool | list[bool] | None = None
    relative_exclude_joints: list[str] | None = None

    def __post_init__(self):
        if self.quantile_stats not in ("exact", "metadata"):
            raise ConfigError(f"dataset {self.name or self.repo_id!r}: quantile_stats must be 'exact' or 'metadata', "
                              f"got {self.quantile_stats!r}")
        if self.repo_id is None and self.root is None:
            raise ConfigError("DatasetConfig needs repo_id or root")
        if self.outlier_widths is not None and not (isinstance(self.outlier_widths, int | float)
                                                    and self.outlier_widths > 0):
            raise ConfigError(f"dataset {self.name or self.repo_id!r}: outlier_widths must be a positive number or "
                              f"null, got {self.outlier_widths!r}")
        if self.name is None:
            self.name = self.repo_id or Path(self.root).name
        if not self.weight > 0:
            raise ConfigError(f"dataset {self.name!r}: weight must be > 0, got {self.weight}")
        if not isinstance(self.cameras, list) or not self.cameras or not any(self.cameras):
            raise ConfigError(f"dataset {self.name!r}: `cameras` must map at least one model camera slot to a camera key")
        from hf_vla.models.pi05.normalization import parse_mapping

        try:
            self.normalization = parse_mapping(self.normalization, f"dataset {self.name!r}: normalization") or None
        except ValueError as error:
            raise ConfigError(str(error)) from None
        relative = self.relative_actions
        if isinstance(relative, list):
            if not relative or not all(isinstance(m, bool) or m in (0, 1) for m in relative):
                raise ConfigError(f"dataset {self.name!r}: relative_actions as a mask is a non-empty list of true/false "
                                  f"(openpi's make_bool_mask), got {relative!r}")
            self.relative_actions = [bool(m) for m in relative]
        elif relative is not None and not isinstance(relative, bool):
            raise ConfigError(f"dataset {self.name!r}: relative_actions must be true/false or a list of true/false "
                              f"(a mask), got {relative!r}")
        if self.relative_exclude_joints is not None:
            if self.relative_actions is not True:
                raise ConfigError(f"dataset {self.name!r}: relative_exclude_joints names action dims kept absolute "
                                  "with relative_actions: true (an explicit mask says it itself)")
            if not isinstance(self.relative_exclude_joints, list) or not all(
                    isinstance(n, str) for n in self.relative_exclude_joints):
                raise ConfigError(f"dataset {self.name!r}: relative_exclude_joints must be a list of action names, got "
                                  f"{self.relative_exclude_joints!r}")


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


class BlockList(Sequence):
    """Blocks of one source held as an int64 array `[n, 3]` (episode, start, end); items are `Block`s on access.

    92k episodes cost 2 MB here instead of 92k Python objects in every rank and DataLoader worker.
    """

    def __init__(self, source: int, ranges: np.ndarray):
        self.source = source
        self.ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)

    def __len__(self) -> int:
        return len(self.ranges)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return BlockList(self.source, self.ranges[index])
        episode, start, end = self.ranges[index]
        return Block(self.source, int(episode), int(start), int(end))

    def __iter__(self) -> Iterator[Block]:
        for episode, start, end in self.ranges.tolist():
            yield Block(self.source, episode, start, end)

    @property
    def frames(self) -> int:
        return int((self.ranges[:, 2] - self.ranges[:, 1]).sum())


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
        info_file = root / "meta" / "info.json"
        if not info_file.is_file():
            raise MissingFileError(f"dataset {name!r}: {info_file} not found (is root a LeRobot dataset?)")
        try:
            info = json.loads(info_file.read_text())
        except json.JSONDecodeError as error:
            raise DataError(f"dataset {name!r}: {info_file} is not valid JSON ({error})") from error
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

    def _episode_files(self) -> list[Path]:
        return sorted((self.root / "meta" / "episodes").glob("*/*.parquet"))

    def _read_episode_table(self, columns: list[str], required: bool = True) -> pa.Table:
        tables = []
        for path in self._episode_files():
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
        self._file_of_row = inverse
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
            from hf_vla.models.pi05.normalization import mask_from_names

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
        available = set(pq.read_schema(self._episode_files()[0]).names) - {"tasks"}
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

    def _load_keep_ranges_spec(self) -> dict:
        spec = self.config.keep_ranges
        if isinstance(spec, str | os.PathLike):
            from hf_vla.hub.resolve import fetch_file, is_remote

            path = fetch_file(spec, f"dataset {self.name!r}: keep_ranges") if is_remote(spec) else Path(spec)
            if not path.is_file():
                raise MissingFileError(f"dataset {self.name!r}: keep_ranges file {path} not found")
            try:
                spec = json.loads(path.read_text())
            except json.JSONDecodeError as error:
                raise DataError(f"dataset {self.name!r}: keep_ranges file {path} is not valid JSON ({error})") from error
        if not isinstance(spec, dict):
            raise DataError(f"dataset {self.name!r}: keep_ranges must map episode keys to [[start, end], ...] lists, "
                            f"got {type(spec).__name__}")
        if not spec:
            where = f" ({self.config.keep_ranges})" if isinstance(self.config.keep_ranges, str) else ""
            raise DataError(f"dataset {self.name!r}: the keep_ranges filter{where} is empty: it would keep no frame")
        return spec

    def _block_ranges(self) -> np.ndarray:
        """`[n, 3]` (episode, start, end) of the blocks: whole episodes, or the kept ranges (validated)."""
        lengths = self.episodes["length"].astype(np.int64)
        if self.config.keep_ranges is None:
            return np.stack([self.episodes["episode_index"].astype(np.int64), np.zeros_like(lengths), lengths], axis=1)
        self.keep_ranges = True
        spec = self._load_keep_ranges_spec()
        keys = self.episode_keys()
        row_of_key = {key: row for row, key in enumerate(keys)}
        rows, starts, ends, malformed, unmatched = [], [], [], [], []
        matched = 0
        for key, ranges in spec.items():
            row = row_of_key.get(key)
            if row is None:
                unmatched.append(key)
                continue
            matched += 1
            if not isinstance(ranges, list):
                malformed.append(f"{key}: {ranges!r}")
                continue
            for item in ranges:
                if (isinstance(item, list | tuple) and len(item) == 2
                        and all(isinstance(v, int) and not isinstance(v, bool) for v in item)):
                    rows.append(row)
                    starts.append(item[0])
                    ends.append(item[1])
                else:
                    malformed.append(f"{key}: {item!r}")
        rows, starts, ends = (np.asarray(v, dtype=np.int64) for v in (rows, starts, ends))
        length = lengths[rows]
        reversed_ = ends < starts
        empty = ends == starts
        outside = ~reversed_ & ~empty & ((starts >= length) | (ends <= 0))
        valid = ~(reversed_ | empty | outside)
        clipped = valid & ((starts < 0) | (ends > length))
        problems = []

        def examples(mask):
            picked = np.flatnonzero(mask)[:3]
            return ", ".join(f"{keys[rows[i]]} [{starts[i]}, {ends[i]}] (length {length[i]})" for i in picked)

        for label, mask in (("reversed (end < start)", reversed_), ("empty (end == start)", empty),
                            ("outside their episode", outside), ("clipped to their episode", clipped)):
            if mask.any():
                problems.append(f"{int(mask.sum())} {label}, e.g. {examples(mask)}")
        if malformed:
            problems.append(f"{len(malformed)} malformed entries (not [start, end] integer pairs), e.g. "
                            f"{'; '.join(malformed[:3])}")
        total = len(rows) + len(malformed)
        kept_rows, kept_starts = rows[valid], np.maximum(starts[valid], 0)
        kept_ends = np.minimum(ends[valid], length[valid])
        if not len(kept_rows):
            if not matched:
                raise DataError(
                    f"dataset {self.name!r}: the keep_ranges filter matches no episode: none of its "
                    f"{len(spec)} keys equals an episode key (filter keys like {list(spec)[:3]}, episode keys like "
                    f"{keys[:3]}); check keep_ranges_key ({self.config.keep_ranges_key!r})"
                )
            raise DataError(
                f"dataset {self.name!r}: the keep_ranges filter keeps no frame: its keys match {matched} episodes, "
                f"but all {total} of their ranges are invalid: {'; '.join(problems)}"
            )
        order = np.lexsort((kept_starts, kept_rows))
        kept_rows, kept_starts, kept_ends = kept_rows[order], kept_starts[order], kept_ends[order]
        overlap = (kept_rows[1:] == kept_rows[:-1]) & (kept_starts[1:] < kept_ends[:-1])
        if overlap.any():
            problems.append(f"{int(overlap.sum())} overlapping another range of the same episode (their frames are "
                            "used twice)")
        if unmatched:
            problems.append(f"{len(unmatched)} filter keys match no episode (e.g. {unmatched[:3]})")
        if problems:
            logger.warning("dataset %r: keep_ranges: %d of %d ranges kept; %s", self.name, len(kept_rows), total,
                           "; ".join(problems))
        self.keep_range_report = {"kept": int(len(kept_rows)), "total": int(total), "problems": problems}
        episodes = self.episodes["episode_index"].astype(np.int64)[kept_rows]
        return np.stack([episodes, kept_starts, kept_ends], axis=1)

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
        return {self._data_path_of_row(int(group[0])): group for group in self._group(rows, self._file_of_row[rows])}

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
            extra = [key for key in (self.config.target_text_key, self.config.action_chunk_key) if key is not None]
            if extra:
                rows = self._episode_rows(episode, row, length, [*extra, "episode_index"])
                if self.config.target_text_key is not None:
                    table["target_text"] = rows[self.config.target_text_key].to_pylist()
                if self.config.action_chunk_key is not None:
                    table["action_chunks"] = self._action_chunks(rows, episode, row)
            return table
        columns = [self.config.state_key, self.config.action_key, "task_index", "episode_index"]
        if self.config.target_text_key is not None:
            columns.append(self.config.target_text_key)
        if self.config.action_chunk_key is not None:
            columns.append(self.config.action_chunk_key)
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
        if self.config.action_chunk_key is not None:
            out["action_chunks"] = self._action_chunks(table, episode, row)
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
    def column_values(self, max_frames: int = 2_000_000, seed: int = 0) -> dict[str, np.ndarray]:
        """state / actions of (a seeded subsample of) the used frames, read from parquet only (see `scan`)."""
        from hf_vla.data.scan import scan_source

        result = scan_source(self, max_frames=max_frames, seed=seed)
        return {"state": result.state, "actions": result.actions, "frames": result.frames}


class VideoReader:
    """Sequential decoding of one camera of one block, resized with aspect-preserving padding while decoding."""

    def __init__(self, path: Path, start_time: float, fps: float, image_size: int, episode: int | None = None,
                 threads: int = 0):
        self.path = path
        self.fps = fps
        self.image_size = image_size
        self.episode = episode
        try:
            self.container = av.open(str(path))
        except (FileNotFoundError, av.error.FileNotFoundError) as error:
            raise MissingFileError(f"video file {path} is missing") from error
        except av.FFmpegError as error:
            raise DataError(f"{self._where()}: cannot open the video ({error})") from error
        self.stream = self.container.streams.video[0]
        if threads < 0:  # FFmpeg's choice (one thread per core, per decoder)
            self.stream.thread_type = "AUTO"
        elif threads > 1:
            self.stream.thread_type = "AUTO"  # frame and slice threads, at most `threads`
            self.stream.codec_context.thread_count = threads
        else:
            self.stream.thread_type = "SLICE"  # no frame threads: one decoder per open block, dozens per worker
            self.stream.codec_context.thread_count = 1
        self.start_time = start_time
        self._frames = None
        self._last = None
        self._scaled = None
        # One swscale context for the whole block: `VideoFrame.to_ndarray(width=...)` builds a new one for every frame
        # (filter set-up cost 0.8 ms vs 0.36 ms per 640x480 -> 224 frame; same pixels).
        self._reformatter = VideoReformatter()

    def _where(self) -> str:
        return f"{self.path}" + (f" (episode {self.episode})" if self.episode is not None else "")

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
        try:
            if self._frames is None or (self._last is not None and target < self._last[0] - 1e-6):
                self._seek(target)
            tolerance = 0.5 / self.fps
            while self._last is None or self._last[0] < target - tolerance:
                try:
                    decoded = next(self._frames)
                except StopIteration:
                    if self._last is not None and abs(self._last[0] - target) < 2 * tolerance:
                        break
                    end = f"{self._last[0]:.3f}s" if self._last else "its start"
                    raise DataError(f"{self._where()}: no frame at {target:.3f}s (frame {index}); the video ends at "
                                    f"{end}: truncated, or shorter than meta/episodes says") from None
                self._last = (float(decoded.time), decoded)
        except av.FFmpegError as error:
            raise DataError(f"{self._where()}: cannot decode frame {index} at {target:.3f}s ({error}); the file is "
                            "corrupt or truncated") from error
        decoded = self._last[1]
        height, width = self._scale(decoded.height, decoded.width)
        array = self._reformatter.reformat(decoded, format="rgb24", width=width, height=height,
                                           interpolation="AREA").to_ndarray()
        if out is None:
            out = torch.zeros(3, self.image_size, self.image_size, dtype=torch.uint8)
        top, left = (self.image_size - height) // 2, (self.image_size - width) // 2
        out[:, top : top + height, left : left + width] = torch.from_numpy(array).permute(2, 0, 1)
        return out

    def close(self):
        self.container.close()
