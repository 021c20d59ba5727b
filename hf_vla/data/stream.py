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

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from hf_vla.data.sources import Block, BlockList, LeRobotSource, VideoReader
from hf_vla.errors import ConfigError


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
    """One dataset's blocks for one shard, epoch after epoch (a new permutation each epoch).

    `pieces` (after a re-shard) are served first: the unconsumed remainders of an earlier layout; then the epochs
    continue from `base_epoch`. `epoch` is always the next epoch to draw.
    """

    def __init__(self, blocks: list[Block], seed: int, base_epoch: int, source: int, shard: int, num_shards: int,
                 pieces: list[Block] | None = None):
        self.blocks, self.seed, self.source = blocks, seed, source
        self.shard, self.num_shards = shard, num_shards
        self.epoch = base_epoch
        self._queue: list[Block] = []
        self._pieces = 0  # how many of the queued blocks are pieces of a re-shard (served first)
        self.last_origin: int | None = None  # the epoch of the block popped last (None: a piece)
        if pieces is None:
            self._refill()
        else:
            self._queue = list(pieces)[::-1]
            self._pieces = len(self._queue)

    def epoch_share(self, epoch: int) -> list[Block]:
        order = np.random.default_rng([self.seed, epoch, self.source]).permutation(len(self.blocks))
        return [self.blocks[i] for i in order[self.shard :: self.num_shards]]

    def _refill(self):
        self._queue = self.epoch_share(self.epoch)[::-1]
        self.epoch += 1

    def remaining(self) -> list[Block]:
        """The blocks still queued, in the order they would be served."""
        return self._queue[::-1]

    def pop(self) -> Block:
        if not self._queue:
            self._refill()
        self.last_origin = None if len(self._queue) <= self._pieces else self.epoch - 1
        self._pieces = min(self._pieces, len(self._queue) - 1)
        return self._queue.pop()


class ShardSchedule:
    """The infinite, deterministic sample order of one shard: (source, block, frame, slot token) tuples.

    Each source keeps up to `open_blocks` blocks open (at most its blocks in this shard) and visits them in a
    shuffled round-robin; a finished block is replaced by the next one of its queue. With a `segment` (after a change
    of layout: see `EpisodeShuffleStream.load_state_dict`) each source starts from its share of the segment's pieces,
    then continues at the segment's epoch of that source.
    """

    def __init__(self, blocks: list[list[Block]], weights: np.ndarray, seed: int, epoch: int, shard: tuple[int, int],
                 open_blocks: int, segment: dict | None = None, track_origins: bool = False):
        """`shard`: (this shard's index, the number of shards)."""
        shard, num_shards = shard
        self.blocks = blocks
        # token -> the epoch its block belongs to (None: a re-shard's piece); kept only when asked (tests, tools)
        self.origins: dict[int, int | None] | None = {} if track_origins else None
        key = [seed, epoch, shard, 7] if segment is None else [seed, epoch, shard, 7, int(segment["index"])]
        self.rng = np.random.default_rng(key)
        if segment is None:
            self.queues = [_SourceQueue(b, seed, epoch, s, shard, num_shards) for s, b in enumerate(blocks)]
            counts = [len(q._queue) for q in self.queues]
        else:
            self.queues, counts = [], []
            for s, b in enumerate(blocks):
                mine = [Block(s, *piece) for piece in segment["pieces"][s][shard::num_shards]]
                self.queues.append(_SourceQueue(b, seed, int(segment["source_epochs"][s]), s, shard, num_shards, mine))
                counts.append(max(len(mine), len(range(shard, len(b), num_shards))))
        self.tokens = iter(range(1 << 62))
        self.slots = [[self._open(q) for _ in range(min(open_blocks, n))] for q, n in zip(self.queues, counts)]
        self.cycles: list[list[int]] = [[] for _ in blocks]
        self.probabilities = weights / weights.sum()

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, Block, int, int]:
        source = int(self.rng.choice(len(self.blocks), p=self.probabilities)) if len(self.blocks) > 1 else 0
        if not self.cycles[source]:  # shuffled round-robin over this source's open blocks
            self.cycles[source] = list(self.rng.permutation(len(self.slots[source])))
        index = self.cycles[source].pop()
        slot = self.slots[source][index]
        sample = (source, slot.block, slot.frame, slot.token)
        slot.frame += 1
        if slot.frame >= slot.block.end:
            self.slots[source][index] = self._open(self.queues[source])
        return sample

    def _open(self, queue: _SourceQueue) -> _Slot:
        block = queue.pop()
        slot = _Slot(block, block.start, next(self.tokens))
        if self.origins is not None:
            self.origins[slot.token] = queue.last_origin
        return slot

    def unconsumed(self, source: int) -> list[Block]:
        """What this shard has not yet emitted of `source` up to its current epoch: the open blocks' remainders, then
        the queued blocks."""
        open_rest = [Block(source, slot.block.episode, slot.frame, slot.block.end) for slot in self.slots[source]
                     if slot.frame < slot.block.end]
        return open_rest + self.queues[source].remaining()


