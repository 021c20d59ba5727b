"""Meta-World closed loop: expert data -> pi0.5 trained by `python -m hf_vla.train` -> success per task, next to lerobot.

    python -m benchmarks.closed_loop.metaworld_benchmark --stage record            # 5 tasks x 50 expert episodes at 96 px
    python -m benchmarks.closed_loop.metaworld_benchmark --stage record --crop 144,96,400,352 --work data_cache/metaworld_crop
                                                                       # the same, the workspace cropped first
    python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min 20
    python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min 20 --tag cotrain \
        --config configs/pi05_metaworld_cotrain.json       # pi0.5's token objective (FAST + knowledge insulation)
    python -m benchmarks.closed_loop.metaworld_benchmark --stage lerobot --budget_min 20   # lerobot-train, ACT (no pretrained backbone)
    python -m benchmarks.closed_loop.metaworld_benchmark --stage evaluate --episodes 50

(Not `benchmarks/metaworld.py`: run as a script, that name would shadow the `metaworld` package.)

Stages share `--work` (default data_cache/metaworld_bench, git-ignored) and write `results.json` there and to
`--output` (default benchmarks/results/metaworld_cpu.json):
- record: `python -m hf_vla.record --env metaworld` for reach, push, button-press-topdown, drawer-open, door-open
  (seeds 0..; only successful episodes; the expert's success rate on those seeds is the ceiling);
- hf_vla: `python -m hf_vla.train configs/pi05_metaworld.json` with `max_steps` from a measured step rate so the run
  fits `--budget_min`, a checkpoint every `--checkpoints`-th of the run, and each checkpoint's eval loss and per-task
  action MSE on held-out episodes (validation split);
- lerobot: `lerobot-train` with ACT from scratch (`pretrained_backbone_weights=null`: nothing to download) on the
  same dataset for the same wall-clock budget;
- evaluate: every checkpoint through `hf_vla.evaluate` (one torch thread: the env worker needs the other core) (lerobot's env wrapper, held-out seeds from 10,000,
  `--max_episode_steps`), `--episodes` per task for the last checkpoint, `--checkpoint_episodes` for the others; and
  the Spearman rank correlation of offline metrics with closed-loop success across checkpoints and tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import CONFIG, IMAGE, REPO, TASKS, dataset_spec, evaluate, evaluate_lerobot, recorded_cameras
from benchmarks.common import load_json as _load


def _save(work: Path, output: Path, results: dict):
    text = json.dumps(results, indent=2)
    (work / "results.json").write_text(text + "\n")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text + "\n")
    print(text)


def _recorded_env_kwargs(work: Path) -> dict:
    """The env arguments the data was recorded with (a crop), as the checkpoints' contract has them."""
    from hf_vla.deployment.contract import benchmark_of

    return (benchmark_of(work / "data" / TASKS[0]) or {}).get("env_kwargs") or {}


def stage_record(work: Path, episodes: int, results: dict, crop: str | None = None, cameras: str | None = None):
    expert, rejected, frames, seconds = {}, {}, 0, 0.0
    for task in TASKS:
        data = work / "data" / task
        if not (data / "meta" / "hf_vla_record.json").exists():
            subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", task,
                            "--episodes", str(episodes), "--output", str(data), "--image_size", str(IMAGE),
                            *(["--crop", crop] if crop else []), *(["--cameras", cameras] if cameras else [])],
                           check=True, cwd=REPO)
        marker = _load(data / "meta" / "hf_vla_record.json")
        stats = marker["tasks"][task]
        expert[task] = stats["kept"] / (stats["kept"] + stats["rejected"])
        rejected[task] = stats["rejected"]
        frames += marker["frames"]
        seconds += marker["seconds"]
    results["record"] = {"episodes_per_task": episodes, "image_size": IMAGE, "seconds": round(seconds, 1),
                         "env_kwargs": marker.get("env_kwargs") or {}, "cameras": recorded_cameras(data),
                         "frames": frames, "expert_success": expert, "rejected": rejected}




