"""MEM observation memory on CPU: a task that needs memory, the five Meta-World tasks that do not, the stream's cost,
and the training cost per step at the published dims.

    python -m benchmarks.closed_loop.memory_cpu --stage colorreach   # ColorReach with the cue in the first frames only
    python -m benchmarks.closed_loop.memory_cpu --stage metaworld    # the five tasks, memory against none
    python -m benchmarks.closed_loop.memory_cpu --stage stream       # frames/s of the stream on the teleop dataset
    python -m benchmarks.closed_loop.memory_cpu --stage flops        # FLOPs of a training step at pi0.5's dims

Each stage merges its figures into `benchmarks/results/memory_cpu.json` (`--output`); work files go to `--work`
(default data_cache/memory_bench, git-ignored), and a stage re-run reuses what is there.

- colorreach: `hf_vla.record --env color_reach --cue_steps 3` (the instruction does not name the colour; the first 3
  frames show the goal alone), `configs/color_reach_memory.json` trained with MEM (6 observations 2 steps apart,
  visual and proprioceptive) and without (the same config, memory off), the same steps; `hf_vla.evaluate` on 50
  held-out episodes each (seeds from 10,000).
- metaworld: the five tasks of `benchmarks/common.py` recorded at 96 px, `configs/pi05_metaworld.json` with and without
  MEM (6 observations 16 frames apart: 0.2 s at 80 fps), the same steps, `--episodes` per task each.
- stream: samples/s of the training stream on `../shared/datasets/humanoid_teleop_24` (640x480 video decoded to 224 px)
  with 6 memory frames 30 apart against none, and its start-up.
- flops: `torch.utils.flop_counter` over one forward and backward of pi0.5 at the published dims (PaliGemma 3B, SigLIP
  So400m, Gemma 300M expert) on the meta device: with visual memory (6 frames, every 4th SigLIP layer) against none,
  one and two cameras; no weights are made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTPUT = REPO / "benchmarks" / "results" / "memory_cpu.json"
TELEOP = REPO.parent / "shared" / "datasets" / "humanoid_teleop_24"
MEMORY_OFF = ["--use_visual_memory", "false", "--use_proprioceptive_memory", "false"]


def _merge(output: Path, figures: dict) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(output.read_text()) if output.is_file() else {}
    output.write_text(json.dumps(current | figures, indent=2) + "\n")


def _train(config: Path, out: Path, overrides: list[str]) -> dict:
    """One arm in a subprocess (its own threads); -> its training time and steps/s, final losses (trainer's
    `all_results.json`)."""
    results = out / "all_results.json"
    if not results.is_file():
        subprocess.run([sys.executable, "-m", "hf_vla.train", str(config), "--output_dir", str(out), *overrides],
                       check=True, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    saved = json.loads(results.read_text())
    keep = ("train_runtime", "train_steps_per_second", "train_loss", "eval_loss", "eval_mse")
    return {key: saved[key] for key in keep if key in saved}


def _evaluate(checkpoint: Path, episodes: int, out: Path, extra: list[str] | None = None) -> dict:
    if not (out / "eval_result.json").is_file():
        subprocess.run([sys.executable, "-m", "hf_vla.evaluate", "--checkpoint", str(checkpoint), "--episodes",
                        str(episodes), "--output_dir", str(out), *(extra or [])], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    saved = json.loads((out / "eval_result.json").read_text())
    return {"mean_success": saved["success_rate"], "episodes": episodes,
            "tasks": {name: r["success_rate"] for name, r in saved.get("tasks", {}).items()}}


def colorreach(work: Path, episodes: int, steps: int, cue_steps: int = 3, n_action_steps: int | None = None) -> dict:
    data = REPO / "data_cache" / ("color_reach_cue" if cue_steps == 3 else f"color_reach_cue{cue_steps}")
    if not (data / "meta" / "info.json").is_file():
        subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "color_reach", "--cue_steps", str(cue_steps),
                        "--episodes", "1000", "--output", str(data)], check=True, cwd=REPO)
    config = REPO / "configs" / "color_reach_memory.json"
    dataset = json.loads(config.read_text())["datasets"][0] | {"root": str(data)}
    variant = "" if cue_steps == 3 and n_action_steps is None else f"_cue{cue_steps}_n{n_action_steps}"
    common = ["--max_steps", str(steps), "--datasets", json.dumps([dataset])]
    if n_action_steps:
        common += ["--n_action_steps", str(n_action_steps)]
    out = {}
    for arm, overrides in (("memory", []), ("no_memory", MEMORY_OFF)):
        trained = _train(config, work / f"colorreach{variant}" / arm, [*common, *overrides])
        result = _evaluate(work / f"colorreach{variant}" / arm, episodes,
                           work / f"colorreach{variant}" / f"eval_{arm}")
        out[arm] = {"mean_success": result["mean_success"], "episodes": episodes, "training": trained}
    out["setup"] = {"config": "configs/color_reach_memory.json", "recorded_episodes": 1000, "cue_steps": cue_steps,
                    "n_action_steps": n_action_steps or 4, "steps_per_arm": steps,
                    "memory": "6 observations, stride 2, visual + proprioceptive"}
    return out


def metaworld(work: Path, episodes: int, steps: int) -> dict:
    from benchmarks.common import TASKS, dataset_spec

    base = work / "metaworld"
    for task in TASKS:
        data = base / "data" / task
        if not (data / "meta" / "info.json").is_file():
            subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", task, "--episodes",
                            "30", "--image_size", "96", "--output", str(data)], check=True, cwd=REPO)
    config = REPO / "configs" / "pi05_metaworld.json"
    datasets = json.dumps(dataset_spec(base))
    memory = ["--use_visual_memory", "true", "--use_proprioceptive_memory", "true", "--memory_frames", "6",
              "--memory_stride", "16", "--memory_temporal_attention_every", "1"]
    out = {}
    for arm, overrides in (("memory", memory), ("no_memory", [])):
        trained = _train(config, base / arm, ["--datasets", datasets, "--max_steps", str(steps), "--save_strategy", "no",
                                              *overrides])
        result = _evaluate(base / arm, episodes, base / f"eval_{arm}", ["--env", "metaworld", "--task",
                                                                        ",".join(TASKS)])
        out[arm] = {"mean_success": result["mean_success"], "tasks": result["tasks"], "episodes_per_task": episodes,
                    "training": trained}
    out["setup"] = {"config": "configs/pi05_metaworld.json", "recorded_episodes_per_task": 30, "image_size": 96,
                    "steps_per_arm": steps, "memory": "6 observations, stride 16 (0.2 s at 80 fps), visual + "
                    "proprioceptive, temporal attention in both SigLIP layers"}
    return out


def stream(samples: int) -> dict:
    """Samples/s of the episode-shuffle stream on the teleop dataset in one process (no DataLoader workers): the samples
    alone, and collated into batches of 32 through the processor (normalisation, prompt, the frames to [-1, 1])."""
    from hf_vla.data import WeightedDatasetMixture
    from hf_vla.data.collator import VLACollator
    from hf_vla.data.stream import StreamSettings
    from hf_vla.models.pi05 import PI05Processor
    from hf_vla.tiny import build_tiny_tokenizer

    spec = {"root": str(TELEOP), "name": "teleop", "cameras": ["image"], "state_key": "state", "action_key": "actions",
            "control_mode": "joint"}
    tokenizer = build_tiny_tokenizer()
    out = {}
    for arm, memory in (("no_memory", None), ("memory_6x30", {"frames": 6, "stride": 30, "visual": True,
                                                                "proprio": True})):
        started = time.perf_counter()
        mixture = WeightedDatasetMixture([spec])
        iterator = iter(mixture.train_stream(StreamSettings(224, 50, open_blocks=8, memory=memory)))
        next(iterator)
        first = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(samples):
            next(iterator)
        seconds = time.perf_counter() - started
        processor = PI05Processor(tokenizer, norm_stats=mixture.norm_stats, head_names=mixture.head_names,
                                  image_size=224, max_state_dim=34, max_action_dim=34, prompt_max_length=48,
                                  memory=memory)
        batches = iter(mixture.train_stream(StreamSettings(224, 50, batch_size=32, collate_fn=VLACollator(processor),
                                                           open_blocks=8, memory=memory, seed=1)))
        next(batches)
        started = time.perf_counter()
        count = max(1, samples // 32)
        for _ in range(count):
            next(batches)
        collated = time.perf_counter() - started
        out[arm] = {"samples_per_s": round(samples / seconds, 1), "first_sample_s": round(first, 2),
                    "collated_samples_per_s": round(32 * count / collated, 1), "samples": samples}
    out["ratio"] = round(out["memory_6x30"]["samples_per_s"] / out["no_memory"]["samples_per_s"], 3)
    out["collated_ratio"] = round(out["memory_6x30"]["collated_samples_per_s"]
                                  / out["no_memory"]["collated_samples_per_s"], 3)
    out["setup"] = {"dataset": "humanoid_teleop_24 (640x480, 30 fps, 34-dim state)", "image_size": 224,
                    "open_blocks": 8, "workers": 0, "batch_size": 32}
    return out


def flops() -> dict:
    """FLOPs of one training forward+backward at pi0.5's published dims, with and without visual memory."""
    from unittest import mock

    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import masking_utils

    from hf_vla.models.pi05 import PI05Config, PI05ForConditionalGeneration

    # the mask builder's shortcut reads the mask's values, which meta tensors have not: always build the mask
    mock.patch.object(masking_utils, "_ignore_bidirectional_mask_sdpa", lambda *a, **k: False).start()

    out = {}
    for cameras in (1, 2):
        for arm, memory in (("no_memory", {}), ("memory", {"use_visual_memory": True, "use_proprioceptive_memory": True})):
            config = PI05Config(**memory)
            config._attn_implementation = "eager"  # sdpa's mask shortcut reads values (none on meta)
            with torch.device("meta"):
                model = PI05ForConditionalGeneration(config)
                model.model.unused_modules()
                batch, frames = 1, config.memory_frames
                pixels = torch.zeros(batch, cameras, *([frames] if memory else []), 3, 224, 224)
                inputs = {"input_ids": torch.zeros(batch, 200, dtype=torch.long), "pixel_values": pixels,
                          "actions": torch.zeros(batch, 50, 32), "noise": torch.zeros(batch, 50, 32),
                          "timestep": torch.full((batch,), 0.5)}
                if memory:
                    inputs["memory_state"] = torch.zeros(batch, frames, 32)
                with FlopCounterMode(display=False) as counter:
                    model(**inputs).loss.backward()
            out.setdefault(f"{cameras}_camera", {})[arm] = counter.get_total_flops()
        entry = out[f"{cameras}_camera"]
        entry["ratio"] = round(entry["memory"] / entry["no_memory"], 3)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", required=True, choices=["colorreach", "metaworld", "stream", "flops"])
    parser.add_argument("--work", type=Path, default=REPO / "data_cache" / "memory_bench")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--episodes", type=int, default=None, help="evaluation episodes (per task for metaworld)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per arm")
    parser.add_argument("--samples", type=int, default=300, help="stream samples timed per arm")
    parser.add_argument("--cue_steps", type=int, default=3, help="colorreach: frames that show the goal")
    parser.add_argument("--n_action_steps", type=int, default=None, help="colorreach: actions executed per chunk")
    args = parser.parse_args(argv)
    if args.stage == "colorreach":
        result = colorreach(args.work, args.episodes or 50, args.steps or 4000, args.cue_steps, args.n_action_steps)
        if args.cue_steps == 3 and args.n_action_steps is None:
            _merge(args.output, {"memory_task": result})
        else:
            current = json.loads(args.output.read_text()) if args.output.is_file() else {}
            variants = current.get("memory_task_variants", {})
            variants[f"cue{args.cue_steps}_n{args.n_action_steps}"] = result
            _merge(args.output, {"memory_task_variants": variants})
    elif args.stage == "metaworld":
        result = metaworld(args.work, args.episodes or 10, args.steps or 2000)
        _merge(args.output, {"five_task": result})
    elif args.stage == "stream":
        result = stream(args.samples)
        _merge(args.output, {"stream_frames_per_s": result})
    else:
        result = flops()
        _merge(args.output, {"flops_per_training_step": result,
                             "step_cost_ratio": result["1_camera"]["ratio"]})
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