def schedule(
    blocks: list[list[Block]], weights: np.ndarray, seed: int, epoch: int, shard: int, num_shards: int, open_blocks: int,
    segment: dict | None = None,
) -> Iterator[tuple[int, Block, int, int]]:
    """The sample order of one shard (`ShardSchedule`)."""
    return ShardSchedule(blocks, weights, seed, epoch, (shard, num_shards), open_blocks, segment)


def samples_done(batches: int, worker: int, num_workers: int, batch_size: int | None) -> int:
    """Samples logical worker `worker` has emitted after its rank's DataLoader took `batches` batches round-robin."""
    return math.ceil(max(0, batches - worker) / num_workers) * (batch_size or 1)


def _shard() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def resolve_decoder_threads(setting: int | None, open_decoders: int) -> int:
    """Threads per video decoder: `setting`, or automatically 2 when this DataLoader worker has two CPUs to itself on
    the node and keeps at most 32 decoders open, else 1: a second thread helps a few open decoders and only costs
    threads and memory with many (docs/measurements.md)."""
    if setting is not None:
        return setting
    _, workers = _shard()
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 2 if cpus // max(1, workers * local_processes) >= 2 and open_decoders <= 32 else 1


def memory_indices(frame: int, memory: dict) -> tuple[np.ndarray, np.ndarray]:
    """MEM's past frames of episode frame `frame`: `memory["frames"] - 1` indices `memory["stride"]` apart, oldest
    first, clamped to the episode's first frame, and which of them are real (lerobot's `delta_timestamps` indices and
    their `_is_pad`: an index before the episode's start is its first frame, padded)."""
    offsets = np.arange(1 - memory["frames"], 0) * memory["stride"]
    wanted = frame + offsets
    return np.maximum(wanted, 0), wanted >= 0


class _FrameHistory:
    """The decoded frames of one camera of one open block, kept back to MEM's horizon: a block is decoded once, each
    frame read again as the past of the frames `stride`, 2 `stride`, ... after it. A block that starts after its
    episode's start (a kept range, a resumed position) decodes the horizon before it first."""

    def __init__(self, reader: VideoReader, horizon: int):
        self.reader, self.horizon = reader, horizon
        self.frames: dict[int, torch.Tensor] = {}
        self.newest = -1

    def read(self, frame: int) -> torch.Tensor:
        if frame < self.newest:  # never within a block; stay correct if it happens
            self.frames.clear()
            self.newest = -1
        first = max(0, frame - self.horizon) if self.newest < 0 else self.newest + 1
        for index in range(first, frame + 1):
            self.frames[index] = self.reader.frame(index)
        self.newest = max(self.newest, frame)
        for index in [i for i in self.frames if i < frame - self.horizon]:
            del self.frames[index]
        return self.frames[frame]


