"""Closed-loop rollouts during training (hf_vla.training.rollouts) on the ColorReach demo: snapshots evaluated in a process of
their own, figures logged and in the model card, equal to evaluating the same weights afterwards; bad arguments
refused before training; a failed rollout is logged and training goes on."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from hf_vla.errors import ConfigError
from hf_vla.train import main as train_main
from hf_vla.training.arguments import parse_config

ENV = "hf_vla/ColorReach-v0"


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    from hf_vla.envs.generate import ensure_demo_dataset

    return ensure_demo_dataset(tmp_path_factory.mktemp("rollouts") / "data", episodes=6, seed=3)


def train(demo_data, out, *overrides):
    datasets = json.loads((REPO / "configs/demo.json").read_text())["datasets"]
    datasets[0]["root"] = str(demo_data)
    return train_main([str(REPO / "configs/demo.json"), "--datasets", json.dumps(datasets), "--output_dir", str(out),
                       "--generate_demo_data", "false", "--validation_ratio", "0", "--per_device_train_batch_size",
                       "4", "--stream_open_blocks", "2", "--logging_steps", "1", "--warmup_steps", "0",
                       "--disable_tqdm", "true", "--rollout_env", ENV, "--rollout_episodes", "2", *overrides])


def test_synchronous_rollouts_equal_evaluating_the_saved_weights(demo_data, tmp_path):
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    out = tmp_path / "run"
    trainer = train(demo_data, out, "--max_steps", "4", "--rollout_steps", "2", "--rollout_wait", "true")
    logged = [e for e in trainer.state.log_history if "rollout/step" in e]
    assert [e["rollout/step"] for e in logged] == [2, 4]
    assert all(set(e) >= {"rollout/ColorReach-v0/success", "rollout/success"} for e in logged)
    lines = [json.loads(line) for line in (out / "rollout_results.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2, 4] and lines[1]["result"]["episodes"] == 2
    # the step-4 snapshot is the final model: evaluating the saved model afterwards gives the same episodes
    again = evaluate_checkpoint(EvaluateArguments(out, env=ENV, episodes=2, seed=10_000, save_videos=0, device="cpu",
                                                  output_dir=tmp_path / "again"), progress=False)
    assert (again.success_rate, again.mean_steps) == (lines[1]["result"]["success_rate"], lines[1]["result"]["mean_steps"])
    snapshot = out / "_rollouts" / "step-4"
    assert not list(snapshot.glob("*.safetensors"))  # the weights are gone once evaluated, the figures stay
    assert (snapshot / "eval" / "eval_result.json").is_file() and list((snapshot / "eval").glob("*.gif"))
    # the snapshot carries the run's deployment contract, and the rollout ran with it
    assert json.loads((snapshot / "deployment_config.json").read_text()) == json.loads(
        (out / "deployment_config.json").read_text())
    assert lines[1]["result"]["settings"]["n_action_steps"] == {"value": 4, "source": "checkpoint"}
    assert [e["seed"] for e in lines[1]["result"]["episode_records"]] == [10_000, 10_001]
    card = (out / "README.md").read_text()
    assert "model-index" in card and "success_rate" in card and "weights of step 4" in card


@pytest.mark.slow
def test_asynchronous_rollout_is_awaited_at_the_end_and_a_failed_one_does_not_stop_training(demo_data, tmp_path,
                                                                                           caplog):
    out = tmp_path / "run"
    trainer = train(demo_data, out, "--max_steps", "3", "--rollout_steps", "2")
    logged = [e for e in trainer.state.log_history if "rollout/step" in e]
    assert [e["rollout/step"] for e in logged] == [2] and 0.0 <= logged[0]["rollout/success"] <= 1.0
    # an env argument the env does not take: the rollout process fails, the error is logged, training finishes
    out = tmp_path / "broken"
    trainer = train(demo_data, out, "--max_steps", "2", "--rollout_steps", "1", "--rollout_wait", "true",
                    "--rollout_env_kwargs", '{"no_such_argument": 1}')
    assert trainer.state.global_step == 2 and (out / "model.safetensors").is_file()
    assert not [e for e in trainer.state.log_history if "rollout/step" in e]
    assert "the rollout of step 1 failed" in caplog.text and "no_such_argument" in caplog.text


@pytest.mark.parametrize("overrides, message", [
    (["--rollout_env", ENV], "rollout_steps=None"),
    (["--rollout_env", ENV, "--rollout_steps", "5", "--rollout_episodes", "0"], "rollout_episodes=0"),
    (["--rollout_env", "hf_vla/Nope-v0", "--rollout_steps", "5"], "rollout_env='hf_vla/Nope-v0'"),
    (["--rollout_env", ENV, "--rollout_steps", "5", "--rollout_tasks", "reach"], "only a benchmark env"),
    (["--rollout_env", "libero", "--rollout_steps", "5", "--rollout_tasks", "libero_nope"], "'libero_nope' is not"),
    (["--rollout_env", "libero", "--rollout_steps", "5", "--rollout_tasks", "libero_goal/10"], "tasks 0..9"),
    (["--rollout_env", ENV, "--rollout_steps", "5", "--max_episode_steps", "30", "--rollout_env_kwargs",
      '{"max_episode_steps": 12}'], "rollout_env_kwargs max_episode_steps=12 contradicts max_episode_steps=30"),
])
def test_rollout_arguments_are_checked_before_anything_runs(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_config(REPO / "configs/demo.json", overrides)


def test_libero_without_its_package_is_one_line():
    pytest.importorskip("lerobot")
    try:
        import libero  # noqa: F401
        pytest.skip("LIBERO is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="pip install hf-libero"):
        parse_config(REPO / "configs/demo.json", ["--rollout_env", "libero", "--rollout_steps", "5",
                                                   "--rollout_tasks", "libero_spatial"])
    from hf_vla.evaluate import main

    with pytest.raises(ConfigError, match="pip install hf-libero"):
        main(["--checkpoint", "someone/policy", "--env", "libero", "--task", "libero_spatial"])


@pytest.mark.slow
def test_rollouts_under_a_two_process_fsdp2_launch(demo_data, tmp_path):
    """Every rank writes the snapshot together (FSDP2 gathers the shards), only the main process evaluates it, the
    others train on; the snapshot is the whole model (its rollout runs and equals evaluating the saved weights)."""
    import os
    import subprocess
    import sys

    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    settings = json.loads((REPO / "configs/demo.json").read_text())
    settings["datasets"][0]["root"] = str(demo_data)
    settings.update(output_dir=str(tmp_path / "run"), generate_demo_data=False, validation_ratio=0, max_steps=2,
                    per_device_train_batch_size=2, stream_open_blocks=2, warmup_steps=0, disable_tqdm=True,
                    rollout_env=ENV, rollout_steps=2, rollout_episodes=2, dataloader_num_workers=0)
    (tmp_path / "run.json").write_text(json.dumps(settings))
    result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                             str(REPO / "configs" / "accelerate" / "fsdp2.yaml"), "--num_processes", "2",
                             "--main_process_port", "29681", "-m", "hf_vla.train", str(tmp_path / "run.json")],
                            capture_output=True, text=True, cwd=REPO, timeout=900,
                            env=dict(os.environ, OMP_NUM_THREADS="1", HF_VLA_CPU_SHARDING="1"))
    assert result.returncode == 0, result.stderr[-5000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "rollout_results.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [2]
    again = evaluate_checkpoint(EvaluateArguments(tmp_path / "run", env=ENV, episodes=2, save_videos=0, device="cpu",
                                                  output_dir=tmp_path / "again"), progress=False)
    assert (again.success_rate, again.mean_steps) == (lines[0]["result"]["success_rate"], lines[0]["result"]["mean_steps"])
