"""The deployment contract (hf_vla.deployment.contract) and batched evaluation (hf_vla.envs.episodes).

A ColorReach policy recorded at 24 px with a 30-step limit and trained with n_action_steps 3: its checkpoint says so,
`hf_vla.evaluate` and `hf_vla.serve` take every such setting from it, and a flag that contradicts one is refused with
one line naming both values and the override. Batched evaluation gives every seed the outcome serial evaluation gives.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from PIL import Image

ENV = "hf_vla/ColorReach-v0"
HEAD = "color_reach::delta_xy"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A recording at 24 px (30-step episodes, seeds 0..) and a 2-step run with n_action_steps 3."""
    from conftest import colorreach_run

    return colorreach_run(tmp_path_factory.mktemp("contract"), 30, "--save_strategy", "steps", "--save_steps", "2",
                          "--n_action_steps", "3")[0]


def test_the_contract_is_filled_from_the_data_and_the_config(trained):
    contract = json.loads((trained / "deployment_config.json").read_text())
    assert contract["version"] == 1 and contract["policy"] == "pi05"
    assert contract["chunk_size"] == 8 and contract["n_action_steps"] == 3 and contract["image_size"] == 32
    assert contract["default_head"] == HEAD
    head = contract["heads"][HEAD]
    assert head["cameras"] == [{"key": "observation.image", "height": 24, "width": 24}]
    assert head["state"] == {"key": "observation.state", "dim": 2} and head["action"] == {"key": "action", "dim": 2}
    assert head["fps"] == 10.0 and head["control_mode"] == "delta_xy" and head["instruction"] == "task"
    assert head["benchmark"]["env"] == ENV and head["benchmark"]["max_episode_steps"] == 30
    assert head["benchmark"]["image_size"] == 24 and head["benchmark"]["data_seeds"][0] == 0
    # every checkpoint carries it, and the processor reads it back
    assert json.loads((trained / "checkpoint-2" / "deployment_config.json").read_text()) == contract
    from hf_vla.models.pi05 import PI05Processor

    assert PI05Processor.from_pretrained(trained).deployment == contract
    # plain JSON: readable by a Python without any site package (no torch, no hf_vla)
    read = subprocess.run([sys.executable, "-S", "-I", "-c", "import json, sys; print(json.load(open(sys.argv[1]))"
                           "['n_action_steps'])", str(trained / "deployment_config.json")], capture_output=True,
                          text=True, timeout=60)
    assert read.stdout.strip() == "3", read.stderr


def test_evaluate_takes_every_setting_from_the_checkpoint(trained, tmp_path):
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    result = evaluate_checkpoint(EvaluateArguments(trained, episodes=2, save_videos=1, output_dir=tmp_path, num_envs=1,
                                                   device="cpu"), progress=False)
    taken = {name: s["value"] for name, s in result.settings.items() if s["source"] == "checkpoint"}
    assert taken == {"env": ENV, "image_size": 24, "max_episode_steps": 30, "n_action_steps": 3,
                     "cameras": ["observation.image"], "head": HEAD, "control_mode": "delta_xy"}
    assert result.settings["seed"] == {"value": 10_000, "source": "default"}
    assert all(episode["steps"] <= 30 for episode in result.episode_records)
    assert [e["seed"] for e in result.episode_records] == [10_000, 10_001]
    gif = Image.open(result.videos[0])
    assert gif.size[0] == 24 * 11  # the env rendered at the recorded 24 px (GIF frames enlarged 11x to >= 256 px)
    saved = json.loads((tmp_path / "eval_result.json").read_text())
    assert saved["settings"]["image_size"] == {"value": 24, "source": "checkpoint"}
    assert saved["episode_records"][0].keys() >= {"seed", "success", "steps"}


def fails(capsys, argv) -> str:
    from hf_vla.evaluate import cli

    with pytest.raises(SystemExit) as exited:
        cli(argv)
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert exited.value.code == 2, lines
    assert lines[-1].startswith("hf_vla.evaluate: error: "), lines
    return lines[-1]


CONTRADICTIONS = [
    (["--image_size", "64"], "--image_size 64 contradicts the checkpoint, which was trained with image_size=24 "
                             "(deployment_config.json); drop the flag, or pass --override image_size"),
    (["--n_action_steps", "8"], "--n_action_steps 8 contradicts the checkpoint, which was trained with "
                                "n_action_steps=3"),
    (["--max_episode_steps", "100"], "--max_episode_steps 100 contradicts the checkpoint, which was trained with "
                                     "max_episode_steps=30"),
    (["--cameras", "observation.image", "observation.image"], "--cameras: ['observation.image'] given more than once"),
    (["--cameras", "observation.other"], "--cameras observation.other contradicts the checkpoint, which was trained "
                                         "with cameras=observation.image"),
    (["--seed", "0"], "--seed 0: episodes 0..1 overlap the env seeds 0..3 the training data was recorded with"),
    (["--override", "nope"], "argument --override: invalid choice: 'nope'"),
]


