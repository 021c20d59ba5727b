"""Weighted mixture of LeRobot datasets: normalization heads, pooled stats, episode splits, streams."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import numpy as np
from lerobot.datasets.compute_stats import aggregate_feature_stats

from hf_vla.data.scan import MAX_STATS_FRAMES
from hf_vla.data.sources import BlockList, DatasetConfig, LeRobotSource
from hf_vla.data.stream import EpisodeShuffleStream, Provenance, StreamSettings, ValidationStream
from hf_vla.errors import ConfigError, DataError
from hf_vla.models.common.normalization import DEFAULT_MODE, STAT_NAMES, missing_stats

logger = logging.getLogger("hf_vla.data")
EXACT_QUANTILES = [0.01, 0.10, 0.90, 0.99]  # q01/q99 (QUANTILES), q10/q90 (QUANTILE10)


class WeightedDatasetMixture:
    """Datasets with weights, grouped into normalization heads keyed `robot_type::control_mode`.

    - `dataset_index` of a sample is its head (which normalization it uses), `source_index` its dataset,
      `episode_index` a global episode id (datasets' episodes offset one after another).
    - A head's stats pool its members' stats by frame count (lerobot's `aggregate_feature_stats`); members of one
      head must have the same state/action dims.
    - The validation split is by episode: a seeded `validation_ratio` of each dataset's episodes.
    """

    def __init__(self, datasets: Sequence[DatasetConfig | dict], validation_ratio: float = 0.0, split_seed: int = 0,
                 chunk_size: int | None = None):
        self.chunk_size = chunk_size  # the statistics of relative-action heads are over chunks of this many steps
        configs = [d if isinstance(d, DatasetConfig) else DatasetConfig(**d) for d in datasets]
        if not configs:
            raise ConfigError("the mixture needs at least one dataset")
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ConfigError(f"dataset names must be unique, got {names}")
        if not 0.0 <= validation_ratio < 1.0:
            raise ConfigError(f"validation_ratio must be in [0, 1), got {validation_ratio}")
        self.sources: list[LeRobotSource] = []
        offset = 0
        for index, config in enumerate(configs):
            source = LeRobotSource(config, index, episode_offset=offset)
            offset += source.num_episodes
            self.sources.append(source)
        self.weights = [c.weight for c in configs]
        self.head_names: list[str] = []
        for source in self.sources:
            if source.norm_key not in self.head_names:
                self.head_names.append(source.norm_key)
        self.head_of_source = [self.head_names.index(s.norm_key) for s in self.sources]
        self.norm_stats = {head: self._pool(head) for head in self.head_names}
        self.num_cameras = max(len(c.cameras) for c in configs)
        self.max_state_dim = max(s.state_dim for s in self.sources)
        self.max_action_dim = max(s.action_dim for s in self.sources)
        self.train_blocks: list[BlockList] = []
        self.validation_blocks: list[BlockList] = []
        for source in self.sources:
            train, validation = self._split(source, validation_ratio, split_seed)
            self.train_blocks.append(source.blocks(train))
            self.validation_blocks.append(source.blocks(validation))
        _release_build_memory()

    def use_returns(self, failure_cost: float | None = None, allow_unlabelled: bool = False) -> dict[str, int]:
        """Give every sample its frame's normalised return (`value_return`: the value model's target, RECAP), from each
        episode's outcome (`LeRobotSource.episode_outcomes`) and its task's one episode limit across the mixture
        (`resolve_episode_limits`, returned). An episode without an outcome is refused, naming it; with
        `allow_unlabelled` it is left out of training and validation, and the count logged."""
        import logging

        from hf_vla.data.blocks import BlockList
        from hf_vla.data.sources import resolve_episode_limits

        limits = resolve_episode_limits(self.sources)

        for index, source in enumerate(self.sources):
            outcomes = source.episode_outcomes(allow_unlabelled)
            source.returns_cost = failure_cost
            unknown = source.episodes["episode_index"][np.isnan(outcomes)]
            if len(unknown):
                logging.getLogger("hf_vla").warning("dataset %r: %d of %d episodes have no outcome and are left out "
                                                    "(allow_unlabelled)", source.name, len(unknown), len(outcomes))
                for blocks in (self.train_blocks, self.validation_blocks):
                    kept = blocks[index].ranges[~np.isin(blocks[index].ranges[:, 0], unknown)]
                    blocks[index] = BlockList(blocks[index].source, kept)
        return limits

    def _pool(self, head: str) -> dict:
        members = [s for s in self.sources if s.norm_key == head]
        for key, dim in (("state", "state_dim"), ("actions", "action_dim")):
            dims = {s.name: getattr(s, dim) for s in members}
            if len(set(dims.values())) > 1:
                raise ConfigError(
                    f"normalization head {head!r}: its datasets have different {key} dims {dims}; give them distinct "
                    "robot_type/control_mode so each gets its own head"
                )
        modes = {s.name: s.config.normalization or {} for s in members}
        masks = {s.name: s.relative_mask for s in members}
        for what, values in (("normalization", modes), ("relative_actions", masks)):
            if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
                raise ConfigError(f"normalization head {head!r}: its datasets differ in {what} {values}; one head "
                                  "normalises one way: give them the same setting, or distinct robot_type/control_mode")
        pooled = {}
        for key in ("state", "actions"):
            stats = aggregate_feature_stats([s.stats[key] for s in members])
            pooled[key] = {name: np.asarray(value).tolist() for name, value in stats.items()
                           if name in STAT_NAMES}
        # The scan checks every member's data (NaN/inf, layout, tasks, videos) whichever quantiles are used; cached.
        scans = [s.scan() for s in members]
        if all(s.config.quantile_stats == "exact" for s in members):
            # Exact quantiles of the pooled frames: each member contributes in proportion to its frame count.
            total = sum(v.frames for v in scans)
            rng = np.random.default_rng(0)
            for key in ("state", "actions"):
                parts = []
                for v in scans:
                    values = getattr(v, key)
                    if total <= MAX_STATS_FRAMES:  # every frame of every member: weighting by frame count is exact
                        parts.append(values)
                        continue
                    share = max(1, int(round(MAX_STATS_FRAMES * v.frames / total)))
                    parts.append(values[rng.choice(len(values), size=share, replace=share > len(values))])
                data = np.concatenate(parts) if len(parts) > 1 else parts[0]
                columns = []
                for column in range(data.shape[1]):  # one float64 column at a time, not a float64 copy of it all
                    columns.append(np.quantile(data[:, column].astype(np.float64), EXACT_QUANTILES))
                for index, name in enumerate(("q01", "q10", "q90", "q99")):
                    pooled[key][name] = [float(c[index]) for c in columns]
                del data
        mask = members[0].relative_mask
        if mask is not None:  # the actions the head trains on are offsets: their statistics are the offsets'
            pooled["actions"] = self._relative_stats(head, members, mask)
        mapping = members[0].config.normalization or {}
        for key in ("state", "actions"):
            mode = mapping.get(key, DEFAULT_MODE)
            missing = missing_stats(pooled[key], mode)
            if missing:
                source = next(s for s in members if not set(missing) <= set(s.stats[key]))
                raise ConfigError(f"dataset {source.name!r}: {mode} normalisation of {key} "
                                  f"({source.config.state_key if key == 'state' else source.config.action_key!r}) "
                                  f"needs {' and '.join(missing)}, which its meta/stats.json lacks (quantile_stats "
                                  f"{source.config.quantile_stats!r}); use quantile_stats: exact, or another mode")
            if mode != DEFAULT_MODE:
                pooled[key]["mode"] = mode
        if mask is not None:
            pooled["actions"]["relative_mask"] = list(mask)
        return pooled

    def _relative_stats(self, head: str, members: list[LeRobotSource], mask: list[bool]) -> dict:
        """Every statistic of the head's relative chunks (`hf_vla.data.relative`), pooled over its datasets in
        proportion to their chunks; `meta/stats.json` is not read for them."""
        from hf_vla.data.relative import relative_chunks
        from hf_vla.models.common.normalization import relative_chunk_stats

        if self.chunk_size is None:
            raise ConfigError(f"normalization head {head!r}: relative_actions needs the model's chunk_size for its "
                              "statistics (WeightedDatasetMixture(..., chunk_size=...))")
        share = max(1, MAX_STATS_FRAMES // len(members))
        chunks = np.concatenate([relative_chunks(s, mask, self.chunk_size, share) for s in members])
        stats = relative_chunk_stats(chunks)
        logger.info("head %r: relative-action statistics over %d chunks of %d steps (%d of %d dims relative)", head,
                    len(chunks), self.chunk_size, sum(mask), len(stats["mean"]))
        return stats

    @staticmethod
    def _split(source: LeRobotSource, ratio: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        episodes = np.asarray(source.usable_episodes(), dtype=np.int64)
        if ratio == 0:
            return episodes, episodes[:0]
        order = np.random.default_rng([seed, source.source_index]).permutation(len(episodes))
        count = max(1, int(round(ratio * len(episodes))))
        if count >= len(episodes):
            raise DataError(
                f"dataset {source.name!r}: validation_ratio={ratio} leaves no training episode ({len(episodes)} usable)"
            )
        validation = np.sort(episodes[order[:count]])
        return np.setdiff1d(episodes, validation), validation

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def provenance(self) -> Provenance:
        datasets = []
        for source in self.sources:
            episode = source.usable_episodes()[0]
            table = source.episode_table(episode)
            datasets.append({"name": source.name, "source": source.config.repo_id or "local",
                             "weight": source.config.weight, "head": source.norm_key,
                             "cameras": ", ".join(c or "(empty)" for c in source.config.cameras),
                             "example_task": source.task(table["task_index"][0], episode)})
        return Provenance(self.names, list(self.head_names), list(self.weights),
                          [s.episode_offset for s in self.sources], datasets)

    def training_datasets(self, args, image_size: int, chunk_size: int, memory: dict | None = None):
        """(train, validation) datasets for `VLATrainer`, from its training arguments: the episode-shuffle stream
        sharded for this rank (`per_device_train_batch_size`, `data_seed` or `seed`, `stream_open_blocks`,
        `decoder_threads`) and the validation stream (None without a validation split). Both yield lists of samples
        per batch, for the trainer's `data_collator`, and carry `provenance`. `memory`: MEM's settings (the
        processor's `memory`): every sample then carries its past observations."""
        self.check_chunks(chunk_size)
        if memory:
            self.check_memory_fps(memory)
        seed = args.data_seed if args.data_seed is not None else args.seed
        threads = getattr(args, "decoder_threads", None)
        train = self.train_stream(StreamSettings(
            image_size, chunk_size, batch_size=args.per_device_train_batch_size, seed=seed,
            open_blocks=getattr(args, "stream_open_blocks", 32), rank=args.process_index, world_size=args.world_size,
            decoder_threads=threads, memory=memory))
        validation = None
        if any(len(blocks) for blocks in self.validation_blocks):
            validation = self.validation_stream(StreamSettings(
                image_size, chunk_size, args.per_device_eval_batch_size, rank=args.process_index,
                world_size=args.world_size, decoder_threads=threads, memory=memory))
        return train, validation

    def check_memory_fps(self, memory: dict) -> None:
        """MEM's stride counts dataset frames: datasets of different frame rates would give the same stride different
        durations (the policy learns one): refused, naming them."""
        rates = {source.name: float(source.fps) for source in self.sources}
        if len(set(rates.values())) > 1:
            raise ConfigError(f"observation memory (memory_stride={memory['stride']} frames) over datasets of different "
                              f"fps {rates}: the stride would mean different times; train them separately or resample")

    def check_chunks(self, chunk_size: int) -> None:
        """A dataset whose per-frame chunks (`action_chunk_key`) are shorter than `chunk_size` is refused. A chunk longer
        than every episode of a dataset trains, its steps past the episode end masked out of the loss, but that is more
        often a wrong chunk_size (or fps) than an intent: say so with the numbers."""
        for source in self.sources:
            if source.chunk_steps is not None:  # its chunks are whole per frame: nothing is padded
                if source.chunk_steps < chunk_size:
                    raise ConfigError(f"dataset {source.name!r}: action_chunk_key {source.config.action_chunk_key!r} "
                                      f"holds {source.chunk_steps} steps per frame, fewer than chunk_size {chunk_size}")
                continue
            lengths = source.episodes["length"][source.used_rows()]
            if len(lengths) and chunk_size > int(lengths.max()):
                longest = int(lengths.max())
                logger.warning("dataset %r: chunk_size %d is longer than every episode (longest %d frames, median %d): "
                               "at least %d of each chunk's %d steps are padding, masked out of the loss; lower "
                               "chunk_size (or check the data's fps)", source.name, chunk_size, longest,
                               int(np.median(lengths)), chunk_size - longest, chunk_size)

    def train_stream(self, settings: StreamSettings) -> EpisodeShuffleStream:
        """The episode-shuffle stream over the training blocks, served as `settings` say."""
        stream = EpisodeShuffleStream(self.sources, self.train_blocks, self.weights, self.head_of_source,
                                      self.num_cameras, settings)
        stream.provenance = self.provenance
        return stream

    def validation_stream(self, settings: StreamSettings) -> ValidationStream:
        """Every validation frame once, in order, served as `settings` say (`batch_size` required)."""
        stream = ValidationStream(self.sources, self.validation_blocks, self.head_of_source, self.num_cameras, settings)
        stream.provenance = self.provenance
        return stream


def _release_build_memory():
    """Give the statistics scan's freed heap back to the OS before DataLoader workers fork from this process."""
    try:
        import pyarrow as pa

        pa.default_memory_pool().release_unused()
    except Exception:  # noqa: BLE001 - best effort
        pass
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
