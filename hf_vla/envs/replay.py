"""Object locations added to an existing Meta-World recording, without recording it again.

    python -m hf_vla.record --env metaworld --add_locations data/mt50 --output data/mt50_loc

Meta-World resets from the seed, so each recorded episode can be replayed: its seed is found among the seeds its task
tried (`meta/hf_vla_record.json`; the first whose reset frame is the episode's first frame: failed tries left gaps),
its recorded actions are stepped in order, and at every frame the replay must reproduce the recording (the state
exactly, every `check_every`-th image within `tolerance` levels of the lossless video's). Then the locations the
recorder would have written (`MetaWorldEnv.target_text`: gripper, object and goal as PaliGemma `<loc>` points) are
added as the `locations` column. A replay that departs from the recording stops with one line naming the episode,
frame and what differs; nothing is written until every episode has replayed. The new dataset is staged beside
`--output` and renamed into place; videos are hard-linked where the filesystem allows (copied otherwise).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hf_vla.cli import progress_bar
from hf_vla.deployment.contract import RECORD_MARKER
from hf_vla.envs.metaworld import LOCATIONS
from hf_vla.errors import ConfigError, DataError

logger = logging.getLogger("hf_vla.record")


def _episodes(root: Path, info: dict) -> dict[int, dict]:
    """episode index -> its task description, length and first video frame's place; with its rows' state and action."""
    import pyarrow.parquet as pq

    episodes = {}
    for path in sorted((root / "meta" / "episodes").glob("*/*.parquet")):
        table = pq.read_table(path).to_pydict()
        for row in range(len(table["episode_index"])):
            video = {key.split("/")[-1]: table[key][row] for key in table if key.startswith("videos/observation.image/")}
            episodes[int(table["episode_index"][row])] = {
                "task": table["tasks"][row][0], "length": int(table["length"][row]), "video": video}
    for path in sorted((root / "data").glob("*/*.parquet")):
        table = pq.read_table(path, columns=["episode_index", "frame_index", "observation.state", "action"])
        index = table["episode_index"].to_numpy()
        order = np.lexsort((table["frame_index"].to_numpy(), index))  # by episode, then frame: one pass per file
        state = np.asarray(table["observation.state"].to_pylist(), np.float32)[order]
        action = np.asarray(table["action"].to_pylist(), np.float32)[order]
        starts = np.flatnonzero(np.r_[True, np.diff(index[order]) != 0])
        for start, end in zip(starts, np.r_[starts[1:], len(order)]):
            episode = episodes[int(index[order][start])]
            episode["state"], episode["action"] = state[start:end], action[start:end]
    return episodes


def _video_frames(root: Path, info: dict, episode: dict, fps: float, size: int):
    """The episode's recorded frames, in order, as `[H, W, 3]` uint8."""
    from hf_vla.data.sources import VideoReader

    place = episode["video"]
    path = root / info["video_path"].format(video_key="observation.image", chunk_index=int(place["chunk_index"]),
                                            file_index=int(place["file_index"]))
    reader = VideoReader(path, float(place["from_timestamp"]), fps, size)
    try:
        for index in range(episode["length"]):
            yield reader.frame(index).permute(1, 2, 0).numpy()
    finally:
        reader.close()


def _differs(rendered: np.ndarray, recorded: np.ndarray) -> float:
    return float(np.abs(rendered.astype(np.float64) - recorded.astype(np.float64)).mean())


def add_locations(source: str | os.PathLike, output: str | os.PathLike, check_every: int = 10,
                  tolerance: float = 2.0, overwrite: bool = False, progress: bool = True) -> Path:
    """Write `output`: the Meta-World recording `source` with the per-frame `locations` column, found by replay."""

    source, output = Path(source), Path(output)
    marker_path = source / "meta" / RECORD_MARKER
    if not (source / "meta" / "info.json").is_file():
        raise ConfigError(f"--add_locations {str(source)!r}: not a LeRobot dataset (no meta/info.json)")
    if not marker_path.is_file():
        raise ConfigError(f"--add_locations {str(source)!r}: not a recording of hf_vla.record (no meta/{RECORD_MARKER}):"
                          " its episodes' seeds are unknown, so they cannot be replayed")
    marker, info = json.loads(marker_path.read_text()), json.loads((source / "meta" / "info.json").read_text())
    from hf_vla.registry import find_env

    if not getattr(find_env(marker.get("env")), "locations", False):
        raise ConfigError(f"--add_locations {str(source)!r}: a recording of {marker.get('env')!r}, whose frames have "
                          "no location text (Meta-World's have)")
    if LOCATIONS in info["features"]:
        raise ConfigError(f"--add_locations {str(source)!r}: it already has a {LOCATIONS!r} column")
    from hf_vla.storage import check_output, make_dir

    # never over, above or inside the source; --overwrite replaces only a recording (never a folder of other files)
    check_output("--output", output, overwrite, inputs={"--add_locations": source}, marker=f"meta/{RECORD_MARKER}",
                 what="recording")
    make_dir("--output", output.parent)
    from hf_vla.storage import DirectoryLock

    # one writer of --output at a time (the lock's own folder beside it: the staging folder is made by the copy)
    with DirectoryLock(output.parent / f".{output.name}.writing", label="--output", lock_name="_hf_vla_replay.lock",
                       what=f"another replay into {output}"):
        return _add_locations(source, output, marker, info, check_every, tolerance, overwrite, progress)