@pytest.mark.parametrize("argv,message", CONTRADICTIONS, ids=[a[0] for a, _ in CONTRADICTIONS])
def test_a_flag_that_contradicts_the_checkpoint_is_refused_before_the_model_loads(trained, capsys, monkeypatch, argv,
                                                                                  message):
    import transformers

    loads = []
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: loads.append(a))
    line = fails(capsys, ["--checkpoint", str(trained), "--episodes", "2", *argv])
    assert message in line, line
    assert loads == []


def test_an_override_is_accepted_and_recorded(trained, tmp_path):
    from hf_vla.evaluate import main

    main(["--checkpoint", str(trained), "--episodes", "1", "--image_size", "32", "--n_action_steps", "8", "--seed",
          "0", "--override", "image_size", "n_action_steps", "seed", "--output_dir", str(tmp_path), "--save_videos",
          "1", "--num_envs", "1"])
    settings = json.loads((tmp_path / "eval_result.json").read_text())["settings"]
    assert settings["image_size"] == {"value": 32, "source": "flag (override)"}
    assert settings["n_action_steps"] == {"value": 8, "source": "flag (override)"}
    assert settings["seed"] == {"value": 0, "source": "flag (override)"}
    gif = Image.open(next(tmp_path.glob("*.gif")))
    assert gif.size[0] == 32 * 8 and gif.size[1] > 32 * 8  # 32 px frames enlarged, the instruction in a band above
    band = np.asarray(gif.convert("RGB"))[: gif.size[1] - 32 * 8]
    assert (band.sum(-1) < 100).sum() > 50  # dark text pixels on the white band


def test_serve_takes_the_cameras_from_the_checkpoint_and_sends_the_contract(trained):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from test_serve import Server

    import hf_vla.envs  # noqa: F401

    running = Server("--checkpoint", str(trained))
    try:
        client = WebsocketClientPolicy(running.uri)
        metadata = client.get_server_metadata()
        assert metadata["deployment"] == json.loads((trained / "deployment_config.json").read_text())
        assert metadata["cameras"] == ["observation.image"]
        import gymnasium as gym

        observation, info = gym.make(ENV, image_size=24).reset(seed=10_000)
        extra = {"observation.extra": np.zeros((24, 24, 3), np.uint8)}  # a second image: not a slot of this policy
        assert client.infer({**observation, **extra, "prompt": info["task"]})["actions"].shape == (8, 2)
    finally:
        running.stop()
    for argv, message in ((["--num_camera_slots", "2"], "--num_camera_slots 2 contradicts the checkpoint, which was "
                                                         "trained with num_camera_slots=1"),
                          (["--cameras", "a", "b"], "--cameras a b: 2 camera(s), but the checkpoint was trained with 1 "
                                                    "(observation.image); pass --override cameras"),
                          (["--cameras", "a", "a"], "--cameras: ['a'] given more than once")):
        result = subprocess.run([sys.executable, "-m", "hf_vla.serve", "--checkpoint", str(trained), "--port", "0",
                                 *argv], capture_output=True, text=True, timeout=300, cwd=REPO)
        last = result.stderr.strip().splitlines()[-1]
        assert result.returncode == 2 and last.startswith("hf_vla.serve: error: ") and message in last, last


# ---- batched evaluation -------------------------------------------------------------------------------------------
class SeededWalker:
    """A policy whose chunks depend on the episode's seed and the observation: it finds the named target in the image
    and heads for it at a seed-dependent speed, except every fourth seed, which walks away. So episodes end at many
    different steps, some fail, and a slot that mixed up seeds, observations or chunks would show."""

    def __init__(self):
        self.seed = None

    def fork(self):
        return SeededWalker()

    def reset(self, seed=None):
        self.seed = seed

    def __call__(self, observation, task, inference_delay=0, executed_steps=None):
        from hf_vla.envs.reach import COLORS

        image = observation["observation.image"].astype(int)
        color = np.array(COLORS[task.split()[-2]])
        rows, cols = np.nonzero(np.abs(image - color).sum(-1) < 30)
        size = image.shape[0]
        goal = np.array([cols.mean() / ((size - 1) / 2) - 1, 1 - rows.mean() / ((size - 1) / 2)])
        delta = goal - observation["observation.state"]
        if self.seed % 4 == 0:
            delta = -delta
        speed = 0.02 + 0.08 * ((self.seed * 7) % 10) / 10
        step = delta / max(np.linalg.norm(delta), 1e-6) * speed
        return np.tile(step, (8, 1)).astype(np.float32)


