"""Meta-World's other cameras beside the scene camera (#76): the wrist view `gripperPOV` rendered upright in every
frame, recorded as its own LeRobot video feature, and a two-camera checkpoint evaluated from its contract alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# In a process of its own (one GL context per process): the goal of reach, drawn pure green, projected through the
# wrist camera's pose and field of view at every step of the expert's episode, against where the frame shows it.
PROJECTION = r"""
import json, numpy as np
from hf_vla.envs.metaworld import MetaWorldEnv
env = MetaWorldEnv("reach-v3", image_size=64, cameras="corner2,gripperPOV", max_episode_steps=80)
obs, _ = env.reset(seed=0)
model, data = env.inner._env.model, env.inner._env.data
cam, goal = model.camera("gripperPOV").id, model.site("goal").id
model.site_rgba[goal] = [0, 1, 0, 1]
rows, done = [], False
while not done:
    frame = env.render_camera("gripperPOV").astype(int)
    mask = (frame[..., 1] > 150) & (frame[..., 0] < 90) & (frame[..., 2] < 90)
    local = data.cam_xmat[cam].reshape(3, 3).T @ (data.site_xpos[goal] - data.cam_xpos[cam])
    size = frame.shape[0]
    focal = size / 2 / np.tan(np.deg2rad(model.cam_fovy[cam]) / 2)
    u, v = size / 2 + focal * local[0] / -local[2], size / 2 - focal * local[1] / -local[2]
    ys, xs = np.nonzero(mask)
    rows.append({"pixels": int(mask.sum()), "projected": [float(u), float(v)], "depth": float(-local[2]),
                 "seen": [float(xs.mean()), float(ys.mean())] if mask.any() else None,
                 "keys": sorted(k for k in obs if k.startswith("observation.image")),
                 "shape": list(obs["observation.images.gripperPOV"].shape)})
    obs, _, done, truncated, _ = env.step(env.expert_action())
    done = done or truncated
print(json.dumps(rows))
"""


def test_the_wrist_view_is_upright_in_every_frame():
    result = subprocess.run([sys.executable, "-c", PROJECTION], capture_output=True, text=True, cwd=REPO,
                            timeout=600, env=dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl")))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert rows[0]["keys"] == ["observation.images.corner2", "observation.images.gripperPOV"]
    assert rows[0]["shape"] == [64, 64, 3]
    # frames where the goal is in view, whole (its projected centre well inside the 480 px frame)
    visible = [r for r in rows if r["seen"] and r["pixels"] > 200 and all(60 < c < 420 for c in r["projected"])]
    assert len(visible) >= 5, [r["pixels"] for r in rows]
    for row in visible:
        (u, v), (x, y) = row["projected"], row["seen"]
        assert abs(x - u) < 25 and abs(y - v) < 25, row  # where the camera's pinhole puts it, upright
        assert abs(y - (480 - v)) > abs(y - v) and abs(x - (480 - u)) > abs(x - u) or abs(u - 240) < 25, row


def test_two_cameras_record_train_and_evaluate_from_the_contract(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from hf_vla.errors import ConfigError
    from hf_vla.evaluation.runner import evaluate_checkpoint
    from hf_vla.train import main as train_main

    data = tmp_path / "reach"
    result = subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", "reach",
                             "--episodes", "1", "--output", str(data), "--image_size", "32",
                             "--cameras", "corner2,gripperPOV"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    keys = ["observation.images.corner2", "observation.images.gripperPOV"]
    dataset = LeRobotDataset("local/reach", root=data)
    assert [k for k in dataset.meta.video_keys] == keys
    frame = dataset[0]
    assert all(frame[key].shape == (3, 32, 32) for key in keys)
    assert float((frame[keys[0]] - frame[keys[1]]).abs().mean()) > 0.05  # two views, not one twice
    marker = json.loads((data / "meta" / "hf_vla_record.json").read_text())
    assert marker["env_kwargs"] == {"cameras": ["corner2", "gripperPOV"]}
    run = tmp_path / "run"
    spec = {"root": str(data), "name": "metaworld", "cameras": keys, "control_mode": "delta_xyz_gripper"}
    train_main([str(REPO / "configs/pi05_metaworld.json"), "--datasets", json.dumps([spec]), "--output_dir", str(run),
                "--max_steps", "2", "--save_strategy", "no", "--validation_ratio", "0", "--stream_open_blocks", "2",
                "--per_device_train_batch_size", "4", "--warmup_steps", "0", "--disable_tqdm", "true",
                "--max_episode_steps", "6"])
    contract = json.loads((run / "deployment_config.json").read_text())["heads"]["metaworld::delta_xyz_gripper"]
    assert [c["key"] for c in contract["cameras"]] == keys and contract["cameras"][1]["height"] == 32
    assert contract["benchmark"]["env_kwargs"] == {"cameras": ["corner2", "gripperPOV"]}
    evaluated = evaluate_checkpoint(run, episodes=1, save_videos=0, output_dir=tmp_path / "eval", progress=False)
    assert evaluated.tasks["reach-v3"].episodes == 1  # both cameras rendered by the env the contract names
    with pytest.raises(ConfigError, match="observation.images.gripperPOV"):
        evaluate_checkpoint(run, episodes=1, save_videos=0, output_dir=tmp_path / "eval1", progress=False,
                            cameras=["observation.images.corner2"])
    # a DAgger round of the two-camera policy records both cameras, with no camera flag
    from hf_vla.record import record

    record("metaworld", tmp_path / "round", episodes=1, strategy="dagger", policy=str(run), progress=False)
    round_data = LeRobotDataset("local/round", root=tmp_path / "round")
    assert list(round_data.meta.video_keys) == keys and round_data[0][keys[1]].shape == (3, 32, 32)
