"""RECAP (pi*0.6's learning from experience) against behaviour cloning on ColorReach's plateau start, every arm from
the same start at equal wall-clock minutes (collection and value training included), one torch thread each, each
arm alone.

    python -m benchmarks.closed_loop.recap_colorreach            # start, RECAP's two rounds, both BC arms, evaluate
    python -m benchmarks.closed_loop.recap_colorreach --arms continued_bc --episodes 500   # one arm again

Start: the whole demo recipe (`configs/demo.json`, 5,000 steps, 1,200 decay) on 100 recorded expert episodes, SFT at
its plateau on scarce data (docs/measurements.md: 20.6% over 500 held-out episodes, where GRPO reached 29.8% and
continued SFT 20.4% in 60 minutes with 24,480 rollout episodes). Arms:

- `recap`: two rounds; each collects `--collect` episodes of the current policy acting alone (`hf_vla.record
  --strategy dagger --beta 0`: every episode kept with `next.success`; the executed action is `policy_action`),
  trains a value model (`policy: pi05_value`, from the start's backbone, or the previous round's value model) on the
  demonstrations (successes) and every episode collected so far, annotates the collected episodes (`python -m
  hf_vla.recap annotate`, N-step advantage, 30% positive per task), and trains the policy from the previous round's
  weights on the demonstrations ("Advantage: positive") and the collected episodes (their own indicator, their
  executed actions), indicator dropout 0.3;
- `continued_bc`: behaviour cloning on the demonstrations from the start, for RECAP's total minutes;
- `bc_with_collected`: behaviour cloning from the start on the demonstrations and RECAP's collected episodes (their
  executed actions, failures included, no indicator) for RECAP's minutes less its collection (the episodes are
  RECAP's);
- `recap_weighted`: RECAP with the demonstrations' mixture weight `--demo_weight` (4: two thirds of each batch);
- `guidance`: the RECAP policy evaluated with `--cfg_beta` 1.5 and 2.5;
- `judge`: the last value model's mean predicted value over 100 episodes of each arm's policy, ranked against the
  arms' held-out success (Spearman).

Every policy keeps the start's normalisation (`norm_stats_from`), trains at the start's last rate (1e-4, constant) and
is evaluated by `python -m hf_vla.evaluate` on `--episodes` held-out seeds from 10,000. The value model is also judged
offline: the AUC of each held-out episode's mean predicted value for its success (the round-2 collection's episodes,
which the round-1 value model never saw). JSON (`--output`, default `benchmarks/results/recap_cpu.json`, key
`colorreach_plateau`): `{"start", "recap", "continued_bc", "bc_with_collected": {"mean_success", "minutes",
"episodes_collected", ...}, "value_model": {"auc", ...}}`.
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

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SEED = 10_000
ARMS = ("recap", "continued_bc", "bc_with_collected")
POLICY_CONFIG = REPO / "configs" / "demo.json"


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", WANDB_MODE="offline", MUJOCO_GL="egl")


def _run(command: list[str], log: Path, budget_s: float | None = None) -> tuple[float, int]:
    """Run `command` (SIGTERM after `budget_s`: a training then checkpoints and exits 75); (seconds, exit code)."""
    started = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=_env())
        try:
            process.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            process.wait()
    seconds = time.perf_counter() - started
    if process.returncode not in (0, 75):
        sys.exit(f"{' '.join(command[2:5])} ... failed (exit {process.returncode}); its output: {log}")
    return seconds, process.returncode


def _demos(work: Path, **extra) -> dict:
    return {"root": str(work / "data"), "name": "demos", "cameras": ["observation.image"],
            "state_key": "observation.state", "action_key": "action", "control_mode": "delta_xy", **extra}


def _collected(root: Path, name: str, **extra) -> dict:
    # the executed actions: with beta 0 the policy acted at every step (`action` holds the expert's labels)
    return {"root": str(root), "name": name, "cameras": ["observation.image"], "state_key": "observation.state",
            "action_key": "policy_action", "control_mode": "delta_xy", **extra}


def _train_policy(work: Path, start: Path, datasets: list[dict], out: Path, log: Path, steps: int | None = None,
                  budget_s: float | None = None) -> tuple[float, int]:
    """Behaviour cloning (or advantage-conditioned training) from `start` at 1e-4 constant, the start's
    normalisation; `steps`, or SIGTERM after `budget_s` (its last complete checkpoint is the result)."""
    command = [sys.executable, "-m", "hf_vla.train", str(POLICY_CONFIG), "--model_name_or_path", str(start),
               "--model_config", json.dumps({"tokenizer_max_length": 40}), "--datasets", json.dumps(datasets),
               "--norm_stats_from", str(work / "start"), "--generate_demo_data", "false", "--validation_ratio", "0",
               "--max_steps", str(steps or 10_000_000), "--learning_rate", "1e-4", "--lr_scheduler_type", "constant",
               "--lr_scheduler_kwargs", "{}", "--warmup_steps", "0", "--eval_strategy", "no", "--disable_tqdm", "true",
               "--save_strategy", "no" if steps else "steps", "--save_steps", "500", "--output_dir", str(out)]
    return _run(command, log, budget_s)


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


def stage_start(work: Path, results: dict) -> None:
    if not (work / "data" / "meta" / "info.json").exists():
        _run([sys.executable, "-m", "hf_vla.record", "--env", "color_reach", "--episodes", "100", "--output",
              str(work / "data")], work / "record.log")
    if not (work / "start" / "model.safetensors").exists():
        seconds, _ = _run([sys.executable, "-m", "hf_vla.train", str(POLICY_CONFIG), "--datasets",
                           json.dumps([_demos(work, name="color_reach")]), "--generate_demo_data", "false",
                           "--max_steps", "5000", "--stream_open_blocks", "100",
                           "--lr_scheduler_kwargs", json.dumps({"num_decay_steps": 1200, "min_lr_ratio": 0.1}),
                           "--output_dir", str(work / "start")], work / "start.log")
        results["start_run"] = {"recorded_episodes": 100, "steps": 5000, "wall_seconds": round(seconds, 1)}


def arm_recap(work: Path, collect: int, value_steps: int, policy_steps: int, rounds: int, results: dict,
              name: str = "recap", demo_weight: float = 1.0) -> dict:
    """RECAP's rounds; returns the arm's record (minutes, episodes, per-round figures)."""
    policy, value, collected, record = work / "start", None, [], {"rounds": []}
    started = time.perf_counter()
    collection_s = 0.0
    for index in range(1, rounds + 1):
        round_dir = work / f"{name}_round{index}"
        round_dir.mkdir(parents=True, exist_ok=True)
        rollouts = round_dir / "rollouts"
        seconds, _ = _run([sys.executable, "-m", "hf_vla.record", "--env", "color_reach", "--strategy", "dagger",
                           "--policy", str(policy), "--beta", "0", "--episodes", str(collect), "--seed",
                           str(1_000 * index), "--output", str(rollouts), "--overwrite", "true"],
                          round_dir / "collect.log")
        collection_s += seconds
        collected.append(rollouts)
        successes = _successes(rollouts)
        value_out = round_dir / "value"
        datasets = [_demos(work)] + [_collected(root, f"round{i + 1}") for i, root in enumerate(collected)]
        value_source = value or work / "start"
        _run([sys.executable, "-m", "hf_vla.train", str(POLICY_CONFIG), "--policy", "pi05_value",
              "--model_name_or_path", str(value_source), "--model_config", "null", "--datasets",
              json.dumps(datasets), "--generate_demo_data", "false", "--validation_ratio", "0",
              "--max_steps", str(value_steps), "--learning_rate", "3e-4", "--lr_scheduler_type", "constant",
              "--lr_scheduler_kwargs", "{}", "--warmup_steps", "0", "--eval_strategy", "no", "--save_strategy", "no",
              "--disable_tqdm", "true", "--output_dir", str(value_out)], round_dir / "value.log")
        value = value_out
        annotated = round_dir / "annotated"
        _run([sys.executable, "-m", "hf_vla.recap", "annotate", "--value", str(value), "--datasets",
              json.dumps([_collected(root, f"round{i + 1}") for i, root in enumerate(collected)]),
              "--output", str(annotated), "--overwrite", "true"], round_dir / "annotate.log")
        conditioned = [_demos(work, advantage={"value": True}, weight=demo_weight)] + [
            _collected(annotated / f"round{i + 1}" if len(collected) > 1 else annotated, f"round{i + 1}",
                       advantage={"key": "advantage_positive"}) for i in range(len(collected))]
        _train_policy(work, policy, conditioned, round_dir / "policy", round_dir / "policy.log", steps=policy_steps)
        policy = round_dir / "policy"
        record["rounds"].append({"collected": collect, "collected_success": successes, "value_steps": value_steps,
                                 "policy_steps": policy_steps, "minutes_so_far":
                                 round((time.perf_counter() - started) / 60, 2)})
    record.update({"minutes": round((time.perf_counter() - started) / 60, 2),
                   "collection_minutes": round(collection_s / 60, 2), "episodes_collected": collect * rounds,
                   "weights": str(policy), "value": str(value)})
    return record


def _successes(root: Path) -> float:
    import pyarrow.parquet as pq

    table = pq.read_table(sorted((root / "data").rglob("*.parquet"))[0], columns=["episode_index", "next.success"])
    frame = table.to_pandas()
    return float(frame.groupby("episode_index")["next.success"].any().mean())


def value_auc(work: Path, results: dict) -> dict:
    """The round-1 value model as an offline judge on the round-2 episodes (never seen by it): AUC of each episode's
    mean predicted value for its success."""
    import torch

    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource
    from hf_vla.recap.annotate import AnnotateArguments, _load_value_model, _values

    model, processor = _load_value_model(str(work / "recap_round1" / "value"), "cpu")
    spec = _collected(work / "recap_round2" / "rollouts", "round2")
    args = AnnotateArguments(value=str(work / "recap_round1" / "value"), datasets=[spec], output=str(work / "x"))
    source = LeRobotSource(DatasetConfig(**spec), 0)
    torch.set_num_threads(1)
    values = _values(source, model, processor, args, work / "auc_values", "round1")
    outcomes = source.episode_outcomes()
    means = np.asarray([values[int(e)].mean() for e in source.episodes["episode_index"]])
    positive, negative = means[outcomes == 1], means[outcomes == 0]
    if not len(positive) or not len(negative):
        return {"auc": None, "episodes": len(means)}
    wins = (positive[:, None] > negative[None, :]).sum() + 0.5 * (positive[:, None] == negative[None, :]).sum()
    return {"auc": float(wins / (len(positive) * len(negative))), "episodes": len(means),
            "successes": int(len(positive)), "failures": int(len(negative)),
            "mean_value_success": float(positive.mean()), "mean_value_failure": float(negative.mean())}


def value_judge(work: Path, results: dict, episodes: int) -> dict:
    """The last round's value model as an offline judge of checkpoints: each arm's policy (and the start) records
    `episodes` episodes of its own (`--strategy policy`, seeds from 20,000); the rank correlation of their mean
    predicted value with the arms' held-out success."""
    import torch

    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource
    from hf_vla.recap.annotate import AnnotateArguments, _load_value_model, _values

    value = Path(results["recap"]["value"])
    model, processor = _load_value_model(str(value), "cpu")
    torch.set_num_threads(1)
    means, successes, names = [], [], []
    for name in ("start", "recap", "continued_bc", "bc_with_collected"):
        if "mean_success" not in results.get(name, {}):
            continue
        weights = work / "start" if name == "start" else (Path(results["recap"]["weights"]) if name == "recap"
                                                           else _weights(work / name))
        own = work / f"judge_{name}"
        if not (own / "meta" / "info.json").exists():
            _run([sys.executable, "-m", "hf_vla.record", "--env", "color_reach", "--strategy", "policy", "--policy",
                  str(weights), "--episodes", str(episodes), "--seed", "20000", "--output", str(own), "--overwrite",
                  "true"], work / f"judge_{name}.log")
        spec = {"root": str(own), "name": name, "cameras": ["observation.image"], "control_mode": "delta_xy"}
        args = AnnotateArguments(value=str(value), datasets=[spec], output=str(work / "x"))
        source = LeRobotSource(DatasetConfig(**spec), 0)
        values = _values(source, model, processor, args, work / f"judge_values_{name}", str(value))
        means.append(float(np.mean(np.concatenate(list(values.values())))))
        successes.append(results[name]["mean_success"])
        names.append(name)
    ranks = [np.argsort(np.argsort(x)) for x in (means, successes)]
    spearman = float(np.corrcoef(*ranks)[0, 1]) if len(names) >= 3 else None
    return {"checkpoints": names, "mean_predicted_value": means, "held_out_success": successes,
            "spearman": spearman, "episodes_each": episodes}


