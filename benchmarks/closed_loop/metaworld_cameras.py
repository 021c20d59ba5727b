"""Meta-World with a wrist camera beside the scene camera (#76): what a second camera costs to render and record.

    python -m benchmarks.closed_loop.metaworld_cameras --stage render          # ms per frame per camera, 96 / 128 px
    python -m benchmarks.closed_loop.metaworld_cameras --stage record          # the five-task recording, 1 and 2 cameras
    python -m benchmarks.closed_loop.metaworld_cameras --stage probe           # each arm's 200-step probe, one machine
    TAG=hf_vla_4500 RATE=3.75
    # the five-task success arm with two cameras at its own probe's steps (3.75 steps/s with start-up: 4,500 steps in
    # 20 minutes, as the one-camera run's 4.78 gave it 5,700), then with TAG=hf_vla_5700 and RATE=4.78: at the
    # one-camera run's steps, more minutes than its own
    python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min 20 --checkpoints 1 \
        --steps_per_s $RATE --tag $TAG --work data_cache/metaworld_cameras/two_cameras \
        --output data_cache/metaworld_cameras/two_cameras/benchmark.json
    python -m benchmarks.closed_loop.metaworld_benchmark --stage evaluate --which hf_vla --checkpoint_episodes 0 \
        --episodes 50 --tag $TAG --work data_cache/metaworld_cameras/two_cameras \
        --output data_cache/metaworld_cameras/two_cameras/benchmark.json
    # the four object-centred tasks with two cameras (the MT50 recipe's flow-only arm at its one-camera run's steps):
    python -m hf_vla.record --env metaworld --task basketball,peg-insert-side,push,pick-place --episodes 50 \
        --output data_cache/mt50_4_cams --image_size 160 --cameras corner2,gripperPOV
    python -m benchmarks.closed_loop.metaworld_mt50_ablation --data data_cache/mt50_4_cams --work \
        data_cache/object_centred_cams --output data_cache/object_centred_cams/result.json --steps 2700 --settings flow_only
    python -m benchmarks.closed_loop.metaworld_cameras --stage collect         # the arms into the issue's schema

`render`: in a process of its own (one GL context), `--steps` env steps of reach-v3 at each image size with corner2
alone and with corner2 + gripperPOV; per camera, the time of its render and resize (the fast-render setting, as
recording and evaluation use), and the whole env step. `record`: the five-task benchmark's record stage
(`--record_episodes` per task, 96 px) with each camera set into `--work`/<arm>, its seconds and frames; a success arm
trains on that recording (`metaworld_benchmark --stage hf_vla --work <work>/two_cameras`). `probe`: on each arm's
recording, the recipe's 200-step probe one after the other, its rate with start-up (what a budget's steps are set
from) and its training loop's rate. Results are merged into `benchmarks/results/metaworld_cameras_cpu.json`
(`render`, `record`, `probe`). `collect`: the success arms in the issue's
schema (`five_task`, `object_centred`: `{"one_camera", "two_cameras"}`, each `{"mean_success", "tasks", "minutes",
"steps"}`, percent): a two-camera arm from its run above, a one-camera arm from its own run under `--work` when there
is one, else from the committed one-camera result of the same recipe (`metaworld_cpu.json`, the `flow_only` arm of
`metaworld_object_centred_cpu.json`), named in its `source`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, load_json, result_path

CAMERA_SETS = {"one_camera": "corner2", "two_cameras": "corner2,gripperPOV"}
# The two-camera five-task run at the one-camera run's steps (`metaworld_benchmark --tag hf_vla_5700 --steps_per_s
# 4.78`, the one-camera probe's rate): within the 20 minutes, and more of them than two cameras' own probe gives
EQUAL_STEPS_TAG = "hf_vla_5700"
# The two-camera five-task run at the steps of its own probe (`--stage probe`: 3.75 steps/s with start-up, as the
# one-camera run's 4.78 was measured; `--tag hf_vla_4500 --steps_per_s 3.75`): the equal-minutes arm
OWN_PROBE_TAG = "hf_vla_4500"

RENDER = r"""
import json, sys, time
import numpy as np
from hf_vla.envs.metaworld import MetaWorldEnv, render_to_observation
steps, out = int(sys.argv[1]), {}
# Every camera renders the 480 px frame (the fast-render setting: no shadows, reflections or multisampling; its
# context is made at the first render, after the setting) and is then resized: the size changes only the resize.
for size in (96, 128):
    for arm, cameras in (("one_camera", "corner2"), ("two_cameras", "corner2,gripperPOV")):
        env = MetaWorldEnv("reach-v3", image_size=size, cameras=cameras)
        env.reset(seed=0)
        inner, per_camera = env.inner._env, {"corner2": [], "gripperPOV": []}
        for _ in range(10):  # warm-up: the GL context and first renders
            env.step(np.zeros(4, np.float32))
        started = time.perf_counter()
        for _ in range(steps):
            env.step(np.zeros(4, np.float32))
        step_ms = 1000 * (time.perf_counter() - started) / steps
        for _ in range(steps):
            t = time.perf_counter()
            render_to_observation(np.flip(inner.render(), (0, 1)), None, size)  # lerobot's corner2 path
            per_camera["corner2"].append(time.perf_counter() - t)
            if arm == "two_cameras":
                t = time.perf_counter()
                render_to_observation(env.render_camera("gripperPOV"), None, size)
                per_camera["gripperPOV"].append(time.perf_counter() - t)
        out.setdefault(str(size), {})[arm] = {
            "env_step_ms": round(step_ms, 2),
            "render_ms": {name: round(1000 * float(np.median(v)), 2) for name, v in per_camera.items() if v}}
        env.close()
