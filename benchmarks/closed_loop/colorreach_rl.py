"""RL against more SFT on the built-in demo task (ColorReach), every arm from the same start at the same extra
wall-clock: the minutes-long check of whether an RL method improves a policy on this CPU, before Meta-World hours.

    python -m benchmarks.closed_loop.colorreach_rl                       # record, start, every arm, evaluate (about 25 min)
    python -m benchmarks.closed_loop.colorreach_rl --arms filtered_bc --budget_min 5   # one arm again (reuses record and start)
    python -m benchmarks.closed_loop.colorreach_rl --recorded 100 --start_steps 5000 --start_decay 1200 \
        --work data_cache/colorreach_rl_100 --output benchmarks/results/colorreach_rl_100_cpu.json   # a plateau start
    python -m benchmarks.closed_loop.colorreach_rl ... --arms grpo_constant_replay,filtered_bc_replay --side_by_side \
        --budget_min 60 --episodes 500          # two arms at once, one core each

Start (default): `configs/demo.json` on 1,000 recorded expert episodes (`python -m hf_vla.record --env color_reach`),
stopped at 2,000 of its 5,000 steps with a 300-step decay (the demo's notes put the colour word's binding after about
2,500 steps), so it fails where it has not bound the colour yet: more SFT on the same data is the arm to beat. With
`--recorded 100 --start_steps 5000 --start_decay 1200` the start is the whole demo recipe on 100 episodes: SFT at its
plateau on scarce data, where RL's new episodes are what more SFT does not have. Arms, each `--budget_min` minutes of
training (alone on the machine, or with `--side_by_side` all at once, one torch thread each; held-out evaluations
are not run during training):

- `continued_sft`: `python -m hf_vla.train` from the start on the same expert data at the start's last learning rate
  (1e-4, constant), stopped by SIGTERM when the budget is spent (the preemption checkpoint is evaluated);
- `grpo`: `python -m hf_vla.rl configs/rl/demo.json` (GRPO on the 0/1 success, Flow-SDE noise 0.5, 4 seeds x 8);
- `filtered_bc`: the same rollouts' budget with `--algorithm filtered_bc` on the deterministic sampler (noise level 0),
  32 seeds per update, imitating the successful episodes (rejection-sampling fine-tuning);
- `grpo_constant`: GRPO with the constant noise schedule at level 2.0 (rollouts that leave the policy's choice), 3e-4;
- `grpo_constant_replay` / `filtered_bc_replay`: GRPO as `grpo_constant`, filtered BC as `filtered_bc` at 3e-4 (where
  imitating its own chunks alone degraded a 73.5% start to 48-60%), each with the expert data replayed beside the RL
  loss (`--bc_datasets`: supervised training's loss on 32 expert frames per update, as continued SFT draws them).

Each arm's final weights (no selection on held-out seeds) and the start are evaluated by `python -m hf_vla.evaluate` on
`--episodes` held-out seeds from 10,000 (never recorded, never rolled out). JSON (`--output`, default
`benchmarks/results/colorreach_rl_cpu.json`): `{"start": {"success", ...}, "<arm>": {"success", "run": {...}}, ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REPLAY = "<replay>"  # expands to the expert data of the work folder (`--bc_datasets`)
CONSTANT = ["--noise_schedule", "constant", "--noise_level", "2.0"]
FILTERED = ["--algorithm", "filtered_bc", "--noise_level", "0", "--group_size", "1", "--groups_per_update", "32"]
ARMS = {
    "continued_sft": None,
    "grpo": [],
    "filtered_bc": FILTERED,
    "grpo_constant": [*CONSTANT, "--learning_rate", "3e-4"],
    "grpo_constant_replay": [*CONSTANT, "--learning_rate", "3e-4", REPLAY],
    "filtered_bc_replay": [*FILTERED, "--learning_rate", "3e-4", REPLAY],
}
SEED = 10_000


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_MODE="offline")


def _run(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=_env())
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} ... failed (exit {done.returncode}); its output: {log}")
    return time.perf_counter() - started


def _datasets(work: Path) -> str:
    return json.dumps([{"root": str(work / "data"), "name": "color_reach", "cameras": ["observation.image"],
                        "state_key": "observation.state", "action_key": "action", "control_mode": "delta_xy"}])


def stage_start(work: Path, results: dict, recorded: int, steps: int, decay: int) -> bool:
    """Record and train the start where `work` has none; True when a new start was trained."""
    if not (work / "data" / "meta" / "info.json").exists():
        _run([sys.executable, "-m", "hf_vla.record", "--env", "color_reach", "--episodes", str(recorded),
              "--output", str(work / "data")], work / "record.log")
    if not (work / "start" / "model.safetensors").exists():
        seconds = _run([sys.executable, "-m", "hf_vla.train", str(REPO / "configs" / "demo.json"),
                        "--datasets", _datasets(work), "--generate_demo_data", "false", "--max_steps", str(steps),
                        "--stream_open_blocks", str(min(128, recorded)),
                        "--lr_scheduler_kwargs", json.dumps({"num_decay_steps": decay, "min_lr_ratio": 0.1}),
                        "--output_dir", str(work / "start")], work / "start.log")
        results["start_run"] = {"recorded_episodes": recorded, "steps": steps, "decay_steps": decay,
                                "wall_seconds": round(seconds, 1)}
        return True
    return False


def _arm_command(work: Path, arm: str, budget_min: float) -> list[str]:
    out = work / arm
    if ARMS[arm] is None:  # stopped by SIGTERM at the budget (_launch): a step count far beyond it
        return [sys.executable, "-m", "hf_vla.train", str(REPO / "configs" / "demo.json"),
                "--model_name_or_path", str(work / "start"), "--model_config", "null",
                "--datasets", _datasets(work), "--generate_demo_data", "false", "--max_steps", "10000000",
                "--learning_rate", "1e-4", "--lr_scheduler_type", "constant", "--lr_scheduler_kwargs", "{}",
                "--warmup_steps", "0", "--eval_strategy", "no", "--save_strategy", "no", "--disable_tqdm", "true",
                "--output_dir", str(out)]
    extra = []
    for item in ARMS[arm]:
        # the expert batches as continued SFT draws them (configs/demo.json: 32 frames from 128 open episodes)
        extra += (["--bc_datasets", _datasets(work), "--per_device_train_batch_size", "32", "--stream_open_blocks",
                   "128"] if item == REPLAY else [item])
    return [sys.executable, "-m", "hf_vla.rl", str(REPO / "configs" / "rl" / "demo.json"),
            "--model_name_or_path", str(work / "start"), "--output_dir", str(out), "--max_steps", "100000",
            "--max_train_minutes", str(budget_min), "--eval_strategy", "no", "--eval_on_start", "false",
            "--save_strategy", "no", "--disable_tqdm", "true", *extra]


def _launch(work: Path, arm: str, budget_min: float):
    """Start an arm's training; returns (process, log handle, start time)."""
    log = open(work / f"{arm}.log", "w")
    process = subprocess.Popen(_arm_command(work, arm, budget_min), cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT, env=_env())
    return process, log, time.perf_counter()


