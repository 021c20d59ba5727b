"""LeRobot data pipeline: decoding, sharding, reseeding, resume, filters, mixture, provenance, validation, errors."""

import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hf_vla import PI05Processor
from hf_vla.data import PI05Collator, WeightedDatasetMixture, schedule
from hf_vla.data.stream import ShardSchedule, StreamSettings, _SourceQueue
from hf_vla.data.writer import DatasetLayout, write_lerobot_dataset
from hf_vla.models.common.images import resize_with_pad

CAM = "observation.images.cam"


def _episode(e, n, state_dim, action_dim, cameras, task):
    for f in range(n):
        images = {}
        for camera, (h, w) in cameras.items():
            img = np.zeros((h, w, 3), np.uint8)
            img[..., 0] = (f * 8) % 256  # the frame index, readable after lossy encoding
            img[..., 1] = e * 20
            images[camera] = img
        yield {"images": images, "state": np.full(state_dim, e + f / 100, np.float32),
               "action": np.arange(action_dim, dtype=np.float32) + f, "task": task.format(e=e)}


def make_dataset(root, episodes, state_dim=3, action_dim=2, cameras=None, robot_type="arm_a", lengths=None):
    cameras = cameras or {CAM: (48, 64)}
    lengths = lengths or [12 + e for e in range(episodes)]
    write_lerobot_dataset(root, (_episode(e, lengths[e], state_dim, action_dim, cameras, "reach target {e}")
                                 for e in range(episodes)),
                          DatasetLayout(fps=10, cameras=cameras, state_dim=state_dim, action_dim=action_dim,
                                        robot_type=robot_type))
    return root


@pytest.fixture(scope="session")
def datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("lerobot")
    a = make_dataset(base / "a", 10)
    b = make_dataset(base / "b", 8, state_dim=4, action_dim=3, robot_type="arm_b",
                     cameras={"wrist": (32, 32), "front": (48, 64)})
    return {"a": a, "b": b, "base": base}


def spec_a(root, **kw):
    return dict(root=str(root), name="a", cameras=[CAM], control_mode="joint", **kw)


def spec_b(root, **kw):
    return dict(root=str(root), name="b", cameras=["front", None, "wrist"], control_mode="eef", **kw)


def test_samples_decode_the_right_frames_and_chunks(datasets):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"])])
    stream = mixture.train_stream(StreamSettings(image_size=32, chunk_size=4, open_blocks=3))
    for sample, _ in zip(stream, range(200)):
        frame, episode = sample["frame_index"], sample["episode_index"]
        image = sample["images"][0].float()
        # 64x48 -> 32x24 content centred in 32x32; channel 0 holds the frame, channel 1 the episode
        assert abs(image[0, 8:24].mean().item() - (frame * 8) % 256) < 6
        assert abs(image[1, 8:24].mean().item() - episode * 20) < 6
        assert image[:, :4].abs().max() == 0  # black padding rows
        assert torch.allclose(sample["state"], torch.full((3,), episode + frame / 100))
        length = 12 + episode
        valid = min(4, length - frame)
        assert sample["action_is_pad"].tolist() == [False] * valid + [True] * (4 - valid)
        expected = torch.arange(2).float() + torch.arange(frame, frame + valid).float()[:, None]
        assert torch.equal(sample["actions"][:valid], expected)
        assert sample["task"] == f"reach target {episode}"


def test_training_frames_match_the_processor_resize_at_inference(humanoid):
    """On real 640x480 video, the stream's frames are what `resize_with_pad` makes of the full frame at inference
    (decoder-side scaling must not shift colours: AREA gives mean 0.9, p99 6 levels here; FAST_BILINEAR gave 2.7, 28)."""
    import av

    from hf_vla.data.sources import DatasetConfig, LeRobotSource, VideoReader

    source = LeRobotSource(DatasetConfig(root=str(humanoid), name="humanoid", cameras=["image"], state_key="state",
                                         action_key="actions"), 0)
    path, start = source.video_path(3, "image")
    reader = VideoReader(path, start, source.meta.fps, image_size=224)
    container = av.open(str(path))
    container.seek(int(max(0.0, start - 0.5) / container.streams.video[0].time_base), stream=container.streams.video[0])
    full = [f for f in container.decode(video=0) if f.time >= start - 1e-3][:30:6]
    errors = []
    for index, frame in zip(range(0, 30, 6), full):
        reference = resize_with_pad(torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1), 224)
        streamed = reader.frame(index).float() / 127.5 - 1.0
        errors.append((streamed - reference).abs() * 127.5)
    errors = torch.stack(errors)
    assert errors.mean() < 1.5 and torch.quantile(errors.flatten()[::7], 0.99) < 12, (errors.mean(), errors.max())
    reader.close()
    container.close()


