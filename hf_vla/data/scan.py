"""The start-up scan of one dataset: every check that reads data, and the sample the exact quantiles come from.

It reads the state, action and index columns of every data file the run uses (no video frame is decoded) and the
container of every video file, and checks:

- each data file holds exactly its episodes' rows, in order, with frame indices 0..length-1 (what meta/episodes says;
  per-episode reads rely on it);
- every used state/action value (and `action_chunk_key`'s, where set) is finite (a NaN/inf is reported with dataset,
  file, episode, frame, column, dim) and lies within `outlier_widths` q01..q99 widths of that range (bit rot in a page
  body decodes to values like 1e38);
- the pages' CRC checksums, where the writer stored them (pyarrow's `write_page_checksum`), verify;
- every used task index is in meta/tasks.parquet;
- every video reaches the end of the last episode that uses it (container duration, and the tail is demuxed, which
  finds truncated files without decoding).

The result (frame count and a seeded sample of at most `max_frames` rows for the quantiles) is cached on disk under
`$HF_VLA_CACHE` (default `$HF_HOME/hf_vla/scan`), keyed by a fingerprint of the dataset's files (names, sizes,
modification and status-change times), the keep-ranges selection and the feature mapping: later runs and other ranks
read it instead of scanning, and a dataset that changed gets a new fingerprint and is scanned again. The status-change
time (ctime) is in the key because no copy tool can set it: a file edited in place whose size is kept and whose mtime
is restored (`cp -p`, `rsync -t` over an edit, bit rot repaired by hand) still gets a new ctime, so its content is
read again rather than taken from the cache; the price is a re-scan after a dataset is copied or moved.

The same pass writes every row of the used episodes (state, actions, task index; float32) into the cache entry as
`.npy` files: a block opening then reads its episode with one positioned read, whatever the parquet row groups are
(lerobot's converter, which published DROID, writes about a million rows per row group; a parquet read of one episode
would decode all of them). That is 68 bytes per frame with DROID's 8-dim state and actions: 1.8 GB for 26.7M frames.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hf_vla.errors import DataError

logger = logging.getLogger("hf_vla.data")
# `source` below is a `hf_vla.data.sources.LeRobotSource`, read through its public attributes only (config, root, name,
# episodes, ranges, file_of_row, episode_files(), data_files(), ...); the scan changes nothing of it and returns a
# `ScanResult` the source takes (`LeRobotSource.scan`). No import of sources here: the source imports this module.
SCAN_VERSION = 5  # 4: the content hash of the used rows; 5: ctime in the key, per-episode hashes
MAX_STATS_FRAMES = 2_000_000


class EpisodeRows:
    """The scan's copy of every used episode's rows; `read` takes one episode with a positioned read per array."""

    def __init__(self, directory: Path, state_dim: int, action_dim: int):
        self.directory = Path(directory)
        self.offsets = np.load(self.directory / "offsets.npy")  # first row of each episode-table row, -1 if unused
        self.arrays = {}
        for name, dim, dtype in (("state", state_dim, np.float32), ("actions", action_dim, np.float32),
                                 ("task_index", 0, np.int64)):
            path = self.directory / f"{name}.npy"
            with open(path, "rb") as handle:
                version = np.lib.format.read_magic(handle)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, file_dtype = read_header(handle)
                start = handle.tell()
            expected = start + int(np.prod(shape)) * np.dtype(file_dtype).itemsize
            if np.dtype(file_dtype) != np.dtype(dtype) or (dim and shape[1:] != (dim,)) or \
                    path.stat().st_size != expected:
                raise ValueError(f"{path}: shape {shape} / dtype {file_dtype} / size {path.stat().st_size} do not fit")
            self.arrays[name] = (path, start, np.dtype(dtype), dim)

    def read(self, row: int, length: int) -> dict:
        first = int(self.offsets[row])
        if first < 0:
            raise KeyError(f"episode row {row} was not scanned (not used by this run)")
        out = {}
        for name, (path, start, dtype, dim) in self.arrays.items():
            width = max(dim, 1)
            values = np.fromfile(path, dtype=dtype, count=length * width, offset=start + first * width * dtype.itemsize)
            out[name] = values.reshape(length, dim) if dim else values
        return out


class _RowWriter:
    """Appends rows to a `.npy` file of known final shape with plain writes (no memory map: nothing of it stays in
    this process's memory)."""

    def __init__(self, path: Path, rows: int, dim: int, dtype):
        self.handle = open(path, "wb")
        shape = (rows, dim) if dim else (rows,)
        np.lib.format.write_array_header_1_0(self.handle, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                           "fortran_order": False, "shape": shape})
        self.dtype = dtype

    def append(self, values: np.ndarray):
        self.handle.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())

    def close(self):
        self.handle.close()