def _train(work: Path, out: Path, overrides: list[str], config: Path = CONFIG) -> float:
    started = time.perf_counter()
    target = next((d.get("target_text_key") for d in json.loads(Path(config).read_text()).get("datasets", [])), None)
    subprocess.run([sys.executable, "-m", "hf_vla.train", str(config),
                    "--datasets", json.dumps(dataset_spec(work, target_text_key=target)), "--output_dir", str(out), *overrides],
                   check=True, cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"))
    return time.perf_counter() - started


def probe(work: Path, out: Path, steps: int = 200, config: Path = CONFIG) -> dict:
    """A `steps`-step training run without checkpoints or evaluation: its rate with start-up (`steps_per_s`, a safe
    under-estimate that a budget's steps are set from) and its training loop's own (Trainer's `train_runtime`, without
    model build and data scan: the start-up was 9-12 s of a 200-step probe's 41-53 s, metaworld_cameras_cpu.json)."""
    seconds = _train(work, out, ["--max_steps", str(steps), "--save_strategy", "no", "--validation_ratio", "0.05",
                                 "--eval_strategy", "no"], config)
    loop = _load(out / "train_results.json")
    return {"steps": steps, "seconds": seconds, "steps_per_s": steps / seconds,
            "loop_steps_per_s": loop.get("train_steps_per_second"),
            "start_up_seconds": seconds - loop["train_runtime"] if "train_runtime" in loop else None}


def stage_hf_vla(work: Path, budget_min: float, checkpoints: int, results: dict, tag: str = "hf_vla",
                 rate: float | None = None, rollout_episodes: int = 0, max_episode_steps: int = 200,
                 config: Path = CONFIG):
    loop = None  # the training loop's own rate, when the probe runs here
    if rate is None:  # the step rate, measured undisturbed (a run's wall clock may be stretched by other work)
        measured = probe(work, work / f"probe_{tag}", config=config)
        rate, loop = measured["steps_per_s"], measured["loop_steps_per_s"]
    steps = int(rate * budget_min * 60 / 100) * 100
    out = work / tag
    save = max(100, steps // checkpoints // 100 * 100)
    rollouts = [] if not rollout_episodes else [  # closed-loop success at every checkpoint, during training
        "--rollout_env", "metaworld", "--rollout_tasks", ",".join(TASKS), "--rollout_steps", str(save),
        "--rollout_episodes", str(rollout_episodes), "--rollout_env_kwargs",
        json.dumps({"image_size": IMAGE, "max_episode_steps": max_episode_steps,
                    **_recorded_env_kwargs(work)})]
    seconds = _train(work, out, ["--max_steps", str(steps), "--save_strategy", "steps", "--save_steps", str(save),
                                 "--max_episode_steps", str(max_episode_steps),
                                 "--eval_strategy", "steps", "--eval_steps", str(save), "--validation_ratio", "0.05",
                                 "--lr_scheduler_kwargs", json.dumps({"num_decay_steps": max(1, steps // 4),
                                                                      "min_lr_ratio": 0.1}), *rollouts], config)
    history = json.loads(sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
                         .joinpath("trainer_state.json").read_text())["log_history"]
    evals = {int(e["step"]): {k: v for k, v in e.items() if k.startswith("eval_")} for e in history
             if "eval_loss" in e}
    import resource

    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # the largest child so far: the training
    results[tag] = {"peak_rss_gb": round(peak_gb, 2), "config": str(Path(config).relative_to(REPO)) if Path(config).is_relative_to(REPO) else str(config),
                    "budget_min": budget_min, "probe_steps_per_s": round(rate, 2), "max_steps": steps,
                    **({"probe_loop_steps_per_s": round(loop, 2)} if loop else {}),
                    "train_seconds": round(seconds, 1), "checkpoint_every": save, "offline": evals, "batch_size": 32}
    if (out / "rollout_results.jsonl").exists():  # hf_vla.training.rollouts: per-task success at each rollout step
        results[tag]["rollouts"] = {
            str(line["step"]): {task: r["success_rate"] for task, r in line["result"]["tasks"].items()}
            for line in map(json.loads, (out / "rollout_results.jsonl").read_text().splitlines())}


def stage_lerobot(work: Path, budget_min: float, results: dict, batch: int = 32):
    """lerobot-train with ACT from scratch on the same data, for the same wall-clock budget (steps from a probe)."""
    out = work / "lerobot_act"
    merged = work / "data_all"
    if not (merged / "meta" / "info.json").exists():  # lerobot-train takes one dataset: the five, merged by lerobot
        from lerobot.datasets.dataset_tools import merge_datasets
        from lerobot.datasets.lerobot_dataset import LeRobotDataset

        merge_datasets([LeRobotDataset(f"local/{task}", root=work / "data" / task) for task in TASKS],
                       output_repo_id="local/metaworld_all", output_dir=merged)

    def run(steps: int, output: Path, save: bool) -> float:
        started = time.perf_counter()
        command = ["lerobot-train", "--policy.type=act", "--policy.device=cpu", "--policy.push_to_hub=false",
                   "--policy.pretrained_backbone_weights=null", "--policy.chunk_size=16", "--policy.n_action_steps=8",
                   "--dataset.repo_id=local/metaworld_all", f"--dataset.root={merged}",
                   f"--batch_size={batch}", f"--steps={steps}", f"--output_dir={output}", "--wandb.enable=false",
                   f"--save_freq={steps}", f"--save_checkpoint={'true' if save else 'false'}", "--num_workers=1",
                   "--log_freq=100"]
        subprocess.run([str(Path(sys.executable).parent / command[0]), *command[1:]], check=True, cwd=work,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
        return time.perf_counter() - started

    probe_steps = 100
    rate = probe_steps / run(probe_steps, work / "lerobot_probe", save=False)
    steps = int(rate * budget_min * 60 / 100) * 100
    seconds = run(steps, out, save=True)
    results["lerobot_act"] = {"budget_min": budget_min, "probe_steps_per_s": round(rate, 2), "steps": steps,
                              "train_seconds": round(seconds, 1), "batch_size": batch, "chunk_size": 16,
                              "n_action_steps": 8}


def _spearman(x: list[float], y: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


def stage_evaluate(work: Path, episodes: int, checkpoint_episodes: int, max_steps: int, results: dict,
                   which: str = "both", tag: str = "hf_vla"):
    if which in ("both", "lerobot"):
        act = sorted((work / "lerobot_act" / "checkpoints").glob("*/pretrained_model"))
        if act:
            started = time.perf_counter()
            results.setdefault("lerobot_act", {})["closed_loop"] = evaluate_lerobot(act[-1], episodes, max_steps,
                                                                                     work / "eval" / "lerobot_act",
                                                                                     _recorded_env_kwargs(work))
            results["lerobot_act"]["closed_loop"]["seconds"] = round(time.perf_counter() - started, 1)
    if which == "lerobot":
        return
    out = work / tag
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    if tag != "hf_vla" and (out / "model.safetensors").is_file():  # the final model, when no checkpoint is at the end
        checkpoints.append(out)
    closed = {}
    for index, checkpoint in enumerate(checkpoints):
        last = index == len(checkpoints) - 1
        if not last and not checkpoint_episodes:
            continue
        name = "final" if checkpoint == out else checkpoint.name
        started = time.perf_counter()
        closed[name] = evaluate(checkpoint, episodes if last else checkpoint_episodes, max_steps,
                                 work / "eval" / f"{tag}_{name}")
        closed[name]["seconds"] = round(time.perf_counter() - started, 1)
    results.setdefault(tag, {})["closed_loop"] = closed
    results["max_episode_steps"] = max_steps
    if tag != "hf_vla":
        return
    # offline metrics against closed-loop success: per checkpoint (mean) and per (checkpoint, task)
    offline = results["hf_vla"].get("offline", {})
    pairs_loss, pairs_success, task_mse, task_success = [], [], [], []
    for name, evaluation in closed.items():
        step = name.split("-")[1]
        metrics = offline.get(step) or offline.get(int(step)) or {}
        if "eval_loss" in metrics:
            pairs_loss.append(-metrics["eval_loss"])
            pairs_success.append(evaluation["success_rate"])
        for task, r in evaluation["tasks"].items():
            key = next((k for k in metrics if re.search(rf"{re.escape(task)}.*mse|mse.*{re.escape(task)}", k)), None)
            if key is not None:
                task_mse.append(-metrics[key])
                task_success.append(r["success_rate"])
    results["correlation"] = {
        "checkpoints": len(pairs_loss),
        "spearman_neg_eval_loss_vs_success": _spearman(pairs_loss, pairs_success) if len(pairs_loss) > 2 else None,
        "task_pairs": len(task_mse),
        "spearman_neg_task_mse_vs_success": _spearman(task_mse, task_success) if len(task_mse) > 2 else None,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["record", "hf_vla", "lerobot", "evaluate"], required=True)
    parser.add_argument("--work", default=str(REPO / "data_cache" / "metaworld_bench"))
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "metaworld_cpu.json"))
    parser.add_argument("--record_episodes", type=int, default=50)
    parser.add_argument("--budget_min", type=float, default=20.0)
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--checkpoint_episodes", type=int, default=20)
    parser.add_argument("--max_episode_steps", type=int, default=200)
    parser.add_argument("--tag", default="hf_vla", help="hf_vla and evaluate stages: the run's folder under --work "
                        "and key in the results (e.g. hf_vla_60 for a 60-minute budget beside the 20-minute one)")
    parser.add_argument("--steps_per_s", type=float, default=None, help="hf_vla stage: a step rate measured before "
                        "(skips the probe)")
    parser.add_argument("--rollout_episodes", type=int, default=0, help="hf_vla stage: closed-loop episodes per task "
                        "at every checkpoint, during training (hf_vla.training.rollouts)")
    parser.add_argument("--which", choices=["both", "hf_vla", "lerobot"], default="both", help="evaluate stage: whose "
                        "checkpoints")
    parser.add_argument("--config", default=str(CONFIG), help="hf_vla stage: the training config (e.g. "
                        "configs/pi05_metaworld_cotrain.json, the token objective)")
    parser.add_argument("--crop", default=None, help="record stage: left,top,right,bottom of the 480 px render kept "
                        "before resizing (python -m hf_vla.record --crop); the checkpoints' contract carries it")
    parser.add_argument("--cameras", default=None, help="record stage: Meta-World's cameras, e.g. corner2,gripperPOV "
                        "(python -m hf_vla.record --cameras); training and evaluation take them from the recording")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = _load(work / "results.json")
    if args.stage == "record":
        stage_record(work, args.record_episodes, results, args.crop, args.cameras)
    elif args.stage == "hf_vla":
        stage_hf_vla(work, args.budget_min, args.checkpoints, results, args.tag, args.steps_per_s,
                     args.rollout_episodes, args.max_episode_steps, Path(args.config).resolve())
    elif args.stage == "lerobot":
        stage_lerobot(work, args.budget_min, results)
    else:
        stage_evaluate(work, args.episodes, args.checkpoint_episodes, args.max_episode_steps, results, args.which,
                       args.tag)
    _save(work, Path(args.output), results)


if __name__ == "__main__":
    main()
