"""DAgger against continued behaviour cloning on the five Meta-World tasks, at equal extra minutes (issue #65).

    python -m benchmarks.closed_loop.metaworld_benchmark --stage record                        # the expert data (once)
    python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min 20 --steps_per_s 4.75 --tag bc_start
    python -m benchmarks.closed_loop.metaworld_dagger --start data_cache/metaworld_bench/bc_start --budget_min 20 --rounds 2

From the 20-minute BC start (the five-task recipe, `configs/pi05_metaworld.json`), two arms get `--budget_min` more
minutes each:
- continued BC: `python -m hf_vla.train` from the start on the expert data, `rate x budget` steps;
- DAgger: `--rounds` rounds of `python -m hf_vla.record --strategy dagger --policy CURRENT` (`--dagger_episodes` per
  task, the policy acting, the expert labelling; seeds 1000 x round) then training from the current policy on the
  expert data plus every round so far (each round its own dataset of the mixture, weighted by its frames: the
  aggregate sampled uniformly, as in the paper) for the round's share of the
  budget less its recording's cost (CPU seconds of the recorder and its env worker: about one core, so its wall
  time when alone).
With `--chunks plan` the rounds train on each frame's `action_plan` (the expert's own chunk from the state the policy
reached) instead of the frames' labels strung together (docs/deployment_data.md). Both train with the same arguments (learning rate `--learning_rate`, WSD decay over the last quarter, the start's
normalisation via `--norm_stats_from`); the step rate comes from a probe run alone first (`--steps_per_s` to give
it). The start and both arms are evaluated with `hf_vla.evaluate` on the same held-out episodes (seeds from 10,000).
JSON (`--output`, default benchmarks/results/metaworld_dagger_cpu.json):
`{"start", "continued_bc", "dagger": {"mean_success", "tasks", "rounds": [...]}, "budget_min", "rounds"}`.
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
# run as a script, its folder is on the path: the five-task benchmark's spec and evaluation (episode limits: the
# checkpoint's contract)
from benchmarks.common import CONFIG, TASKS, dataset_spec, evaluate  # noqa: E402

ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
OBJECT_CENTRED = ["basketball-v3", "peg-insert-side-v3", "push-v3", "pick-place-v3"]
MT50_CONFIG = REPO / "configs" / "pi05_metaworld_mt50.json"


def _setting(args) -> dict:
    """The tasks, expert datasets, training config and evaluation episode limit of `--setting`."""
    if args.setting == "five_task":
        return {"tasks": TASKS, "datasets": dataset_spec(args.work), "config": CONFIG, "max_steps": 200}
    # the four object-centred MT50 tasks: their recording (with locations) as one dataset, the MT50 recipe
    return {"tasks": OBJECT_CENTRED, "config": MT50_CONFIG, "max_steps": 500,
            "datasets": [{"root": str(args.data), "name": "expert", "cameras": ["observation.image"],
                          "robot_type": "metaworld", "control_mode": "delta_xyz_gripper"}]}


def _train(start: Path, datasets: list[dict], out: Path, steps: int, args) -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_vla.train", str(_setting(args)["config"]), "--datasets",
                    json.dumps(datasets),
                    "--model_name_or_path", str(start), "--norm_stats_from", str(args.start),
                    "--output_dir", str(out), "--max_steps", str(steps), "--save_strategy", "steps",
                    "--save_steps", str(steps), "--eval_strategy", "no", "--validation_ratio", "0.05",
                    "--learning_rate", str(args.learning_rate), "--warmup_steps", "50",
                    "--lr_scheduler_kwargs", json.dumps({"num_decay_steps": max(1, steps // 4), "min_lr_ratio": 0.1})],
                   check=True, cwd=REPO, env=ENV)
    return time.perf_counter() - began


def _probe(args, work: Path) -> float:
    probe_steps = 200
    seconds = _train(args.start, _setting(args)["datasets"], work / "probe", probe_steps, args)
    return probe_steps / seconds  # start-up included: a safe under-estimate


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _record_round(policy: Path, round_index: int, out: Path, episodes: int, tasks: list[str]) -> dict:
    """One DAgger round recorded; its cost in CPU seconds (the recorder and its env worker; about one core at a time,
    so about its wall time when run alone, and unlike the wall time not stretched by other work on the machine)."""
    began, cpu = time.perf_counter(), _children_cpu()
    if not (out / "meta" / "hf_vla_record.json").exists():
        subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", ",".join(tasks),
                        "--strategy", "dagger", "--policy", str(policy), "--round", str(round_index),
                        "--episodes", str(episodes), "--output", str(out)],
                       check=True, cwd=REPO, env=dict(ENV, OMP_NUM_THREADS="1"))
    marker = json.loads((out / "meta" / "hf_vla_record.json").read_text())
    tasks = marker["tasks"]
    return {"round": round_index, "wall_seconds": round(time.perf_counter() - began, 1),
            "seconds": round(_children_cpu() - cpu, 1), "frames": marker["frames"],
            "policy_success": {t: s["successes"] / max(1, s["kept"]) for t, s in tasks.items()},
            "mean_policy_success": sum(s["successes"] for s in tasks.values()) / max(1, sum(s["kept"] for s in
                                                                                          tasks.values()))}


def _frames(root) -> int:
    return int(json.loads((Path(root) / "meta" / "info.json").read_text())["total_frames"])


def _aggregate_weight(round_data: Path, expert: list[dict]) -> float:
    """A DAgger round's mixture weight: its share of the aggregate's frames (Ross et al. train on the union, each
    frame alike). The mixture weighs datasets, not frames, so a round of F frames beside expert data of E frames under
    total weight W gets W x F / E (the expert datasets keep the recipe's weights among themselves)."""
    total_weight = sum(float(d.get("weight", 1.0)) for d in expert)
    return round(total_weight * _frames(round_data) / sum(_frames(d["root"]) for d in expert), 4)


def _summary(result: dict) -> dict:
    return {"mean_success": result["success_rate"],
            "tasks": {task: value["success_rate"] for task, value in result["tasks"].items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--start", type=Path, required=True, help="the BC start checkpoint")
    parser.add_argument("--work", type=Path, default=REPO / "data_cache" / "metaworld_bench")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "metaworld_dagger_cpu.json")
    parser.add_argument("--budget_min", type=float, default=20.0, help="extra minutes per arm")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dagger_episodes", type=int, default=10, help="DAgger episodes per task and round")
    parser.add_argument("--episodes", type=int, default=50, help="held-out evaluation episodes per task")
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--steps_per_s", type=float, default=None)
    parser.add_argument("--stage", choices=["all", "start", "bc", "dagger"], default="all")
    parser.add_argument("--setting", choices=["five_task", "object_centred"], default="five_task", help="object_centred: "
                        "basketball, peg-insert-side, push, pick-place with the MT50 recipe, from --start trained on "
                        "--data (their recording)")
    parser.add_argument("--data", type=Path, default=REPO / "data_cache" / "mt50_4loc")
    parser.add_argument("--chunks", choices=["labels", "plan"], default="labels", help="the DAgger rounds' training "
                        "chunks: the frames' labels strung together, or each frame's action_plan (the expert's own "
                        "chunk from the visited state; its own work folder, dagger_plan)")
    args = parser.parse_args(argv)
    setting = _setting(args)
    work = args.work / (("dagger" if args.setting == "five_task" else "dagger_object_centred")
                        + ("_plan" if args.chunks == "plan" else ""))
    work.mkdir(parents=True, exist_ok=True)
    state_file = work / "results.json"
    results = json.loads(state_file.read_text()) if state_file.exists() else {}
    results |= {"setting": args.setting, "tasks": setting["tasks"], "budget_min": args.budget_min, "rounds": args.rounds, "dagger_episodes_per_task": args.dagger_episodes,
                "eval_episodes_per_task": args.episodes, "learning_rate": args.learning_rate, "chunks": args.chunks,
                "start_checkpoint": str(args.start)}

    def save():
        text = json.dumps(results, indent=2) + "\n"
        state_file.write_text(text)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)

    if "steps_per_s" not in results:
        results["steps_per_s"] = args.steps_per_s or round(_probe(args, args.work), 2)
        save()
    rate = results["steps_per_s"]
    budget_s = args.budget_min * 60
    if args.stage in ("all", "start") and "start" not in results:
        results["start"] = _summary(evaluate(args.start, args.episodes, 0, work / "eval_start", setting["tasks"]))
        save()
    if args.stage in ("all", "bc") and "continued_bc" not in results:
        steps = int(rate * budget_s / 100) * 100
        seconds = _train(args.start, setting["datasets"], work / "continued_bc", steps, args)
        results["continued_bc"] = {"steps": steps, "train_seconds": round(seconds, 1)}
        results["continued_bc"] |= _summary(evaluate(work / "continued_bc", args.episodes, 0, work / "eval_bc",
                                                      setting["tasks"]))
        save()
    if args.stage in ("all", "dagger") and "mean_success" not in results.get("dagger", {}):
        dagger = results.setdefault("dagger", {"rounds": []})
        policy, datasets = args.start, setting["datasets"]
        for round_index in range(1, args.rounds + 1):
            data = work / f"dagger_data_{round_index}"
            done = next((r for r in dagger["rounds"] if r["round"] == round_index and "steps" in r), None)
            if done is None:
                entry = _record_round(policy, round_index, data, args.dagger_episodes, setting["tasks"])
                entry["steps"] = max(100, int(rate * (budget_s / args.rounds - entry["seconds"]) / 100) * 100)
            else:
                entry = done
            datasets = datasets + [{"root": str(data), "name": f"dagger_{round_index}",
                                    "cameras": ["observation.image"], "robot_type": "metaworld",
                                    "control_mode": "delta_xyz_gripper",
                                    "weight": _aggregate_weight(data, setting["datasets"]),
                                    **({"action_chunk_key": "action_plan"} if args.chunks == "plan" else {})}]
            out = work / f"dagger_{round_index}"
            if done is None:
                entry["train_seconds"] = round(_train(policy, datasets, out, entry["steps"], args), 1)
                dagger["rounds"] = [r for r in dagger["rounds"] if r["round"] != round_index] + [entry]
                save()
            policy = out
        dagger |= _summary(evaluate(policy, args.episodes, 0, work / "eval_dagger", setting["tasks"]))
        dagger["steps"] = sum(r["steps"] for r in dagger["rounds"])
        save()
    if "continued_bc" in results and "mean_success" in results.get("dagger", {}):
        results["dagger_minus_bc_points"] = round(100 * (results["dagger"]["mean_success"]
                                                         - results["continued_bc"]["mean_success"]), 1)
        save()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
