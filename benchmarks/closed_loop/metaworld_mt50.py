"""Meta-World MT50 as published: one policy for all 50 tasks, success per difficulty group and the mean of the four
group means, hf_vla next to lerobot's trainer at the same budget, both evaluated by the same harness.

    python -m benchmarks.closed_loop.metaworld_mt50 --stage record                  # 50 tasks x 50 expert episodes, resumable
    python -m benchmarks.closed_loop.metaworld_mt50 --stage hf_vla --budget_min 45 --steps_per_s 3.0   # pi05_metaworld_mt50.json
    python -m benchmarks.closed_loop.metaworld_mt50 --stage lerobot --budget_min 45  # lerobot-train (ACT) on the same data
    python -m benchmarks.closed_loop.metaworld_mt50 --stage evaluate --episodes 5 --num_envs 2
    python -m benchmarks.closed_loop.metaworld_mt50 --stage longer --steps 20000     # hf_vla's run resumed to 20,000 steps
    python -m benchmarks.closed_loop.metaworld_mt50 --stage evaluate --which hf_vla_long --episodes 5 --num_envs 2
    OMP_NUM_THREADS=1 python -m benchmarks.closed_loop.metaworld_mt50 --stage augment   # hf_vla's run with image augmentation
    python -m benchmarks.closed_loop.metaworld_mt50 --stage evaluate --which hf_vla_aug --episodes 5 --num_envs 2

pi0.5's token objective on MT50 (issue #64): `--arm` trains one of the object-centred ablation's arms
(benchmarks/closed_loop/metaworld_mt50_ablation.py's SETTINGS: `fast_ki`, `fast_ki_locations`; the latter needs the recording's
`locations` column) into `<work>/hf_vla_<arm>`, at the steps of `--budget_min x --steps_per_s` (that arm's one-core
rate), and `--which hf_vla_<arm>` evaluates it:

    python -m benchmarks.closed_loop.metaworld_mt50 --stage hf_vla --arm fast_ki_locations --data data_cache/mt50_loc \
        --budget_min 45 --steps_per_s 2.3
    python -m benchmarks.closed_loop.metaworld_mt50 --stage evaluate --which hf_vla_fast_ki_locations --episodes 5 --num_envs 2 \
        --data data_cache/mt50_loc

The committed figures ran the two training stages side by side with OMP_NUM_THREADS=1 (one core each; 3.0 steps/s is
hf_vla's rate measured that way; ACT's came from its probe), then the evaluation with `--which hf_vla` and
`--which lerobot` side by side.

Stages share `--work` (default data_cache/mt50_bench, git-ignored; `--data` points at an existing recording) and
write `--output` (default benchmarks/results/metaworld_mt50_cpu.json):
`{"hf_vla": R, "lerobot": R, "record": {...}}`, each `R = {"groups": {easy, medium, hard, very_hard}, "average",
"tasks": {50 names: success}, "budget", "episodes_per_task", "seeds"}` (fractions in [0, 1]; `average` is the mean of
the group means, the published figure). Both policies run through `hf_vla.evaluate`'s episode engine on lerobot's
Meta-World wrapper, held-out seeds from 10,000, the recording's image size and the step limit of the hf_vla
checkpoint's deployment contract.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import load_json

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "pi05_metaworld_mt50.json"


def _save(output: Path, results: dict) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "tasks"} if isinstance(v, dict) else v
                      for k, v in results.items()}, indent=2))


def _dataset(data: Path, target_text_key: str | None = None) -> list[dict]:
    return [{"root": str(data), "name": "mt50", "cameras": ["observation.image"], "control_mode": "delta_xyz_gripper",
             **({"target_text_key": target_text_key} if target_text_key else {})}]


def _arm_overrides(arm: str | None) -> tuple[list[str], str | None]:
    """(train flags, target text column) of the object-centred ablation's arm `arm` (None: the recipe as it is)."""
    if arm is None:
        return [], None
    from metaworld_mt50_ablation import SETTINGS, TARGET_TEXT, override_flags

    if arm not in SETTINGS:
        raise SystemExit(f"--arm: unknown {arm!r}; known: {sorted(SETTINGS)}")
    return override_flags(SETTINGS[arm][1]), TARGET_TEXT.get(arm)


def stage_record(data: Path, episodes: int, image_size: int, results: dict) -> None:
    if not (data / "meta" / "hf_vla_record.json").exists():  # a rerun continues an interrupted recording
        subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", "mt50", "--episodes",
                        str(episodes), "--output", str(data), "--image_size", str(image_size)], check=True, cwd=REPO)
    marker = load_json(data / "meta" / "hf_vla_record.json")
    results["record"] = {"episodes_per_task": marker["episodes_per_task"], "image_size": marker["image_size"],
                         "seconds": marker["seconds"], "frames": marker["frames"], "shortfall": marker["shortfall"],
                         "expert_success": {n: t["kept"] / max(1, t["kept"] + t["rejected"])
                                            for n, t in marker["tasks"].items()}}


