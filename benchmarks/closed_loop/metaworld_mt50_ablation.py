"""The MT50 recipe's ablation: which image size, chunk and executed actions let a from-scratch pi0.5 on this 2-core CPU
solve Meta-World's medium and hard tasks (issue #38, item 2).

    python -m benchmarks.closed_loop.metaworld_mt50_ablation --data data_cache/mt50_160 --settings base_96,mt50_128,exec8_128

(`exec8_128` differs from `mt50_128` only in how many actions of a chunk run, so it evaluates that checkpoint.)
The step-count settings on a recording of the four tasks alone (7 minutes here), two at a time, one core each:

    python -m hf_vla.record --env metaworld --task basketball,peg-insert-side,push,pick-place --episodes 50 \
        --output data_cache/mt50_4 --image_size 160
    OMP_NUM_THREADS=1 python -m benchmarks.closed_loop.metaworld_mt50_ablation --data data_cache/mt50_4 --settings long_128 &
    OMP_NUM_THREADS=1 python -m benchmarks.closed_loop.metaworld_mt50_ablation --data data_cache/mt50_4 --settings aug_long_128

pi0.5's token objective at equal minutes (issue #64; `--budget_min`: each setting's steps from its own 200-step probe,
`--probe_only` measures every probe first, alone): settings `flow_only`, `fast_ki`, `fast_ki_locations` (the last
needs a recording with the `locations` column); docs/measurements.md, "The four object-centred tasks".

Every setting trains `configs/pi05_metaworld_mt50.json` with its overrides for the same number of optimizer steps on
the same episodes (the recording's episodes of `--tasks`, selected with the dataset's `keep_ranges`), then
`python -m hf_vla.evaluate` runs `--episodes` held-out episodes per task (seeds from 10,000) with the step limit and
actions per chunk of the checkpoint's contract. Writes `--output` (default
benchmarks/results/metaworld_mt50_ablation_cpu.json): per setting its overrides, steps, train and eval seconds,
success per task and mean. Settings already in the output are skipped (a rerun continues), unless `--force`.
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
CONFIG = REPO / "configs" / "pi05_metaworld_mt50.json"
TASKS = "basketball-v3,peg-insert-side-v3,push-v3,pick-place-v3"  # 2 medium, 2 hard; the 96 px recipe got 0-15%

# name -> (what it tests, overrides of configs/pi05_metaworld_mt50.json)
SETTINGS = {
    "base_96": ("the five-task recipe's shape: 96 px, chunk 8, all 8 executed",
                {"model_config.vlm_config.vision_config.image_size": 96, "model_config.chunk_size": 8,
                 "n_action_steps": 8}),
    "mt50_128": ("the MT50 candidate: 128 px, chunk 16, 4 executed", {}),
    "exec8_128": ("128 px, chunk 16, 8 executed (less closed-loop correction)", {"n_action_steps": 8}),
    "mt50_160": ("160 px (100 image tokens), chunk 16, 4 executed",
                 {"model_config.vlm_config.vision_config.image_size": 160}),
    "wide_128": ("128 px with a 2x wider action expert (192)", {"model_config.dit_config.hidden_size": 192,
                                                               "model_config.dit_config.intermediate_size": 384}),
    "short_128": ("the MT50 candidate, 4,000 steps (mt50_128 again, on the data of long_128)", {}),
    "long_128": ("the MT50 candidate trained 3x longer (12,000 steps)", {}),
    "patch8_96": ("96 px in 8 px patches (144 image tokens, each a quarter of a 16 px patch's area at 128 px)",
                  {"model_config.vlm_config.vision_config.image_size": 96,
                   "model_config.vlm_config.vision_config.patch_size": 8}),
    "aug_long_128": ("long_128 with openpi's training-time image augmentation", {"image_augmentation": "openpi"}),
    # pi0.5's token objective (issue #64, docs/cotraining.md), compared at equal minutes with --budget_min
    "flow_only": ("the MT50 candidate (flow loss only), at the token arms' budget", {}),
    "fast_ki": ("+ FAST action tokens' CE, knowledge insulation (512 FAST ids in the tiny vocabulary)",
                {"token_loss": True, "knowledge_insulation": True, "fast_vocab_size": 512}),
    "fast_ki_locations": ("+ FAST CE, knowledge insulation and the recording's object locations as text targets",
                          {"token_loss": True, "knowledge_insulation": True, "fast_vocab_size": 1024,
                           "tokenizer": "tiny_loc", "model_config.vlm_config.text_config.vocab_size": 2560,
                           "model_config.vlm_config.image_token_id": 2559,
                           "model_config.dit_config.vocab_size": 2560}),
}
# Settings whose dataset carries per-frame target text (the column written by hf_vla.record --env metaworld).
TARGET_TEXT = {"fast_ki_locations": "locations"}
# Settings trained for a fixed number of optimizer steps instead of --steps (the question they ask is the steps').
STEPS = {"short_128": 4000, "patch8_96": 4000, "long_128": 12000, "aug_long_128": 12000}
# Settings that differ from another only in how the policy is run, not in how it is trained: evaluate that setting's
# checkpoint with these evaluation flags instead of training the same model twice.
EVAL_ONLY = {"exec8_128": "mt50_128"}


def keep_ranges(data: Path, tasks: list[str]) -> dict:
    """`{episode_index: [[0, length]]}` for the recording's episodes of `tasks` (by their lerobot descriptions)."""
    import pyarrow.parquet as pq

    from hf_vla.envs import metaworld

    wanted = {metaworld.task_description(name) for name in tasks}
    # lerobot gives two MT50 tasks one description (push-v3 and push-back-v3: "Push the puck to a goal"); an episode
    # records only its description, so a recording of both gives both here: say so
    shared = sorted(name for name, text in metaworld._lerobot_metaworld().TASK_DESCRIPTIONS.items()
                    if text in wanted and name not in tasks)
    if shared:
        print(f"note: {shared} share a description with {tasks}; episodes of theirs in {data}, if any, are selected too",
              flush=True)
    ranges = {}
    for path in sorted((data / "meta" / "episodes").glob("*/*.parquet")):
        table = pq.read_table(path, columns=["episode_index", "tasks", "length"]).to_pydict()
        for index, episode_tasks, length in zip(table["episode_index"], table["tasks"], table["length"]):
            if set(episode_tasks) & wanted:
                ranges[str(index)] = [[0, int(length)]]
    if not ranges:
        raise SystemExit(f"{data}: no episode of {tasks}")
    return ranges