def test_batched_episodes_equal_serial_ones_per_seed():
    from hf_vla.envs.worker import InWorker, make_gym
    from hf_vla.evaluation.runner import run_episodes

    serial = run_episodes(make_gym(ENV), SeededWalker(), range(500, 512), 2, progress=False)
    import functools

    workers = [InWorker(functools.partial(make_gym, ENV), name=ENV) for _ in range(3)]
    try:
        batched = run_episodes(workers, SeededWalker(), range(500, 512), 2, progress=False)
    finally:
        for worker in workers:
            worker.close()
    assert batched.episode_records == serial.episode_records and batched.num_envs == 3
    outcomes = {(e["success"], e["steps"]) for e in serial.episode_records}
    assert len(outcomes) >= 4 and 0 < serial.successes < 12  # the comparison is not between identical episodes


def test_batched_evaluation_of_a_checkpoint_equals_serial(trained, tmp_path):
    """The real policy through `evaluate_checkpoint`: 2 envs in workers and one batched forward per control step give
    each seed the success, steps and chunk-boundary figures of 1 env in this process."""
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    common = dict(episodes=4, save_videos=0, seed=20_000, device="cpu")
    one = evaluate_checkpoint(EvaluateArguments(trained, num_envs=1, output_dir=tmp_path / "one", **common),
                              progress=False)
    two = evaluate_checkpoint(EvaluateArguments(trained, num_envs=2, output_dir=tmp_path / "two", **common),
                              progress=False)
    assert [(e["seed"], e["success"], e["steps"]) for e in one.episode_records] == \
        [(e["seed"], e["success"], e["steps"]) for e in two.episode_records]
    assert two.boundary_jump == pytest.approx(one.boundary_jump, abs=1e-5)
    assert two.interior_jerk == pytest.approx(one.interior_jerk, abs=1e-5)
    assert two.settings["num_envs"] == {"value": 2, "source": "flag"}


def test_reading_a_contract_is_versioned_and_forward_compatible(tmp_path, caplog):
    """A field added later within the same version is ignored with a warning (an older hf_vla still runs the
    checkpoint); another version or a missing field is refused naming the file."""
    from hf_vla.deployment import contract as deployment

    base = {"version": 1, "policy": "pi05", "chunk_size": 8, "n_action_steps": 4, "image_size": 32, "heads": {}}
    (tmp_path / deployment.FILE_NAME).write_text(json.dumps(base | {"camera_rig": "later"}))
    with caplog.at_level("WARNING", logger="hf_vla.deployment.contract"):
        assert deployment.read(tmp_path).n_action_steps == 4
    assert "ignoring field(s) ['camera_rig']" in caplog.text
    for data, message in ((base | {"version": 2}, "deployment contract version 2; this hf_vla reads version 1"),
                          ({k: v for k, v in base.items() if k != "heads"}, "missing field(s) ['heads']"),
                          (base | {"n_action_steps": 9}, "n_action_steps=9: must be 1..chunk_size (8)")):
        (tmp_path / deployment.FILE_NAME).write_text(json.dumps(data))
        with pytest.raises(ValueError, match=re.escape(message)):
            deployment.read(tmp_path)
    assert deployment.read(tmp_path / "nowhere") is None and deployment.read(REPO) is None


def test_recordings_of_one_head_merge_and_a_differing_one_is_named(caplog):
    """One dataset per Meta-World task recorded alike merges into one benchmark (tasks and seeds of all, no warning);
    a dataset recorded with another crop or image size keeps the first's settings and the warning names both datasets
    and what differs (the contract would otherwise run the second task the first's way in silence)."""
    from hf_vla.deployment.contract import _merge_benchmarks

    reach = {"env": "metaworld", "tasks": ["reach-v3"], "image_size": 96, "data_seeds": [0, 49],
             "max_episode_steps": 200, "env_kwargs": {"crop": [144, 96, 400, 352]}}
    push = reach | {"tasks": ["push-v3"], "data_seeds": [0, 299]}
    with caplog.at_level("WARNING", logger="hf_vla.deployment.contract"):
        merged = _merge_benchmarks(reach, push, ("reach", "push"))
    assert merged["tasks"] == ["reach-v3", "push-v3"] and merged["data_seeds"] == [0, 299]
    assert merged["env_kwargs"] == {"crop": [144, 96, 400, 352]} and caplog.text == ""
    uncropped = push | {"env_kwargs": {}, "image_size": 128}
    with caplog.at_level("WARNING", logger="hf_vla.deployment.contract"):
        assert _merge_benchmarks(reach, uncropped, ("reach", "push_128")) == reach
    assert "datasets 'reach' and 'push_128'" in caplog.text
    assert "image_size: 96 vs 128" in caplog.text and "env_kwargs: {'crop': [144, 96, 400, 352]} vs {}" in caplog.text
    assert "keeps 'reach''s" in caplog.text