@dataclass
class ScanResult:
    frames: int  # used frames (rows inside the kept ranges)
    state: np.ndarray  # [m, state_dim] sample (all rows when frames <= max_frames), in the data's dtype
    actions: np.ndarray  # [m, action_dim]
    cached: bool = False
    # A hash of what training reads from the data files: every kept row's episode, frame, state, actions and task
    # index. Unlike the cache key (sizes and modification times) it does not change when a dataset is copied or moved,
    # and it does change when a value does (a resume compares it: `EpisodeShuffleStream.load_state_dict`).
    content: str = ""
    # The same content per data file (its path under the dataset root): the file's hash and a hash per kept episode,
    # so a resume that finds the content changed can name the file and the episodes (`content_difference`).
    detail: dict | None = None
    # every used episode's state/action rows as cached beside the scan (None without the cache): the source reads its
    # episodes from there afterwards (`LeRobotSource.scan`)
    rows: EpisodeRows | None = None


def cache_dir() -> Path:
    """Where scans are cached: `scan/` under hf_vla's cache (`hf_vla.storage.cache_root`)."""
    from hf_vla.storage import cache_root

    return cache_root() / "scan"


def _stat(path: Path) -> list:
    info = path.stat()
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def vector_column(column: pa.ChunkedArray | pa.Array, dim: int, what: str) -> np.ndarray:
    """A list column of `dim` numbers per row as a `[rows, dim]` array; a DataError naming `what` otherwise."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = array.type
    if not (pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise DataError(f"{what} is a scalar column ({kind}), not a vector: state and actions must be numeric vectors")
    if not (pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type)):
        raise DataError(f"{what} holds {kind.value_type} values, not numbers")
    if array.null_count:
        raise DataError(f"{what} has {array.null_count} null rows")
    if not pa.types.is_fixed_size_list(kind):
        import pyarrow.compute as pc

        lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != dim).any():
            row = int(np.flatnonzero(lengths != dim)[0])
            raise DataError(f"{what}: row {row} has {lengths[row]} values, the feature has {dim}")
    elif kind.list_size != dim:
        raise DataError(f"{what} has {kind.list_size} values per row, meta/info.json says {dim}")
    return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), dim)


def fingerprint(source, max_frames: int, seed: int) -> str:
    """Changes when any file the scan reads changes, or the selection / feature mapping / sampling does."""
    config = source.config
    digest = hashlib.sha256()
    digest.update(json.dumps({
        "version": SCAN_VERSION, "state_key": config.state_key, "action_key": config.action_key,
        "cameras": [c for c in config.cameras if c], "max_frames": max_frames, "seed": seed,
        "check_tasks": config.task is None and config.shuffle_tasks_seed is None,
        "outlier_widths": getattr(config, "outlier_widths", None),
        "target_text_key": getattr(config, "target_text_key", None),
        # only where set: the key's absence keeps the fingerprints (and caches) of every other dataset as they were
        **({"action_chunk_key": config.action_chunk_key} if getattr(config, "action_chunk_key", None) else {}),
    }, sort_keys=True).encode())
    digest.update(np.ascontiguousarray(source.ranges).tobytes())
    root = source.root
    files = [root / "meta" / "info.json", root / "meta" / "tasks.parquet", *source.episode_files(),
             *sorted(source.data_files())]
    for camera in config.cameras:
        if camera:
            files += sorted(source.video_files(camera))
    for path in files:
        if path.exists():
            digest.update(json.dumps([str(path.relative_to(root)), *_stat(path)]).encode())
    return digest.hexdigest()[:32]


def merged_ranges(ranges: np.ndarray) -> np.ndarray:
    """Union of (episode, start, end) ranges, per episode, as non-overlapping ranges sorted by episode and start."""
    if not len(ranges):
        return ranges
    ranges = ranges[np.lexsort((ranges[:, 1], ranges[:, 0]))]
    out = [list(ranges[0])]
    for episode, start, end in ranges[1:].tolist():
        last = out[-1]
        if episode == last[0] and start <= last[2]:
            last[2] = max(last[2], end)
        else:
            out.append([episode, start, end])
    return np.asarray(out, dtype=np.int64)


def kept_mask(episodes: np.ndarray, frames: np.ndarray, merged: np.ndarray) -> np.ndarray:
    """Rows (episode, frame) inside one of the `merged` ranges, vectorised."""
    keys = episodes.astype(np.int64) * (1 << 32) + frames
    starts = merged[:, 0] * (1 << 32) + merged[:, 1]
    index = np.searchsorted(starts, keys, side="right") - 1
    valid = index >= 0
    index = np.clip(index, 0, None)
    return valid & (merged[index, 0] == episodes) & (frames < merged[index, 2])


def _read_file(source, path: Path) -> pa.Table:
    config = source.config
    columns = [config.state_key, config.action_key, "episode_index", "frame_index", "task_index"]
    for key in (getattr(config, "target_text_key", None), getattr(config, "action_chunk_key", None)):
        if key:
            columns.append(key)
    try:
        present = pq.read_schema(path).names
        missing = [c for c in columns if c not in present]
        if missing:
            raise DataError(f"dataset {source.name!r}: {path} lacks the column(s) {missing}")
        return pq.read_table(path, columns=columns, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"dataset {source.name!r}: {path} is not a readable parquet file ({error})") from error


def _check_layout(source, path: Path, table: pa.Table, file_rows: np.ndarray):
    """The file holds exactly the episodes meta/episodes places in it, contiguous, frames 0..length-1."""
    episodes_meta = source.episodes["episode_index"][file_rows]
    lengths = source.episodes["length"][file_rows].astype(np.int64)
    order = np.argsort(source.episodes["file_row"][file_rows], kind="stable")
    episodes_meta, lengths = episodes_meta[order], lengths[order]
    expected = int(lengths.sum())
    if table.num_rows != expected:
        raise DataError(f"dataset {source.name!r}: {path} has {table.num_rows} rows, but meta/episodes places "
                        f"{expected} rows of episodes {episodes_meta[0]}..{episodes_meta[-1]} in it (truncated or "
                        "rewritten file, or stale metadata)")
    episodes = table["episode_index"].to_numpy()
    frames = table["frame_index"].to_numpy()
    expected_episodes = np.repeat(episodes_meta, lengths)
    expected_frames = np.arange(expected) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    bad = (episodes != expected_episodes) | (frames != expected_frames)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DataError(f"dataset {source.name!r}: {path} row {row} holds episode {episodes[row]} frame {frames[row]}, "
                        f"meta/episodes says episode {expected_episodes[row]} frame {expected_frames[row]}")
    return episodes, frames


def _check_text(source, path: Path, name: str, column, keep, episodes, frames):
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"dataset {source.name!r}: {path} column {name!r} (target_text_key) holds {column.type}, not "
                        "strings")
    missing = np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)[keep])
    if len(missing):
        row = int(missing[0])
        raise DataError(f"dataset {source.name!r}: {path} episode {episodes[row]} frame {frames[row]} has no target "
                        f"text in {name!r} ({len(missing)} used row(s) without one)")


def _check_finite(source, path: Path, name: str, values: np.ndarray, episodes, frames):
    finite = np.isfinite(values)
    if finite.all():
        return
    rows, dims = np.nonzero(~finite)
    raise DataError(
        f"dataset {source.name!r}: {len(rows)} non-finite value(s) in column {name!r} of {path}; first at episode "
        f"{episodes[rows[0]]}, frame {frames[rows[0]]}, dim {dims[0]} ({values[rows[0], dims[0]]}); "
        f"episodes affected: {sorted(set(episodes[rows].tolist()))[:10]}"
    )


class _Extremes:
    """Per column and dim, the smallest and largest used value and where it is (file, episode, frame): enough to find
    values far outside the robust range once the quantiles are known, without keeping the rows."""

    def __init__(self):
        self.found: dict[str, list] = {}

    def add(self, name: str, path: Path, values: np.ndarray, episodes, frames):
        if not len(values):
            return
        for which, index in (("min", values.argmin(axis=0)), ("max", values.argmax(axis=0))):
            picked = values[index, np.arange(values.shape[1])]
            self.found.setdefault(name, []).append((which, picked.astype(np.float64), path, episodes[index],
                                                    frames[index]))

    def check(self, source, name: str, sample: np.ndarray, widths: float | None):
        if widths is None or not len(sample) or name not in self.found:
            return
        # nearest ranks inward ("higher" q01, "lower" q99): an interpolated q99 of a small dataset leans on its
        # largest value, which may be the very outlier being looked for
        q01 = np.array([np.quantile(sample[:, d], 0.01, method="higher") for d in range(sample.shape[1])], np.float64)
        q99 = np.array([np.quantile(sample[:, d], 0.99, method="lower") for d in range(sample.shape[1])], np.float64)
        scale = np.maximum(q99 - q01, 1e-3 * np.maximum(1.0, np.maximum(np.abs(q01), np.abs(q99))))
        for which, values, path, episodes, frames in self.found[name]:
            distance = (q01 - values if which == "min" else values - q99) / scale
            far = np.flatnonzero(distance > widths)
            if far.size:
                d = int(far[np.argmax(distance[far])])
                raise DataError(
                    f"dataset {source.name!r}: column {name!r} of {path}, episode {episodes[d]}, frame {frames[d]}, dim "
                    f"{d}: {values[d]:.6g} lies {distance[d]:.3g} widths outside the column's q01..q99 range "
                    f"[{q01[d]:.6g}, {q99[d]:.6g}]: a corrupt page (bit rot, a bad copy)? If such values are real, "
                    f"raise the dataset's outlier_widths (now {widths:g}) or set it to null")


def check_videos(source) -> int:
    """Every used video file reaches the end of the episodes that use it. Returns the number of files checked."""
    checked = 0
    fps = source.fps
    for camera in source.config.cameras:
        if not camera:
            continue
        start = source.episodes[f"videos/{camera}/from_timestamp"]
        end = source.episodes[f"videos/{camera}/to_timestamp"]
        lengths = source.episodes["length"]
        # lerobot 0.6 writes to_timestamp = from + length/fps; older conversions wrote the last frame's time
        span = (end - start) * fps
        mismatch = (span < lengths - 1.5) | (span > lengths + 0.5)
        last_frame = start + (lengths - 1) / fps
        rows = source.used_rows()
        if mismatch[rows].any():
            row = rows[mismatch[rows]][0]
            raise DataError(f"dataset {source.name!r}: camera {camera!r} episode {source.episodes['episode_index'][row]}"
                            f" spans {start[row]:.3f}..{end[row]:.3f}s of video for {lengths[row]} frames at {fps} fps"
                            " (meta/episodes is inconsistent)")
        for path, file_rows in source.video_files(camera).items():
            last = file_rows[np.argmax(last_frame[file_rows])]
            needed = float(last_frame[last])
            reached = _video_reach(path, needed, fps)
            if reached is None or reached < needed - 0.5 / fps:
                found = "no frame near the end" if reached is None else f"its last frame is at {reached:.3f}s"
                raise DataError(
                    f"dataset {source.name!r}: video {path} ({camera!r}) is truncated or too short: episode "
                    f"{int(source.episodes['episode_index'][last])} needs a frame at {needed:.3f}s, {found}")
            checked += 1
    return checked


def _video_reach(path: Path, needed: float, fps: float) -> float | None:
    """Timestamp of the last packet at or before `needed` (demuxed after a seek near it; nothing decoded)."""
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            container.seek(int(max(0.0, needed - 1.0) / stream.time_base), stream=stream, backward=True)
            reached = None
            for packet in container.demux(stream):
                if packet.pts is None:
                    continue
                reached = float(packet.pts * stream.time_base)
                if reached >= needed - 0.5 / fps:
                    break
            return reached
    except av.FFmpegError as error:
        raise DataError(f"video {path} cannot be read ({error})") from error


def _scan(source, max_frames: int, seed: int, rows_dir: Path | None = None) -> ScanResult:
    config = source.config
    merged = merged_ranges(source.ranges)
    total = int((merged[:, 2] - merged[:, 1]).sum())
    chosen = None
    if total > max_frames:
        chosen = np.sort(np.random.default_rng(seed).choice(total, size=max_frames, replace=False))
    check_tasks = config.task is None and config.shuffle_tasks_seed is None
    known_tasks = np.asarray(sorted(source.tasks), dtype=np.int64)
    states, actions = [], []
    extremes = _Extremes()
    content = hashlib.blake2b(digest_size=16)
    detail = {}
    offset = 0
    used_files = source.data_files()
    writers, offsets, cursor = None, None, 0
    if rows_dir is not None:
        used = source.used_rows()
        rows_total = int(source.episodes["length"][used].sum())
        writers = {"state": _RowWriter(rows_dir / "state.npy", rows_total, source.state_dim, np.float32),
                   "actions": _RowWriter(rows_dir / "actions.npy", rows_total, source.action_dim, np.float32),
                   "task_index": _RowWriter(rows_dir / "task_index.npy", rows_total, 0, np.int64)}
        offsets = np.full(source.num_episodes, -1, dtype=np.int64)
        used_mask = np.zeros(source.num_episodes, dtype=bool)
        used_mask[used] = True
    # every episode of a file (also the unused ones) is checked against the file's layout
    order = np.argsort(source.file_of_row, kind="stable")
    bounds = np.searchsorted(source.file_of_row[order], np.arange(source.file_of_row.max() + 2))
    from hf_vla.cli import progress_bar

    # a DROID-size scan reads thousands of files for minutes: a live bar, or a line every 30 s in a log
    bar = progress_bar(len(used_files), f"scanning {source.name}", "files", final_line=False)
    for path in sorted(used_files):
        bar.update(1)
        file_id = source.file_of_row[used_files[path][0]]
        file_rows = order[bounds[file_id] : bounds[file_id + 1]]
        table = _read_file(source, path)
        pa.default_memory_pool().release_unused()  # the previous file's buffers: keep the pool from growing
        episodes, frames = _check_layout(source, path, table, file_rows)
        keep = kept_mask(episodes, frames, merged)
        where = f"dataset {source.name!r}: {path} column"
        all_state = vector_column(table[config.state_key], source.state_dim, f"{where} {config.state_key!r}")
        all_action = vector_column(table[config.action_key], source.action_dim, f"{where} {config.action_key!r}")
        if writers is not None:  # every row of the used episodes of this file, in file order
            ordered = file_rows[np.argsort(source.episodes["file_row"][file_rows], kind="stable")]
            used_here = ordered[used_mask[ordered]]
            lengths = source.episodes["length"][used_here]
            offsets[used_here] = cursor + np.concatenate([[0], np.cumsum(lengths)[:-1]])
            cursor += int(lengths.sum())
            rows = used_mask[np.searchsorted(source.episodes["episode_index"], episodes)]
            writers["state"].append(all_state[rows])
            writers["actions"].append(all_action[rows])
            writers["task_index"].append(table["task_index"].to_numpy()[rows])
        state, action = all_state[keep], all_action[keep]
        kept_episodes, kept_frames = episodes[keep], frames[keep]
        parts = [np.ascontiguousarray(part) for part in (
            kept_episodes.astype(np.int64), kept_frames.astype(np.int64), state.astype(np.float32),
            action.astype(np.float32), table["task_index"].to_numpy()[keep].astype(np.int64))]
        for part in parts:
            content.update(part.data)
        detail[str(path.relative_to(source.root))] = _episode_hashes(parts)
        if getattr(config, "target_text_key", None):  # every used row has its target text, a string
            _check_text(source, path, config.target_text_key, table[config.target_text_key], keep, kept_episodes,
                        kept_frames)
        _check_finite(source, path, config.state_key, state, kept_episodes, kept_frames)
        _check_finite(source, path, config.action_key, action, kept_episodes, kept_frames)
        if getattr(config, "action_chunk_key", None):  # the frames' own target chunks (e.g. a DAgger round's plan)
            chunks = vector_column(table[config.action_chunk_key], source.chunk_steps * source.action_dim,
                                   f"{where} {config.action_chunk_key!r}")
            _check_finite(source, path, config.action_chunk_key, chunks[keep], kept_episodes, kept_frames)
        extremes.add(config.state_key, path, state, kept_episodes, kept_frames)
        extremes.add(config.action_key, path, action, kept_episodes, kept_frames)
        if check_tasks:
            tasks = table["task_index"].to_numpy()[keep]
            unknown = ~np.isin(tasks, known_tasks)
            if unknown.any():
                row = int(np.flatnonzero(unknown)[0])
                raise DataError(f"dataset {source.name!r}: {path} episode {kept_episodes[row]} frame {kept_frames[row]} "
                                f"has task_index {tasks[row]}, which is not in {source.root / 'meta/tasks.parquet'} "
                                f"(known: {known_tasks.tolist()[:10]})")
        count = len(state)
        if chosen is None:
            states.append(state)
            actions.append(action)
        else:
            lo, hi = np.searchsorted(chosen, [offset, offset + count])
            picked = chosen[lo:hi] - offset
            states.append(state[picked])
            actions.append(action[picked])
        offset += count
        del table
    bar.close()
    if writers is not None:
        for writer in writers.values():
            writer.close()
        np.save(rows_dir / "offsets.npy", offsets)
    if offset != total:
        raise DataError(f"dataset {source.name!r}: the data files hold {offset} frames in the kept ranges, "
                        f"meta/episodes and keep_ranges say {total}")
    state_sample, action_sample = np.concatenate(states), np.concatenate(actions)
    widths = getattr(config, "outlier_widths", None)
    extremes.check(source, config.state_key, state_sample, widths)
    extremes.check(source, config.action_key, action_sample, widths)
    check_videos(source)
    # the sample stays in the data's own dtype (float32 for lerobot's features): a float64 copy of 2M x dims x 2 would
    # dominate the start-up's peak memory; quantiles are computed per column in float64
    return ScanResult(total, state_sample, action_sample, content=content.hexdigest(), detail=detail)


def _episode_hashes(parts: list[np.ndarray]) -> dict:
    """One file's kept rows (episode, frame, state, actions, task index; rows in file order, episodes contiguous) ->
    `{"digest": file hash, "episodes": [ids], "hashes": 8 hex digits per episode}`."""
    episodes = parts[0]
    starts = np.flatnonzero(np.r_[True, episodes[1:] != episodes[:-1]]) if len(episodes) else np.zeros(0, int)
    ends = np.r_[starts[1:], len(episodes)]
    hashes = []
    for start, end in zip(starts.tolist(), ends.tolist()):
        digest = hashlib.blake2b(digest_size=4)
        for part in parts:
            digest.update(part[start:end].data)
        hashes.append(digest.hexdigest())
    joined = "".join(hashes)
    return {"digest": hashlib.blake2b(joined.encode(), digest_size=8).hexdigest(),
            "episodes": episodes[starts].tolist(), "hashes": joined}


def _by_episode(entry: dict) -> dict:
    """`_episode_hashes`'s entry of one file -> {episode id: its 8 hex digits}."""
    hashes = entry["hashes"]
    return dict(zip(entry["episodes"], (hashes[i:i + 8] for i in range(0, len(hashes), 8))))