def probe_rate(name: str, data: Path, work: Path, ranges: dict, env: dict, probe_steps: int = 200) -> float:
    """Optimizer steps per second of `name`'s training, from `probe_steps` steps run undisturbed (start-up included: a
    safe under-estimate); the run itself gets `rate x budget` steps, so a wall clock stretched by other work later
    changes its duration, not its steps."""
    cache = work / "probe_rates.json"  # one probe per setting: `--probe_only` runs them all first, undisturbed
    rates = json.loads(cache.read_text()) if cache.exists() else {}
    if name not in rates:
        seconds = _train(data, work / f"probe_{name}", probe_steps, SETTINGS[name][1], ranges, env,
                         TARGET_TEXT.get(name), save=False)
        rates = json.loads(cache.read_text()) if cache.exists() else {}
        rates[name] = probe_steps / seconds
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(rates, indent=2) + "\n")
    return rates[name]


def run(name: str, data: Path, work: Path, tasks: list[str], steps: int, episodes: int, ranges: dict,
        trained: dict, budget_min: float | None = None) -> dict:
    what, overrides = SETTINGS[name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    if name in EVAL_ONLY:
        base = EVAL_ONLY[name]
        if base not in trained:
            raise SystemExit(f"--settings: {name} evaluates {base}'s checkpoint; run {base} first")
        # the checkpoint's contract says how it was trained to run; --override records that this run departs from it
        out = work / base
        eval_flags = [f"--{key}={value}" for key, value in overrides.items()] + ["--override", *overrides]
        train_seconds, steps = trained[base]["train_seconds"], trained[base]["steps"]
    else:
        out, eval_flags, steps, rate = work / name, [], STEPS.get(name, steps), None
        if budget_min is not None:
            rate = probe_rate(name, data, work, ranges, env)
            steps = int(rate * budget_min * 60 / 100) * 100
        train_seconds = _train(data, out, steps, overrides, ranges, env, TARGET_TEXT.get(name))
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_vla.evaluate", "--checkpoint", str(out), "--task", ",".join(tasks),
                    "--episodes", str(episodes), "--num_envs", "2", "--output_dir", str(work / f"eval_{name}"),
                    "--save_videos", "1", *eval_flags],  # two envs in worker processes: 500-step failures cost 12-14 s
                   check=True, cwd=REPO, env=env)
    result = json.loads((work / f"eval_{name}" / "eval_result.json").read_text())
    return {"what": what, "overrides": overrides, "steps": steps, "train_seconds": round(train_seconds, 1),
            "eval_seconds": round(time.perf_counter() - started, 1), "mean_success": result["success_rate"],
            "tasks": {t: r["success_rate"] for t, r in result["tasks"].items()}, "episodes_per_task": episodes,
            **({"trained_as": EVAL_ONLY[name]} if name in EVAL_ONLY else {}),
            **({"budget_min": budget_min, "probe_steps_per_s": round(rate, 3), "peak_rss_gb": peak_rss_gb()}
               if budget_min is not None and name not in EVAL_ONLY else {})}


