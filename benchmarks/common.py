"""What the benchmark scripts share (run each as `python -m benchmarks.<kind>.<script>` from the repository root):
the repository's paths, JSON results, and the five-task Meta-World benchmark's tasks, data layout and evaluation (one
place, which every Meta-World study imports; no script imports another).

Folders: `speed/` (throughput and memory: data loading, model step, inference, serving, engines, DROID scale),
`closed_loop/` (success-rate studies in simulation: Meta-World, ColorReach, RL, DAgger, the token objective), `gpu/`
(what runs on a lent GPU machine). Results: `benchmarks/results/<study>_<device>.json` (`_cpu`, `_h100`, `_h200`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
TASKS = ["reach-v3", "push-v3", "button-press-topdown-v3", "drawer-open-v3", "door-open-v3"]
IMAGE = 96
CONFIG = REPO / "configs" / "pi05_metaworld.json"


def result_path(study: str, device: str = "cpu") -> Path:
    """`benchmarks/results/<study>_<device>.json`: the one naming scheme of the committed results."""
    return RESULTS / f"{study}_{device}.json"


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def recorded_cameras(data: Path) -> list[str]:
    """The camera keys of a Meta-World recording (`hf_vla.record --cameras`), in its order; `observation.image` for
    the scene camera alone (and before the recording exists)."""
    from hf_vla.deployment.contract import benchmark_of
    from hf_vla.evaluation.envs import env_camera_keys

    return env_camera_keys("metaworld", (benchmark_of(data) or {}).get("env_kwargs") or {})


def dataset_spec(work: Path, focus: list[str] | None = None, target_text_key: str | None = None,
                 control_mode: str = "delta_xyz_gripper") -> list[dict]:
    """One dataset per task, one normalisation head: the validation metrics come per task
    (`eval_by_dataset/<task>/mse`). `focus`: sample those tasks' frames (weight 1) and the others almost never
    (weight 0.001); every task stays in the mixture so the normalisation statistics, pooled over all five, are the
    ones a checkpoint trained on all five has. `control_mode`: the head's (`ee_position` for absolute targets)."""
    spec = [{"root": str(work / "data" / task), "name": task, "cameras": recorded_cameras(work / "data" / task),
             "robot_type": "metaworld", "control_mode": control_mode} for task in TASKS]
    for dataset in spec if focus else []:
        dataset["weight"] = 1.0 if dataset["name"] in focus else 0.001
    for dataset in spec if target_text_key else []:  # e.g. the recordings' object locations (token objective)
        dataset["target_text_key"] = target_text_key
    return spec


def evaluate(checkpoint: Path, episodes: int, max_steps: int, out: Path, tasks: list[str] | None = None) -> dict:
    # image size, episode limit and actions per chunk come from the checkpoint's deployment contract
    subprocess.run([sys.executable, "-m", "hf_vla.evaluate", "--checkpoint", str(checkpoint), "--env", "metaworld",
                    "--task", ",".join(tasks or TASKS), "--episodes", str(episodes), "--save_videos", "1",
                    "--output_dir", str(out)], check=True, cwd=REPO, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))  # 30 ms a step; with 2 threads beside an env: 150
    saved = json.loads((out / "eval_result.json").read_text())
    return {"success_rate": saved["success_rate"],
            "tasks": {name: {k: r[k] for k in ("success_rate", "episodes", "successes", "mean_steps")}
                      for name, r in saved["tasks"].items()}}


class LeRobotChunks:
    """A lerobot policy checkpoint (ACT here) as a chunk predictor for `hf_vla.evaluation.runner.run_episodes`: lerobot's own
    pre-processor (normalisation), `predict_action_chunk`, post-processor (un-normalisation), on the observation the
    hf_vla harness gives (lerobot's Meta-World wrapper, the recorded image size)."""

    def __init__(self, path: Path):
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors

        config = PreTrainedConfig.from_pretrained(path)
        self.policy = get_policy_class(config.type).from_pretrained(path).eval()
        self.pre, self.post = make_pre_post_processors(self.policy.config, pretrained_path=str(path))

    def __call__(self, observation: dict, task: str, inference_delay: int = 0, executed_steps=None):
        import torch

        image = torch.from_numpy(observation["observation.image"]).permute(2, 0, 1).float().div(255)[None]
        batch = {"observation.image": image, "observation.state": torch.from_numpy(observation["observation.state"])[None],
                 "task": [task]}
        with torch.no_grad():
            batch = self.pre(batch)
            chunk = self.policy.predict_action_chunk(batch)
            chunk = self.post(chunk)
        return chunk[0].cpu().numpy()


def evaluate_lerobot(path: Path, episodes: int, max_steps: int, out: Path, env_kwargs: dict | None = None) -> dict:
    from hf_vla.envs import metaworld
    from hf_vla.evaluation.runner import BenchmarkResult, run_episodes

    policy = LeRobotChunks(path)
    results = {}
    for task in TASKS:
        env = metaworld.in_worker(task, image_size=IMAGE, max_episode_steps=max_steps, **(env_kwargs or {}))
        try:
            policy.policy.reset()
            results[task] = run_episodes(env, policy, range(10_000, 10_000 + episodes), 8, save_videos=1,
                                         output_dir=out / task,
                                         progress=False)
        finally:
            env.close()
    result = BenchmarkResult.from_tasks("metaworld", results)
    return {"success_rate": result.success_rate,
            "tasks": {name: {"success_rate": r.success_rate, "episodes": r.episodes, "successes": r.successes,
                             "mean_steps": r.mean_steps} for name, r in result.tasks.items()}}



__all__ = ["CONFIG", "IMAGE", "REPO", "RESULTS", "TASKS", "LeRobotChunks", "dataset_spec", "evaluate", "evaluate_lerobot",
           "load_json", "result_path"]