class FrameReader:
    """Turns (source, block, frame) into a sample dict, keeping one decoder per open block and camera. With `memory`
    (MEM: `{"frames", "stride", "visual", "proprio"}`) each sample also carries its past observations
    (`memory_images` `[n_cams, T-1, 3, S, S]` with visual memory, `memory_state` `[T-1, state_dim]`, `memory_mask`)."""

    def __init__(self, sources: list[LeRobotSource], head_of_source: list[int], num_cameras: int, image_size: int,
                 chunk_size: int, decoder_threads: int | None = None, open_blocks: int = 1,
                 memory: dict | None = None):
        self.sources, self.head_of_source = sources, head_of_source
        self.num_cameras, self.image_size, self.chunk_size = num_cameras, image_size, chunk_size
        self.decoder_threads = resolve_decoder_threads(decoder_threads, open_blocks * len(sources) * num_cameras)
        self.memory = memory
        self._readers: dict[tuple, VideoReader] = {}
        self._histories: dict[tuple, _FrameHistory] = {}
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
        memory = self.memory
        extra = {}
        if memory:
            past, real = memory_indices(frame, memory)
            extra["memory_mask"] = torch.from_numpy(real)
            extra["memory_state"] = torch.from_numpy(np.asarray(table["state"][past], dtype=np.float32))
            visual = memory["visual"]
            if visual:
                extra["memory_images"] = torch.zeros(self.num_cameras, len(past), 3, self.image_size, self.image_size,
                                                     dtype=torch.uint8)
        for slot, camera in enumerate(source.config.cameras[: self.num_cameras]):
            if camera is None:
                continue
            reader = self._readers.get((key, camera))
            if reader is None:
                path, start = source.video_path(block.episode, camera)
                reader = self._readers[(key, camera)] = VideoReader(path, start, source.fps, self.image_size,
                                                                    episode=block.episode,
                                                                    threads=self.decoder_threads)
            if memory and visual:
                history = self._histories.get((key, camera))
                if history is None:
                    horizon = (memory["frames"] - 1) * memory["stride"]
                    history = self._histories[(key, camera)] = _FrameHistory(reader, horizon)
                images[slot] = history.read(frame)
                for column, index in enumerate(past.tolist()):
                    extra["memory_images"][slot, column] = history.frames[index]
            else:
                reader.frame(frame, out=images[slot])
            camera_mask[slot] = True
        if "action_chunks" in table:  # the frame's own chunk (action_chunk_key: e.g. the expert's plan from here)
            actions = table["action_chunks"][frame, : self.chunk_size].copy()
            is_pad = np.zeros(self.chunk_size, dtype=bool)
        else:  # action chunk [frame, frame + chunk) never crosses the block (episode or kept range) end
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
            **({"target_text": table["target_text"][frame]} if "target_text" in table else {}),
            **({"subtask": table["subtask"][frame]} if "subtask" in table else {}),
            **_advantage(source.config.advantage, table, frame),
            **_value_return(source, block, table, frame),
            "dataset_index": self.head_of_source[source_index],
            "source_index": source_index,
            "episode_index": source.episode_offset + block.episode,
            "frame_index": frame,
            **extra,
        }

    def release(self, source_index: int, block: Block, token=None):
        key = (source_index, block, token)
        self._tables.pop(key, None)
        for reader_key in [k for k in self._readers if k[0] == key]:
            self._readers.pop(reader_key).close()
            self._histories.pop(reader_key, None)

    def close(self):
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._histories.clear()
        self._tables.clear()


@dataclass
class StreamSettings:
    """How a stream serves samples: the image side and chunk length of each, `batch_size` samples per item (None:
    single samples) through `collate_fn`, this process's `rank` of `world_size`, video `decoder_threads`; for the
    training stream also its `seed` and the blocks each source keeps open (`open_blocks`)."""

    image_size: int
    chunk_size: int
    batch_size: int | None = None
    collate_fn: Callable | None = None
    seed: int = 0
    open_blocks: int = 32
    rank: int = 0
    world_size: int = 1
    decoder_threads: int | None = None
    memory: dict | None = None  # MEM's past observations per sample (`FrameReader`); None: none