def peak_rss_gb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2)  # the largest child so far


def override_flags(overrides: dict) -> list[str]:
    """A setting's overrides as `hf_vla.train` flags (`--key json-value`)."""
    flags = []
    for key, value in overrides.items():
        flags += [f"--{key}", json.dumps(value)]
    return flags


def _train(data: Path, out: Path, steps: int, overrides: dict, ranges: dict, env: dict,
           target_text_key: str | None = None, save: bool = True) -> float:
    from benchmarks.common import recorded_cameras

    dataset = [{"root": str(data), "name": "mt50", "cameras": recorded_cameras(data), "control_mode": "delta_xyz_gripper",
                "keep_ranges": ranges, **({"target_text_key": target_text_key} if target_text_key else {})}]
    flags = override_flags(overrides)
    resume = ["--resume_from_checkpoint", "true"] if list(out.glob("checkpoint-*")) else []
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_vla.train", str(CONFIG), "--datasets", json.dumps(dataset),
                    "--output_dir", str(out), "--max_steps", str(steps), "--save_steps", str(max(100, steps // 4)),
                    *([] if save else ["--save_strategy", "no"]),
                    "--validation_ratio", "0", "--lr_scheduler_kwargs",
                    json.dumps({"num_decay_steps": max(1, steps // 4), "min_lr_ratio": 0.1}), *flags, *resume],
                   check=True, cwd=REPO, env=env)
    return time.perf_counter() - started


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO / "data_cache" / "mt50_160"), help="the MT50 recording")
    parser.add_argument("--work", default=str(REPO / "data_cache" / "mt50_ablation"))
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "metaworld_mt50_ablation_cpu.json"))
    parser.add_argument("--settings", default="base_96,mt50_128,exec8_128", help=f"of {sorted(SETTINGS)}")
    parser.add_argument("--tasks", default=TASKS)
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per setting (batch 32)")
    parser.add_argument("--episodes", type=int, default=10, help="held-out episodes per task")
    parser.add_argument("--budget_min", type=float, default=None,
                        help="train each setting for this many minutes' steps (from its own 200-step probe) instead "
                             "of --steps: the token objective's cost per step shows as fewer steps")
    parser.add_argument("--force", action="store_true", help="rerun settings already in --output")
    parser.add_argument("--probe_only", action="store_true",
                        help="with --budget_min: measure every setting's step rate (kept in --work) and stop, so that "
                             "the rates are measured alone and the runs may share the machine afterwards")
    args = parser.parse_args(argv)
    data, work, output = Path(args.data), Path(args.work), Path(args.output)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    results = json.loads(output.read_text()) if output.exists() else {}
    ranges = keep_ranges(data, tasks)
    results.update({"tasks": tasks, "data": str(data), "episodes_in_training": len(ranges),
                    "machine": "2-core CPU, no GPU", "seeds": "10,000.. per task", "settings": results.get("settings", {})})
    names = [s.strip() for s in args.settings.split(",")]
    for name in names:
        if name not in SETTINGS:
            raise SystemExit(f"--settings: unknown {name!r}; known: {sorted(SETTINGS)}")
    if args.probe_only:
        if args.budget_min is None:
            raise SystemExit("--probe_only measures the step rates of --budget_min: give --budget_min")
        env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
        print(json.dumps({name: probe_rate(name, data, work, ranges, env) for name in names if name not in EVAL_ONLY}))
        return
    for name in names:
        if name in results["settings"] and not args.force:
            continue
        results["settings"][name] = run(name, data, work, tasks, args.steps, args.episodes, ranges,
                                        results["settings"], args.budget_min)
        # settings may run side by side in two processes (one core each): merge this one into what is there now
        current = json.loads(output.read_text()) if output.exists() else {"settings": {}}
        current["settings"][name] = dict(results["settings"][name], data=str(data),
                                         episodes_in_training=len(ranges))
        for key in ("tasks", "data", "episodes_in_training", "machine", "seeds"):  # the first run's, kept
            current.setdefault(key, results[key])
        results["settings"] = current["settings"]
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(current, indent=2) + "\n")
        print(json.dumps({name: results["settings"][name]}, indent=2), flush=True)


if __name__ == "__main__":
    main()
