"""The episode-shuffle stream (training) and the deterministic validation stream.

Map-style random access re-opens and seeks a video for every frame. Here an episode (or a kept segment) is a block:
every dataset epoch has one seeded permutation of its blocks (identical on every rank); block i goes to shard
`i % (world_size * num_workers)` with shard = `rank * num_workers + worker_id`. Inside a shard several blocks are open
at once and visited in a shuffled round-robin, so a batch mixes episodes while each block is decoded sequentially,
once. Datasets are drawn per frame in proportion to their mixture weight.

The sample *schedule* (which block, which frame) is a cheap deterministic function of (seed, epoch, shard), computed
apart from decoding. Each worker batches its own samples, so after B batches worker w has produced exactly
ceil((B - w) / num_workers) of them: resuming fast-forwards the schedule and seeks once per open block, without
decoding anything twice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..errors import ConfigError
from .sources import Block, BlockList, LeRobotSource, VideoReader


@dataclass
class Provenance:
    """What the indices in a batch mean, for metrics, error messages and model cards (set by the mixture).

    names / weights / episode_offsets are by `source_index` (datasets), head_names by `dataset_index` (heads);
    `datasets` describes each dataset for a model card (name, source, weight, head, cameras, example_task).
    """

    names: list[str]
    head_names: list[str]
    weights: list[float]
    episode_offsets: list[int]
    datasets: list[dict]

    def episode(self, source: int, global_episode: int) -> int:
        """A dataset's own episode index from the global `episode_index` of a sample."""
        return int(global_episode) - self.episode_offsets[source]


@dataclass
class _Slot:
    block: Block
    frame: int  # next frame (episode frame index) to emit
    token: int  # unique per opening: the same block may be open twice (across dataset epochs)


class _SourceQueue:
    """One dataset's blocks for one shard, epoch after epoch (a new permutation each epoch)."""

    def __init__(self, blocks: list[Block], seed: int, base_epoch: int, source: int, shard: int, num_shards: int):
        self.blocks, self.seed, self.source = blocks, seed, source
        self.shard, self.num_shards = shard, num_shards
        self.epoch = base_epoch
        self._queue: list[Block] = []
        self._refill()

    def _refill(self):
        order = np.random.default_rng([self.seed, self.epoch, self.source]).permutation(len(self.blocks))
        self._queue = [self.blocks[i] for i in order[self.shard :: self.num_shards]][::-1]
        self.epoch += 1

    def pop(self) -> Block:
        if not self._queue:
            self._refill()
        return self._queue.pop()


def schedule(
    blocks: list[list[Block]], weights: np.ndarray, seed: int, epoch: int, shard: int, num_shards: int, open_blocks: int
) -> Iterator[tuple[int, Block, int, int]]:
    """The infinite, deterministic sample order of one shard: (source, block, frame, slot token) tuples.

    Each source keeps up to `open_blocks` blocks open (at most its blocks in this shard) and visits them in a
    shuffled round-robin; a finished block is replaced by the next one of its queue.
    """
    rng = np.random.default_rng([seed, epoch, shard, 7])
    queues = [_SourceQueue(b, seed, epoch, s, shard, num_shards) for s, b in enumerate(blocks)]
    tokens = iter(range(1 << 62))
    slots = [[_Slot(b, b.start, next(tokens)) for b in (q.pop() for _ in range(min(open_blocks, len(q._queue))))]
             for q in queues]
    cycles: list[list[int]] = [[] for _ in blocks]
    probabilities = weights / weights.sum()
    while True:
        source = int(rng.choice(len(blocks), p=probabilities)) if len(blocks) > 1 else 0
        if not cycles[source]:  # shuffled round-robin over this source's open blocks
            cycles[source] = list(rng.permutation(len(slots[source])))
        index = cycles[source].pop()
        slot = slots[source][index]
        yield source, slot.block, slot.frame, slot.token
        slot.frame += 1
        if slot.frame >= slot.block.end:
            block = queues[source].pop()
            slots[source][index] = _Slot(block, block.start, next(tokens))


def _shard() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def resolve_decoder_threads(setting: int | None, open_decoders: int) -> int:
    """Threads per video decoder: `setting`, or automatically 2 when this DataLoader worker has two CPUs to itself on
    the node and keeps at most 32 decoders open, else 1. Measured: with 32 open 640x480 decoders in one worker on two
    cores, 2 threads gave about 20% more frames/s; with 96 (32 blocks x 3 cameras) they gave nothing, and cost 192
    threads and about 100 MB per worker."""
    if setting is not None:
        return setting
    _, workers = _shard()
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 2 if cpus // max(1, workers * local_processes) >= 2 and open_decoders <= 32 else 1


