"""Relative against absolute actions where it matters: a position-controlled arm (issue #74).

    python -m benchmarks.closed_loop.metaworld_relative --stage record     # the five tasks x 50 expert episodes, absolute targets
    python -m benchmarks.closed_loop.metaworld_relative --stage train --arm absolute
    python -m benchmarks.closed_loop.metaworld_relative --stage train --arm relative
    python -m benchmarks.closed_loop.metaworld_relative --stage evaluate --arm absolute
    python -m benchmarks.closed_loop.metaworld_relative --stage evaluate --arm relative
    python -m benchmarks.closed_loop.metaworld_relative --stage report     # benchmarks/results/metaworld_relative_cpu.json

Meta-World's actions are deltas (the hand's target moves by 0.01 x action). Here the five-task benchmark
(`benchmarks/closed_loop/metaworld_benchmark.py`: reach, push, button-press-topdown, drawer-open, door-open, 96 px, 50 episodes per task,
seeds from 0) is recorded with `python -m hf_vla.record --action_mode absolute_ee`: each action is the hand's absolute
target position (`hand + 0.01 x delta`, gripper unchanged), what a position-controlled arm receives. The five-task
recipe (`configs/pi05_metaworld.json`) then trains on it at its 20-minute budget (5,700 steps, the committed
delta-native arm's: the same model, so the same cost per step) twice: with the targets absolute, and with
`relative_actions: [true, true, true, false]` (xyz as offsets from the hand's position in the state, the gripper
absolute), and each is evaluated on 50 held-out episodes per task (seeds from 10,000, the 200-step limit), the env in
the recording's action space (the checkpoint's contract carries it). `delta_native` is the committed 56.0% arm
(`benchmarks/results/metaworld_cpu.json`, Meta-World's own deltas). Stages share `--work` (git-ignored) and skip what
is done.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import CONFIG, IMAGE, TASKS, dataset_spec, evaluate, load_json, result_path

REPO = Path(__file__).resolve().parents[2]

STEPS = 5_700  # the committed five-task arm's budget: 4.78 steps/s (its probe) x 20 minutes
MASK = [True, True, True, False]  # xyz relative to the hand (state[:3]), the gripper absolute
RESULTS = result_path("metaworld_relative")


def _spec(work: Path, arm: str) -> list[dict]:
    spec = dataset_spec(work, control_mode="ee_position")
    for dataset in spec if arm == "relative" else []:
        dataset["relative_actions"] = MASK
    return spec


def stage_record(work: Path, episodes: int, results: dict) -> None:
    seconds, frames = 0.0, 0
    for task in TASKS:
        data = work / "data" / task
        if not (data / "meta" / "hf_vla_record.json").exists():
            subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", task,
                            "--episodes", str(episodes), "--output", str(data), "--image_size", str(IMAGE),
                            "--action_mode", "absolute_ee"], check=True, cwd=REPO)
        marker = load_json(data / "meta" / "hf_vla_record.json")
        seconds += marker["seconds"]
        frames += marker["frames"]
    results["record"] = {"episodes_per_task": episodes, "image_size": IMAGE, "action_mode": "absolute_ee",
                         "seconds": round(seconds, 1), "frames": frames}


def stage_train(work: Path, arm: str, steps: int, results: dict) -> None:
    out = work / arm
    if not (out / "model.safetensors").is_file():
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hf_vla.train", str(CONFIG), "--datasets", json.dumps(_spec(work, arm)),
                        "--output_dir", str(out), "--max_steps", str(steps), "--save_strategy", "steps",
                        "--save_steps", str(steps // 2), "--max_episode_steps", "200", "--eval_strategy", "no",
                        "--validation_ratio", "0.05", "--lr_scheduler_kwargs",
                        json.dumps({"num_decay_steps": max(1, steps // 4), "min_lr_ratio": 0.1}),
                        *(["--resume_from_checkpoint", "true"] if any(out.glob("checkpoint-*")) else [])],
                       check=True, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"))
        results.setdefault(arm, {})["train_seconds"] = round(time.perf_counter() - started, 1)
    results.setdefault(arm, {}).update({"steps": steps, "minutes": 20.0, "relative_actions": MASK if arm == "relative"
                                        else None})


def stage_evaluate(work: Path, arm: str, episodes: int, results: dict) -> None:
    started = time.perf_counter()
    closed = evaluate(work / arm, episodes, 200, work / "eval" / arm)
    entry = results.setdefault(arm, {})
    entry |= {"mean_success": closed["success_rate"], "episodes_per_task": episodes,
              "tasks": {task: r["success_rate"] for task, r in closed["tasks"].items()},
              "evaluate_seconds": round(time.perf_counter() - started, 1)}


def stage_report(results: dict) -> dict:
    native = load_json(REPO / "benchmarks" / "results" / "metaworld_cpu.json")
    final = native["hf_vla"]["closed_loop"]  # its evaluation of the last checkpoint with 50 episodes per task
    last = next(entry for entry in reversed(list(final.values()))
                if all(r["episodes"] == 50 for r in entry["tasks"].values()))
    out = {"delta_native": {"mean_success": last["success_rate"],
                            "tasks": {task: r["success_rate"] for task, r in last["tasks"].items()},
                            "minutes": native["hf_vla"]["budget_min"], "steps": native["hf_vla"]["max_steps"],
                            "from": "benchmarks/results/metaworld_cpu.json"}}
    for arm in ("absolute", "relative"):
        entry = results.get(arm, {})
        out[arm] = {"mean_success": entry.get("mean_success"), "tasks": entry.get("tasks"), "minutes": 20.0,
                    "steps": entry.get("steps", STEPS), **{k: entry[k] for k in ("train_seconds", "evaluate_seconds",
                                                                                 "relative_actions") if k in entry}}
    out["record"] = results.get("record")
    out["episodes_per_task"] = 50
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["record", "train", "evaluate", "report"], required=True)
    parser.add_argument("--arm", choices=["absolute", "relative"], default="absolute")
    parser.add_argument("--work", default=str(REPO / "data_cache" / "metaworld_relative"))
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = load_json(work / "results.json")
    if args.stage == "record":
        stage_record(work, args.episodes, results)
    elif args.stage == "train":
        stage_train(work, args.arm, args.steps, results)
    elif args.stage == "evaluate":
        stage_evaluate(work, args.arm, args.episodes, results)
    # the arms' stages may run side by side: merge this stage's entry into the file as it is now
    key = "record" if args.stage == "record" else args.arm
    if args.stage != "report":
        merged = load_json(work / "results.json") | {key: results[key]}
        (work / "results.json").write_text(json.dumps(merged, indent=2) + "\n")
        results = merged
    if args.stage == "report":
        report = stage_report(results)
        RESULTS.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
    else:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
