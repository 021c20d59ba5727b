"""The action chunks a relative-action head trains on, in relative space, for its normalisation statistics.

As lerobot's `compute_relative_action_stats` (and openpi's norm stats, computed after `DeltaActions`): every full
chunk of `chunk_size` steps inside one block (an episode, or a kept range of it), each step minus the state of the
chunk's first frame on the masked dims. A dataset with per-frame chunks (`action_chunk_key`) uses those, one per
frame. At most `max_values` steps are kept (whole chunks, drawn with a fixed seed), as the exact quantiles are.
"""

from __future__ import annotations

import numpy as np

from hf_vla.errors import DataError


def relative_chunks(source, mask: list[bool], chunk_size: int, max_values: int, seed: int = 0) -> np.ndarray:
    """`[N, chunk_size, action_dim]` float32 relative chunks of `source` (a `LeRobotSource` whose scan has run)."""
    blocks = list(source.blocks(source.usable_episodes()))
    per_frame = source.chunk_steps is not None
    starts = np.array([b.length if per_frame else max(0, b.length - chunk_size + 1) for b in blocks], np.int64)
    total = int(starts.sum())
    if total == 0:
        longest = max((b.length for b in blocks), default=0)
        raise DataError(f"dataset {source.name!r}: relative_actions statistics need chunks of chunk_size "
                        f"{chunk_size} inside one episode, and no episode (longest {longest} frames) holds one")
    chosen = np.arange(total)
    keep = max(1, max_values // chunk_size)
    if total > keep:
        chosen = np.sort(np.random.default_rng(seed).choice(total, size=keep, replace=False))
    bounds = np.concatenate([[0], np.cumsum(starts)])
    owner = np.searchsorted(bounds, chosen, side="right") - 1
    mask_t = np.zeros(source.action_dim, np.float32)
    mask_t[: len(mask)] = mask
    out = np.empty((len(chosen), chunk_size, source.action_dim), np.float32)
    steps = np.arange(chunk_size)
    for index in np.unique(owner):
        block = blocks[int(index)]
        picked = np.flatnonzero(owner == index)
        offsets = chosen[picked] - bounds[index] + block.start  # first frames of the chosen chunks
        table = source.episode_table(block.episode)
        state = table["state"][offsets, : source.action_dim] if source.state_dim >= source.action_dim else np.pad(
            table["state"][offsets], ((0, 0), (0, source.action_dim - source.state_dim)))
        if per_frame:
            chunk = table["action_chunks"][offsets, :chunk_size]
        else:
            chunk = table["actions"][offsets[:, None] + steps[None, :]]
        out[picked] = chunk - (state * mask_t)[:, None, :]
    return out


__all__ = ["relative_chunks"]