class FrameReader:
    """Turns (source, block, frame) into a sample dict, keeping one decoder per open block and camera."""

    def __init__(self, sources: list[LeRobotSource], head_of_source: list[int], num_cameras: int, image_size: int,
                 chunk_size: int, decoder_threads: int | None = None, open_blocks: int = 1):
        self.sources, self.head_of_source = sources, head_of_source
        self.num_cameras, self.image_size, self.chunk_size = num_cameras, image_size, chunk_size
        self.decoder_threads = resolve_decoder_threads(decoder_threads, open_blocks * len(sources) * num_cameras)
        self._readers: dict[tuple, VideoReader] = {}
        self._tables: dict[tuple, dict] = {}

    def sample(self, source_index: int, block: Block, frame: int, token=None) -> dict:
        """The sample at `frame` of `block`; `token` identifies the opening (decoders are kept per opening)."""
        source = self.sources[source_index]
        key = (source_index, block, token)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = source.episode_table(block.episode)
        images = torch.zeros(self.num_cameras, 3, self.image_size, self.image_size, dtype=torch.uint8)
        camera_mask = torch.zeros(self.num_cameras, dtype=torch.bool)
        for slot, camera in enumerate(source.config.cameras[: self.num_cameras]):
            if camera is None:
                continue
            reader = self._readers.get((key, camera))
            if reader is None:
                path, start = source.video_path(block.episode, camera)
                reader = self._readers[(key, camera)] = VideoReader(path, start, source.fps, self.image_size,
                                                                    episode=block.episode,
                                                                    threads=self.decoder_threads)
            reader.frame(frame, out=images[slot])
            camera_mask[slot] = True
        # action chunk [frame, frame + chunk) never crosses the block (episode or kept range) end
        end = min(frame + self.chunk_size, block.end)
        actions = np.zeros((self.chunk_size, source.action_dim), dtype=np.float32)
        actions[: end - frame] = table["actions"][frame:end]
        is_pad = np.ones(self.chunk_size, dtype=bool)
        is_pad[: end - frame] = False
        return {
            "images": images,
            "camera_mask": camera_mask,
            "state": torch.from_numpy(table["state"][frame].copy()),
            "actions": torch.from_numpy(actions),
            "action_is_pad": torch.from_numpy(is_pad),
            "task": source.task(table["task_index"][frame], block.episode),
            "dataset_index": self.head_of_source[source_index],
            "source_index": source_index,
            "episode_index": source.episode_offset + block.episode,
            "frame_index": frame,
        }

    def release(self, source_index: int, block: Block, token=None):
        key = (source_index, block, token)
        self._tables.pop(key, None)
        for reader_key in [k for k in self._readers if k[0] == key]:
            self._readers.pop(reader_key).close()

    def close(self):
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._tables.clear()


class EpisodeShuffleStream(IterableDataset):
    """Infinite training stream over a weighted mixture; yields collated batches (or samples without batch_size).

    state_dict()/load_state_dict() hold the position (epoch, batches consumed on this rank); the trainer saves it
    with each checkpoint.
    """

    def __init__(
        self,
        sources: list[LeRobotSource],
        blocks: list[list[Block]],
        weights: list[float],
        head_of_source: list[int],
        num_cameras: int,
        image_size: int,
        chunk_size: int,
        seed: int = 0,
        open_blocks: int = 32,
        batch_size: int | None = None,
        collate_fn: Callable | None = None,
        rank: int = 0,
        world_size: int = 1,
        decoder_threads: int | None = None,
    ):
        super().__init__()
        if open_blocks <= 0:
            raise ConfigError(f"open_blocks (stream_open_blocks) must be positive, got {open_blocks}")
        if batch_size is not None and batch_size <= 0:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        self.decoder_threads = decoder_threads
        self.provenance: Provenance | None = None  # set by the mixture
        self.sources, self.blocks = sources, blocks
        self.weights = np.asarray(weights, dtype=np.float64)
        self.head_of_source = head_of_source
        self.num_cameras, self.image_size, self.chunk_size = num_cameras, image_size, chunk_size
        self.seed, self.open_blocks = seed, open_blocks
        self.batch_size, self.collate_fn = batch_size, collate_fn
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.batches_consumed = 0

    # ---- position ------------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int):
        self.epoch = int(epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed, "seed": self.seed,
                "batch_size": self.batch_size, "world_size": self.world_size}

    def load_state_dict(self, state: dict):
        for key in ("seed", "batch_size", "world_size"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"cannot resume the stream: checkpoint has {key}={state.get(key)}, this run {getattr(self, key)}"
                )
        self.epoch = int(state["epoch"])
        self.batches_consumed = int(state["batches_consumed"])

    # ---- iteration -----------------------------------------------------------------------------------------------
    def shard_schedule(self, worker_id: int, num_workers: int) -> Iterator[tuple[int, Block, int, int]]:
        num_shards = self.world_size * num_workers
        for source, blocks in zip(self.sources, self.blocks):
            if len(blocks) < num_shards:
                raise ConfigError(
                    f"dataset {source.name!r} has {len(blocks)} blocks (episodes or kept ranges) for {num_shards} shards "
                    f"(world_size {self.world_size} x num_workers {num_workers}); use fewer workers or processes"
                )
        shard = self.rank * num_workers + worker_id
        return schedule(self.blocks, self.weights, self.seed, self.epoch, shard, num_shards, self.open_blocks)

    def __iter__(self):
        worker_id, num_workers = _shard()
        # The DataLoader takes batches round-robin starting at worker 0; after B batches it is logical worker
        # B % W's turn, so DataLoader worker i plays logical worker (i + B) % W (same blocks, same position).
        logical = (worker_id + self.batches_consumed) % num_workers
        samples = self.shard_schedule(logical, num_workers)
        per_item = self.batch_size or 1
        done = math.ceil(max(0, self.batches_consumed - logical) / num_workers) * per_item
        for _ in range(done):  # fast-forward the schedule only: nothing is decoded, readers seek on first use
            next(samples)
        reader = FrameReader(self.sources, self.head_of_source, self.num_cameras, self.image_size, self.chunk_size,
                             self.decoder_threads, open_blocks=self.open_blocks)
        try:
            batch = []
            for source, block, frame, token in samples:
                batch.append(reader.sample(source, block, frame, token))
                if frame + 1 >= block.end:
                    reader.release(source, block, token)
                if self.batch_size is None:
                    yield batch.pop()
                elif len(batch) == self.batch_size:
                    yield self.collate_fn(batch) if self.collate_fn else batch
                    batch = []
        finally:
            reader.close()


