"""LeRobot data for VLA training: sources, the episode-shuffle stream, the weighted mixture, the collator."""

from hf_vla.data.collator import PI0Collator, PI05Collator, VLACollator
from hf_vla.data.mixture import WeightedDatasetMixture
from hf_vla.data.sources import Block, DatasetConfig, LeRobotSource, VideoReader
from hf_vla.data.stream import EpisodeShuffleStream, ForkFriendlyDataLoader, Provenance, ValidationStream, schedule

__all__ = [
    "Block",
    "DatasetConfig",
    "EpisodeShuffleStream",
    "ForkFriendlyDataLoader",
    "LeRobotSource",
    "PI0Collator",
    "PI05Collator",
    "Provenance",
    "VLACollator",
    "ValidationStream",
    "VideoReader",
    "WeightedDatasetMixture",
    "schedule",
]