def _train(data: Path, out: Path, overrides: list[str], target_text_key: str | None = None) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_vla.train", str(CONFIG), "--datasets",
                    json.dumps(_dataset(data, target_text_key)),
                    "--output_dir", str(out), *overrides], check=True, cwd=REPO,
                   env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"))
    return time.perf_counter() - started


def stage_hf_vla(data: Path, work: Path, budget_min: float, results: dict, rate: float | None = None,
                 arm: str | None = None) -> None:
    from metaworld_mt50_ablation import peak_rss_gb

    name = "hf_vla" if arm is None else f"hf_vla_{arm}"
    arm_flags, target_text_key = _arm_overrides(arm)
    if rate is None:  # steps per second including start-up: a safe under-estimate of the run's rate
        probe_steps = 100
        rate = probe_steps / _train(data, work / f"{name}_probe", ["--max_steps", str(probe_steps),
                                                                   "--save_strategy", "no", *arm_flags],
                                    target_text_key)
    steps = int(rate * budget_min * 60 / 100) * 100
    out = work / name
    decay = max(1, steps // 4)
    resume = ["--resume_from_checkpoint", "true"] if list(out.glob("checkpoint-*")) else []
    seconds = _train(data, out, ["--max_steps", str(steps), "--save_steps", str(max(100, steps // 10 // 100 * 100)),
                                 "--lr_scheduler_kwargs", json.dumps({"num_decay_steps": decay, "min_lr_ratio": 0.1}),
                                 *arm_flags, *resume], target_text_key)
    results[f"{name}_train"] = {"budget_min": budget_min, "probe_steps_per_s": round(rate, 3), "max_steps": steps,
                                "train_seconds": round(seconds, 1), "peak_rss_gb": peak_rss_gb(),
                                **({"arm": arm, "overrides": arm_flags} if arm else {})}


def stage_longer(data: Path, work: Path, steps: int, results: dict) -> None:
    """hf_vla's run continued past its budget: a copy of `<work>/hf_vla` resumed from its last checkpoint (weights,
    optimizer, data stream) to `steps` in all, the warmup-stable-decay schedule rebuilt for them (its last quarter
    decays, so the learning rate returns to its peak at the resumed step), as a user trains a run longer."""
    import shutil

    source, out = work / "hf_vla", work / "hf_vla_long"
    if not out.exists():
        last = max(source.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        shutil.copytree(source, out, ignore=lambda folder, names: [n for n in names if n.startswith("checkpoint-")
                                                                   and Path(folder) == source and n != last.name])
    seconds = _train(data, out, ["--max_steps", str(steps), "--save_steps", "1000", "--lr_scheduler_kwargs",
                                 json.dumps({"num_decay_steps": steps // 4, "min_lr_ratio": 0.1}),
                                 "--resume_from_checkpoint", "true"])
    results["hf_vla_long_train"] = {"resumed_from_step": results.get("hf_vla_train", {}).get("max_steps"),
                                    "max_steps": steps, "train_seconds": round(seconds, 1)}


def stage_augment(data: Path, work: Path, results: dict) -> None:
    """The 45-minute hf_vla run again with openpi's training-time image augmentation (`--image_augmentation openpi`):
    the same steps, schedule and data, into `<work>/hf_vla_aug`."""
    base = results.get("hf_vla_train")
    if not base:
        raise SystemExit("--stage augment repeats --stage hf_vla's run with augmentation: run --stage hf_vla first")
    steps, out = base["max_steps"], work / "hf_vla_aug"
    resume = ["--resume_from_checkpoint", "true"] if list(out.glob("checkpoint-*")) else []
    seconds = _train(data, out, ["--max_steps", str(steps), "--save_steps", str(max(100, steps // 10 // 100 * 100)),
                                 "--lr_scheduler_kwargs", json.dumps({"num_decay_steps": max(1, steps // 4),
                                                                      "min_lr_ratio": 0.1}),
                                 "--image_augmentation", "openpi", *resume])
    results["hf_vla_aug_train"] = {"max_steps": steps, "image_augmentation": "openpi",
                                   "train_seconds": round(seconds, 1),
                                   "threads": os.environ.get("OMP_NUM_THREADS", "default")}


def stage_lerobot(data: Path, work: Path, budget_min: float, results: dict, policy: str = "act",
                  batch: int = 32, chunk: int = 16, n_action_steps: int = 8, rate: float | None = None) -> None:
    """lerobot-train from scratch on the same recording for the same wall-clock budget (steps from a probe)."""

    def run(steps: int, output: Path, save: bool) -> float:
        started = time.perf_counter()
        command = ["lerobot-train", f"--policy.type={policy}", "--policy.device=cpu", "--policy.push_to_hub=false",
                   "--dataset.repo_id=local/mt50", f"--dataset.root={data.resolve()}",
                   "--dataset.video_backend=pyav",  # torchcodec needs system FFmpeg libraries, PyAV bundles its own
                   f"--batch_size={batch}",
                   f"--steps={steps}", f"--output_dir={output}", "--wandb.enable=false", f"--save_freq={steps}",
                   f"--save_checkpoint={'true' if save else 'false'}", "--num_workers=1", "--log_freq=100"]
        if policy == "act":  # nothing to download: no pretrained ResNet
            command += ["--policy.pretrained_backbone_weights=null", f"--policy.chunk_size={chunk}",
                        f"--policy.n_action_steps={n_action_steps}"]
        subprocess.run([str(Path(sys.executable).parent / command[0]), *command[1:]], check=True, cwd=work,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
        return time.perf_counter() - started

    if rate is None:  # steps per second including start-up: a safe under-estimate of the run's rate
        probe_steps = 50
        rate = probe_steps / run(probe_steps, work / f"lerobot_{policy}_probe", save=False)
    steps = int(rate * budget_min * 60 / 100) * 100
    seconds = run(steps, work / f"lerobot_{policy}", save=True)
    results["lerobot_train"] = {"policy": policy, "budget_min": budget_min, "probe_steps_per_s": round(rate, 3),
                                "steps": steps, "train_seconds": round(seconds, 1), "batch_size": batch}


def _summary(result: dict, budget: dict, episodes: int, seed: int) -> dict:
    return {"groups": result["groups"], "average": result["average"],
            "tasks": {name: task["success_rate"] for name, task in result["tasks"].items()},
            "budget": budget, "episodes_per_task": episodes, "seeds": [seed, seed + episodes - 1]}


def _evaluate_hf_vla(work: Path, name: str, episodes: int, num_envs: int, save_videos: int = 3) -> tuple[dict, float]:
    """`python -m hf_vla.evaluate` on the checkpoint `<work>/<name>` into `<work>/eval/<name>`: (its eval_result.json,
    seconds). Env, the 50 tasks, image size, step limit and actions per chunk come from the deployment contract;
    `save_videos` as evaluate's flag (its default 3)."""
    started = time.perf_counter()
    out = work / "eval" / name
    subprocess.run([sys.executable, "-m", "hf_vla.evaluate", "--checkpoint", str(work / name), "--episodes",
                    str(episodes), "--num_envs", str(num_envs), "--save_videos", str(save_videos), "--output_dir",
                    str(out)], check=True, cwd=REPO)
    return json.loads((out / "eval_result.json").read_text()), round(time.perf_counter() - started, 1)


def stage_evaluate(data: Path, work: Path, episodes: int, num_envs: int, results: dict, which: str) -> None:
    seed = 10_000
    if which in ("both", "hf_vla"):
        result, seconds = _evaluate_hf_vla(work, "hf_vla", episodes, num_envs, save_videos=1)
        budget = dict(results.get("hf_vla_train", {}), eval_seconds=seconds)
        results["hf_vla"] = _summary(result, budget, episodes, seed)
    if which == "hf_vla_long":  # the run continued by --stage longer
        result, seconds = _evaluate_hf_vla(work, "hf_vla_long", episodes, num_envs)
        train = results.get("hf_vla_long_train", {})
        budget = dict(train, train_minutes_in_all=round((results.get("hf_vla_train", {}).get("train_seconds", 0)
                                                         + train.get("train_seconds", 0)) / 60, 1),
                      eval_seconds=seconds)
        results["hf_vla_long"] = _summary(result, budget, episodes, seed)
    if which == "hf_vla_aug":  # the run of --stage augment
        result, seconds = _evaluate_hf_vla(work, "hf_vla_aug", episodes, num_envs, save_videos=1)
        results["hf_vla_aug"] = _summary(result, dict(results.get("hf_vla_aug_train", {}), eval_seconds=seconds),
                                         episodes, seed)
    if which.startswith("hf_vla_") and which not in ("hf_vla_long", "hf_vla_aug"):  # an --arm's run
        result, seconds = _evaluate_hf_vla(work, which, episodes, num_envs, save_videos=1)
        results[which] = _summary(result, dict(results.get(f"{which}_train", {}), eval_seconds=seconds), episodes,
                                  seed)
    if which in ("both", "lerobot"):
        from benchmarks.common import LeRobotChunks  # the lerobot policy adapter both benchmarks share
        from hf_vla.envs import metaworld
        from hf_vla.evaluation.runner import BenchmarkResult, run_episodes
        from hf_vla.hub.resolve import resolve_contract

        contract = resolve_contract(str(work / "hf_vla")) if (work / "hf_vla").exists() else None
        limit = 500 if contract is None else next(iter(contract.heads.values()))["benchmark"]["max_episode_steps"]
        image = load_json(data / "meta" / "hf_vla_record.json")["image_size"]
        policy_dir = sorted((work / f"lerobot_{results['lerobot_train']['policy']}" / "checkpoints").glob(
            "*/pretrained_model"))[-1]
        policy = LeRobotChunks(policy_dir)
        started, tasks = time.perf_counter(), {}
        for name in metaworld.task_names("mt50"):
            env = metaworld.in_worker(name, image_size=image, max_episode_steps=limit)
            try:
                policy.policy.reset()
                steps = getattr(policy.policy.config, "n_action_steps", 8)
                tasks[name] = run_episodes(env, policy, range(seed, seed + episodes), steps, save_videos=1,
                                           output_dir=work / "eval" / "lerobot" / name, progress=False)
            finally:
                env.close()
        result = BenchmarkResult.from_tasks("metaworld", tasks)
        data_out = {"groups": result.groups, "average": result.average,
                    "tasks": {n: {"success_rate": r.success_rate} for n, r in result.tasks.items()}}
        budget = dict(results.get("lerobot_train", {}), eval_seconds=round(time.perf_counter() - started, 1))
        results["lerobot"] = _summary(data_out, budget, episodes, seed)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["record", "hf_vla", "longer", "augment", "lerobot", "evaluate"],
                        required=True)
    parser.add_argument("--work", default=str(REPO / "data_cache" / "mt50_bench"))
    parser.add_argument("--data", default=None, help="the MT50 recording (default: <work>/data)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "metaworld_mt50_cpu.json"))
    parser.add_argument("--record_episodes", type=int, default=50, help="expert episodes per task (lerobot's "
                        "metaworld_mt50 has 50)")
    parser.add_argument("--image_size", type=int, default=160, help="render size of the recording")
    parser.add_argument("--budget_min", type=float, default=120.0)
    parser.add_argument("--steps_per_s", type=float, default=None, help="training stages: a measured rate "
                        "(no probe, whose start-up makes it an under-estimate; fixed, a resumed run keeps its steps)")
    parser.add_argument("--lerobot_policy", default="act", choices=["act", "diffusion"])
    parser.add_argument("--episodes", type=int, default=10, help="evaluation episodes per task")
    parser.add_argument("--num_envs", type=int, default=1)
    parser.add_argument("--which", default="both", help="both, hf_vla, lerobot, hf_vla_long, hf_vla_aug or "
                        "hf_vla_<arm> (a run of --stage hf_vla --arm)")
    parser.add_argument("--arm", default=None, help="--stage hf_vla: train the recipe with this object-centred "
                        "ablation arm's overrides (fast_ki, fast_ki_locations) into <work>/hf_vla_<arm>")
    parser.add_argument("--steps", type=int, default=20_000, help="--stage longer: steps in all")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = (Path(args.data) if args.data else work / "data").resolve()  # the stages run from the repository root
    output = Path(args.output)
    results = load_json(output)
    before = json.loads(json.dumps(results))
    if args.stage == "record":
        stage_record(data, args.record_episodes, args.image_size, results)
    elif args.stage == "hf_vla":
        stage_hf_vla(data, work, args.budget_min, results, args.steps_per_s, args.arm)
    elif args.stage == "longer":
        stage_longer(data, work, args.steps, results)
    elif args.stage == "augment":
        stage_augment(data, work, results)
    elif args.stage == "lerobot":
        stage_lerobot(data, work, args.budget_min, results, args.lerobot_policy, rate=args.steps_per_s)
    else:
        if args.which not in ("both", "hf_vla", "lerobot") and not (work / args.which).is_dir():
            raise SystemExit(f"--which {args.which}: no run {work / args.which} to evaluate")
        stage_evaluate(data, work, args.episodes, args.num_envs, results, args.which)
    # stages may run side by side (hf_vla and lerobot train on one core each): write only what this stage changed
    # into the file as it is now, so the later stage does not drop the earlier one's keys
    merged = load_json(output)
    merged.update({key: value for key, value in results.items() if before.get(key) != value})
    _save(output, merged)


if __name__ == "__main__":
    main()