def _add_locations(source: Path, output: Path, marker: dict, info: dict, check_every: int, tolerance: float,
                   overwrite: bool, progress: bool) -> Path:
    """`add_locations`' replay and write, with the output's writer lock held."""
    from hf_vla.envs import metaworld

    size, fps = int(marker["image_size"]), float(info["fps"])
    by_description = {}
    for name, stats in marker["tasks"].items():
        by_description.setdefault(stats.get("description") or metaworld.task_description(name), []).append(name)
    episodes = _episodes(source, info)
    recording = _Recording(source, info, fps, size, check_every, tolerance)
    texts: dict[int, list[str]] = {}
    bar = progress_bar(len(episodes), "replaying for locations", "episodes", enabled=progress)
    try:
        for description, names in by_description.items():
            if len(names) > 1:  # lerobot gives push-v3 and push-back-v3 one description
                raise ConfigError(f"{source}: tasks {names} share the description {description!r}, so an episode "
                                  "does not say which it is: replay cannot add their locations")
            (name,) = names
            low, high = marker["tasks"][name]["seeds"]
            env = metaworld.MetaWorldEnv(name, image_size=size, max_episode_steps=int(marker["max_episode_steps"]),
                                         fast_render=bool(marker.get("fast_render", True)),
                                         crop=(marker.get("env_kwargs") or {}).get("crop"))
            try:
                seed = int(low)
                for index in sorted(i for i, e in episodes.items() if e["task"] == description):
                    seed, texts[index] = _replay(env, episodes[index], index, name, seed, int(high), recording)
                    seed += 1
                    bar.update(1)
            finally:
                env.close()
    finally:
        bar.close()
    missing = sorted(set(episodes) - set(texts))
    if missing:
        raise ConfigError(f"{source}: episodes {missing[:5]} belong to no task of meta/{RECORD_MARKER}")
    return _write(source, output, info, marker, texts, overwrite)


@dataclass
class _Recording:
    """The recording being replayed: its root and info.json, fps and image size, and how closely its images are
    checked (every `check_every` frames, to a mean gap of `tolerance` levels)."""

    root: Path
    info: dict
    fps: float
    size: int
    check_every: int
    tolerance: float


def _replay(env, episode: dict, index: int, name: str, seed: int, high: int,
            recording: _Recording) -> tuple[int, list[str]]:
    """(seed, per-frame location texts) of one episode, or a DataError saying where the replay departs."""
    check_every, tolerance = recording.check_every, recording.tolerance
    frames = _video_frames(recording.root, recording.info, episode, recording.fps, recording.size)
    first = next(frames)
    closest = None
    while seed <= high:  # the first seed at or after `seed` whose reset is this episode's first frame
        observation, _ = env.reset(seed=seed)
        gap = _differs(observation["observation.image"], first)
        closest = gap if closest is None else min(closest, gap)
        if gap <= tolerance and np.array_equal(observation["observation.state"], episode["state"][0]):
            break
        seed += 1
    else:
        raise DataError(f"episode {index} ({name}): no seed in {seed}..{high} resets to its first frame (closest: "
                        f"{closest:.1f} levels apart on average): the recording cannot gain locations by replay")
    texts = []
    for step in range(episode["length"]):
        recorded_image = next(frames) if step else first
        if not np.allclose(observation["observation.state"], episode["state"][step], atol=1e-5):
            raise DataError(f"episode {index} ({name}, seed {seed}) departs from the recording at frame {step}: state "
                            f"{observation['observation.state'].tolist()} replayed, {episode['state'][step].tolist()} "
                            "recorded; the recording cannot gain locations by replay")
        if step % check_every == 0 or step == episode["length"] - 1:
            gap = _differs(observation["observation.image"], recorded_image)
            if gap > tolerance:
                raise DataError(f"episode {index} ({name}, seed {seed}) departs from the recording at frame {step}: the "
                                f"image is {gap:.1f} levels apart on average (tolerance {tolerance}); the recording "
                                "cannot gain locations by replay")
        texts.append(env.target_text())
        observation, *_ = env.step(episode["action"][step])
    return seed, texts


def _write(source: Path, output: Path, info: dict, marker: dict, texts: dict[int, list[str]], overwrite: bool) -> Path:
    """The source's files with the column added to every data file and to info.json, staged, then renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hf_vla.storage import replace_dir, staging_dir

    staging = staging_dir(output, "adding")

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    try:
        shutil.copytree(source, staging, copy_function=link_or_copy,
                        ignore=lambda folder, names: names if Path(folder) == source / "data" else [])
        for path in sorted((source / "data").glob("*/*.parquet")):
            table = pq.read_table(path)
            episodes, frames = table["episode_index"].to_pylist(), table["frame_index"].to_pylist()
            column = pa.array([texts[e][f] for e, f in zip(episodes, frames)], pa.string())
            at = table.column_names.index("action") + 1 if "action" in table.column_names else table.num_columns
            table = table.add_column(at, LOCATIONS, column)
            metadata = dict(table.schema.metadata or {})
            if b"huggingface" in metadata:  # the `datasets` features lerobot's loader reads
                features = json.loads(metadata[b"huggingface"])
                features.setdefault("info", {}).setdefault("features", {})[LOCATIONS] = {"dtype": "string",
                                                                                           "_type": "Value"}
                metadata[b"huggingface"] = json.dumps(features).encode()
            target = staging / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table.replace_schema_metadata(metadata), target)
        info = dict(info, features={**info["features"], LOCATIONS: {"dtype": "string", "shape": [1], "names": None}})
        (staging / "meta" / "info.json").unlink()  # a hard link to the source's: write a file of its own
        (staging / "meta" / "info.json").write_text(json.dumps(info, indent=4))
        (staging / "meta" / RECORD_MARKER).unlink()
        (staging / "meta" / RECORD_MARKER).write_text(json.dumps(
            dict(marker, locations_added={"from": str(source), "how": "replayed from each episode's seed"}), indent=2))
        replace_dir(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote %s: %s with the %r column (%d episodes replayed)", output, source, LOCATIONS, len(texts))
    return output


__all__ = ["add_locations"]
