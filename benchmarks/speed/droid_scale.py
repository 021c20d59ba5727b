"""DROID-scale data loading: hf_vla's stream against lerobot's LeRobotDataset on the same DROID-shaped dataset.

    python -m benchmarks.speed.droid_scale [--episodes 10000 92000] [--root DATA_DIR] [--lerobot_batches 20]

For each size it writes (once, under --root) a synthetic dataset with DROID's shape (`hf_vla.data.synthetic`: 3
cameras of tiny video, so decoding is cheap and the data pipeline is what is measured; about 290 frames per episode;
about 100 MB data files) and measures, each in a fresh process, one rank with one DataLoader worker, batch 32,
chunk 15, 224 px images:
- hf_vla, cold (empty statistics cache) and as a second rank reading the cache; with and without DROID's keep-ranges
  filter: start-up s (mixture with exact quantiles, validation 1%), peak RSS, first batch s, block opening ms (one
  episode's rows; and the first sample of a new block, three videos opened), frames/s over the first 20 batches and
  over batches 21-420 (episodes turn over), the worker's PSS/USS and threads;
- lerobot's `LeRobotDataset` (map-style, shuffled, the same chunk as `delta_timestamps`): start-up s, peak RSS, worker
  PSS, frames/s.
Prints JSON, including the per-node estimate for 8 ranks x 8 workers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH, CHUNK, IMAGE = 32, 15, 224


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _proc_memory(pid: int) -> dict:
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            parts = line.split()
            if parts[0].rstrip(":") in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                fields[parts[0].rstrip(":")] = int(parts[1]) / 2**20  # kB -> GB
    with open(f"/proc/{pid}/status") as handle:
        threads = next(int(line.split()[1]) for line in handle if line.startswith("Threads:"))
    return {"rss_gb": round(fields["Rss"], 3), "pss_gb": round(fields["Pss"], 3),
            "uss_gb": round(fields["Private_Clean"] + fields["Private_Dirty"], 3), "threads": threads}


def _worker_pids(loader_iterator) -> list[int]:
    return [w.pid for w in getattr(loader_iterator, "_workers", [])]


def _rate(iterator, batches: int) -> float:
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * BATCH / (time.perf_counter() - start)


def measure_hf_vla(root: str, keep_ranges: bool, turnover_batches: int) -> dict:
    import numpy as np
    import torch

    from hf_vla import PI05Processor
    from hf_vla.data import ForkFriendlyDataLoader, PI05Collator, WeightedDatasetMixture
    from hf_vla.data.stream import FrameReader, StreamSettings
    from hf_vla.data.synthetic import droid_dataset_config
    from hf_vla.tiny import build_tiny_tokenizer

    started = time.perf_counter()
    mixture = WeightedDatasetMixture([droid_dataset_config(root, keep_ranges=keep_ranges)], validation_ratio=0.01)
    startup = time.perf_counter() - started
    startup_rss = _peak_rss_gb()
    source = mixture.sources[0]
    cached = source.episode_rows is not None
    # block opening: one episode's rows, and the first sample of a new block (its three videos opened)
    rng = np.random.default_rng(0)
    blocks = mixture.train_blocks[0]
    picks = [blocks[int(i)] for i in rng.choice(len(blocks), size=min(200, len(blocks)), replace=False)]
    table_ms, first_sample_ms = [], []
    for block in picks:
        start = time.perf_counter()
        source.episode_table(block.episode)
        table_ms.append((time.perf_counter() - start) * 1000)
    reader = FrameReader(mixture.sources, mixture.head_of_source, mixture.num_cameras, IMAGE, CHUNK)
    for token, block in enumerate(picks[:60]):
        start = time.perf_counter()
        reader.sample(0, block, block.start, token)
        first_sample_ms.append((time.perf_counter() - start) * 1000)
        reader.release(0, block, token)
    reader.close()
    processor = PI05Processor(tokenizer=build_tiny_tokenizer(), norm_stats=mixture.norm_stats, image_size=IMAGE,
                              max_state_dim=32, max_action_dim=32, chunk_size=CHUNK, prompt_max_length=64)
    stream = mixture.train_stream(StreamSettings(IMAGE, CHUNK, batch_size=BATCH, collate_fn=PI05Collator(processor), seed=0))
    loader = ForkFriendlyDataLoader(stream, batch_size=None, num_workers=1, persistent_workers=True)  # as the trainer
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    first_batch = time.perf_counter() - started
    first_rate = _rate(iterator, 20)
    worker = _proc_memory(_worker_pids(iterator)[0])
    turnover_rate = _rate(iterator, turnover_batches)
    worker_after = _proc_memory(_worker_pids(iterator)[0])
    del iterator
    quantile = float(np.quantile(table_ms, 0.95))
    return {
        "startup_s": round(startup, 1), "peak_rss_startup_gb": round(startup_rss, 2),
        "peak_rss_gb": round(_peak_rss_gb(), 2), "stats_from_cache": bool(mixture.sources[0].episode_rows is not None
                                                                        and cached),
        "blocks": len(blocks), "episodes": int(source.num_episodes),
        "block_opening_ms": {"episode_rows_median": round(statistics.median(table_ms), 2),
                             "episode_rows_p95": round(quantile, 2),
                             "first_sample_of_block_median": round(statistics.median(first_sample_ms), 1),
                             "first_sample_of_block_p95": round(float(np.quantile(first_sample_ms, 0.95)), 1)},
        "first_batch_s": round(first_batch, 2), "frames_per_s_first_20_batches": round(first_rate, 1),
        f"frames_per_s_batches_21_to_{20 + turnover_batches}": round(turnover_rate, 1),
        "worker_after_20_batches": worker, f"worker_after_{20 + turnover_batches}_batches": worker_after,
        "torch_threads": torch.get_num_threads(),
    }


def measure_lerobot(root: str, batches: int) -> dict:
    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from torch.utils.data import DataLoader

    from hf_vla.models.common.images import resize_with_pad

    started = time.perf_counter()
    dataset = LeRobotDataset("local/droid_bench", root=root, video_backend="pyav",
                             delta_timestamps={"action": [i / 15 for i in range(CHUNK)]},
                             image_transforms=lambda image: resize_with_pad(image, IMAGE))
    startup = time.perf_counter() - started
    startup_rss = _peak_rss_gb()
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=1, persistent_workers=True,
                        generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    first_batch = time.perf_counter() - started
    rate = _rate(iterator, batches)
    worker = _proc_memory(_worker_pids(iterator)[0])
    del iterator
    return {"startup_s": round(startup, 1), "peak_rss_startup_gb": round(startup_rss, 2),
            "peak_rss_gb": round(_peak_rss_gb(), 2), "first_batch_s": round(first_batch, 2),
            f"frames_per_s_{batches}_batches": round(rate, 1), "worker": worker}


def _run(args: list[str], env: dict) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        result = subprocess.run([sys.executable, __file__, *args, "--json", out.name], env=env, capture_output=True,
                                text=True, timeout=3600)
        if result.returncode != 0:
            raise SystemExit(f"{args}: failed\n{result.stderr[-4000:]}")
        return json.loads(Path(out.name).read_text())


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, nargs="*", default=[10_000, 92_000])
    parser.add_argument("--root", default="data_cache/droid_scale")
    parser.add_argument("--turnover_batches", type=int, default=400)
    parser.add_argument("--lerobot_batches", type=int, default=20)
    parser.add_argument("--skip_lerobot", action="store_true")
    parser.add_argument("--measure", choices=("hf_vla", "lerobot"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--keep", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        result = measure_hf_vla(args.data, bool(args.keep), args.turnover_batches) if args.measure == "hf_vla" else \
            measure_lerobot(args.data, args.lerobot_batches)
        Path(args.json).write_text(json.dumps(result))
        return result

    from hf_vla.data.synthetic import DroidLike, write_droid_like

    report = {"setup": {"batch": BATCH, "chunk": CHUNK, "image_size": IMAGE, "ranks": 1, "dataloader_workers": 1,
                        "machine_cpus": os.cpu_count()}, "sizes": {}}
    for episodes in args.episodes:
        root = Path(args.root) / f"droid_{episodes}"
        if not (root / "meta" / "info.json").exists():
            started = time.perf_counter()
            write_droid_like(root, DroidLike(episodes=episodes))
            generated = time.perf_counter() - started
        else:
            generated = None
        entry = {"generated_s": round(generated, 1) if generated else "reused"}
        for keep in (1, 0):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, HF_VLA_CACHE=cache, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
                common = ["--measure", "hf_vla", "--data", str(root), "--keep", str(keep),
                          "--turnover_batches", str(args.turnover_batches)]
                cold = _run(common, env)
                warm = _run(common + ["--turnover_batches", "20"], env)  # a second rank: the cache is there
            label = "hf_vla_keep_ranges" if keep else "hf_vla_all_frames"
            entry[label] = {"cold": cold, "second_rank_with_cache": {k: warm[k] for k in (
                "startup_s", "peak_rss_startup_gb", "stats_from_cache", "first_batch_s")}}
        if not args.skip_lerobot:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            entry["lerobot_map_style"] = _run(["--measure", "lerobot", "--data", str(root), "--lerobot_batches",
                                               str(args.lerobot_batches)], env)
        report["sizes"][str(episodes)] = entry
    sizes = sorted(report["sizes"], key=int)
    if len(sizes) >= 2:
        small, large = report["sizes"][sizes[0]], report["sizes"][sizes[-1]]
        report["startup_growth"] = {
            "episodes_ratio": round(int(sizes[-1]) / int(sizes[0]), 1),
            "hf_vla_keep_ranges_startup_ratio": round(large["hf_vla_keep_ranges"]["cold"]["startup_s"]
                                                      / max(small["hf_vla_keep_ranges"]["cold"]["startup_s"], 0.1), 1)}
    largest = report["sizes"][sizes[-1]]["hf_vla_keep_ranges"]["cold"]
    worker_key = next(k for k in largest if k.startswith("worker_after_") and k != "worker_after_20_batches")
    per_rank = largest["peak_rss_gb"] + 8 * largest[worker_key]["pss_gb"]
    report["per_node_estimate_8_ranks_x_8_workers"] = {
        "memory_gb": round(8 * per_rank, 1),
        "how": "8 x (rank peak RSS + 8 x worker PSS) at the largest size, keep-ranges, cold; one rank scans, the "
               "others read its cache",
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