def evaluate(weights: Path, name: str, work: Path, episodes: int, *flags: str) -> dict:
    out = work / f"eval_{name}"
    _run([sys.executable, "-m", "hf_vla.evaluate", "--checkpoint", str(weights), "--episodes", str(episodes),
          "--num_envs", "4", "--output_dir", str(out), *flags], work / f"eval_{name}.log")
    found = json.loads((out / "eval_result.json").read_text())
    return {"mean_success": found["success_rate"], "episodes": episodes, "seeds": f"{SEED}..{SEED + episodes - 1}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=str(REPO / "data_cache" / "recap_colorreach"))
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "recap_cpu.json"))
    parser.add_argument("--arms", default=",".join(ARMS) + ",guidance,judge", help=f"comma list of {', '.join(ARMS)}, "
                        "guidance (the RECAP policy evaluated with cfg_beta 1.5 and 2.5) and judge (the value model "
                        "as a judge of the arms' checkpoints)")
    parser.add_argument("--episodes", type=int, default=500, help="held-out episodes per evaluation")
    parser.add_argument("--collect", type=int, default=200, help="episodes RECAP collects per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--value_steps", type=int, default=600)
    parser.add_argument("--demo_weight", type=float, default=4.0, help="recap_weighted: the demonstrations' mixture "
                        "weight against 1 for each round's collected episodes")
    parser.add_argument("--policy_steps", type=int, default=2000)
    args = parser.parse_args()
    work, output = Path(args.work), Path(args.output)
    work.mkdir(parents=True, exist_ok=True)
    everything = json.loads(output.read_text()) if output.exists() else {}
    results = everything.setdefault("colorreach_plateau", {})
    results["machine"] = "2-core CPU, no GPU, each arm alone with one torch thread"
    stage_start(work, results)
    if results.get("start", {}).get("episodes") != args.episodes:
        results["start"] = evaluate(work / "start", "start", work, args.episodes)
    arms = [a for a in args.arms.split(",") if a]
    if "recap_weighted" in arms:  # RECAP with the demonstrations weighted up in the policy's mixture
        record = arm_recap(work, args.collect, args.value_steps, args.policy_steps, args.rounds, results,
                           name="recap_weighted", demo_weight=args.demo_weight)
        results["recap_weighted"] = {**evaluate(Path(record["weights"]), "recap_weighted", work, args.episodes),
                                     **record, "demo_weight": args.demo_weight}
        output.write_text(json.dumps(everything, indent=1) + "\n")
    if "recap" in arms:
        record = arm_recap(work, args.collect, args.value_steps, args.policy_steps, args.rounds, results)
        results["recap"] = {**evaluate(Path(record["weights"]), "recap", work, args.episodes), **record}
        if args.rounds >= 2:
            everything["value_model"] = value_auc(work, results)
        output.write_text(json.dumps(everything, indent=1) + "\n")
    budget = results["recap"]["minutes"] * 60 if "recap" in results else None
    if "continued_bc" in arms and budget is not None:
        seconds, _ = _train_policy(work, work / "start", [_demos(work)], work / "continued_bc",
                                   work / "continued_bc.log", budget_s=budget)
        weights = _weights(work / "continued_bc")
        results["continued_bc"] = {**evaluate(weights, "continued_bc", work, args.episodes),
                                   "minutes": round(seconds / 60, 2), "episodes_collected": 0, "steps": _steps(weights)}
        output.write_text(json.dumps(everything, indent=1) + "\n")
    if "bc_with_collected" in arms and budget is not None:
        rounds = sorted(work.glob("recap_round*/rollouts"))
        datasets = [_demos(work)] + [_collected(root, f"round{i + 1}") for i, root in enumerate(rounds)]
        seconds, _ = _train_policy(work, work / "start", datasets, work / "bc_with_collected",
                                   work / "bc_with_collected.log",
                                   budget_s=budget - results["recap"]["collection_minutes"] * 60)
        weights = _weights(work / "bc_with_collected")
        results["bc_with_collected"] = {
            **evaluate(weights, "bc_with_collected", work, args.episodes),
            "minutes": round(seconds / 60 + results["recap"]["collection_minutes"], 2),
            "episodes_collected": results["recap"]["episodes_collected"], "steps": _steps(weights)}
        output.write_text(json.dumps(everything, indent=1) + "\n")
    if "guidance" in arms:  # the RECAP policy with classifier-free guidance towards "positive"
        for beta in (1.5, 2.5):
            results[f"recap_cfg_beta_{beta}"] = evaluate(Path(results["recap"]["weights"]), f"recap_cfg{beta}", work,
                                                         args.episodes, "--cfg_beta", str(beta))
            output.write_text(json.dumps(everything, indent=1) + "\n")
    if "judge" in arms:
        judged = value_judge(work, results, 100)
        everything.setdefault("value_model", {}).update({"spearman_checkpoints": judged["spearman"],
                                                         "checkpoints": judged})
    output.write_text(json.dumps(everything, indent=1) + "\n")
    print(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