def content_difference(saved: dict | None, current: dict | None) -> str | None:
    """Where two scans' per-file hashes (`ScanResult.detail`) differ: `file F episode E` (and how many more), or None
    when either has no detail or nothing differs."""
    if not saved or not current:
        return None
    changed = []
    for path in sorted(set(saved) | set(current)):
        before, after = saved.get(path), current.get(path)
        if before is None or after is None:
            changed.append((path, None, 0))
            continue
        if before["digest"] == after["digest"]:
            continue
        old, new = _by_episode(before), _by_episode(after)
        episodes = sorted(e for e in set(old) | set(new) if old.get(e) != new.get(e))
        changed.append((path, episodes[0] if episodes else None, len(episodes)))
    if not changed:
        return None
    path, episode, count = changed[0]
    where = f"{path} episode {episode}" if episode is not None else path
    more = []
    if count > 1:
        more.append(f"{count - 1} more episode(s) in that file")
    if len(changed) > 1:
        more.append(f"{len(changed) - 1} more file(s)")
    return where + (f" ({', '.join(more)})" if more else "")


def scan_source(source, max_frames: int = MAX_STATS_FRAMES, seed: int = 0, use_cache: bool = True) -> ScanResult:
    """The checked frame count and quantile sample of `source` (a `hf_vla.data.sources.LeRobotSource`, read through
    its public interface; nothing of it is changed), from the cache when the dataset is unchanged; with the cache, the
    result's `rows` hold every used episode's rows (`LeRobotSource.scan` reads its episodes from them after)."""
    key = fingerprint(source, max_frames, seed)
    directory = cache_dir() / key
    if use_cache and (directory / "scan.npz").is_file():
        try:
            with np.load(directory / "scan.npz") as data:
                result = ScanResult(int(data["frames"]), data["state"], data["actions"], cached=True,
                                    content=str(data["content"]), detail=json.loads(str(data["detail"])),
                                    rows=EpisodeRows(directory, source.state_dim, source.action_dim))
            logger.info("dataset %r: checks, statistics and episode rows from the cache %s", source.name, directory)
            return result
        except (OSError, ValueError, KeyError) as error:  # a damaged cache entry is recomputed
            import shutil

            logger.warning("dataset %r: recomputing the damaged cache %s (%s)", source.name, directory, error)
            shutil.rmtree(directory, ignore_errors=True)
    return _scan_to_cache(source, max_frames, seed, use_cache, key, directory)


