"""RECAP (pi*0.6's learning from experience) against behaviour cloning, every arm from the same start with equal
minutes (collection and value training included), one torch thread each:

    python -m benchmarks.closed_loop.recap                         # ColorReach's plateau start: every arm
    python -m benchmarks.closed_loop.recap --bench metaworld       # the five Meta-World tasks' 20-minute start
    python -m benchmarks.closed_loop.recap --arms continued_bc --episodes 500   # one arm again

Starts:
- `colorreach` (key `colorreach_plateau`): the whole demo recipe (`configs/demo.json`, 5,000 steps, 1,200 decay) on
  100 recorded expert episodes, SFT at its plateau on scarce data (docs/measurements.md: 20.6% over 500 held-out
  episodes, where GRPO reached 29.8% and continued SFT 20.4% in 60 minutes with 24,480 rollout episodes); 500
  held-out episodes per evaluation; arms budgeted in wall minutes, each arm alone.
- `metaworld` (key `metaworld_five_task`): the five-task recipe (`configs/pi05_metaworld.json`, 96 px, 5,700 steps,
  its 20-minute budget, as the committed 56.0% run) on 5 x 50 expert episodes; 50 held-out episodes per task; arms
  budgeted in CPU minutes of their whole process tree (`--parallel`: two arms at a time, one core each).

Arms:
- `recap`: two rounds; each collects `--collect` episodes (per task) of the current policy acting alone (ColorReach:
  `hf_vla.record --strategy dagger --beta 0`, the executed action `policy_action`; Meta-World: `--strategy policy`,
  its own actions), every episode kept with `next.success`; trains two value models (`policy: pi05_value`, from the
  start's backbone) on the demonstrations (successes) and every episode collected so far, each holding out one fold of
  the collected episodes (`hold_out_fold`); annotates the collected episodes cross-fitted (`python -m hf_vla.recap
  annotate` with both, N-step advantage, `--positive_fraction` per task); trains the policy from the start (the
  base, as each of the paper's iterations does) on the demonstrations ("Advantage: positive") and every collected
  episode (their own indicator, their executed actions), indicator dropout 0.3; every dataset of a task under one
  episode limit (Meta-World's demonstrations, recorded at the env's 500 steps, get the policy's 200);
- `continued_bc`: behaviour cloning on the demonstrations from the start, for RECAP's total minutes;
- `bc_with_collected`: behaviour cloning from the start on the demonstrations and RECAP's collected episodes (their
  executed actions, failures included, no indicator) for RECAP's minutes less its collection (the episodes are
  RECAP's);
- `recap_weighted`: RECAP with the demonstrations' mixture weight `--demo_weight` (ColorReach);
- `relabel`: the value models' budget alone: RECAP's last round labelled and trained again on the episodes both
  rounds collected, with cross-fitted value models of `--relabel_steps` (their ranking per task, the policy's success);
- `guidance`: the RECAP policy evaluated with `--cfg_beta` 1.5 and 2.5;
- `judge`: the last value model's mean predicted value over episodes of each arm's policy acting alone, ranked against
  the arms' held-out success (Spearman).

Every policy keeps the start's normalisation (`norm_stats_from`), trains with a warmup of 100 steps to a peak of 3e-4
(cosine to 10% over a run of known steps; constant after the warmup in a budgeted one) and is evaluated by `python -m hf_vla.evaluate` on held-out seeds from 10,000. The value model is also judged offline:
the AUC of each held-out episode's mean predicted value for its success (the round-2 collection's episodes, which the
round-1 value model never saw). JSON (`--output`, default `benchmarks/results/recap_cpu.json`, under the bench's key):
`{"start", "recap", "continued_bc", "bc_with_collected": {"mean_success", "minutes", "episodes_collected", ...},
"value_model": {"auc", ...}}`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SEED = 10_000
ARMS = ("recap", "continued_bc", "bc_with_collected")
MW_TASKS = ["reach-v3", "push-v3", "button-press-topdown-v3", "drawer-open-v3", "door-open-v3"]


@dataclass(frozen=True)
class Bench:
    """What differs between the two starts: the env, the recipe, the data layout, the budgets' clock."""

    name: str
    key: str
    env: str
    config: Path
    control_mode: str
    work: Path
    episodes: int  # held-out episodes per evaluation (per task on Meta-World)
    collect: int  # episodes collected per round (per task on Meta-World)
    value_steps: int
    policy_steps: int
    positive_fraction: float
    judge_episodes: int  # per task
    cpu_budget: bool  # arms budgeted in CPU minutes of their process tree (else wall minutes)
    tasks: list[str] = field(default_factory=list)
    start_steps: int | None = None  # the start recipe's steps (default: the recipe's)
    prompt_tokens: int = 40  # the fine-tunes' tokenizer_max_length: room for the task, the state and the indicator