class EpisodeShuffleStream(IterableDataset):
    """Infinite training stream over a weighted mixture; yields collated batches (or samples without batch_size).

    state_dict()/load_state_dict() hold the position (epoch, batches consumed on this rank) and the layout it was
    consumed under (world size, DataLoader workers, batch size, open blocks); the trainer saves it with each
    checkpoint. Resuming under another layout re-shards what is left (see `load_state_dict`).
    """

    def __init__(self, sources: list[LeRobotSource], blocks: list[list[Block]], weights: list[float],
                 head_of_source: list[int], num_cameras: int, settings: StreamSettings):
        super().__init__()
        image_size, chunk_size, seed, open_blocks = (settings.image_size, settings.chunk_size, settings.seed,
                                                     settings.open_blocks)
        batch_size, collate_fn, rank, world_size = (settings.batch_size, settings.collate_fn, settings.rank,
                                                    settings.world_size)
        decoder_threads = settings.decoder_threads
        if open_blocks <= 0:
            raise ConfigError(f"open_blocks (stream_open_blocks) must be positive, got {open_blocks}")
        if batch_size is not None and batch_size <= 0:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        self.decoder_threads = decoder_threads
        self.memory = settings.memory
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
        self.num_workers = 1  # DataLoader workers per rank (the trainer sets it): part of the shard layout
        self.segment: dict | None = None  # after a re-shard: the pieces left by the earlier layout (load_state_dict)

    # ---- position ------------------------------------------------------------------------------------------------

    @property
    def frames(self) -> int:
        """The training frames the stream draws from (all ranks): what one pass over the data is."""
        return sum(blocks.frames if hasattr(blocks, "frames") else sum(len(block) for block in blocks)
                   for blocks in self.blocks)
    def set_epoch(self, epoch: int):
        self.epoch = int(epoch)

    def layout(self) -> dict:
        return {"world_size": self.world_size, "num_workers": self.num_workers, "batch_size": self.batch_size,
                "open_blocks": self.open_blocks}

    def data_fingerprint(self) -> str:
        """Changes when the blocks (datasets, episodes, kept ranges, split) or the mixture weights change."""
        import hashlib

        digest = hashlib.sha256(np.asarray(self.weights, dtype=np.float64).tobytes())
        for source, blocks in zip(self.sources, self.blocks):
            digest.update(str(getattr(source, "name", "")).encode())
            ranges = blocks.ranges if isinstance(blocks, BlockList) else [(b.episode, b.start, b.end) for b in blocks]
            digest.update(np.ascontiguousarray(np.asarray(ranges, dtype=np.int64)).tobytes())
        return digest.hexdigest()[:16]

    def content_fingerprint(self) -> str | None:
        """Changes when a value training reads changes (a state, an action, a task index of a kept row), whatever
        the files' names, sizes or times: the start-up scan's hash of each dataset (None when a source has none)."""
        import hashlib

        parts = [getattr(source, "content_fingerprint", None) for source in self.sources]
        if not parts or any(part is None for part in parts):
            return None
        return hashlib.sha256("/".join(parts).encode()).hexdigest()[:16]

    def content_detail(self) -> dict:
        """Per dataset, the scan's hashes per data file and episode (what a changed-content refusal names)."""
        return {str(getattr(source, "name", i)): source.content_detail for i, source in enumerate(self.sources)
                if getattr(source, "content_detail", None)}

    def content_changes(self, saved: dict | None) -> str:
        """`; first change: dataset 'x', ROOT/FILE episode E (...)` for the first dataset whose per-file hashes
        differ from the checkpoint's `saved` ones, or '' when none can be named."""
        from hf_vla.data.scan import content_difference

        for index, source in enumerate(self.sources):
            name = str(getattr(source, "name", index))
            where = content_difference((saved or {}).get(name), getattr(source, "content_detail", None))
            if where:
                root = getattr(source, "root", None)
                return f"; first change: dataset {name!r}, " + (f"{root}/{where}" if root is not None else where)
        return ""

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed, "seed": self.seed,
                **self.layout(), "segment": self.segment, "data_fingerprint": self.data_fingerprint(),
                "content_fingerprint": self.content_fingerprint(), "content_detail": self.content_detail()}

    def load_state_dict(self, state: dict, on_data_change: str = "error") -> str | None:
        """Restore the position. Returns None when the stream continues as it was, or what changed.

        Under the same layout the stream continues exactly. Under another one (world size, DataLoader workers, batch
        size, open blocks) the stream re-shards: the schedule of every old shard is replayed to where it stopped
        (nothing is decoded), and what it had not emitted yet (its open blocks' remaining frames, its queued blocks,
        and its shares of the epochs it had not reached while another shard had) becomes a list of pieces per dataset,
        dealt to the new shards (piece i to shard i % shards) before their epochs continue. So within the epochs under
        way no block is repeated or skipped across the change. When the data changed since the checkpoint (datasets,
        episodes, kept ranges, split or weights: `data_fingerprint`), resuming is refused unless `on_data_change` is
        `"restart_epoch"`, which starts the next epoch on the new data.
        """
        from hf_vla.errors import CheckpointError

        if state.get("seed") != self.seed:
            raise CheckpointError(f"cannot resume the stream: the checkpoint has seed={state.get('seed')}, this run "
                                  f"{self.seed}")
        saved = state.get("data_fingerprint")
        blocks_changed = saved is not None and saved != self.data_fingerprint()
        # a checkpoint written before content hashes (or by a source without a scan) is compared by its blocks only
        saved_content, content = state.get("content_fingerprint"), self.content_fingerprint()
        values_changed = None not in (saved_content, content) and saved_content != content
        if blocks_changed or values_changed:
            if on_data_change != "restart_epoch":
                what = ("the training data changed since the checkpoint (datasets, episodes, kept ranges, validation "
                        "split or weights): its stream position does not apply to these blocks" if blocks_changed else
                        "values in the training data changed since the checkpoint (the same episodes, but a state, "
                        "action or task index differs): the normalisation and the samples are not the checkpoint's"
                        + self.content_changes(state.get("content_detail")))
                raise CheckpointError(f"{what}; resume on the same data, or pass --on_data_change restart_epoch to "
                                      "start the next epoch on the new data")
            self.epoch = int(state["epoch"]) + 1 + max([int(e) for e in (state.get("segment") or {}).get(
                "source_epochs", [0])])
            self.segment, self.batches_consumed = None, 0
            return f"the data changed: starting epoch {self.epoch} on the new data"
        old = {"world_size": state["world_size"], "num_workers": state.get("num_workers", self.num_workers),
               "batch_size": state["batch_size"], "open_blocks": state.get("open_blocks", self.open_blocks)}
        self.epoch = int(state["epoch"])
        if old == self.layout():
            self.segment = state.get("segment")
            self.batches_consumed = int(state["batches_consumed"])
            return None
        self.segment = self._reshard(old, state.get("segment"), int(state["batches_consumed"]))
        self.batches_consumed = 0
        changed = ", ".join(f"{k} {old[k]} -> {v}" for k, v in self.layout().items() if old[k] != v)
        pieces = sum(len(p) for p in self.segment["pieces"])
        return f"the stream layout changed ({changed}): {pieces} unconsumed pieces re-sharded"

    def _reshard(self, old: dict, old_segment: dict | None, batches: int) -> dict:
        shards = old["world_size"] * old["num_workers"]
        replays = []
        for rank in range(old["world_size"]):
            for worker in range(old["num_workers"]):
                shard = rank * old["num_workers"] + worker
                replay = ShardSchedule(self.blocks, self.weights, self.seed, self.epoch, (shard, shards),
                                       old["open_blocks"], old_segment)
                done = samples_done(batches, worker, old["num_workers"], old["batch_size"])
                for _ in range(done):
                    next(replay)
                replays.append(replay)
        pieces, epochs = [], []
        for source in range(len(self.blocks)):
            reached = max(replay.queues[source].epoch for replay in replays)  # the next epoch of the furthest shard
            mine = []
            for replay in replays:
                mine += replay.unconsumed(source)
                for epoch in range(replay.queues[source].epoch, reached):  # epochs this shard had not started
                    mine += replay.queues[source].epoch_share(epoch)
            pieces.append([[b.episode, b.start, b.end] for b in mine])
            epochs.append(reached)
        index = (old_segment or {}).get("index", 0) + 1
        return {"index": index, "source_epochs": epochs, "pieces": pieces}

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
        return schedule(self.blocks, self.weights, self.seed, self.epoch, shard, num_shards, self.open_blocks,
                        self.segment)

    def __iter__(self):
        worker_id, num_workers = _shard()
        # The DataLoader takes batches round-robin starting at worker 0; after B batches it is logical worker
        # B % W's turn, so DataLoader worker i plays logical worker (i + B) % W (same blocks, same position).
        logical = (worker_id + self.batches_consumed) % num_workers
        samples = self.shard_schedule(logical, num_workers)
        done = samples_done(self.batches_consumed, logical, num_workers, self.batch_size)
        for _ in range(done):  # fast-forward the schedule only: nothing is decoded, readers seek on first use
            next(samples)
        reader = FrameReader(self.sources, self.head_of_source, self.num_cameras, self.image_size, self.chunk_size,
                             self.decoder_threads, open_blocks=self.open_blocks, memory=self.memory)
        dropouts = [float((source.config.advantage or {}).get("dropout", 0.0)) for source in self.sources]
        shard = self.rank * num_workers + logical
        try:
            batch = []
            for source, block, frame, token in samples:
                sample = reader.sample(source, block, frame, token)
                if dropouts[source] and "advantage" in sample and self._drops(shard, token, frame, dropouts[source]):
                    sample["advantage"] = None  # RECAP's indicator dropout: this sample trains unconditioned
                batch.append(sample)
                if frame + 1 >= block.end:
                    reader.release(source, block, token)
                if self.batch_size is None:
                    yield batch.pop()
                elif len(batch) == self.batch_size:
                    yield self.collate_fn(batch) if self.collate_fn else batch
                    batch = []
        finally:
            reader.close()


    def _drops(self, shard: int, token: int, frame: int, probability: float) -> bool:
        """Whether a sample's advantage indicator is dropped: seeded by the sample's place in its shard's schedule
        (the block opening's token and the frame), so a resumed run drops the same samples as an uninterrupted one."""
        segment = int((self.segment or {}).get("index", -1))
        return bool(np.random.default_rng([self.seed, self.epoch, segment + 1, shard, token, frame, 13]).random()
                    < probability)


