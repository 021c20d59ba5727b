"""Meta-World with a wrist camera beside the scene camera (#76): what a second camera costs to render and record.

    python -m benchmarks.closed_loop.metaworld_cameras --stage render          # ms per frame per camera, 96 / 128 px
    python -m benchmarks.closed_loop.metaworld_cameras --stage record          # the five-task recording, 1 and 2 cameras

`render`: in a process of its own (one GL context), `--steps` env steps of reach-v3 at each image size with corner2
alone and with corner2 + gripperPOV; per camera, the time of its render and resize (the fast-render setting, as
recording and evaluation use), and the whole env step. `record`: the five-task benchmark's record stage
(`--record_episodes` per task, 96 px) with each camera set into `--work`/<arm>, its seconds and frames; a success arm
trains on that recording (`metaworld_benchmark --stage hf_vla --work <work>/two_cameras`). Results are merged into
`benchmarks/results/metaworld_cameras_cpu.json` (`render`, `record`); the success-rate arms of the issue
(`five_task`, `object_centred`, `mt50`) go there too when measured.
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["render", "record"], required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--record_episodes", type=int, default=50)
    parser.add_argument("--work", default=str(REPO / "data_cache" / "metaworld_cameras"))
    parser.add_argument("--output", default=str(result_path("metaworld_cameras")))
    args = parser.parse_args(argv)
    output = Path(args.output)
    results = load_json(output)
    if args.stage == "render":
        results["render"] = stage_render(args.steps)
    else:
        results["record"] = stage_record(Path(args.work), args.record_episodes)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
