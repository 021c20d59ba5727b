"""The server's bounds (message size, connections) and its API-key variable: what `python -m hf_vla.serve` checks
its options against before anything heavy is imported."""

from __future__ import annotations

import math

API_KEY_ENV = "HF_VLA_API_KEY"
# The default message bound: room for every camera's image at 1920x1080 in float32 (uint8 needs a quarter), plus 1 MiB
# for the state, prompt and RTC fields. pi0.5 is published with 3 camera slots.
DEFAULT_CAMERA_BYTES = 1920 * 1080 * 3 * 4
DEFAULT_CAMERAS = 3


# What one connection can hold at its worst, in multiples of the message bound: the frame websockets is receiving, the
# assembled message, the decoded copy of its images and the pre-processing's temporaries, above the peak growth per
# connection `benchmarks/speed/serve_load.py --memory` measures (docs/measurements.md).
CONNECTION_MEMORY_FACTOR = 6
MAX_CONNECTIONS_CAP = 256


def default_max_message_mb(num_cameras: int | None) -> float:
    return math.ceil((num_cameras or DEFAULT_CAMERAS) * DEFAULT_CAMERA_BYTES / 2**20) + 1


def default_max_connections(max_message_mb: float, available_bytes: int | None = None) -> int:
    """As many connections as half the memory available now holds when every one of them sends a message of
    `max_message_mb` at once (`CONNECTION_MEMORY_FACTOR` x the bound each); at least 1, at most 256."""
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    per_connection = CONNECTION_MEMORY_FACTOR * max_message_mb * 2**20
    return int(min(MAX_CONNECTIONS_CAP, max(1, available_bytes // 2 // per_connection)))