def _value_return(source, block: Block, table: dict, frame: int) -> dict:
    """The frame's normalised return when the mixture gives returns (`use_returns`: a value model's target)."""
    if not hasattr(source, "returns_cost"):
        return {}
    cost = source.returns_cost  # None: the task's episode limit
    if "returns" not in table:
        table["returns"] = source.frame_returns(block.episode, cost)
    return {"value_return": float(table["returns"][frame])}


def _advantage(settings: dict | None, table: dict, frame: int) -> dict:
    """The sample's RECAP indicator: the frame's column value, or the dataset's constant (nothing without one)."""
    if not settings:
        return {}
    if "value" in settings:
        return {"advantage": bool(settings["value"])}
    return {"advantage": bool(table["advantage"][frame])}


class ValidationStream(IterableDataset):
    """One deterministic pass over every validation frame of the mixture, each exactly once across ranks/workers.

    Frames are ordered (source, block, frame) and cut into equal contiguous slices per rank (then per worker), so
    decoding stays sequential; the last slice is padded with copies whose `action_is_pad` is all True, which count
    zero in every loss. Every rank runs the same number of batches. Positions are computed from cumulative block
    lengths: nothing is held per frame.
    """

    def __init__(self, sources, blocks: list[BlockList], head_of_source, num_cameras, settings: StreamSettings):
        super().__init__()
        image_size, chunk_size, batch_size = settings.image_size, settings.chunk_size, settings.batch_size
        collate_fn, rank, world_size = settings.collate_fn, settings.rank, settings.world_size
        decoder_threads = settings.decoder_threads
        if batch_size is None:
            raise ConfigError("the validation stream needs a batch_size")
        if batch_size <= 0:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        self.sources, self.head_of_source = sources, head_of_source
        self.num_cameras, self.image_size, self.chunk_size = num_cameras, image_size, chunk_size
        self.batch_size, self.collate_fn, self.rank, self.world_size = batch_size, collate_fn, rank, world_size
        self.decoder_threads = decoder_threads
        self.memory = settings.memory
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
                             self.decoder_threads, memory=self.memory)
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


def _worker_init(worker_id: int, then: Callable | None = None) -> None:
    """In each DataLoader worker: ignore the signals that announce a preemption (`hf_vla.cli.SIGNALS`).

    `timeout`, `kill -TERM -PGID` and batch systems that signal every process of a job step reach the workers too;
    torch's worker dies on SIGTERM, and the main process, which is finishing its step and writing the preemption
    checkpoint, then fails with "DataLoader worker ... is killed by signal". The main process decides when to stop;
    its workers leave when it shuts them down or exits (torch's workers watch their parent)."""
    import signal

    from hf_vla.cli import SIGNALS

    for number in SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


class ForkFriendlyDataLoader(DataLoader):
    """Forks its workers with the parent's objects frozen out of the garbage collector: a collection in a forked
    worker would otherwise touch every inherited object and copy its memory page. The parent unfreezes right after the fork. Its workers ignore preemption signals
    (`_worker_init`): the main process handles them."""

    def __init__(self, *args, worker_init_fn: Callable | None = None, **kwargs):
        super().__init__(*args, worker_init_fn=functools.partial(_worker_init, then=worker_init_fn), **kwargs)

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