def test_blocks_partition_over_shards_every_epoch(datasets):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"])])
    blocks = mixture.train_blocks[0]
    for epoch in (0, 1):
        seen = []
        for shard in range(4):  # 2 ranks x 2 workers
            queue = _SourceQueue(blocks, seed=3, base_epoch=epoch, source=0, shard=shard, num_shards=4)
            seen.append({queue.pop() for _ in range(len(queue._queue))})
        assert set().union(*seen) == set(blocks)
        assert sum(len(s) for s in seen) == len(blocks)


def test_each_shard_emits_only_its_own_blocks(datasets):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"])])
    owned = {shard: set(_SourceQueue(mixture.train_blocks[0], 5, 0, 0, shard, 4)._queue) for shard in range(4)}
    assert all(not (owned[i] & owned[j]) for i in range(4) for j in range(i + 1, 4))
    for shard in range(4):
        samples = _take(schedule([mixture.train_blocks[0]], np.ones(1), 5, 0, shard, 4, 8), 10)
        # 10 samples cannot finish a block (>= 12 frames): everything is still first-epoch
        assert {block for _, block, _, _ in samples} == owned[shard]  # all its blocks open at once, none else


def test_a_block_open_twice_keeps_separate_decoders(datasets):
    """With 1 shard and more open slots than blocks, the next epoch's copy of a block may be open already."""
    mixture = WeightedDatasetMixture([spec_a(datasets["a"], keep_ranges={"1": [[0, 6]], "2": [[0, 3]]})])
    stream = mixture.train_stream(StreamSettings(image_size=16, chunk_size=2, open_blocks=2))
    for sample, _ in zip(stream, range(60)):
        image = sample["images"][0].float()
        assert abs(image[0, 5:11].mean().item() - sample["frame_index"] * 8) < 6


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_reseeds_per_epoch_and_is_reproducible(datasets):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"])])
    def order(epoch):
        return [(b.episode, f) for _, b, f, _ in _take(schedule(mixture.train_blocks, np.ones(1), 0, epoch, 0, 1, 4), 60)]
    assert order(0) == order(0)
    assert order(0) != order(1)
    stream = mixture.train_stream(StreamSettings(image_size=16, chunk_size=2, open_blocks=4))
    stream.set_epoch(1)
    assert [(s["episode_index"], s["frame_index"]) for s, _ in zip(stream, range(60))] == order(1)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_exactly_without_replaying(datasets, workers, monkeypatch, tiny_tokenizer):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"]), spec_b(datasets["b"], weight=0.5)])
    processor = PI05Processor(tokenizer=tiny_tokenizer, norm_stats=mixture.norm_stats, head_names=mixture.head_names,
                              image_size=16, max_state_dim=8, max_action_dim=6, chunk_size=3, prompt_max_length=48)
    def loader(state=None):
        stream = mixture.train_stream(StreamSettings(image_size=16, chunk_size=3, batch_size=4, collate_fn=PI05Collator(processor),
                                      seed=11, open_blocks=3))
        if state:
            stream.load_state_dict(state)
        return stream, DataLoader(stream, batch_size=None, num_workers=workers)
    stream, full = loader()
    reference = _take(iter(full), 7)
    state = stream.state_dict() | {"batches_consumed": 3}
    decoded = []
    if workers == 0:
        from hf_vla.data import sources
        original = sources.VideoReader.frame
        monkeypatch.setattr(sources.VideoReader, "frame", lambda self, *a, **k: decoded.append(1) or original(self, *a, **k))
    _, resumed = loader(state)
    continued = _take(iter(resumed), 4)
    for got, want in zip(continued, reference[3:]):
        assert got.keys() == want.keys()
        for key in got:
            assert torch.equal(got[key], want[key]), key
    if workers == 0:  # only the 4 x 4 emitted samples were decoded (dataset b has 2 cameras)
        assert len(decoded) <= 16 * 2
    with pytest.raises(ValueError, match="seed"):
        loader(state | {"seed": 12})
    with pytest.raises(ValueError, match="the training data changed since the checkpoint"):
        loader(state | {"data_fingerprint": "0" * 16})
    fresh, _ = loader()
    message = fresh.load_state_dict(state | {"data_fingerprint": "0" * 16}, on_data_change="restart_epoch")
    assert message.startswith("the data changed: starting epoch 1") and fresh.batches_consumed == 0