BENCHES = {
    "colorreach": Bench("colorreach", "colorreach_plateau", "color_reach", REPO / "configs" / "demo.json", "delta_xy",
                        REPO / "data_cache" / "recap_colorreach", 500, 200, 600, 2000, 0.3, 100, False),
    "metaworld": Bench("metaworld", "metaworld_five_task", "metaworld", REPO / "configs" / "pi05_metaworld.json",
                       "delta_xyz_gripper", REPO / "data_cache" / "recap_metaworld", 50, 20, 600, 1000, 0.4, 10, True,
                       MW_TASKS, prompt_tokens=56),
}


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_MODE="offline", MUJOCO_GL="egl")


def _tree_cpu(process) -> float:
    """CPU seconds of a process and its descendants: the live ones' own and what exited children left to theirs."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(process.pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system + times.children_user + times.children_system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


_RUSAGE = threading.Lock()


def _run(command: list[str], log: Path, budget_s: float | None = None, cpu: bool = False,
         threads: int = 1) -> tuple[float, float, int]:
    """Run `command` (SIGTERM once `budget_s` of wall time, or with `cpu` of the tree's CPU time, is spent: a training
    then checkpoints and exits 75); (wall seconds, CPU seconds, exit code)."""
    started, cpu_seen = time.perf_counter(), 0.0
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                   env=dict(_env(), OMP_NUM_THREADS=str(threads)))
        while process.poll() is None:
            time.sleep(1.0)
            cpu_seen = max(cpu_seen, _tree_cpu(process))
            spent = cpu_seen if cpu else time.perf_counter() - started
            if budget_s is not None and spent >= budget_s:
                process.send_signal(signal.SIGTERM)
                process.wait()
                break
    seconds = time.perf_counter() - started
    if process.returncode not in (0, 75):
        sys.exit(f"{' '.join(command[2:5])} ... failed (exit {process.returncode}); its output: {log}")
    return seconds, cpu_seen, process.returncode


def _demos(bench: Bench, **extra) -> list[dict]:
    if bench.name == "colorreach":
        return [{"root": str(bench.work / "data"), "name": "demos", "cameras": ["observation.image"],
                 "state_key": "observation.state", "action_key": "action", "control_mode": bench.control_mode,
                 **extra}]
    # recorded with the env's 500-step default; the policy runs (and its rollouts are recorded) under 200: one limit
    return [{"root": str(bench.work / "data" / task), "name": task, "cameras": ["observation.image"],
             "robot_type": "metaworld", "control_mode": bench.control_mode, "max_episode_steps": 200, **extra}
            for task in bench.tasks]


def _collected(bench: Bench, root: Path, name: str, **extra) -> dict:
    # ColorReach's DAgger with beta 0: the policy acted at every step, `action` holds the expert's labels
    action = "policy_action" if bench.name == "colorreach" else "action"
    return {"root": str(root), "name": name, "cameras": ["observation.image"], "state_key": "observation.state",
            "action_key": action, "control_mode": bench.control_mode,
            **({"robot_type": "metaworld"} if bench.name == "metaworld" else {}), **extra}


def _train_policy(bench: Bench, start: Path, datasets: list[dict], out: Path, log: Path, steps: int | None = None,
                  budget_s: float | None = None) -> tuple[float, float, int]:
    """Behaviour cloning (or advantage-conditioned training) from `start` with the start's normalisation: warmup 100
    steps to a peak of 3e-4, cosine to 10% over `steps` (a budgeted run: constant at the peak after the warmup);
    `steps`, or SIGTERM after `budget_s` (its last complete checkpoint is the result)."""
    schedule = (["--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs", json.dumps({"min_lr_rate": 0.1})]
                if steps else ["--lr_scheduler_type", "constant_with_warmup", "--lr_scheduler_kwargs", "{}"])
    command = [sys.executable, "-m", "hf_vla.train", str(bench.config), "--model_name_or_path", str(start),
               "--model_config", json.dumps({"tokenizer_max_length": bench.prompt_tokens}), "--datasets", json.dumps(datasets),
               "--norm_stats_from", str(bench.work / "start"), "--generate_demo_data", "false",
               "--validation_ratio", "0", "--max_steps", str(steps or 10_000_000), "--learning_rate", "3e-4",
               *schedule, "--warmup_steps", "100",
               "--eval_strategy", "no", "--disable_tqdm", "true", "--save_strategy", "no" if steps else "steps",
               "--save_steps", "250" if bench.name == "metaworld" else "500", "--output_dir", str(out)]
    return _run(command, log, budget_s, cpu=bench.cpu_budget)


def _weights(out: Path) -> Path:
    """A run's final weights: its output, or the last complete checkpoint SIGTERM left."""
    if (out / "model.safetensors").is_file():
        return out
    from hf_vla.training.checkpoints import last_complete_checkpoint

    folder, _ = last_complete_checkpoint(out)
    if folder is None:
        sys.exit(f"{out}: no weights")
    return folder


