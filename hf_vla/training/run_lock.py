"""One training run per `output_dir`: `hf_vla.storage.DirectoryLock` as `python -m hf_vla.train` holds it."""

from __future__ import annotations

from hf_vla.storage import HEARTBEAT_S, LOCK_NAME, STALE_AFTER_S, DirectoryLock

RunLock = DirectoryLock  # `with RunLock(output_dir):` (label "output_dir", lock `_hf_vla_run.lock`)

__all__ = ["HEARTBEAT_S", "LOCK_NAME", "RunLock", "STALE_AFTER_S"]
