"""LeRobot data for VLA training: sources, the episode-shuffle stream, the weighted mixture, the collator.

Names load on first use, so the torch-free parts (`dataset_config`, checked before anything loads) import alone."""

from hf_vla.cli import lazy_attributes

_PUBLIC = {"PI0Collator": ".collator", "PI05Collator": ".collator", "VLACollator": ".collator",
           "WeightedDatasetMixture": ".mixture", "Block": ".sources", "DatasetConfig": ".dataset_config",
           "LeRobotSource": ".sources", "VideoReader": ".sources", "EpisodeShuffleStream": ".stream",
           "ForkFriendlyDataLoader": ".stream", "Provenance": ".stream", "ValidationStream": ".stream",
           "schedule": ".stream"}
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_attributes(__name__, _PUBLIC)