def _scan_to_cache(source, max_frames: int, seed: int, use_cache: bool, key: str, directory: Path) -> ScanResult:
    started = time.perf_counter()
    if not use_cache:
        result = _scan(source, max_frames, seed)
        logger.info("dataset %r: scanned %d frames in %.1f s", source.name, result.frames, time.perf_counter() - started)
        return result
    import shutil

    temporary = directory.with_name(f".{key}.{os.getpid()}.tmp")
    try:
        temporary.mkdir(parents=True, exist_ok=True)
        result = _scan(source, max_frames, seed, rows_dir=temporary)
        np.savez(temporary / "scan.npz", frames=result.frames, state=result.state, actions=result.actions,
                 content=result.content, detail=json.dumps(result.detail))
        if directory.exists():  # written meanwhile by another process: keep that one
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            os.replace(temporary, directory)
        result.rows = EpisodeRows(directory, source.state_dim, source.action_dim)
    except OSError as error:  # no room or no permission for the cache: scan without it (parquet reads later)
        shutil.rmtree(temporary, ignore_errors=True)
        logger.warning("dataset %r: could not write the cache %s (%s); reading episodes from parquet", source.name,
                       directory, error)
        result = _scan(source, max_frames, seed)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    logger.info("dataset %r: scanned %d frames in %.1f s", source.name, result.frames, time.perf_counter() - started)
    return result


__all__ = ["MAX_STATS_FRAMES", "EpisodeRows", "ScanResult", "cache_dir", "check_videos", "content_difference",
           "fingerprint", "scan_source"]