print(json.dumps(out))
"""


def stage_render(steps: int) -> dict:
    result = subprocess.run([sys.executable, "-c", RENDER, str(steps)], capture_output=True, text=True, cwd=REPO,
                            check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def stage_record(work: Path, episodes: int) -> dict:
    """The five-task benchmark's own record stage (`metaworld_benchmark --stage record`, per task, 96 px) once per
    camera set, each into `work/<arm>`: the recording a success arm then trains on (`--work work/<arm>`)."""
    out = {}
    for arm, cameras in CAMERA_SETS.items():
        target = work / arm
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchmarks.closed_loop.metaworld_benchmark", "--stage", "record",
                        "--work", str(target), "--record_episodes", str(episodes), "--cameras", cameras,
                        "--output", str(target / "benchmark.json")], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        recorded = load_json(target / "results.json")["record"]
        out[arm] = {"cameras": recorded["cameras"], "wall_seconds": round(time.perf_counter() - started, 1),
                    "record_seconds": recorded["seconds"], "frames": recorded["frames"],
                    "episodes_per_task": episodes, "expert_success": recorded["expert_success"]}
        print(json.dumps({arm: out[arm]}), flush=True)
    return out


def stage_probe(work: Path, steps: int) -> dict:
    """The five-task recipe's 200-step probe on each arm's recording (`work/<arm>`, from the record stage), one after
    the other on this machine: its wall-clock rate with start-up (what `metaworld_benchmark --stage hf_vla` sets its
    steps from) and the training loop's own rate (Trainer's `train_steps_per_second`)."""
    from benchmarks.closed_loop.metaworld_benchmark import probe

    out = {}
    for arm in CAMERA_SETS:
        measured = probe(work / arm, work / arm / "probe_rates", steps)
        out[arm] = {"steps": steps, "wall_seconds": round(measured["seconds"], 1),
                    "steps_per_s_with_start_up": round(measured["steps_per_s"], 2),
                    "loop_steps_per_s": round(measured["loop_steps_per_s"], 2),
                    "start_up_seconds": round(measured["start_up_seconds"], 1),
                    # the recording it trains on, as this machine made it (the record stage, or metaworld_benchmark's)
                    "recording_seconds": load_json(work / arm / "results.json").get("record", {}).get("seconds")}
        print(json.dumps({arm: out[arm]}), flush=True)
    return out


def _percent(rate: float) -> float:
    return round(100 * rate, 1)


def _five_task_arm(results: dict, source: str, tag: str = "hf_vla") -> dict | None:
    """A five-task run's final checkpoint (metaworld_benchmark's results: `tag`, its `closed_loop`)."""
    run = results.get(tag) or {}
    closed = run.get("closed_loop") or {}
    if not closed:
        return None
    def order(name: str) -> int:  # checkpoint-<step>[_<n>_episodes], or `final` (the run's own output, last)
        return int(name.split("-")[1].split("_")[0]) if name.startswith("checkpoint-") else 1 << 30

    last = closed[sorted(closed, key=order)[-1]]
    episodes = {r.get("episodes") for r in last["tasks"].values()} - {None}
    return {"mean_success": _percent(last["success_rate"]),
            "tasks": {task: _percent(r["success_rate"]) for task, r in last["tasks"].items()},
            "minutes": run["budget_min"], "steps": run["max_steps"], "train_seconds": run["train_seconds"],
            "probe_steps_per_s": run["probe_steps_per_s"], "episodes_per_task": max(episodes) if episodes else 50,
            "cameras": results.get("record", {}).get("cameras", ["observation.image"]), "source": source}


def _object_centred_arm(results: dict, source: str) -> dict | None:
    """The MT50 recipe's flow-only arm on the four tasks (metaworld_mt50_ablation's results)."""
    arm = (results.get("settings") or {}).get("flow_only")
    if not arm:
        return None
    return {"mean_success": _percent(arm["mean_success"]),
            "tasks": {task: _percent(rate) for task, rate in arm["tasks"].items()},
            "minutes": arm.get("budget_min") or round(arm["train_seconds"] / 60, 1),  # a run of --steps: its own
            "steps": arm["steps"], "train_seconds": arm["train_seconds"],
            "probe_steps_per_s": arm.get("probe_steps_per_s"), "episodes_per_task": arm["episodes_per_task"],
            "data": arm.get("data"), "source": source}


def stage_collect(work: Path, object_centred_work: Path) -> dict:
    def relative(path: Path) -> str:
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

    five, centred = {}, {}
    own = work / "one_camera" / "benchmark.json"
    five["one_camera"] = _five_task_arm(load_json(own), relative(own))
    own = work / "two_cameras" / "benchmark.json"
    two = load_json(own)
    # the arm at its own probe's steps when there is one, else at the one-camera run's, else the first run's
    runs = [(tag, _five_task_arm(two, relative(own), tag)) for tag in (OWN_PROBE_TAG, EQUAL_STEPS_TAG, "hf_vla")]
    runs = [(tag, arm) for tag, arm in runs if arm]
    five["two_cameras"] = runs[0][1] if runs else None
    what = {EQUAL_STEPS_TAG: ("two_cameras_at_one_camera_steps", "the one-camera run's steps: more minutes than its "
                                                                 "own probe gives"),
            "hf_vla": ("two_cameras_at_probe_steps", "the steps of its first 200-step probe")}
    for tag, arm in runs[1:]:
        if tag in what and arm["steps"] != five["two_cameras"]["steps"]:
            five[what[tag][0]] = dict(arm, what=what[tag][1])
    if five["one_camera"] is None:
        committed = result_path("metaworld")
        five["one_camera"] = _five_task_arm(load_json(committed), f"{relative(committed)} (the committed run)")
    own = object_centred_work / "result.json"
    centred["two_cameras"] = _object_centred_arm(load_json(own), relative(own))
    committed = result_path("metaworld_object_centred")
    centred["one_camera"] = _object_centred_arm(load_json(committed), f"{relative(committed)} (the committed run)")
    # the MT50 arm runs only where two cameras win both comparisons above
    wins = {name: arms["two_cameras"]["mean_success"] > arms["one_camera"]["mean_success"]
            for name, arms in (("five_task", five), ("object_centred", centred))
            if arms.get("two_cameras") and arms.get("one_camera")}
    mt50 = {"run": False, "two_cameras_win": wins,
            "why": "MT50 with two cameras runs only if two cameras win both the five-task and the object-centred arms"}
    return {"five_task": five, "object_centred": centred, "mt50": mt50}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["render", "record", "probe", "collect"], required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--record_episodes", type=int, default=50)
    parser.add_argument("--work", default=str(REPO / "data_cache" / "metaworld_cameras"))
    parser.add_argument("--object_centred_work", default=str(REPO / "data_cache" / "object_centred_cams"),
                        help="collect: the object-centred two-camera run's --work (its result.json)")
    parser.add_argument("--output", default=str(result_path("metaworld_cameras")))
    args = parser.parse_args(argv)
    output = Path(args.output)
    results = load_json(output)
    if args.stage == "render":
        results["render"] = stage_render(args.steps)
    elif args.stage == "record":
        results["record"] = stage_record(Path(args.work), args.record_episodes)
    elif args.stage == "probe":
        results["probe"] = stage_probe(Path(args.work), args.steps)
    else:
        results.update(stage_collect(Path(args.work), Path(args.object_centred_work)))
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