def _finish(work: Path, arm: str, budget_min: float, launched, results: dict) -> None:
    """Wait for an arm (SFT: SIGTERM once the budget is spent, its preemption checkpoint is the result) and record
    its run."""
    process, log, started = launched
    sft = ARMS[arm] is None
    try:
        process.wait(timeout=budget_min * 60 - (time.perf_counter() - started) if sft else None)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # a checkpoint at the end of the current step, exit 75
        process.wait()
    log.close()
    seconds = time.perf_counter() - started
    out = work / arm
    if process.returncode != (75 if sft else 0):
        sys.exit(f"arm {arm} failed (exit {process.returncode}); its output: {work / f'{arm}.log'}")
    if sft:
        checkpoint = _weights(work, arm)
        results[arm] = {"run": {"steps": int(checkpoint.name.split("-")[1]), "learning_rate": 1e-4,
                                "stopped": "SIGTERM at the budget", "wall_seconds": round(seconds, 1)}}
        return
    summary = json.loads((out / "rl_result.json").read_text())
    results[arm] = {"run": {"command_extra": [a for a in ARMS[arm] if a != REPLAY]
                            + (["--bc_datasets <the expert data>"] if REPLAY in ARMS[arm] else []),
                            "updates": summary["updates"], "episodes": summary["episodes"],
                            "method": summary["method"], "wall_seconds": round(seconds, 1)}}


def _weights(work: Path, arm: str) -> Path:
    """The arm's final weights: its output (RL), or the complete checkpoint SIGTERM left (SFT)."""
    if ARMS.get(arm, []) is None:
        from hf_vla.training.checkpoints import last_complete_checkpoint

        folder, _ = last_complete_checkpoint(work / arm)
        if folder is None:
            sys.exit(f"arm {arm}: no complete checkpoint in {work / arm} (see {work / f'{arm}.log'})")
        return folder
    return work / arm


def evaluate(work: Path, name: str, episodes: int, results: dict) -> None:
    out = work / f"eval_{name}"
    _run([sys.executable, "-m", "hf_vla.evaluate", "--checkpoint", str(_weights(work, name)), "--episodes", str(episodes),
          "--num_envs", "4", "--output_dir", str(out)], work / f"eval_{name}.log")
    found = json.loads((out / "eval_result.json").read_text())
    entry = results.setdefault(name, {})
    entry.update({"success": found["success_rate"], "mean_steps": found.get("mean_steps"), "episodes": episodes})


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=str(REPO / "data_cache" / "colorreach_rl"))
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "colorreach_rl_cpu.json"))
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    parser.add_argument("--budget_min", type=float, default=5.0, help="training minutes per arm")
    parser.add_argument("--episodes", type=int, default=200, help="held-out episodes per evaluation")
    parser.add_argument("--recorded", type=int, default=1000, help="expert episodes the start is trained on")
    parser.add_argument("--start_steps", type=int, default=2000, help="the start's steps of configs/demo.json")
    parser.add_argument("--start_decay", type=int, default=300, help="the start's decay steps (warmup-stable-decay)")
    parser.add_argument("--side_by_side", action="store_true", help="train the arms at once (one thread each)")
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"--arms {args.arms}: {', '.join(unknown)} not among {', '.join(ARMS)}")
    work, output = Path(args.work), Path(args.output)
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(output.read_text()) if output.exists() else {}
    results.update({"budget_min": args.budget_min, "seeds": f"{SEED}..{SEED + args.episodes - 1}",
                    "machine": "2-core CPU, no GPU, " + ("the arms side by side, one torch thread each"
                                                         if args.side_by_side else "each arm alone")})
    fresh = stage_start(work, results, args.recorded, args.start_steps, args.start_decay)
    if fresh or results.get("start", {}).get("episodes") != args.episodes:  # the arms' figures are against this one
        evaluate(work, "start", args.episodes, results)
    groups = [arms] if args.side_by_side else [[arm] for arm in arms]
    for group in groups:
        launched = {arm: _launch(work, arm, args.budget_min) for arm in group}
        for arm in group:
            _finish(work, arm, args.budget_min, launched[arm], results)
        for arm in group:
            evaluate(work, arm, args.episodes, results)
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(json.dumps(results, indent=2) + "\n")  # after every arm: nothing lost if one fails
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
