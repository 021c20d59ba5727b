"""LeRobot data for VLA training: sources, the episode-shuffle stream, the weighted mixture, the collator."""

from .collator import PI0Collator, PI05Collator, VLACollator
from .mixture import WeightedDatasetMixture
from .sources import Block, DatasetConfig, LeRobotSource, VideoReader
from .stream import EpisodeShuffleStream, ForkFriendlyDataLoader, Provenance, ValidationStream, schedule

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
