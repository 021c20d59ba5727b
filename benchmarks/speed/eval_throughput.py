"""Closed-loop evaluation throughput: episodes/s of `hf_vla.evaluate` with 1, 2 and 4 envs at once, against the
evaluator before batched envs (one env, one observation per policy call).

    python -m benchmarks.speed.eval_throughput                      # Meta-World reach, 16 episodes of 100 steps per setting
    python -m benchmarks.speed.eval_throughput --baseline_tree ../old_checkout --num_envs 1 2 4 --episodes 16

The policy is `configs/pi05_metaworld.json`'s architecture (96 px, chunk 16, 8 actions executed per chunk) with random
weights, which never succeeds: every episode runs its full `--steps`, so each setting does the same work (episodes x
steps env steps, episodes x steps / 8 policy rows). Each setting is a fresh `python -m hf_vla.evaluate` process (as a
user runs it: start-up, env workers, torch threads as the command sets them), timed from launch to exit, and its
`eval_result.json` is checked to hold every episode at the full length.

`--baseline_tree` is a checkout of hf_vla from before batched evaluation (e.g. `git worktree add ../old 1fbd9af`):
its evaluator runs the same checkpoint with the same flags, as "today's evaluator" was run. Prints JSON (and writes
it to `--output`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAD = "metaworld::delta_xyz_gripper"


def random_checkpoint(path: Path) -> None:
    import torch

    from hf_vla import PI05Config, PI05ForConditionalGeneration, PI05Processor
    from hf_vla.tiny import build_tiny_tokenizer

    torch.manual_seed(0)
    config = json.loads((REPO / "configs" / "pi05_metaworld.json").read_text())["model_config"]
    model = PI05ForConditionalGeneration(PI05Config(**config)).eval()
    four = {"q01": [-1.0] * 4, "q99": [1.0] * 4}
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats={
        HEAD: {"state": {"q01": [-0.5, 0.3, 0.0, -1.0], "q99": [0.5, 0.9, 0.4, 1.0]}, "actions": four}})
    model.save_pretrained(path)
    processor.save_pretrained(path)


def run(tree: Path, checkpoint: Path, out: Path, episodes: int, steps: int, num_envs: int | None, task: str) -> dict:
    command = [sys.executable, "-m", "hf_vla.evaluate", "--checkpoint", str(checkpoint), "--env", "metaworld",
               "--task", task, "--episodes", str(episodes), "--image_size", "96", "--max_episode_steps", str(steps),
               "--n_action_steps", "8", "--save_videos", "0", "--output_dir", str(out)]
    if num_envs is not None:
        command += ["--num_envs", str(num_envs)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {"HF_HUB_OFFLINE": "1",
                                                                            "PYTHONPATH": str(tree)}
    started = time.perf_counter()
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    saved = json.loads((out / "eval_result.json").read_text())["tasks"][task if task.endswith("-v3") else f"{task}-v3"]
    if saved["episodes"] != episodes or saved["mean_steps"] != steps:
        raise RuntimeError(f"expected {episodes} episodes of {steps} steps, got {saved['episodes']} of "
                           f"{saved['mean_steps']}")
    return {"seconds": round(seconds, 1), "episodes_per_s": round(episodes / seconds, 3),
            "env_steps_per_s": round(episodes * steps / seconds, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num_envs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100, help="episode length (the random policy never succeeds)")
    parser.add_argument("--task", default="reach-v3")
    parser.add_argument("--baseline_tree", default=None, help="an hf_vla checkout of the serial evaluator")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    results = {"task": args.task, "episodes": args.episodes, "steps": args.steps, "cpus": os.cpu_count(),
               "policy": "configs/pi05_metaworld.json architecture, random weights, 96 px, 8 of 16 actions executed"}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        random_checkpoint(checkpoint)
        if args.baseline_tree:
            tree = Path(args.baseline_tree).resolve()
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                    text=True).stdout.strip()
            results["serial_evaluator"] = {"tree": commit, **run(tree, checkpoint, Path(tmp) / "base", args.episodes,
                                                                  args.steps, None, args.task)}
        results["num_envs"] = {}
        for count in args.num_envs:
            results["num_envs"][str(count)] = run(REPO, checkpoint, Path(tmp) / f"n{count}", args.episodes, args.steps,
                                                  count, args.task)
            print(f"num_envs {count}: {results['num_envs'][str(count)]}", file=sys.stderr, flush=True)
    base = results.get("serial_evaluator", results["num_envs"].get("1"))
    for entry in results["num_envs"].values():
        entry["speedup"] = round(entry["episodes_per_s"] / base["episodes_per_s"], 2)
    text = json.dumps(results, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