class ValidationStream(IterableDataset):
    """One deterministic pass over every validation frame of the mixture, each exactly once across ranks/workers.

    Frames are ordered (source, block, frame) and cut into equal contiguous slices per rank (then per worker), so
    decoding stays sequential; the last slice is padded with copies whose `action_is_pad` is all True, which count
    zero in every loss. Every rank runs the same number of batches. Positions are computed from cumulative block
    lengths: nothing is held per frame.
    """

    def __init__(self, sources, blocks: list[BlockList], head_of_source, num_cameras, image_size, chunk_size,
                 batch_size: int, collate_fn: Callable | None = None, rank: int = 0, world_size: int = 1,
                 decoder_threads: int | None = None):
        super().__init__()
        if batch_size <= 0:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        self.sources, self.head_of_source = sources, head_of_source
        self.num_cameras, self.image_size, self.chunk_size = num_cameras, image_size, chunk_size
        self.batch_size, self.collate_fn, self.rank, self.world_size = batch_size, collate_fn, rank, world_size
        self.decoder_threads = decoder_threads
        self.provenance: Provenance | None = None  # set by the mixture
        parts = [np.column_stack([np.full(len(b), s, dtype=np.int64), np.asarray(b.ranges if isinstance(b, BlockList)
                                  else [(x.episode, x.start, x.end) for x in b], dtype=np.int64).reshape(-1, 3)])
                 for s, b in enumerate(blocks)]
        self._blocks = np.concatenate(parts) if parts else np.zeros((0, 4), dtype=np.int64)  # source, episode, start, end
        self._offsets = np.concatenate([[0], np.cumsum(self._blocks[:, 3] - self._blocks[:, 2])]).astype(np.int64)
        self.total = int(self._offsets[-1])
        if not self.total:
            raise ValueError("the validation split is empty: raise validation_ratio or add validation episodes")
        self.per_rank = math.ceil(self.total / world_size)

    def _position(self, index: int) -> tuple[int, Block, int]:
        row = int(np.searchsorted(self._offsets, index, side="right")) - 1
        source, episode, start, end = (int(v) for v in self._blocks[row])
        return source, Block(source, episode, start, end), start + index - int(self._offsets[row])

    def __len__(self):
        """Batches this rank yields with `num_workers` <= 1 (more workers can add one partial batch each)."""
        return math.ceil(self.per_rank / self.batch_size)

    def __iter__(self):
        worker_id, num_workers = _shard()
        first = self.rank * self.per_rank
        real = max(0, min(self.per_rank, self.total - first))  # this rank's frames; the rest are padding
        per_worker = math.ceil(self.per_rank / num_workers)
        lo, hi = worker_id * per_worker, min((worker_id + 1) * per_worker, self.per_rank)
        reader = FrameReader(self.sources, self.head_of_source, self.num_cameras, self.image_size, self.chunk_size,
                             self.decoder_threads)
        try:
            batch = []
            for local in range(lo, hi):
                valid = local < real
                source, block, frame = self._position(first + local if valid else 0)
                sample = reader.sample(source, block, frame)
                if frame + 1 >= block.end:
                    reader.release(source, block)
                if not valid:
                    sample["action_is_pad"][:] = True
                batch.append(sample)
                if len(batch) == self.batch_size or local == hi - 1:
                    yield self.collate_fn(batch) if self.collate_fn else batch
                    batch = []
        finally:
            reader.close()


class ForkFriendlyDataLoader(DataLoader):
    """Forks its workers with the parent's objects frozen out of the garbage collector: a collection in a forked
    worker would otherwise touch every inherited object and copy its memory page (about 100 MB per worker measured
    at DROID's size). The parent unfreezes right after the fork."""

    def __iter__(self):
        if not self.num_workers:
            return super().__iter__()
        import gc

        gc.collect()
        gc.freeze()
        try:
            return super().__iter__()
        finally:
            gc.unfreeze()
