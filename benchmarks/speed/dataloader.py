"""Frames/s and distinct episodes per batch: the episode-shuffle stream vs lerobot's shuffled map-style DataLoader.

    python -m benchmarks.speed.dataloader [--dataset ../shared/datasets/humanoid_teleop_24] [--workers 1] [--rounds 3]
                                    [--batches 40] [--lerobot-batches 4]

The two loaders are timed in alternating rounds (stream, lerobot, stream, ...), each round on fresh workers after one
warm-up batch, so a slow spell of a shared machine lands on both: the speedup is total frames/s over total frames/s,
and the per-round ratios are printed too.

Same dataset, same 50-step action chunks, same 224 aspect-preserving resize, same batch size (32) and worker
count. The stream's numbers include the full pi0.5 collation (normalization, prompt tokenization); lerobot's use
torch's default collate, so the comparison favours lerobot. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from hf_vla import PI05Processor
from hf_vla.data import PI05Collator, WeightedDatasetMixture
from hf_vla.data.stream import StreamSettings
from hf_vla.models.common.images import resize_with_pad
from hf_vla.tiny import build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
IMAGE_SIZE, CHUNK, BATCH = 224, 50, 32


def measure(loader, batches: int, key: str) -> dict:
    """Frames/s over `batches` batches of a fresh iterator (fresh workers), after one warm-up batch."""
    iterator = iter(loader)
    next(iterator)  # warm-up: worker start, first opens
    distinct, start = [], time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
        distinct.append(int(torch.as_tensor(batch[key]).unique().numel()))
    elapsed = time.perf_counter() - start
    del iterator  # shuts its workers down before the other loader's round
    return {"frames_per_s": batches * BATCH / elapsed, "seconds": elapsed, "distinct": distinct}


def summary(rounds: list[dict]) -> dict:
    seconds = sum(r["seconds"] for r in rounds)
    distinct = [d for r in rounds for d in r["distinct"]]
    batches = len(distinct)
    return {"frames_per_s": batches * BATCH / seconds, "per_round_frames_per_s": [round(r["frames_per_s"], 1) for r in rounds],
            "distinct_episodes_per_batch_mean": sum(distinct) / batches, "distinct_episodes_per_batch_min": min(distinct),
            "batches": batches}


def lerobot_loader(root: Path, workers: int):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    fps = 30
    dataset = LeRobotDataset(
        "local/bench", root=root, video_backend="pyav",
        delta_timestamps={"actions": [i / fps for i in range(CHUNK)]},
        image_transforms=lambda image: resize_with_pad(image, IMAGE_SIZE),
    )
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(0))


def stream_loader(root: Path, workers: int):
    mixture = WeightedDatasetMixture([dict(root=str(root), name="bench", cameras=["image"], state_key="state",
                                           action_key="actions", control_mode="joint")])
    processor = PI05Processor(tokenizer=build_tiny_tokenizer(), norm_stats=mixture.norm_stats, image_size=IMAGE_SIZE,
                              max_state_dim=mixture.max_state_dim, max_action_dim=mixture.max_action_dim,
                              chunk_size=CHUNK, prompt_max_length=128)
    stream = mixture.train_stream(StreamSettings(IMAGE_SIZE, CHUNK, batch_size=BATCH, collate_fn=PI05Collator(processor), seed=0))
    return DataLoader(stream, batch_size=None, num_workers=workers)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default=str(REPO.parent / "shared/datasets/humanoid_teleop_24"))
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=40, help="stream batches per round")
    parser.add_argument("--lerobot-batches", type=int, default=4, help="lerobot batches per round (about 0.6 s each)")
    args = parser.parse_args()
    root = Path(args.dataset)
    stream, lerobot = stream_loader(root, args.workers), lerobot_loader(root, args.workers)
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(measure(stream, args.batches, "episode_index"))
        theirs.append(measure(lerobot, args.lerobot_batches, "episode_index"))
    ours, theirs = summary(ours), summary(theirs)
    print(json.dumps({
        "dataset": root.name,
        "workers": args.workers,
        "batch_size": BATCH,
        "chunk": CHUNK,
        "image_size": IMAGE_SIZE,
        "stream": ours,
        "lerobot_map_style": theirs,
        "per_round_speedup": [round(a / b, 2) for a, b in zip(ours["per_round_frames_per_s"],
                                                              theirs["per_round_frames_per_s"])],
        "speedup": ours["frames_per_s"] / theirs["frames_per_s"],
        "targets": {"speedup_min": 10, "distinct_episodes_min": 16},
    }, indent=2))


if __name__ == "__main__":
    main()
