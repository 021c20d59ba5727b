"""RL after SFT against more SFT, at the same extra wall-clock, on the Meta-World benchmark's five tasks.

    python -m benchmarks.closed_loop.metaworld_benchmark --stage record                  # 5 tasks x 50 expert episodes, 96 px
    python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min 20  # the start checkpoint (20-minute recipe)
    python -m benchmarks.closed_loop.metaworld_rl --stage rl --budget_min 60             # (b) python -m hf_vla.rl, 60 minutes
    python -m benchmarks.closed_loop.metaworld_rl --stage rl --budget_min 60 --config configs/rl/pi05_metaworld_ppo.json \
        --arm rl_ppo                                                         # (b') PPO with a critic, its own arm
    python -m benchmarks.closed_loop.metaworld_rl --stage rl --budget_min 60 --config configs/rl/pi05_metaworld_ppo_dense.json \
        --arm rl_ppo_dense                                                   # (b'') PPO on the dense reward
    python -m benchmarks.closed_loop.metaworld_rl --stage sft --budget_min 60            # (a) python -m hf_vla.train, 60 minutes
    python -m benchmarks.closed_loop.metaworld_rl --stage evaluate --episodes 50         # start, (a), (b) on the same held-out seeds
    python -m benchmarks.closed_loop.metaworld_rl --stage evaluate --which rl_ppo        # an RL arm by its --arm name

Both arms start from the same checkpoint (`--start`, default the 20-minute recipe's output in the Meta-World benchmark's
work folder). (a) continues `configs/pi05_metaworld.json` on the same expert data with its warmup-stable-decay schedule
scaled to the budget (steps from the recipe's measured 4.78 steps/s, `--sft_steps_per_s`); (b) runs
`configs/rl/pi05_metaworld.json` with `max_train_minutes` = the budget (its held-out evaluations not counted, its
checkpoints every `save_steps` updates evaluated afterwards for the curve). Evaluation: `python -m hf_vla.evaluate`,
`--episodes` per task on seeds from 10,000 (never used by either arm), at most 200 steps, 8 actions per chunk (the
checkpoints' contract). JSON: `benchmarks/results/metaworld_rl_cpu.json` =
`{"start", "continued_sft", "rl": {"mean_success", "tasks", ...}, "budget_min", "seeds", ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

REPO = Path(__file__).resolve().parents[2]
SEED = 10_000


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")


def stage_rl(work: Path, start: Path, budget_min: float, results: dict, extra: list[str], config: Path, arm: str,
             tasks: list[str] | None = None):
    out = work / arm
    started = time.perf_counter()
    extra = [*extra, "--task", ",".join(tasks)] if tasks else extra
    # one torch thread: the env workers need the other core (as the evaluation harness runs)
    subprocess.run([sys.executable, "-m", "hf_vla.rl", str(config),
                    "--model_name_or_path", str(start), "--output_dir", str(out), "--max_steps", "100000",
                    "--max_train_minutes", str(budget_min), *extra], check=True, cwd=REPO,
                   env=dict(_env(), OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - started
    summary = json.loads((out / "rl_result.json").read_text())
    state = json.loads(sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
                       .joinpath("trainer_state.json").read_text())
    history = state["log_history"]
    results[f"{arm}_run"] = {
        "config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config),
        "overrides": extra, "budget_min": budget_min, "wall_seconds": round(seconds, 1), "updates": summary["updates"],
        "episodes": int(max(e.get("rollout/episodes", 0) for e in history)), "method": summary["method"],
        "held_out_during_training": {str(e["step"]): e["eval_success"] for e in history if "eval_success" in e},
        "rollout_success": {str(e["step"]): e["rollout/success"] for e in history if "rollout/success" in e},
        # per task: which task the rollouts improve or lose; episodes/s: how fast this machine rolls out (it sets
        # how many updates the budget buys, so arms from machines of another speed are compared by minutes, not updates)
        "rollout_success_by_task": {str(e["step"]): {k.split("/")[1]: v for k, v in e.items()
                                                     if k.startswith("rollout/") and k.endswith("/success")
                                                     and k.count("/") == 2}
                                    for e in history if "rollout/success" in e},
        "rollout_episodes_per_s": round(sum(rates) / len(rates), 4) if (rates := [
            e["rollout/episodes_per_s"] for e in history if "rollout/episodes_per_s" in e]) else None,
        "minutes_with_evaluations": summary["minutes"]}


# the continued-SFT arms' folders in --work (other arms: their --arm name)
_SFT_FOLDERS = {"continued_sft": "sft_more", "continued_sft_30min": "sft_more_30min"}


def stage_sft(work: Path, start: Path, budget_min: float, rate: float, results: dict, arm: str = "continued_sft",
              tasks: list[str] | None = None):
    out = work / _SFT_FOLDERS.get(arm, arm)
    steps = int(rate * budget_min * 60 / 100) * 100
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_vla.train", str(REPO / "configs" / "pi05_metaworld.json"),
                    "--model_name_or_path", str(start), "--model_config", "null",
                    "--datasets", json.dumps(common.dataset_spec(work, tasks)), "--output_dir", str(out),
                    "--max_steps", str(steps), "--save_strategy", "steps", "--save_steps", str(max(100, steps // 4)),
                    "--max_episode_steps", "200", "--lr_scheduler_kwargs",
                    json.dumps({"num_decay_steps": max(1, steps // 4), "min_lr_ratio": 0.1})],
                   check=True, cwd=REPO, env=_env())
    results["sft_run" if arm == "continued_sft" else f"{arm}_run"] = {
        "budget_min": budget_min, "steps": steps, "steps_per_s_assumed": rate, "tasks": tasks or common.TASKS,
        "wall_seconds": round(time.perf_counter() - started, 1)}


def stage_evaluate(work: Path, start: Path, episodes: int, results: dict, which: list[str],
                   tasks: list[str] | None = None):
    arms = {"start": start, **{name: work / folder for name, folder in _SFT_FOLDERS.items()}}
    for name in which:
        arms.setdefault(name, work / name)  # an arm by its --arm name
        started = time.perf_counter()
        evaluated = common.evaluate(arms[name], episodes, 200, work / f"eval_{name}", tasks)
        # a single-task evaluation gets its own key: the five-task figures of the same arm stay
        results[f"{name}:{','.join(tasks)}" if tasks else name] = {"mean_success": evaluated["success_rate"],
                         "tasks": {t: r["success_rate"] for t, r in evaluated["tasks"].items()},
                         "mean_steps": {t: r["mean_steps"] for t, r in evaluated["tasks"].items()},
                         "episodes_per_task": episodes, "checkpoint": str(arms[name]),
                         "eval_seconds": round(time.perf_counter() - started, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["rl", "sft", "evaluate"], required=True)
    parser.add_argument("--work", default=str(REPO / "data_cache" / "metaworld_bench"))
    parser.add_argument("--start", default=None, help="the SFT checkpoint both arms start from (default: --work/hf_vla)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "metaworld_rl_cpu.json"))
    parser.add_argument("--budget_min", type=float, default=60.0)
    parser.add_argument("--sft_steps_per_s", type=float, default=4.78)
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--which", default="start,continued_sft,rl", help="arms to evaluate (RL arms by --arm name)")
    parser.add_argument("--config", default=str(REPO / "configs" / "rl" / "pi05_metaworld.json"),
                        help="--stage rl: the RL config (configs/rl/pi05_metaworld_ppo.json: PPO with a critic)")
    parser.add_argument("--arm", default=None, help="the arm's name: its folder in --work, its JSON key (default: rl "
                        "for --stage rl, continued_sft for --stage sft)")
    parser.add_argument("--tasks", default=None, help="a comma list of the five tasks: single-task arms (RL rolls out "
                        "only these; SFT samples only their frames, normalised as the start; evaluate runs only these)")
    args, extra = parser.parse_known_args()
    work = Path(args.work)
    tasks = args.tasks.split(",") if args.tasks else None
    unknown = sorted(set(tasks or []) - set(common.TASKS))
    if unknown:
        parser.error(f"--tasks {args.tasks}: {', '.join(unknown)} not among the benchmark's {', '.join(common.TASKS)}")
    start = Path(args.start) if args.start else work / "hf_vla"
    output = Path(args.output)
    results = json.loads(output.read_text()) if output.exists() else {}
    snapshot = json.loads(json.dumps(results))
    results.update({"budget_min": args.budget_min, "seeds": f"{SEED}..{SEED + args.episodes - 1} per task",
                    "start_checkpoint": "the Meta-World benchmark's 20-minute recipe (configs/pi05_metaworld.json)",
                    "machine": "2-core CPU, no GPU"})
    if args.stage == "rl":
        stage_rl(work, start, args.budget_min, results, extra, Path(args.config).resolve(), args.arm or "rl", tasks)
    elif args.stage == "sft":
        stage_sft(work, start, args.budget_min, args.sft_steps_per_s, results, args.arm or "continued_sft", tasks)
    else:
        stage_evaluate(work, start, args.episodes, results, args.which.split(","), tasks)
    output.parent.mkdir(parents=True, exist_ok=True)
    # merge what this stage changed into the file as it is now: arms run side by side with one --output keep both
    changed = {k: v for k, v in results.items() if snapshot.get(k) != v}
    results = (json.loads(output.read_text()) if output.exists() else {}) | changed
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