def _steps(weights: Path) -> int | None:
    """The training steps of a checkpoint SIGTERM left (`checkpoint-N`)."""
    return int(weights.name.split("-")[1]) if weights.name.startswith("checkpoint-") else None


def _record(bench: Bench, output: Path, log: Path, episodes: int, *flags: str) -> tuple[float, float, int]:
    tasks = ["--task", ",".join(bench.tasks)] if bench.tasks else []
    return _run([sys.executable, "-m", "hf_vla.record", "--env", bench.env, *tasks, "--episodes", str(episodes),
                 "--output", str(output), *flags], log)


def stage_start(bench: Bench, results: dict) -> None:
    work = bench.work
    if bench.name == "colorreach":
        if not (work / "data" / "meta" / "info.json").exists():
            _record(bench, work / "data", work / "record.log", 100)
        steps, extra = bench.start_steps or 5000, ["--stream_open_blocks", "100"]
    else:
        for task in bench.tasks:  # one dataset per task, as the committed five-task run
            if not (work / "data" / task / "meta" / "info.json").exists():
                _run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", task, "--episodes", "50",
                      "--output", str(work / "data" / task), "--image_size", "96"], work / f"record_{task}.log")
        steps, extra = bench.start_steps or 5700, []
    decay = steps * 6 // 25 if bench.name == "colorreach" else steps // 4  # 1,200; the five-task runs' quarter
    if not (work / "start" / "model.safetensors").exists():
        seconds, cpu, _ = _run([sys.executable, "-m", "hf_vla.train", str(bench.config), "--datasets",
                                json.dumps(_demos(bench)), "--generate_demo_data", "false", "--validation_ratio", "0",
                                "--max_steps", str(steps), "--save_strategy", "no", "--eval_strategy", "no",
                                "--lr_scheduler_kwargs", json.dumps({"num_decay_steps": decay, "min_lr_ratio": 0.1}),
                                *extra, "--output_dir", str(work / "start")], work / "start.log",
                               threads=1 if bench.name == "colorreach" else 2)
        results["start_run"] = {"recorded_episodes": 100 if bench.name == "colorreach" else 250, "steps": steps,
                                "wall_seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1)}


def _label_and_train(bench: Bench, collected: list[Path], round_dir: Path, value_steps: int,
                     demo_weight: float = 1.0) -> tuple[float, list[Path]]:
    """A round's labels and policy: two value models from the start's backbone (`value_steps` each), each holding out
    one fold of the collected episodes (cross-fitting: every collected episode is annotated by a model that never
    trained on it), the annotation, and the policy from the base on the demonstrations and the annotated episodes.
    -> the CPU seconds and the value models."""
    work, cpu_total, folds = bench.work, 0.0, []
    for fold in range(2):
        value_out = round_dir / f"value_fold{fold}"
        folds.append(value_out)
        if (value_out / "model.safetensors").exists():  # a resumed run: the model is kept (its CPU not counted)
            continue
        datasets = _demos(bench, success=True) + [_collected(bench, root, f"round{i + 1}", hold_out_fold=[fold, 2])
                                                  for i, root in enumerate(collected)]
        _, cpu, _ = _run([sys.executable, "-m", "hf_vla.train", str(bench.config), "--policy", "pi05_value",
                          "--model_name_or_path", str(work / "start"), "--model_config", "null", "--datasets",
                          json.dumps(datasets), "--generate_demo_data", "false", "--validation_ratio", "0",
                          "--max_steps", str(value_steps), "--learning_rate", "3e-4",
                          "--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", "{}", "--warmup_steps", "50",
                          "--eval_strategy", "no", "--save_strategy", "no", "--disable_tqdm", "true",
                          "--output_dir", str(value_out)], round_dir / f"value_fold{fold}.log")
        cpu_total += cpu
    annotated = round_dir / "annotated"
    _, cpu, _ = _run([sys.executable, "-m", "hf_vla.recap", "annotate", "--value", *map(str, folds), "--datasets",
                      json.dumps([_collected(bench, root, f"round{i + 1}") for i, root in enumerate(collected)]),
                      "--positive_fraction", str(bench.positive_fraction), "--output", str(annotated),
                      "--overwrite", "true"], round_dir / "annotate.log")
    cpu_total += cpu
    conditioned = _demos(bench, advantage={"value": True}, weight=demo_weight) + [
        _collected(bench, annotated / f"round{i + 1}" if len(collected) > 1 else annotated, f"round{i + 1}",
                   advantage={"key": "advantage_positive"}) for i in range(len(collected))]
    # from the base (the start) on all the data so far, as each of the paper's iterations fine-tunes
    _, cpu, _ = _train_policy(bench, work / "start", conditioned, round_dir / "policy", round_dir / "policy.log",
                              steps=bench.policy_steps)
    return cpu_total + cpu, folds


def arm_relabel(bench: Bench, value_steps: int) -> dict:
    """The value model's budget alone: RECAP's last round again on the episodes both rounds collected, its two
    cross-fitted value models trained `value_steps` each (the policy from the base as the round trains it); the
    annotation's ranking (cross-fitted AUC, per task) and the policy's success."""
    work = bench.work
    collected = sorted(work.glob("recap_round*/rollouts"))
    round_dir = work / f"relabel_value{value_steps}"
    round_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cpu, _ = _label_and_train(bench, collected, round_dir, value_steps)
    several, one = round_dir / "annotated" / "hf_vla_recap.json", round_dir / "annotated" / "meta" / "hf_vla_recap.json"
    summaries = json.loads(several.read_text()) if several.exists() else [json.loads(one.read_text())]
    per_task = {}
    for summary in summaries:
        for task, figures in summary["tasks"].items():
            per_task.setdefault(task, {})[summary["dataset"]] = {
                k: figures.get(k) for k in ("value_auc", "value_return_correlation", "positive_fraction")}
    return {**evaluate(bench, round_dir / "policy", f"relabel_value{value_steps}"), "value_steps": value_steps,
            "episodes_collected": sum(1 for _ in collected) * bench.collect * max(1, len(bench.tasks)),
            "label_cpu_minutes": round(cpu / 60, 2), "minutes": round((time.perf_counter() - started) / 60, 2),
            "cross_fitted": _cross_fitted_auc(round_dir / "annotated"), "per_task": per_task}


def arm_recap(bench: Bench, rounds: int, name: str = "recap", demo_weight: float = 1.0) -> dict:
    """RECAP's rounds; returns the arm's record (minutes, episodes, per-round figures)."""
    work = bench.work
    policy, value, collected, record = work / "start", None, [], {"rounds": []}
    started, cpu_total, collection_s, collection_cpu = time.perf_counter(), 0.0, 0.0, 0.0
    for index in range(1, rounds + 1):
        round_dir = work / f"{name}_round{index}"
        round_dir.mkdir(parents=True, exist_ok=True)
        rollouts = round_dir / "rollouts"
        strategy = (["--strategy", "dagger", "--beta", "0"] if bench.name == "colorreach"
                    else ["--strategy", "policy"])
        seconds, cpu, _ = _record(bench, rollouts, round_dir / "collect.log", bench.collect, *strategy, "--policy",
                                  str(policy), "--seed", str(1_000 * index), "--overwrite", "true")
        collection_s, collection_cpu, cpu_total = collection_s + seconds, collection_cpu + cpu, cpu_total + cpu
        collected.append(rollouts)
        successes = _successes(rollouts)
        cpu, folds = _label_and_train(bench, collected, round_dir, bench.value_steps, demo_weight)
        cpu_total += cpu
        value = folds[0]
        policy = round_dir / "policy"
        record["rounds"].append({"collected": bench.collect * max(1, len(bench.tasks)),
                                 "collected_success": successes, "value_steps": bench.value_steps,
                                 "policy_steps": bench.policy_steps,
                                 "minutes_so_far": round((time.perf_counter() - started) / 60, 2),
                                 "cpu_minutes_so_far": round(cpu_total / 60, 2)})
    record.update({"minutes": round((time.perf_counter() - started) / 60, 2), "cpu_minutes": round(cpu_total / 60, 2),
                   "collection_minutes": round(collection_s / 60, 2),
                   "collection_cpu_minutes": round(collection_cpu / 60, 2),
                   "episodes_collected": bench.collect * max(1, len(bench.tasks)) * rounds,
                   "positive_fraction": bench.positive_fraction, "weights": str(policy), "value": str(value)})
    return record


def _successes(root: Path) -> float:
    import pyarrow.parquet as pq

    tables = [pq.read_table(path, columns=["episode_index", "next.success"]).to_pandas()
              for path in sorted((root / "data").rglob("*.parquet"))]
    import pandas as pd

    return float(pd.concat(tables).groupby("episode_index")["next.success"].any().mean())


def _episode_means(bench: Bench, value: Path, spec: dict, cache: Path):
    """Each episode's mean predicted value under `value`, its outcome, its index, and every frame's value with its
    return (`{episode: (values, returns)}`)."""
    import torch

    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource
    from hf_vla.recap.annotate import AnnotateArguments, _load_value_model, _values

    model, processor = _load_value_model(str(value), "cpu")
    args = AnnotateArguments(value=str(value), datasets=[spec], output=str(bench.work / "x"))
    source = LeRobotSource(DatasetConfig(**spec), 0)
    torch.set_num_threads(1)
    values = _values(source, model, processor, args, cache, str(value),
                     [int(e) for e in source.episodes["episode_index"]])
    episodes = [int(e) for e in source.episodes["episode_index"]]
    means = np.asarray([values[e].mean() for e in episodes])
    frames = {e: (np.asarray(values[e]), source.frame_returns(e)) for e in episodes}
    return means, np.asarray(source.episode_outcomes()), episodes, frames


def _cross_fitted_auc(annotated: Path) -> dict:
    """The AUC of each collected episode's mean cross-fitted value (`recap.value`: from the value model that held its
    fold out) for its success, over the last round's annotation (every round's episodes)."""
    import pandas as pd
    import pyarrow.parquet as pq

    parts = [p for p in sorted(annotated.rglob("*.parquet")) if "data" in p.parts]
    frame = pd.concat(pq.read_table(p, columns=["episode_index", "recap.value", "next.success"]).to_pandas().assign(
        part=str(p.parent.parent.parent)) for p in parts)
    episodes = frame.groupby(["part", "episode_index"]).agg(value=("recap.value", "mean"), success=("next.success", "any"))
    positive, negative = episodes["value"][episodes["success"]].to_numpy(), episodes["value"][~episodes["success"]].to_numpy()
    return {"auc": _auc(positive, negative), "episodes": len(episodes), "successes": int(len(positive))}


def _auc(positive: np.ndarray, negative: np.ndarray) -> float | None:
    if not len(positive) or not len(negative):
        return None
    wins = (positive[:, None] > negative[None, :]).sum() + 0.5 * (positive[:, None] == negative[None, :]).sum()
    return float(wins / (len(positive) * len(negative)))


def value_auc(bench: Bench) -> dict:
    """The round-1 value model as an offline judge on the round-2 episodes (never seen by it): AUC of each episode's
    mean predicted value for its success (per task too on Meta-World)."""
    work = bench.work
    spec = _collected(bench, work / "recap_round2" / "rollouts", "round2")
    means, outcomes, episodes, frames = _episode_means(bench, work / "recap_round1" / "value_fold0", spec,
                                                       work / "auc_values")
    positive, negative = means[outcomes == 1], means[outcomes == 0]
    found = {"auc": _auc(positive, negative), "episodes": len(means), "successes": int(len(positive)),
             "failures": int(len(negative)), "cross_fitted": _cross_fitted_auc(work / "recap_round2" / "annotated")}
    if len(positive) and len(negative):
        found |= {"mean_value_success": float(positive.mean()), "mean_value_failure": float(negative.mean())}
    if bench.tasks:  # per task: the recording keeps each episode's task
        import pyarrow.parquet as pq

        tasks = {}
        for path in sorted((work / "recap_round2" / "rollouts" / "data").rglob("*.parquet")):
            frame = pq.read_table(path, columns=["episode_index", "task_index"]).to_pandas()
            tasks |= dict(frame.groupby("episode_index")["task_index"].first())
        names = json.loads((work / "recap_round2" / "rollouts" / "meta" / "hf_vla_record.json").read_text())["tasks"]
        order = list(names) if isinstance(names, dict) else list(names)
        per_task = {}
        for index, task in enumerate(order):
            mask = np.asarray([tasks.get(e) == index for e in episodes])
            chosen = [e for e, keep in zip(episodes, mask) if keep and frames[e][1] is not None]
            predicted = np.concatenate([frames[e][0] for e in chosen]) if chosen else np.zeros(0)
            actual = np.concatenate([frames[e][1] for e in chosen]) if chosen else np.zeros(0)
            per_task[task] = {  # calibration: every frame's predicted value against its return
                "frames": int(len(actual)), "mean_predicted": float(predicted.mean()) if len(actual) else None,
                "mean_return": float(actual.mean()) if len(actual) else None,
                "mae": float(np.abs(predicted - actual).mean()) if len(actual) else None,
                "correlation": float(np.corrcoef(predicted, actual)[0, 1]) if len(actual) > 2 and actual.std() > 0
                else None,
                "auc": _auc(means[mask & (outcomes == 1)], means[mask & (outcomes == 0)]),
                "successes": int((mask & (outcomes == 1)).sum()), "failures": int((mask & (outcomes == 0)).sum()),
                "mean_value": float(means[mask].mean()) if mask.any() else None}
        found["tasks"] = per_task
    return found


def value_judge(bench: Bench, results: dict) -> dict:
    """The last round's value model as an offline judge of checkpoints: each arm's policy (and the start) records
    episodes of its own (`--strategy policy`, seeds from 20,000); the rank correlation of their mean predicted value
    with the arms' held-out success."""
    work = bench.work
    value = Path(results["recap"]["value"])
    means, successes, names = [], [], []
    for name in ("start", "recap", "continued_bc", "bc_with_collected"):
        if "mean_success" not in results.get(name, {}):
            continue
        weights = work / "start" if name == "start" else (Path(results["recap"]["weights"]) if name == "recap"
                                                           else _weights(work / name))
        own = work / f"judge_{name}"
        if not (own / "meta" / "info.json").exists():
            _record(bench, own, work / f"judge_{name}.log", bench.judge_episodes, "--strategy", "policy", "--policy",
                    str(weights), "--seed", "20000", "--overwrite", "true")
        spec = {"root": str(own), "name": name, "cameras": ["observation.image"], "control_mode": bench.control_mode}
        found, _, _, _ = _episode_means(bench, value, spec, work / f"judge_values_{name}")
        means.append(float(found.mean()))
        successes.append(results[name]["mean_success"])
        names.append(name)
    ranks = [np.argsort(np.argsort(x)) for x in (means, successes)]
    spearman = float(np.corrcoef(*ranks)[0, 1]) if len(names) >= 3 else None
    return {"checkpoints": names, "mean_predicted_value": means, "held_out_success": successes,
            "spearman": spearman, "episodes_each": bench.judge_episodes * max(1, len(bench.tasks))}


def evaluate(bench: Bench, weights: Path, name: str, *flags: str) -> dict:
    out = bench.work / f"eval_{name}"
    tasks = ["--env", "metaworld", "--task", ",".join(bench.tasks)] if bench.tasks else ["--num_envs", "4"]
    _run([sys.executable, "-m", "hf_vla.evaluate", "--checkpoint", str(weights), "--episodes", str(bench.episodes),
          *tasks, "--output_dir", str(out), *flags], bench.work / f"eval_{name}.log")
    found = json.loads((out / "eval_result.json").read_text())
    record = {"mean_success": found["success_rate"], "episodes": bench.episodes * max(1, len(bench.tasks)),
              "seeds": f"{SEED}..{SEED + bench.episodes - 1}" + (" per task" if bench.tasks else "")}
    if bench.tasks:
        record["tasks"] = {task: r["success_rate"] for task, r in found["tasks"].items()}
    return record


def _bc_arm(bench: Bench, results: dict, name: str) -> dict:
    """`continued_bc` or `bc_with_collected` for RECAP's budget; their record."""
    work, recap = bench.work, results["recap"]
    clock = "cpu_minutes" if bench.cpu_budget else "minutes"
    collection = recap["collection_cpu_minutes" if bench.cpu_budget else "collection_minutes"]
    datasets = _demos(bench)
    budget = recap[clock] * 60
    if name == "bc_with_collected":
        rounds = sorted(work.glob("recap_round*/rollouts"))
        datasets += [_collected(bench, root, f"round{i + 1}") for i, root in enumerate(rounds)]
        budget -= collection * 60
    seconds, cpu, _ = _train_policy(bench, work / "start", datasets, work / name, work / f"{name}.log",
                                    budget_s=budget)
    weights = _weights(work / name)
    spent = (cpu if bench.cpu_budget else seconds) / 60 + (collection if name == "bc_with_collected" else 0.0)
    return {**evaluate(bench, weights, name), clock: round(spent, 2), "wall_minutes": round(seconds / 60, 2),
            "episodes_collected": recap["episodes_collected"] if name == "bc_with_collected" else 0,
            "steps": _steps(weights)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", choices=sorted(BENCHES), default="colorreach")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "recap_cpu.json"))
    parser.add_argument("--arms", default=",".join(ARMS) + ",guidance,judge", help=f"comma list of {', '.join(ARMS)}, "
                        "recap_weighted, relabel (the last round again with value models of --relabel_steps), "
                        "guidance (the RECAP policy evaluated with cfg_beta 1.5 and 2.5) and judge "
                        "(the value model as a judge of the arms' checkpoints)")
    parser.add_argument("--episodes", type=int, default=None, help="held-out episodes per evaluation (per task)")
    parser.add_argument("--collect", type=int, default=None, help="episodes RECAP collects per round (per task)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", default=None, help="the folder of data and runs (default: data_cache/recap_<bench>)")
    parser.add_argument("--start_steps", type=int, default=None, help="the start recipe's steps (default: 5,000 on "
                        "ColorReach, 5,700 on Meta-World)")
    parser.add_argument("--value_steps", type=int, default=None)
    parser.add_argument("--judge_episodes", type=int, default=None, help="judge: episodes of each checkpoint (per task)")
    parser.add_argument("--policy_steps", type=int, default=None)
    parser.add_argument("--relabel_steps", type=int, default=3000, help="relabel: the value models' steps when the "
                        "last round is labelled and trained again on the same collected episodes")
    parser.add_argument("--demo_weight", type=float, default=4.0, help="recap_weighted: the demonstrations' mixture "
                        "weight against 1 for each round's collected episodes")
    parser.add_argument("--parallel", type=int, default=None, help="arms (and evaluations) run at once (default: 1 on "
                        "ColorReach, whose budgets are wall minutes; 2 on Meta-World, budgeted in CPU minutes)")
    args = parser.parse_args()
    bench = BENCHES[args.bench]
    overrides = {k: getattr(args, k) for k in ("episodes", "collect", "value_steps", "policy_steps", "start_steps",
                                                  "judge_episodes")
                 if getattr(args, k) is not None}
    if args.work:
        overrides["work"] = Path(args.work)
    bench = Bench(**{**bench.__dict__, **overrides})
    parallel = args.parallel or (2 if bench.cpu_budget else 1)
    output = Path(args.output)
    bench.work.mkdir(parents=True, exist_ok=True)
    everything = json.loads(output.read_text()) if output.exists() else {}
    results = everything.setdefault(bench.key, {})
    value_key = "value_model" if bench.name == "colorreach" else f"value_model_{bench.name}"
    lock = threading.Lock()

    def save():
        with lock:
            output.write_text(json.dumps(everything, indent=1) + "\n")

    results["machine"] = ("2-core CPU, no GPU, one torch thread per process; " + (
        f"arms budgeted in CPU minutes of their process tree, {parallel} at a time" if bench.cpu_budget
        else "each arm alone, budgeted in wall minutes"))
    stage_start(bench, results)
    if results.get("start", {}).get("episodes") != bench.episodes * max(1, len(bench.tasks)):
        results["start"] = evaluate(bench, bench.work / "start", "start")
        save()
    arms = [a for a in args.arms.split(",") if a]
    if "recap_weighted" in arms:  # RECAP with the demonstrations weighted up in the policy's mixture
        record = arm_recap(bench, args.rounds, name="recap_weighted", demo_weight=args.demo_weight)
        results["recap_weighted"] = {**evaluate(bench, Path(record["weights"]), "recap_weighted"), **record,
                                     "demo_weight": args.demo_weight}
        save()
    jobs = []
    with ThreadPoolExecutor(parallel) as pool:
        if "recap" in arms:
            record = arm_recap(bench, args.rounds)
            results["recap"] = record

            def recap_eval():
                results["recap"] = {**evaluate(bench, Path(record["weights"]), "recap"), **record}
                save()

            jobs.append(pool.submit(recap_eval))
            if args.rounds >= 2:
                try:  # an analysis: its failure must not cost the arms' runs
                    everything[value_key] = value_auc(bench)
                except Exception as error:  # noqa: BLE001
                    everything[value_key] = {"error": repr(error)}
                save()
        for name in ("continued_bc", "bc_with_collected"):
            if name in arms and "recap" in results:
                def bc(name=name):
                    results[name] = _bc_arm(bench, results, name)
                    save()

                jobs.append(pool.submit(bc))
        for job in jobs:
            job.result()
    if "relabel" in arms:  # the value model's budget alone: the last round again with longer-trained value models
        results[f"relabel_value{args.relabel_steps}"] = arm_relabel(bench, args.relabel_steps)
        save()
    if "guidance" in arms:  # the RECAP policy with classifier-free guidance towards "positive"
        with ThreadPoolExecutor(parallel) as pool:
            def guided(beta):
                results[f"recap_cfg_beta_{beta}"] = evaluate(bench, Path(results["recap"]["weights"]),
                                                             f"recap_cfg{beta}", "--cfg_beta", str(beta))
                save()

            list(pool.map(guided, (1.5, 2.5)))
    if "judge" in arms:
        judged = value_judge(bench, results)
        everything.setdefault(value_key, {}).update({"spearman_checkpoints": judged["spearman"],
                                                     "checkpoints": judged})
    save()
    print(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
