"""DROID-shaped data: the synthetic generator (lerobot loads it), the start-up scan's cache (hit, miss, stale,
damaged), and per-episode reads (cached rows, parquet row groups, whole files) that agree."""

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from hf_vla.data import WeightedDatasetMixture
from hf_vla.data import scan as scan_module
from hf_vla.data.scan import cache_dir
from hf_vla.data.sources import DatasetConfig, LeRobotSource
from hf_vla.data.stream import StreamSettings
from hf_vla.data.synthetic import DROID_CAMERAS, DroidLike, droid_dataset_config, write_droid_like


@pytest.fixture(scope="module")
def droid(tmp_path_factory):
    """40 DROID-shaped episodes in 4 data files, one row group per episode; and the same in converter layout."""
    base = tmp_path_factory.mktemp("droid")
    kwargs = dict(episodes=40, mean_length=40, frames_per_data_file=500, episodes_per_video=16)
    return {"episode": write_droid_like(base / "per_episode", DroidLike(row_groups="episode", **kwargs), progress=False),
            "file": write_droid_like(base / "per_file", DroidLike(row_groups="file", **kwargs), progress=False)}


def test_lerobot_loads_what_the_generator_writes(droid):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = droid["episode"]
    info = json.loads((root / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["total_episodes"] == 40 and info["fps"] == 15
    assert len(list((root / "data").rglob("*.parquet"))) > 1  # rotated by size
    assert pq.ParquetFile(next((root / "data").rglob("*.parquet"))).metadata.num_row_groups > 1
    dataset = LeRobotDataset("local/droid", root=root, video_backend="pyav")
    assert dataset.num_episodes == 40 and len(dataset) == info["total_frames"]
    episodes = pq.read_table(next((root / "meta" / "episodes").rglob("*.parquet"))).to_pandas()
    assert {"recording_folderpath", "file_path", "dataset_from_index"} <= set(episodes.columns)
    for index in (0, 123, len(dataset) - 1):
        item = dataset[index]
        episode, frame = int(item["episode_index"]), int(item["frame_index"])
        row = episodes[episodes.episode_index == episode].iloc[0]
        video_frame = round(row[f"videos/{DROID_CAMERAS[0]}/from_timestamp"] * 15) + frame
        for camera in DROID_CAMERAS:  # the template video shows grey level = frame number in its file
            assert abs(float(item[camera].mean()) * 255 - video_frame % 256) < 3, (index, camera)
        assert item["observation.state"].shape == (8,) and item["action"].shape == (8,)


def test_the_stream_reads_synthetic_droid_with_its_keep_ranges(droid):
    config = droid_dataset_config(droid["episode"])
    mixture = WeightedDatasetMixture([config])
    keep = json.loads((droid["episode"] / "keep_ranges.json").read_text())
    source = mixture.sources[0]
    assert len(mixture.train_blocks[0]) == sum(len(ranges) for ranges in keep.values())
    assert source.episode_rows is not None  # the scan cached every used episode's rows
    stream = mixture.train_stream(StreamSettings(image_size=16, chunk_size=4, open_blocks=3))
    for sample, _ in zip(stream, range(60)):
        episode, frame = int(sample["episode_index"]), int(sample["frame_index"])
        offset = source.episodes[f"videos/{DROID_CAMERAS[0]}/from_timestamp"][source.row(episode)] * 15
        assert sample["images"].shape == (3, 3, 16, 16) and sample["camera_mask"].all()
        assert abs(sample["images"][0].float().mean().item() - (round(offset) + frame) % 256) < 3
        key = source.episode_keys()[source.row(episode)]
        assert any(start <= frame < end for start, end in keep[key])


def _whole_file_episode(source, episode):
    table = pq.read_table(source.data_path(episode)).to_pandas()
    rows = table[table.episode_index == episode]
    return {"state": np.stack(rows[source.config.state_key].to_numpy()).astype(np.float32),
            "actions": np.stack(rows[source.config.action_key].to_numpy()).astype(np.float32),
            "task_index": rows["task_index"].to_numpy()}


@pytest.mark.parametrize("layout", ["episode", "file"])
def test_per_episode_reads_equal_whole_file_reads(droid, layout, monkeypatch):
    source = LeRobotSource(DatasetConfig(**droid_dataset_config(droid[layout], keep_ranges=False)), 0)
    source.scan()
    cached = source.episode_rows
    assert cached is not None
    reads = []
    original = pq.ParquetFile.read_row_groups

    def counting(self, row_groups, *args, **kwargs):
        reads.append(len(row_groups))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", counting)
    for episode in source.usable_episodes():
        expected = _whole_file_episode(source, episode)
        source.episode_rows = cached
        from_cache = source.episode_table(episode)
        source.episode_rows = None
        from_parquet = source.episode_table(episode)
        for key in ("state", "actions", "task_index"):
            np.testing.assert_array_equal(from_cache[key], expected[key], err_msg=f"{key} cache, episode {episode}")
            np.testing.assert_array_equal(from_parquet[key], expected[key], err_msg=f"{key} parquet, {episode}")
    if layout == "episode":  # one row group per episode: an opening reads exactly one
        assert set(reads) == {1}


def test_scan_cache_hit_miss_and_stale(droid, tmp_path, monkeypatch):
    root = tmp_path / "droid"
    shutil.copytree(droid["episode"], root, copy_function=shutil.copy)  # new mtimes: not the dataset already scanned
    reads = []
    original = scan_module._read_file
    monkeypatch.setattr(scan_module, "_read_file", lambda source, path: reads.append(path) or original(source, path))

    def scan(**config):
        source = LeRobotSource(DatasetConfig(**(droid_dataset_config(root) | config)), 0)
        return source, source.scan()

    source, first = scan()
    assert not first.cached and reads
    reads.clear()
    source, second = scan()  # another rank, or a later run
    assert second.cached and not reads
    assert second.frames == first.frames
    np.testing.assert_array_equal(second.state, first.state)
    assert source.episode_rows is not None
    # a different selection or feature mapping is another entry
    _, other = scan(keep_ranges=None, keep_ranges_key="{episode_index}")
    assert not other.cached and reads
    reads.clear()
    # the dataset changed (a data file rewritten): stale, scanned again
    data_file = next((root / "data").rglob("*.parquet"))
    table = pq.read_table(data_file)
    os.utime(data_file, ns=(0, 0))
    pq.write_table(table, data_file)
    _, third = scan()
    assert not third.cached and reads
    reads.clear()
    # a damaged entry (truncated rows) is recomputed, not trusted
    entry = cache_dir() / scan_module.fingerprint(source, scan_module.MAX_STATS_FRAMES, 0)
    with open(entry / "state.npy", "r+b") as handle:
        handle.truncate(100)
    source, fourth = scan()
    assert not fourth.cached and reads
    assert torch.equal(torch.from_numpy(fourth.state), torch.from_numpy(first.state))
