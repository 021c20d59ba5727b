"""Frames/s and distinct episodes per batch: the episode-shuffle stream vs lerobot's shuffled map-style DataLoader.

    python benchmarks/dataloader.py [--dataset ../shared/datasets/humanoid_teleop_24] [--workers 1] [--batches 20]

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
from hf_vla.models.pi05.processing_pi05 import resize_with_pad
from hf_vla.tiny import build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
IMAGE_SIZE, CHUNK, BATCH = 224, 50, 32


def measure(loader, batches: int, key: str) -> dict:
    iterator = iter(loader)
    next(iterator)  # warm-up: worker start, first opens
    distinct, start = [], time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
        distinct.append(int(torch.as_tensor(batch[key]).unique().numel()))
    elapsed = time.perf_counter() - start
    return {"frames_per_s": batches * BATCH / elapsed, "distinct_episodes_per_batch_mean": sum(distinct) / len(distinct),
            "distinct_episodes_per_batch_min": min(distinct), "batches": batches}


def lerobot_loader(root: Path, workers: int):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    fps = 30
    dataset = LeRobotDataset(
        "local/bench", root=root, video_backend="pyav",
        delta_timestamps={"actions": [i / fps for i in range(CHUNK)]},
        image_transforms=lambda image: resize_with_pad(image, IMAGE_SIZE),
    )
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(0), persistent_workers=workers > 0)


def stream_loader(root: Path, workers: int):
    mixture = WeightedDatasetMixture([dict(root=str(root), name="bench", cameras=["image"], state_key="state",
                                           action_key="actions", control_mode="joint")])
    processor = PI05Processor(tokenizer=build_tiny_tokenizer(), norm_stats=mixture.norm_stats, image_size=IMAGE_SIZE,
                              max_state_dim=mixture.max_state_dim, max_action_dim=mixture.max_action_dim,
                              chunk_size=CHUNK, prompt_max_length=128)
    stream = mixture.train_stream(IMAGE_SIZE, CHUNK, batch_size=BATCH, collate_fn=PI05Collator(processor), seed=0)
    return DataLoader(stream, batch_size=None, num_workers=workers, persistent_workers=workers > 0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default=str(REPO.parent / "shared/datasets/humanoid_teleop_24"))
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--lerobot-batches", type=int, default=12)
    args = parser.parse_args()
    root = Path(args.dataset)
    ours = measure(stream_loader(root, args.workers), args.batches, "episode_index")
    theirs = measure(lerobot_loader(root, args.workers), args.lerobot_batches, "episode_index")
    print(json.dumps({
        "dataset": root.name,
        "workers": args.workers,
        "batch_size": BATCH,
        "chunk": CHUNK,
        "image_size": IMAGE_SIZE,
        "stream": ours,
        "lerobot_map_style": theirs,
        "speedup": ours["frames_per_s"] / theirs["frames_per_s"],
        "targets": {"speedup_min": 10, "distinct_episodes_min": 16},
    }, indent=2))


if __name__ == "__main__":
    main()
