"""Meta-World's other cameras beside the scene camera (#76): the wrist view `gripperPOV` rendered upright in every
frame, recorded as its own LeRobot video feature, and a two-camera checkpoint evaluated from its contract alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, randomize_

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


KEYS = ["observation.images.corner2", "observation.images.gripperPOV"]


@pytest.fixture(scope="module")
def two_camera_run(tmp_path_factory):
    """One reach episode recorded with the scene and wrist cameras at 32 px, two training steps on it with rollouts
    during training (the trainer's own, with no camera flag: the recording's env settings). Returns (run, data)."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from hf_vla.train import main as train_main

    tmp = tmp_path_factory.mktemp("two_cameras")
    data = tmp / "reach"
    result = subprocess.run([sys.executable, "-m", "hf_vla.record", "--env", "metaworld", "--task", "reach",
                             "--episodes", "1", "--output", str(data), "--image_size", "32",
                             "--cameras", "corner2,gripperPOV"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    dataset = LeRobotDataset("local/reach", root=data)
    assert [k for k in dataset.meta.video_keys] == KEYS
    frame = dataset[0]
    assert all(frame[key].shape == (3, 32, 32) for key in KEYS)
    assert float((frame[KEYS[0]] - frame[KEYS[1]]).abs().mean()) > 0.05  # two views, not one twice
    marker = json.loads((data / "meta" / "hf_vla_record.json").read_text())
    assert marker["env_kwargs"] == {"cameras": ["corner2", "gripperPOV"]}
    run = tmp / "run"
    spec = {"root": str(data), "name": "metaworld", "cameras": KEYS, "control_mode": "delta_xyz_gripper"}
    train_main([str(REPO / "configs/pi05_metaworld.json"), "--datasets", json.dumps([spec]), "--output_dir", str(run),
                "--max_steps", "2", "--save_strategy", "no", "--validation_ratio", "0", "--stream_open_blocks", "2",
                "--per_device_train_batch_size", "4", "--warmup_steps", "0", "--disable_tqdm", "true",
                "--max_episode_steps", "6", "--rollout_env", "metaworld", "--rollout_tasks", "reach",
                "--rollout_steps", "2", "--rollout_episodes", "1", "--rollout_wait", "true"])
    return run, data


def test_two_cameras_record_train_and_evaluate_from_the_contract(two_camera_run, tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from hf_vla.errors import ConfigError
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    run, _ = two_camera_run
    contract = json.loads((run / "deployment_config.json").read_text())["heads"]["metaworld::delta_xyz_gripper"]
    assert [c["key"] for c in contract["cameras"]] == KEYS and contract["cameras"][1]["height"] == 32
    assert contract["benchmark"]["env_kwargs"] == {"cameras": ["corner2", "gripperPOV"]}
    rollout = json.loads((run / "rollout_results.jsonl").read_text())  # rollouts during training rendered both
    assert rollout["step"] == 2 and rollout["result"]["tasks"]["reach-v3"]["episodes"] == 1
    evaluated = evaluate_checkpoint(EvaluateArguments(run, episodes=1, save_videos=0, output_dir=tmp_path / "eval",
                                                      device="cpu"), progress=False)
    assert evaluated.tasks["reach-v3"].episodes == 1  # both cameras rendered by the env the contract names
    with pytest.raises(ConfigError, match="observation.images.gripperPOV"):
        evaluate_checkpoint(EvaluateArguments(run, episodes=1, save_videos=0, output_dir=tmp_path / "eval1",
                                              cameras=["observation.images.corner2"], device="cpu"), progress=False)
    # a DAgger round of the two-camera policy records both cameras, with no camera flag
    from hf_vla.envs.recording import RecordArguments, record

    record(RecordArguments(env="metaworld", output=tmp_path / "round", episodes=1, strategy="dagger", policy=str(run)),
           progress=False)
    round_data = LeRobotDataset("local/round", root=tmp_path / "round")
    assert list(round_data.meta.video_keys) == KEYS and round_data[0][KEYS[1]].shape == (3, 32, 32)


def test_a_two_camera_checkpoint_is_served_from_its_contract(two_camera_run, tmp_path):
    """`hf_vla.serve` fills both camera slots from the contract: openpi's client gets the chunk of hf_vla's runner on
    the recorded frames (the same noise), which the views swapped would change; `evaluate --server` plays the
    in-process episodes."""
    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from test_serve import Server

    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint
    from hf_vla.models.pi05 import PI05ForConditionalGeneration
    from hf_vla.serving.policy import load_policy

    trained, data = two_camera_run
    run = tmp_path / "random"  # random weights everywhere: two training steps leave the expert's gates near zero
    shutil.copytree(trained, run)
    randomize_(PI05ForConditionalGeneration.from_pretrained(run), seed=0, scale=0.1).save_pretrained(run)
    frame = LeRobotDataset("local/reach", root=data)[3]
    observation = {key: (frame[key].permute(1, 2, 0) * 255).round().byte().numpy() for key in KEYS}
    observation["observation.state"] = frame["observation.state"].numpy()
    task = frame["task"]
    common = dict(episodes=2, save_videos=0, seed=5, device="cpu")
    server = Server("--checkpoint", str(run), "--seed", "5")
    try:
        served = WebsocketClientPolicy(server.uri).infer({**observation, "prompt": task})["actions"]
        remote = evaluate_checkpoint(EvaluateArguments(server=server.uri, output_dir=tmp_path / "remote", **common),
                                     progress=False)
    finally:
        log = server.stop()
    expected = load_policy(run, seed=5)(observation, task)
    np.testing.assert_allclose(served, expected, rtol=0, atol=1e-5, err_msg=log[-2000:])
    swapped = load_policy(run, seed=5)({**observation, KEYS[0]: observation[KEYS[1]], KEYS[1]: observation[KEYS[0]]},
                                       task)
    assert np.abs(swapped - expected).max() > 1e-4  # the comparison tells the two views apart
    local = evaluate_checkpoint(EvaluateArguments(run, output_dir=tmp_path / "local", **common), progress=False)
    served_episodes, in_process = remote.tasks["reach-v3"].episode_records, local.tasks["reach-v3"].episode_records
    assert [(e["seed"], e["success"], e["steps"]) for e in served_episodes] == [
        (e["seed"], e["success"], e["steps"]) for e in in_process]


def test_rl_runs_a_two_camera_checkpoint_from_its_contract(two_camera_run, tmp_path):
    """hf_vla.rl's rollouts and held-out evaluation render both cameras with no env flag."""
    from hf_vla.rl.__main__ import main as rl_main

    run, _ = two_camera_run
    config = {"model_name_or_path": str(run), "num_envs": 2, "group_size": 2, "groups_per_update": 1,
              "max_steps": 1, "eval_episodes": 1, "eval_steps": 1, "save_strategy": "no", "learning_rate": 1e-3,
              "use_cpu": True, "report_to": [], "disable_tqdm": True}
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(config))
    rl_main([str(path), "--output_dir", str(tmp_path / "rl")])
    summary = json.loads((tmp_path / "rl" / "rl_result.json").read_text())
    assert summary["env"] == "metaworld" and summary["updates"] == 1 and summary["episodes"] == 2
