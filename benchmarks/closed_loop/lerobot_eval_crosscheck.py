"""A harness hf_vla did not write scores an hf_vla checkpoint: `lerobot-eval` through the `lerobot_policy_hf_vla` plugin
against `hf_vla.evaluate`, the five-task Meta-World checkpoint of the 20-minute recipe, the same held-out seeds.

    python -m benchmarks.closed_loop.metaworld_benchmark --stage record --work data_cache/mw_cross
    python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min 20 --steps_per_s 4.78 \
        --checkpoints 1 --work data_cache/mw_cross --output /tmp/mw.json         # the checkpoint (20 CPU-minutes)
    python -m benchmarks.closed_loop.lerobot_eval_crosscheck --checkpoint data_cache/mw_cross/hf_vla \
        --episodes 50 [--arms hf_vla,lerobot_eval,hf_vla_as_lerobot] [--tasks reach-v3,push-v3]   # a few at a time
    python -m benchmarks.closed_loop.lerobot_eval_crosscheck --checkpoint data_cache/mw_cross/hf_vla \
        --arms lerobot_eval --first_episode 10 --episodes 40 --jobs 2     # 10 episodes done: seeds 10010..10049 added

Arms (each writes its JSON under `--work` and the result is merged into `--output` as it completes, so a killed run
keeps what finished). `--output` records the checkpoint's weights (`weights_sha256`) and refuses to merge another
checkpoint's arms into it (`--replace` starts it anew); the training's steps and seconds come from the benchmark's
`results.json` beside the checkpoint:
- `hf_vla`: `python -m hf_vla.evaluate` with every setting from the checkpoint's contract (episode limit, fast render);
- `lerobot_eval`: `lerobot-eval --policy.path=<plugin dir> --env.type=metaworld --env.task=<task> --seed=10000`, one
  task per call: lerobot's env (480 px frames with shadows, reflections and multisampling, 500-step episodes), its
  rollout loop and its success metric; the plugin crops and resizes the frames as the recording did;
- `hf_vla_as_lerobot`: hf_vla's loop with lerobot's settings (500 steps, the full render): its difference to `hf_vla`
  is the settings'. It is not `lerobot_eval` episode by episode: hf_vla seeds each episode's sampling noise with the
  env seed, the plugin's runner once (lerobot-eval resets the policy without a seed).
Both harnesses seed episode i of a task with 10,000 + i, so episodes are paired (`paired_agreement`).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, TASKS, load_json

LEROBOT_STEPS = 500  # lerobot's MetaworldEnv: max_path_length of MT1, whatever --env.episode_length says


def _summary(tasks: dict) -> dict:
    rates = [t["success_rate"] for t in tasks.values()]
    return {"mean_success": round(100 * sum(rates) / len(rates), 1), "tasks": tasks}


def hf_vla_arm(checkpoint: Path, episodes: int, out: Path, lerobot_settings: bool, task_names: list[str]) -> dict:
    import torch

    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    torch.set_num_threads(1)  # the env workers need the other core (30 ms a step; with 2 threads beside them, 150)

    env_kwargs = {"max_episode_steps": LEROBOT_STEPS, "fast_render": False} if lerobot_settings else None
    started = time.perf_counter()
    args = EvaluateArguments(checkpoint=str(checkpoint), env="metaworld", task=",".join(task_names), episodes=episodes,
                             save_videos=0, output_dir=str(out), device="cpu",
                             override=["max_episode_steps"] if lerobot_settings else [])
    result = evaluate_checkpoint(args, env_kwargs=env_kwargs, progress=False)
    tasks = {}
    for name, task in result.tasks.items():
        tasks[name] = {"success_rate": task.success_rate, "episodes": task.episodes, "successes": task.successes,
                       "per_seed": {str(e["seed"]): bool(e["success"]) for e in task.episode_records}}
    return {**_summary(tasks), "seconds": round(time.perf_counter() - started, 1)}


def _lerobot_task(lerobot_eval: Path, policy: Path, task: str, episodes: int, first: int, run: Path) -> list[str]:
    command = [str(lerobot_eval), f"--policy.path={policy}", "--env.type=metaworld", f"--env.task={task}",
               f"--eval.n_episodes={episodes}", "--eval.batch_size=1", f"--seed={10_000 + first}",
               "--policy.device=cpu", f"--output_dir={run}"]
    return command


def lerobot_arm(checkpoint: Path, episodes: int, out: Path, task_names: list[str], first: int = 0,
                jobs: int = 1, done=None) -> dict:
    """`lerobot-eval` per task, `jobs` tasks at a time (one thread each). Episodes `first` .. `first + episodes - 1`:
    lerobot-eval seeds episode i of a call with --seed + i (batch_size 1), so a call from `first` continues the seeds
    of an earlier one (its sampling-noise stream restarts with the call)."""
    from hf_vla.convert import main as convert_main

    policy = out / "policy"
    convert_main(["--input", str(checkpoint), "--to", "lerobot_plugin", "--output", str(policy), "--overwrite", "true"])
    lerobot_eval = Path(sys.executable).with_name("lerobot-eval")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.setdefault("MUJOCO_GL", "egl")  # headless, as hf_vla's Meta-World env: lerobot's sets no backend
    env.setdefault("PYOPENGL_PLATFORM", env["MUJOCO_GL"])
    if jobs > 1:
        env["LP_NUM_THREADS"] = "1"  # Mesa's llvmpipe renders on every core otherwise
    suffix = f"_from{first}" if first else ""
    pending, running, tasks, started = list(task_names), {}, {}, time.perf_counter()
    while pending or running:
        while pending and len(running) < jobs:
            task = pending.pop(0)
            command = _lerobot_task(lerobot_eval, policy, task, episodes, first, out / f"{task}{suffix}")
            running[task] = (subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL, env=env), time.perf_counter())
        time.sleep(2)
        for task, (process, began) in list(running.items()):
            if process.poll() is None:
                continue
            del running[task]
            if process.returncode:
                raise RuntimeError(f"lerobot-eval failed on {task} (rc {process.returncode}): "
                                   f"rerun {' '.join(process.args)}")
            info = json.loads((out / f"{task}{suffix}" / "eval_info.json").read_text())
            successes = [bool(ok) for group in info["per_task"] for ok in group["metrics"]["successes"]]
            tasks[task] = {"per_seed": {str(10_000 + first + i): ok for i, ok in enumerate(successes)},
                           "seconds": round(time.perf_counter() - began, 1)}
            print(json.dumps({task: sum(successes) / len(successes), "episodes": len(successes)}), flush=True)
            if done is not None:
                done({task: tasks[task]})  # saved as each task completes: a killed run keeps the finished tasks
    command = _lerobot_task(lerobot_eval, policy, "TASK", episodes, 0, out)
    return {"tasks": tasks, "seconds": round(time.perf_counter() - started, 1),
            "command": " ".join(command[:1] + [c for c in command[1:] if not c.startswith("--output_dir")])}


def _task_result(per_seed: dict) -> dict:
    successes = sum(per_seed.values())
    return {"success_rate": successes / len(per_seed), "episodes": len(per_seed), "successes": successes,
            "per_seed": dict(sorted(per_seed.items()))}


def paired(first: dict, second: dict) -> dict:
    """Per task: episodes with the same seed in both arms, and how many had the same outcome."""
    out = {}
    for task in TASKS:
        a, b = first["tasks"].get(task, {}).get("per_seed", {}), second["tasks"].get(task, {}).get("per_seed", {})
        common = sorted(set(a) & set(b))
        out[task] = {"episodes": len(common), "same_outcome": sum(a[s] == b[s] for s in common),
                     "successes": [sum(a[s] for s in common), sum(b[s] for s in common)]}
    return out


def fingerprint(checkpoint: Path) -> str:
    """The weights' sha256 (first 16 hex digits): a retraining at the same path is another checkpoint."""
    digest = hashlib.sha256()
    with (checkpoint / "model.safetensors").open("rb") as weights:
        for block in iter(lambda: weights.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def training(checkpoint: Path) -> dict | None:
    """How the checkpoint was made, from the benchmark's results.json beside it (`metaworld_benchmark --work`)."""
    results = load_json(checkpoint.parent / "results.json")
    run = results.get(checkpoint.name)
    if not run:
        return None
    return {"recipe": "python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min "
                      f"{run['budget_min']:g} --steps_per_s {run['probe_steps_per_s']} --checkpoints 1",
            "max_steps": run["max_steps"], "train_seconds": run["train_seconds"],
            "recorded_frames": results.get("record", {}).get("frames")}


def adoptable(results: dict, earlier: dict) -> dict:
    """What an earlier output of a checkpoint this one reproduces lends: its arms' tasks this output lacks. The gate is
    the hf_vla arm: every task, every seed, the same outcome in both (a retraining on the same recording with the same
    seed and steps reproduces the weights on CPU; the earlier weights may be gone, so their sha256 cannot be compared).
    Tasks both ran are kept as here, their agreement on the seeds both ran reported."""
    ours, theirs = results.get("hf_vla", {}).get("tasks", {}), earlier.get("hf_vla", {}).get("tasks", {})
    differ = sorted(t for t in set(ours) | set(theirs)
                    if ours.get(t, {}).get("per_seed") != theirs.get(t, {}).get("per_seed"))
    if not ours or differ:
        raise SystemExit(f"the earlier output's hf_vla arm differs from this one's on {differ or 'every task'}: "
                         "another checkpoint, nothing adopted (run the hf_vla arm here first)")
    lent, agreement = {}, {}
    for arm in ("lerobot_eval", "hf_vla_as_lerobot"):
        here, there = results.get(arm, {}).get("tasks", {}), earlier.get(arm, {}).get("tasks", {})
        lent[arm] = {t: there[t] for t in TASKS if t in there and t not in here}
        for task in set(here) & set(there):
            common = set(here[task]["per_seed"]) & set(there[task]["per_seed"])
            same = sum(here[task]["per_seed"][s] == there[task]["per_seed"][s] for s in common)
            agreement.setdefault(arm, {})[task] = f"{same}/{len(common)}"
    hf_vla_episodes = sum(t["episodes"] for t in ours.values())
    return {"tasks": {arm: tasks for arm, tasks in lent.items() if tasks}, "agreement": agreement,
            "hf_vla_same_outcome": f"{hf_vla_episodes}/{hf_vla_episodes}"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--hf_vla_episodes", type=int, default=None, help="episodes per task of the hf_vla arm "
                        "(default --episodes; the paired comparison uses the seeds both ran)")
    parser.add_argument("--arms", default="hf_vla,lerobot_eval")
    parser.add_argument("--tasks", default=",".join(TASKS), help="the tasks to run this call; their results replace "
                        "those tasks' in the output and the other tasks' stay, so an arm can be run a few tasks at a time")
    parser.add_argument("--first_episode", type=int, default=0, help="lerobot_eval: start at episode (seed 10000 +) "
                        "this; its episodes are added to those the output holds for the task, so 50 can be run as 10 + 40")
    parser.add_argument("--jobs", type=int, default=1, help="lerobot_eval: tasks run at once, one thread each")
    parser.add_argument("--work", default=str(REPO / "data_cache" / "lerobot_crosscheck"))
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "lerobot_eval_crosscheck_cpu.json"))
    parser.add_argument("--adopt", default=None, help="an earlier output (e.g. `git show REV:PATH > F`) whose "
                        "hf_vla arm this checkpoint reproduces seed for seed: its arms' tasks this output lacks are "
                        "added, with where they came from (`adopted`)")
    parser.add_argument("--replace", action="store_true", help="start --output anew when it holds another "
                        "checkpoint's results (refused otherwise: arms of two checkpoints are not one comparison)")
    args = parser.parse_args(argv)
    checkpoint, work, output = Path(args.checkpoint), Path(args.work), Path(args.output)
    work.mkdir(parents=True, exist_ok=True)
    results, weights = load_json(output), fingerprint(checkpoint)
    if results and results.get("weights_sha256") != weights:
        if not args.replace:
            parser.error(f"{output} holds results of checkpoint weights {results.get('weights_sha256')}, not "
                         f"{checkpoint}'s {weights}: pass --replace to start it anew, or another --output")
        results = {}
    results["weights_sha256"] = weights
    if made := training(checkpoint):
        results["training"] = made
    tasks = [t for t in args.tasks.split(",") if t]
    results |= {"checkpoint": str(checkpoint), "seeds": "10000 + i for episode i of each task, in every arm"}
    if not isinstance(results.get("episodes_per_task"), dict):
        results["episodes_per_task"] = {}
    def save(arm: str, new_tasks: dict, seconds: float) -> None:
        before = results.get(arm, {})
        merged = before.get("tasks", {}) | new_tasks  # this call's tasks replace theirs, the others stay
        results[arm] = {**_summary(merged), "seconds": round(before.get("seconds", 0) + seconds, 1)}
        counts = {t["episodes"] for t in merged.values()}
        results["episodes_per_task"][arm] = counts.pop() if len(counts) == 1 else {n: t["episodes"]
                                                                                  for n, t in merged.items()}
        for first, second in itertools.combinations(("lerobot_eval", "hf_vla", "hf_vla_as_lerobot"), 2):
            if first in results and second in results:
                results.setdefault("paired_agreement", {})[f"{first}_vs_{second}"] = paired(results[first],
                                                                                          results[second])
        output.write_text(json.dumps(results, indent=2) + "\n")

    def lerobot_done(new: dict) -> None:
        kept = results.get("lerobot_eval", {}).get("tasks", {}) if args.first_episode else {}
        merged = {}
        for task, result in new.items():
            earlier = {s: ok for s, ok in kept.get(task, {}).get("per_seed", {}).items()
                       if int(s) < 10_000 + args.first_episode}
            merged[task] = _task_result(earlier | result["per_seed"]) | {
                "seconds": round(result["seconds"] + (kept.get(task, {}).get("seconds", 0) if earlier else 0), 1)}
        save("lerobot_eval", merged, sum(r["seconds"] for r in new.values()))  # each task on its own core

    if args.adopt:
        lent = adoptable(results, load_json(Path(args.adopt)))
        for arm, new_tasks in lent["tasks"].items():
            save(arm, new_tasks, sum(t.get("seconds", 0) for t in new_tasks.values()))
        results["adopted"] = {"from": args.adopt, "earlier_weights_sha256": load_json(Path(args.adopt)).get(
            "weights_sha256"), **{k: v for k, v in lent.items() if k != "tasks"},
            **{arm: sorted(tasks) for arm, tasks in lent["tasks"].items()}}
        output.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results["adopted"]), flush=True)
    for arm in filter(None, args.arms.split(",")):
        episodes = args.hf_vla_episodes or args.episodes if arm == "hf_vla" else args.episodes
        if arm == "lerobot_eval":
            new = lerobot_arm(checkpoint, episodes, work / arm, tasks, args.first_episode, args.jobs, lerobot_done)
            results["command"] = new["command"]
            output.write_text(json.dumps(results, indent=2) + "\n")
        else:
            new = hf_vla_arm(checkpoint, episodes, work / arm, lerobot_settings=arm != "hf_vla", task_names=tasks)
            save(arm, new["tasks"], new["seconds"])
        print(json.dumps({arm: results[arm]["mean_success"]}), flush=True)

if __name__ == "__main__":
    main()