def _frames(blocks) -> Counter:
    return Counter((b.source, b.episode, f) for b in blocks for f in range(b.start, b.end))


@pytest.mark.parametrize("before, after, batches", [
    ((2, 1, 4), (1, 1, 8), 5),   # 2 ranks -> 1, batch 4 -> 8, inside the first epoch
    ((1, 1, 8), (2, 1, 4), 5),   # 1 -> 2
    ((2, 2, 3), (3, 1, 5), 40),  # 2 ranks x 2 workers -> 3 ranks, well past the first epoch (shards out of step)
])
def test_a_new_layout_continues_every_epoch_without_repeating_or_skipping(datasets, before, after, batches):
    """Old shards consume `batches` each; the new layout's shards first serve the dealt pieces. Every frame of every
    epoch under way is then emitted exactly once: consumed before + the pieces == each frame `source_epochs` times."""
    mixture = WeightedDatasetMixture([spec_a(datasets["a"]), spec_b(datasets["b"], weight=0.5)])

    def stream(world_size, workers, batch, rank=0):
        s = mixture.train_stream(StreamSettings(image_size=16, chunk_size=3, batch_size=batch, seed=11, open_blocks=3, rank=rank,
                                 world_size=world_size))
        s.num_workers = workers
        return s

    world, workers, batch = before
    consumed = Counter()
    for rank in range(world):
        old = stream(world, workers, batch, rank)
        for worker in range(workers):  # the DataLoader takes batches round-robin from the workers
            n = -(-max(0, batches - worker) // workers) * batch
            consumed.update((s, b.episode, f) for s, b, f, _ in _take(old.shard_schedule(worker, workers), n))
    state = old.state_dict() | {"batches_consumed": batches}
    world2, workers2, batch2 = after
    new = stream(world2, workers2, batch2)
    message = new.load_state_dict(state)
    assert message.startswith("the stream layout changed (") and new.batches_consumed == 0
    segment = new.segment
    shards = world2 * workers2
    served = Counter()
    for rank in range(world2):  # what each new shard serves first: its dealt pieces, then the next epochs
        resumed = stream(world2, workers2, batch2, rank)
        resumed.load_state_dict(state)
        for worker in range(workers2):
            shard = rank * workers2 + worker
            wanted = [sum(z - a for _, a, z in segment["pieces"][s][shard::shards]) for s in range(2)]
            got = [[], []]
            tracked = ShardSchedule(mixture.train_blocks, resumed.weights, 11, 0, (shard, shards), 3, resumed.segment,
                                    track_origins=True)
            for s, b, f, token in tracked:  # the samples of the dealt pieces (next-epoch blocks open beside them)
                if tracked.origins[token] is None:
                    got[s].append((s, b.episode, f))
                if [len(g) for g in got] == wanted:
                    break
            assert [sample[:3] for sample in _take(resumed.shard_schedule(worker, workers2), 50)] == [
                sample[:3] for sample in _take(ShardSchedule(mixture.train_blocks, resumed.weights, 11, 0,
                                                             (shard, shards), 3, resumed.segment), 50)]
            for s in range(2):  # exactly the dealt pieces
                assert Counter(got[s]) == Counter((s, e, f) for e, a, z in segment["pieces"][s][shard::shards]
                                                  for f in range(a, z))
                served.update(got[s])
    total = consumed + served
    for source, blocks in enumerate(mixture.train_blocks):
        expected = segment["source_epochs"][source]
        frames = _frames(blocks)
        assert {k: v for k, v in total.items() if k[0] == source} == {k: expected for k in frames}


def test_worker_batches_equal_in_process_batches_on_real_video(tiny_tokenizer, humanoid):
    """A DataLoader worker writes pixel_values into shared memory faulted in ahead on a helper thread, packs the
    other tensors into one shared segment, and scales frames with one swscale context per decoder: the batches must
    be the in-process ones, bit for bit."""
    mixture = WeightedDatasetMixture([dict(root=str(humanoid), name="humanoid", cameras=["image"], state_key="state",
                                           action_key="actions")])
    processor = PI05Processor(tokenizer=tiny_tokenizer, norm_stats=mixture.norm_stats, image_size=64,
                              max_state_dim=34, max_action_dim=34, chunk_size=4, prompt_max_length=160)

    def batches(workers):
        stream = mixture.train_stream(StreamSettings(image_size=64, chunk_size=4, batch_size=8, collate_fn=PI05Collator(processor),
                                      seed=3, open_blocks=4))
        return _take(iter(DataLoader(stream, batch_size=None, num_workers=workers)), 5)

    for got, want in zip(batches(1), batches(0), strict=True):
        assert got["pixel_values"].is_shared()
        # everything else travels as views of one shared segment: one file descriptor per batch, not a dozen
        assert len({value.untyped_storage().data_ptr() for key, value in got.items() if key != "pixel_values"}) == 1
        assert got.keys() == want.keys()
        for key in got:
            assert torch.equal(got[key], want[key]), key


def test_shared_pixel_buffers_are_fresh_and_exact(monkeypatch):
    from hf_vla.models.common import images as processing_images

    images = torch.randint(0, 256, (2, 1, 3, 8, 8), dtype=torch.uint8)
    plain = resize_with_pad(images, 8)
    monkeypatch.setattr(processing_images, "get_worker_info", lambda: object())  # as inside a DataLoader worker
    monkeypatch.setattr(processing_images, "_shared_buffers", None)
    first, second = resize_with_pad(images, 8), resize_with_pad(images, 8)
    odd = resize_with_pad(images[:1], 8)  # another size: allocated on the spot
    for out in (first, second, odd):
        assert out.is_shared() and out.dtype == torch.float32
    assert torch.equal(first, plain) and torch.equal(second, plain) and torch.equal(odd, plain[:1])
    # never reused: the main process owns what a worker has sent
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert not resize_with_pad(torch.rand(1, 3, 8, 8), 8).is_shared()  # float input: no worker transport buffer


def test_decorrelated_batches_on_real_data(humanoid):
    mixture = WeightedDatasetMixture([dict(root=str(humanoid), name="humanoid", cameras=["image"], state_key="state",
                                           action_key="actions")])
    stream = mixture.train_stream(StreamSettings(image_size=32, chunk_size=50, batch_size=32, seed=0))
    for batch, _ in zip(stream, range(3)):
        assert len({s["episode_index"] for s in batch}) >= 16
        assert all(s["images"].shape == (1, 3, 32, 32) for s in batch)


def test_keep_ranges_filter(datasets, tmp_path):
    ranges = {"0": [[2, 6], [8, 40]], "3": [[0, 5]], "99": [[0, 3]]}
    path = tmp_path / "keep.json"
    path.write_text(json.dumps(ranges))
    mixture = WeightedDatasetMixture([spec_a(datasets["a"], keep_ranges=str(path))])
    blocks = mixture.train_blocks[0]
    assert [(b.episode, b.start, b.end) for b in blocks] == [(0, 2, 6), (0, 8, 12), (3, 0, 5)]  # clipped to length 12
    stream = mixture.train_stream(StreamSettings(image_size=16, chunk_size=5, open_blocks=3))
    for sample, _ in zip(stream, range(100)):
        block = next(b for b in blocks if b.episode == sample["episode_index"] and b.start <= sample["frame_index"] < b.end)
        valid = (~sample["action_is_pad"]).sum().item()
        assert valid == min(5, block.end - sample["frame_index"])  # chunks never cross a kept range's end
    # key derivation is configurable
    mixture = WeightedDatasetMixture([spec_a(datasets["a"], keep_ranges={"ep-3": [[1, 4]]},
                                             keep_ranges_key="ep-{episode_index}")])
    assert [(b.episode, b.start, b.end) for b in mixture.train_blocks[0]] == [(3, 1, 4)]
    with pytest.raises(ValueError, match="matches no episode"):
        WeightedDatasetMixture([spec_a(datasets["a"], keep_ranges={"nope": [[0, 3]]})])


def test_mixture_frequencies_follow_weights(datasets):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"], weight=3.0), spec_b(datasets["b"], weight=1.0)])
    counts = Counter(source for source, _, _, _ in _take(schedule(mixture.train_blocks, np.array([3.0, 1.0]), 0, 0, 0, 1,
                                                                    8), 4000))
    assert abs(counts[0] / 4000 - 0.75) < 0.03


def test_heads_stats_and_provenance(datasets, tmp_path):
    a2 = tmp_path / "a2"
    shutil.copytree(datasets["a"], a2)
    mixture = WeightedDatasetMixture([spec_a(datasets["a"]), spec_b(datasets["b"]),
                                      dict(spec_a(a2), name="a2")])
    assert mixture.head_names == ["arm_a::joint", "arm_b::eef"]
    assert mixture.head_of_source == [0, 1, 0]
    # exact quantiles of the head's pooled frames (a and its copy a2)
    values = mixture.sources[0].column_values()
    pooled = {k: np.concatenate([values[k], values[k]]) for k in ("state", "actions")}
    np.testing.assert_allclose(mixture.norm_stats["arm_a::joint"]["state"]["q01"], np.quantile(pooled["state"], 0.01, 0))
    np.testing.assert_allclose(mixture.norm_stats["arm_a::joint"]["actions"]["q99"],
                               np.quantile(pooled["actions"], 0.99, 0))
    # lerobot's metadata quantiles stay available on request
    meta = WeightedDatasetMixture([spec_a(datasets["a"], quantile_stats="metadata")])
    np.testing.assert_allclose(meta.norm_stats["arm_a::joint"]["state"]["q01"],
                               mixture.sources[0].stats["state"]["q01"])
    offsets = [s.episode_offset for s in mixture.sources]
    assert offsets == [0, 10, 18]
    stream = mixture.train_stream(StreamSettings(image_size=16, chunk_size=2, open_blocks=2))
    seen = set()
    for sample, _ in zip(stream, range(300)):
        s = sample["source_index"]
        assert sample["dataset_index"] == mixture.head_of_source[s]
        assert offsets[s] <= sample["episode_index"] < offsets[s] + mixture.sources[s].num_episodes
        seen.add(s)
        if s == 1:  # dataset b: slots [front, empty, wrist]
            assert sample["camera_mask"].tolist() == [True, False, True]
            assert sample["images"][1].abs().sum() == 0
    assert seen == {0, 1, 2}
    # no name fallback when control_mode is missing
    mixture = WeightedDatasetMixture([dict(root=str(datasets["a"]), name="plain", cameras=[CAM])])
    assert mixture.head_names == ["plain"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_validation_covers_each_frame_exactly_once(datasets, world_size):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"]), spec_b(datasets["b"])], validation_ratio=0.3,
                                     split_seed=1)
    expected = {(s, b.episode, f) for s, blocks in enumerate(mixture.validation_blocks) for b in blocks
                for f in range(b.start, b.end)}
    assert expected
    train = {(s, b.episode) for s, blocks in enumerate(mixture.train_blocks) for b in blocks}
    assert not train & {(s, e) for s, e, _ in expected}
    got, batches = Counter(), []
    for rank in range(world_size):
        stream = mixture.validation_stream(StreamSettings(image_size=16, chunk_size=3, batch_size=5, rank=rank, world_size=world_size))
        count = 0
        for batch in DataLoader(stream, batch_size=None, num_workers=2):
            count += 1
            for sample in batch:
                if not sample["action_is_pad"].all():
                    got[(sample["source_index"], sample["episode_index"] - mixture.sources[sample["source_index"]]
                         .episode_offset, sample["frame_index"])] += 1
        batches.append(count)
    assert set(got) == expected and set(got.values()) == {1}
    assert len(set(batches)) == 1  # every rank runs the same number of batches


def test_collator_builds_the_batch_contract(datasets, tiny_tokenizer):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"]), spec_b(datasets["b"])])
    processor = PI05Processor(tokenizer=tiny_tokenizer, norm_stats=mixture.norm_stats, head_names=mixture.head_names,
                              image_size=16, max_state_dim=8, max_action_dim=6, chunk_size=3, prompt_max_length=48)
    stream = mixture.train_stream(StreamSettings(image_size=16, chunk_size=3, batch_size=16, collate_fn=PI05Collator(processor)))
    batch = next(iter(stream))
    assert batch["pixel_values"].shape == (16, 3, 3, 16, 16) and batch["pixel_values"].dtype == torch.float32
    assert -1 <= batch["pixel_values"].min() and batch["pixel_values"].max() <= 1
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (16, 48)
    assert batch["state"].shape == (16, 8) and batch["actions"].shape == (16, 3, 6)
    for i in range(16):
        dims = 2 if batch["source_index"][i] == 0 else 3
        assert batch["action_dim_mask"][i].tolist() == [True] * dims + [False] * (6 - dims)
        assert batch["actions"][i, :, dims:].abs().sum() == 0
        assert batch["actions"][i][batch["action_is_pad"][i]].abs().sum() == 0
        prompt = processor.tokenizer.decode(batch["input_ids"][i][batch["attention_mask"][i]])
        assert prompt.startswith("Task: reach target") and "State:" in prompt
    for key in ("dataset_index", "source_index", "episode_index"):
        assert batch[key].dtype == torch.long and batch[key].shape == (16,)


# ---- bad input ----------------------------------------------------------------------------------------------------
def test_missing_video_file_is_named(datasets, tmp_path):
    root = tmp_path / "broken"
    shutil.copytree(datasets["a"], root)
    video = next(root.glob("videos/**/*.mp4"))
    video.unlink()
    with pytest.raises(FileNotFoundError, match=video.name):
        WeightedDatasetMixture([spec_a(root)])


def test_unknown_feature_key_is_named(datasets):
    with pytest.raises(KeyError, match="state_key 'observation.joints'.*available"):
        WeightedDatasetMixture([spec_a(datasets["a"], state_key="observation.joints")])
    with pytest.raises(KeyError, match="cameras 'observation.images.top'"):
        WeightedDatasetMixture([dict(spec_a(datasets["a"]), cameras=["observation.images.top"])])


def test_inconsistent_dims_in_one_head(datasets):
    with pytest.raises(ValueError, match="normalization head 'arm_a::joint'.*different state dims"):
        WeightedDatasetMixture([spec_a(datasets["a"]),
                                dict(spec_b(datasets["b"]), robot_type="arm_a", control_mode="joint")])


def test_empty_validation_split_and_bad_ratio(datasets):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"])])
    with pytest.raises(ValueError, match="validation split is empty"):
        mixture.validation_stream(StreamSettings(image_size=16, chunk_size=2, batch_size=2))
    with pytest.raises(ValueError, match="leaves no training episode"):
        WeightedDatasetMixture([spec_a(datasets["a"], keep_ranges={"1": [[0, 4]]})], validation_ratio=0.5)


def test_older_codebase_version_is_refused(datasets, tmp_path):
    root = tmp_path / "old"
    shutil.copytree(datasets["a"], root)
    info = json.loads((root / "meta/info.json").read_text())
    info["codebase_version"] = "v2.1"
    (root / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match="codebase_version 'v2.1'.*v3.0"):
        WeightedDatasetMixture([spec_a(root)])


def test_fewer_blocks_than_shards_fails_fast(datasets):
    mixture = WeightedDatasetMixture([spec_a(datasets["a"], keep_ranges={"1": [[0, 4]], "2": [[0, 4]]})])
    stream = mixture.train_stream(StreamSettings(image_size=16, chunk_size=2, rank=0, world_size=2))
    with pytest.raises(ValueError, match="2 blocks .* for 4 shards"):
        next(iter(DataLoader(stream, batch_size=None, num_workers=2)))


def test_a_chunk_longer_than_every_episode_is_warned_with_the_numbers(datasets, caplog):
    """Episodes of 12..21 frames and a 30-step chunk: training goes on (padding is masked) but the log says it."""
    from types import SimpleNamespace

    mixture = WeightedDatasetMixture([spec_a(datasets["a"])])
    args = SimpleNamespace(data_seed=None, seed=0, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                           process_index=0, world_size=1)
    with caplog.at_level("WARNING", logger="hf_vla.data"):
        mixture.training_datasets(args, image_size=32, chunk_size=21)
    assert "longer than every episode" not in caplog.text  # the longest episode has 21 frames
    with caplog.at_level("WARNING", logger="hf_vla.data"):
        mixture.training_datasets(args, image_size=32, chunk_size=30)
    assert ("dataset 'a': chunk_size 30 is longer than every episode (longest 21 frames, median 16): at least 9 of "
            "each chunk's 30 steps are padding") in caplog.text
