"""pi0.5's high-level inference on multi-stage Meta-World tasks: no subtask vs its own decoded subtasks vs the
expert's true stage, at the same training budget (docs/subtasks.md).

    python -m benchmarks.closed_loop.subtask_cpu                   # -> benchmarks/results/subtask_cpu.json

Stages (each skipped when its output exists in `--work`, default data_cache/subtask_bench):
- record: `python -m hf_vla.record --env metaworld` on pick-place, assembly and hammer (every one's expert passes
  through four or five stages, in order on recorded episodes), `--episodes` successful episodes each at 96 px, with
  the per-frame `subtask` column (the expert's stage, `hf_vla.envs.expert_stages`);
- train: `configs/pi05_metaworld_subtask.json` twice for `--steps` optimizer steps: (a) without subtasks (the
  subtask column unused, the plain prompt), (b) with `subtask_layout="joint"`; both evaluated on the held-out
  demonstrations at the end (b: the exact-match accuracy of its greedily decoded subtask against the annotated one);
- evaluate: `--eval_episodes` held-out episodes per task (seeds from 10,000): (a) as trained; (b) acting on its own
  decoded subtask (`--subtask auto`), with the decode checked against the expert's stage at every chunk; (c) the
  same checkpoint acting on the expert's true stage (`--subtask oracle`);
- latency: a `PolicyRunner` call on one thread with the subtask decoded every chunk against the plain prompt;
- with `--no_ki`, (b) and (c) again for the subtask arm trained with knowledge insulation off (the flow loss then
  trains the backbone too, as in the no-subtask arm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "pi05_metaworld_subtask.json"
TASKS = ("pick-place-v3", "assembly-v3", "hammer-v3")


def record(work: Path, episodes: int) -> Path:
    data = work / "data"
    if not (data / "meta" / "info.json").is_file():
        subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", ",".join(TASKS),
                        "--episodes", str(episodes), "--image_size", "96", "--output", str(data)], check=True,
                       cwd=REPO)
    return data


def train(work: Path, data: Path, arm: str, steps: int) -> dict:
    """Train one arm in-process; -> its final evaluation metrics on the held-out demonstrations and its time."""
    out = work / arm
    summary = out / "bench_train.json"
    if summary.is_file():
        return json.loads(summary.read_text())
    from hf_vla.train import main

    base = json.loads(CONFIG.read_text())
    dataset = base["datasets"][0] | {"root": str(data), "name": "stages"}
    overrides = ["--output_dir", str(out), "--max_steps", str(steps), "--save_strategy", "no",
                 "--validation_ratio", "0.1", "--eval_strategy", "steps", "--eval_steps", str(steps),
                 "--per_device_eval_batch_size", "32", "--action_metrics_batches", "0"]
    if arm == "no_subtask":
        dataset.pop("subtask_key")
        overrides += ["--subtask_layout", "null"]
    if arm == "subtask_no_ki":  # the flow loss reaches the backbone too (knowledge insulation off)
        overrides += ["--knowledge_insulation", "false"]
    started = time.perf_counter()
    trainer = main([str(CONFIG), "--datasets", json.dumps([dataset]), *overrides])
    seconds = time.perf_counter() - started
    metrics = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k.startswith("eval_")}
    result = {"train_seconds": round(seconds, 1), "steps": steps, "heldout": metrics}
    summary.write_text(json.dumps(result, indent=2))
    return result


def evaluate(work: Path, arm: str, subtask: str | None, episodes: int) -> dict:
    name = f"{arm}_{subtask or 'plain'}"
    out = work / "eval" / name
    if (out / "summary.json").is_file():
        return json.loads((out / "summary.json").read_text())
    import torch

    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    torch.set_num_threads(1)  # the env workers need the other core
    started = time.perf_counter()
    result = evaluate_checkpoint(EvaluateArguments(checkpoint=str(work / arm), episodes=episodes, num_envs=1,
                                                   save_videos=1, device="cpu", output_dir=str(out),
                                                   subtask=subtask), progress=False)
    tasks = {task: r.success_rate for task, r in result.tasks.items()}
    checks = {task: (sum(e.get("subtask_hits", 0) for e in r.episode_records),
                     sum(e.get("subtask_checks", 0) for e in r.episode_records)) for task, r in result.tasks.items()}
    wrong: dict = {}
    for task, r in result.tasks.items():  # what the decoded subtasks got wrong: (decoded, expert's) pairs
        for episode in r.episode_records:
            for entry in episode.get("subtasks", []):
                if len(entry) == 3 and entry[1] != entry[2]:
                    key = f"{entry[1]!r} for {entry[2]!r}"
                    wrong.setdefault(task, {}).setdefault(key, 0)
                    wrong[task][key] += 1
    summary = {"mean_success": round(result.success_rate, 4), "tasks": tasks, "episodes": episodes,
               "seconds": round(time.perf_counter() - started, 1)}
    if any(total for _, total in checks.values()):
        summary["closed_loop_subtask_accuracy"] = {
            task: round(hits / total, 4) if total else None for task, (hits, total) in checks.items()}
        summary["decoded_vs_expert_mismatches"] = {task: dict(sorted(pairs.items(), key=lambda kv: -kv[1])[:5])
                                                   for task, pairs in wrong.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def latency(work: Path, repeats: int = 30) -> dict:
    """Median ms of a `PolicyRunner` call on one thread: the subtask decoded every chunk, and the plain prompt."""
    import numpy as np
    import torch

    from hf_vla.envs.metaworld import MetaWorldEnv
    from hf_vla.serving.policy import load_policy

    torch.set_num_threads(1)
    env = MetaWorldEnv(TASKS[0], image_size=96)
    observation, info = env.reset(seed=10_000)
    env.close()
    out = {}
    for mode in ("auto", None):
        runner = load_policy(str(work / "subtask"), subtask=mode, subtask_every=1)
        times = []
        for index in range(repeats + 3):
            runner.reset(seed=index)
            started = time.perf_counter()
            runner(observation, info["task"])
            if index >= 3:
                times.append(1000 * (time.perf_counter() - started))
        out["decoded" if mode else "plain"] = round(statistics.median(times), 2)
        if mode:
            tokens = runner.processor.tokenizer(runner.last_subtask or "", add_special_tokens=False)["input_ids"]
            out["decoded_tokens"] = len(tokens) + 1
    out["decode_ms_per_chunk"] = round(out["decoded"] - out["plain"], 2)
    return out | {"threads": 1, "numpy_threads": os.environ.get("OMP_NUM_THREADS"), "np": np.__version__}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=str(REPO / "data_cache" / "subtask_bench"))
    parser.add_argument("--episodes", type=int, default=40, help="recorded expert episodes per task")
    parser.add_argument("--steps", type=int, default=3000, help="optimizer steps of each arm (the same budget)")
    parser.add_argument("--eval_episodes", type=int, default=20, help="held-out episodes per task and arm")
    parser.add_argument("--no_ki", action="store_true", help="also the subtask arm with knowledge insulation off")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "subtask_cpu.json"))
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = record(work, args.episodes)
    names = ("no_subtask", "subtask") + (("subtask_no_ki",) if args.no_ki else ())
    trained = {arm: train(work, data, arm, args.steps) for arm in names}
    arms = {"no_subtask": evaluate(work, "no_subtask", None, args.eval_episodes),
            "decoded_subtask": evaluate(work, "subtask", "auto", args.eval_episodes),
            "oracle_subtask": evaluate(work, "subtask", "oracle", args.eval_episodes)}
    if args.no_ki:  # the same subtask training with the flow loss reaching the backbone
        arms |= {"decoded_subtask_no_ki": evaluate(work, "subtask_no_ki", "auto", args.eval_episodes),
                 "oracle_subtask_no_ki": evaluate(work, "subtask_no_ki", "oracle", args.eval_episodes)}
    timing = latency(work)
    heldout = trained["subtask"]["heldout"]
    result = {**arms, "subtask_accuracy": heldout.get("eval_subtask_accuracy"),
              "decode_ms_per_chunk": timing["decode_ms_per_chunk"],
              "setup": {"tasks": list(TASKS), "recorded_episodes_per_task": args.episodes, "image_size": 96,
                        "steps_per_arm": args.steps, "eval_episodes_per_task": args.eval_episodes,
                        "config": str(CONFIG.relative_to(REPO)), "machine_cpus": os.cpu_count()},
              "training": trained, "latency_ms": timing}
    text = json.dumps(result, indent=2)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
