"""CLI and configs: every config validates offline; overrides; errors naming the key; the demo env and main job."""

import json

import numpy as np
import pytest
import torch
from conftest import REPO

from hf_vla.train import main
from hf_vla.training.arguments import parse_config

CONFIGS = sorted((REPO / "configs").glob("*.json"))
RUNNABLE = CONFIGS


@pytest.mark.parametrize("config", RUNNABLE, ids=lambda p: p.name)
def test_every_config_validates_without_downloading(config):
    model_args, data_args, training_args = parse_config(config)
    assert data_args.datasets and training_args.max_steps > 0
    assert model_args.policy in ("pi0", "pi05")


PUBLISHED = {"lerobot/pi05_base", "lerobot/pi0_base", "lerobot/pi05_libero", "lerobot/pi05_droid"}  # on the Hub


def test_no_config_names_an_unpublished_checkpoint():
    for config in CONFIGS:
        start = json.loads(config.read_text()).get("model_name_or_path")
        assert start is None or start in PUBLISHED, (config.name, start)


def test_droid_recipe_is_the_published_one():
    model_args, data_args, args = parse_config(REPO / "configs/pi05_droid.json")
    droid = data_args.datasets[0]
    assert len(droid["cameras"]) == 3 and droid["fps"] == 15 and droid["keep_ranges"]
    assert droid["keep_ranges_key"] == "{recording_folderpath}--{file_path}"
    assert model_args.dtype == "bfloat16" and args.master_weights and args.push_to_hub
    assert (args.learning_rate, args.adam_beta2, args.warmup_steps) == (5e-5, 0.95, 1000)  # tests/test_configs.py


def test_overrides_on_top_of_the_json(tmp_path):
    model_args, data_args, args = parse_config(
        REPO / "configs/demo.json",
        ["--max_steps", "7", "--learning_rate=3e-4", "--model_config.chunk_size", "4", "--output_dir", str(tmp_path),
         "--bf16"],
    )
    assert args.max_steps == 7 and args.learning_rate == 3e-4 and args.output_dir == str(tmp_path)
    assert model_args.model_config["chunk_size"] == 4 and model_args.model_config["max_action_dim"] == 2
    assert args.bf16 is True


@pytest.mark.parametrize("overrides,match", [
    (["--max_stepz", "3"], r"command line: --max_stepz: unknown argument"),
    (["--loss_aggregation", "median"], "loss_aggregation='median'"),
    (["--policy", "pi9"], "policy='pi9'"),
    (["--datasets", '[{"root": "x", "cameras": ["c"], "camera": 1}]'], r"datasets\[0\]: unknown key\(s\) \['camera'\]"),
    (["--datasets", "[]"], "at least one LeRobot dataset"),
    (["--validation_ratio", "1.5"], "validation_ratio=1.5"),
])
def test_bad_configuration_names_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        parse_config(REPO / "configs/demo.json", overrides)


def test_missing_config_file_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        parse_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        parse_config(bad)


def test_color_reach_expert_succeeds_and_language_matters():
    from hf_vla.envs import COLORS, ColorReachEnv, expert_action

    env = ColorReachEnv()
    rng = np.random.default_rng(0)
    for episode in range(20):
        observation, info = env.reset(seed=episode)
        assert observation["observation.image"].shape == (32, 32, 3) and observation["observation.state"].shape == (2,)
        assert info["task"].startswith("move to the ") and env.goal in info["task"] and env.goal in COLORS
        assert len(env.targets) == 3 and env.goal in env.targets
        for _ in range(env.max_steps):
            observation, reward, terminated, truncated, info = env.step(expert_action(env, rng))
            if terminated or truncated:
                break
        assert terminated and info["is_success"] and reward == 1.0
    # the goal colour is drawn in the image
    observation, _ = env.reset(seed=3)
    colors = {tuple(c) for c in observation["observation.image"].reshape(-1, 3)}
    assert tuple(COLORS[env.goal]) in colors


def test_color_reach_random_starts_keep_clear_of_targets():
    from hf_vla.envs import ColorReachEnv

    env = ColorReachEnv()
    starts = []
    for episode in range(30):
        observation, _ = env.reset(seed=episode)
        starts.append(observation["observation.state"])
        assert min(np.linalg.norm(env.agent - p) for p in env.targets.values()) > 0.35
    # not a fixed start: the state alone must not tell how far the agent has gone toward its goal
    assert np.std(np.stack(starts), axis=0).min() > 0.3
    env = ColorReachEnv(start="center")
    assert np.array_equal(env.reset(seed=1)[0]["observation.state"], np.zeros(2, np.float32))


def test_demo_dataset_frames_match_env_renders_and_stale_data_is_rebuilt(tmp_path):
    """The demo video is lossless: decoded training frames equal what the env renders at evaluation."""
    from hf_vla.data.sources import DatasetConfig, LeRobotSource, VideoReader
    from hf_vla.envs import ColorReachEnv
    from hf_vla.envs.generate import ensure_demo_dataset

    root = ensure_demo_dataset(tmp_path / "data", episodes=2, seed=5)
    marker = root / "meta" / "hf_vla_demo.json"
    source = LeRobotSource(DatasetConfig(root=str(root), name="demo", cameras=["observation.image"],
                                         state_key="observation.state", action_key="action"), 0)
    env = ColorReachEnv()
    for episode in range(2):
        observation, _ = env.reset(seed=5 * 100_003 + episode)
        reader = VideoReader(*source.video_path(episode, "observation.image"), fps=10, image_size=32)
        for index in range(3):
            decoded = reader.frame(index).permute(1, 2, 0).numpy().astype(int)
            assert np.abs(decoded - observation["observation.image"].astype(int)).max() <= 2, (episode, index)
            assert np.allclose(source.episode_table(episode)["state"][index], observation["observation.state"])
            observation, *_ = env.step(source.episode_table(episode)["actions"][index])
        reader.close()
    stamp = marker.stat().st_mtime_ns
    assert ensure_demo_dataset(root, episodes=2, seed=5) == root and marker.stat().st_mtime_ns == stamp  # reused
    marker.write_text(json.dumps({"episodes": 2, "seed": 5}))  # written by an older generator
    ensure_demo_dataset(root, episodes=2, seed=5)
    assert json.loads(marker.read_text())["version"] >= 2
    (root / "tmpk3_x9qzw").mkdir()  # lerobot's encoding folder, left by a run killed while writing videos
    marker.unlink()
    ensure_demo_dataset(root, episodes=2, seed=5)
    assert marker.exists() and not (root / "tmpk3_x9qzw").exists()
    foreign = tmp_path / "mine"
    (foreign / "notes").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="not a demo dataset"):
        ensure_demo_dataset(foreign, episodes=2)
    assert (foreign / "notes").is_dir()


@pytest.mark.slow
def test_demo_main_job_end_to_end(tmp_path):
    """The README's main job at smoke size: generate data, train, evaluate closed-loop, load with AutoModel."""
    from hf_vla.demo import main as demo_main

    datasets = json.loads((REPO / "configs/demo.json").read_text())["datasets"]
    datasets[0]["root"] = str(tmp_path / "data")
    summaries = demo_main(["--episodes", "3", "--max_steps", "20", "--demo_episodes", "12", "--validation_ratio", "0.1",
                           "--output_dir", str(tmp_path / "out"), "--datasets", json.dumps(datasets),
                           "--disable_tqdm", "true"])
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary == summaries[0] and summary["episodes"] == 3 and 0.0 <= summary["success_rate"] <= 1.0
    assert (tmp_path / "data" / "meta" / "hf_vla_demo.json").exists()
    assert list((tmp_path / "out" / "rollouts").glob("*.gif"))
    from transformers import AutoModel

    assert type(AutoModel.from_pretrained(tmp_path / "out")).__name__ == "PI05ForConditionalGeneration"
    # the first-move benchmark runs on the checkpoint and reads headings the way the env's geometry says
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_decision", REPO / "benchmarks" / "closed_loop" / "demo_decision.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main([str(tmp_path / "out"), "--starts", "6"])
    assert result["starts"] == 6 and 0 <= result["first_move_accuracy"] <= 1 and result["chance"] == 1 / 3
    start = {"agent": np.zeros(2), "targets": {"red": np.array([-0.6, 0.6]), "blue": np.array([0.6, -0.6]),
                                               "green": np.array([0.6, 0.6])}}
    headings = np.array([[-0.1, 0.12], [0.3, -0.2], [0.2, 0.25]])
    assert bench.chosen_targets(headings, [start] * 3) == ["red", "blue", "green"]


def test_cli_trains_pi0_and_pi05(tmp_path, caplog):
    from test_data import CAM, make_dataset

    make_dataset(tmp_path / "data", 6)
    config = {
        "tokenizer": "tiny",
        "datasets": [{"root": str(tmp_path / "data"), "name": "toy", "cameras": [CAM], "control_mode": "joint"}],
        "max_steps": 3, "per_device_train_batch_size": 4, "report_to": [], "use_cpu": True, "save_strategy": "no",
        "disable_tqdm": True, "stream_open_blocks": 2,
    }
    from hf_vla.tiny import tiny_dit_config, tiny_vlm_config

    dims = {"vlm_config": tiny_vlm_config(), "dit_config": tiny_dit_config(), "chunk_size": 4, "max_state_dim": 8,
            "max_action_dim": 6}
    for policy in ("pi05", "pi0"):
        path = tmp_path / f"{policy}.json"
        path.write_text(json.dumps(config | {"policy": policy, "model_config": dims,
                                             "output_dir": str(tmp_path / policy)}))
        with caplog.at_level("WARNING", logger="hf_vla.train"):
            trainer = main([str(path)])
        assert trainer.state.global_step == 3
        # 2 real action dims under max_action_dim=6, from scratch: the user is told to shrink it
        assert "consider max_action_dim=2" in caplog.text
        caplog.clear()
        stats = json.loads((tmp_path / policy / "norm_stats.json").read_text())
        assert stats["head_names"] == ["arm_a::joint"]
        assert torch.isfinite(torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])).all()


def test_commands_print_their_results_not_library_noise(tmp_path):
    """Generating demo data and training print a progress bar, hf_vla's lines and the results: no FFmpeg encoder
    statistics, no datasets Map bars, no torchcodec traceback, no DeepSpeed accelerator or tokenizer-alignment
    warnings. `--verbose` brings the library logs back, and the run ends by saying where the model is."""
    import os
    import subprocess
    import sys

    def train(*extra):
        out = tmp_path / f"out{len(extra)}"
        datasets = json.dumps([{"root": str(tmp_path / f"data{len(extra)}"), "name": "color_reach",
                                "cameras": ["observation.image"], "state_key": "observation.state",
                                "action_key": "action", "control_mode": "delta_xy"}])
        result = subprocess.run(
            [sys.executable, "-m", "hf_vla.train", str(REPO / "configs/demo.json"), "--datasets", datasets,
             "--demo_episodes", "6", "--max_steps", "1", "--output_dir", str(out), *extra],
            capture_output=True, text=True, cwd=tmp_path, timeout=600,
            env=dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline"))
        assert result.returncode == 0, result.stderr[-3000:]
        return result, out

    result, out = train()
    noise = ("[libx264", "Map:", "torchcodec", "Setting accelerator to CPU", "PAD/BOS/EOS", "[mp4 @", "Traceback")
    for text in noise:
        assert text not in result.stderr + result.stdout, text
    assert len(result.stderr.replace("\r", "\n").splitlines()) < 60
    assert f"saved the trained model to {out}" in result.stdout
    train_metrics = json.loads((out / "train_results.json").read_text())  # the run's own rate, beside the weights
    assert train_metrics["train_steps_per_second"] > 0 and train_metrics["train_runtime"] > 0
    assert "trainable parameters: 1,127,522 of 1,258,850 (89.57%)" in result.stderr  # what trains, said once
    verbose, _ = train("--verbose")
    assert "[libx264" in verbose.stderr  # the library logs are only hidden


def test_help_lists_every_field_with_its_default_and_the_commands(capsys):
    import dataclasses

    from hf_vla.train import help_text
    from hf_vla.training.arguments import DataArguments, ModelArguments
    from hf_vla.training.trainer import VLATrainingArguments

    text = help_text()
    for kind in (ModelArguments, DataArguments, VLATrainingArguments):
        for item in dataclasses.fields(kind):
            if item.init and not item.name.startswith("_"):
                assert f"\n  --{item.name} (" in text, item.name
    for group in ("model (ModelArguments):", "data (DataArguments):", "hf_vla training (VLATrainingArguments):",
                  "transformers TrainingArguments"):
        assert group in text
    assert "--rollout_episodes (int, default: 10)" in text and "episodes per task and rollout" in text
    assert "--max_steps (int, default: 30000; hf_vla's default, transformers' is -1)" in text
    import hf_vla.__main__
    from hf_vla.record import cli as record

    with pytest.raises(SystemExit) as exited:  # in this process: `python -m` itself is tested in test_failures.py
        record(["--help"])
    shown = capsys.readouterr().out
    # a default (--takeover_steps'), and --verbose: every command takes it
    assert exited.value.code == 0 and "(default: 10)" in shown and "--verbose" in shown
    hf_vla.__main__.main()
    listed = capsys.readouterr().out
    for command in ("demo", "train", "evaluate", "serve", "record", "convert", "recap"):
        assert f"python -m hf_vla.{command} " in listed


def test_a_command_line_typo_is_the_command_line_s_and_one_dataset_field_can_be_overridden(tmp_path):
    from hf_vla.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^command line: --max_step: unknown argument \(did you mean 'max_step' -> "
                                          r"'max_steps'\?\)"):
        parse_config(REPO / "configs/demo.json", ["--max_step", "3"])
    _, data_args, _ = parse_config(REPO / "configs/demo.json", ["--datasets.0.weight", "2.5",
                                                                  "--datasets.0.cameras", '["observation.image"]'])
    assert data_args.datasets[0]["weight"] == 2.5 and data_args.datasets[0]["name"] == "color_reach"
    with pytest.raises(ConfigError, match=r"datasets is a list of 1 entry; use an index 0..0"):
        parse_config(REPO / "configs/demo.json", ["--datasets.3.weight", "2"])
    with pytest.raises(ConfigError, match=r"datasets\[0\].*camera"):
        parse_config(REPO / "configs/demo.json", ["--datasets.0.camera", "x"])


def test_hub_lines_are_printed_once():
    """huggingface_hub logs through its own handler and the root's: each retry line appeared twice."""
    import subprocess
    import sys

    script = ("import logging, hf_vla.train\nfrom hf_vla.cli import setup_logging\nsetup_logging()\n"
              "logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("Retrying in 1s [Retry 1/5].") == 1, result.stderr


def test_a_long_phase_writes_progress_to_a_log_that_is_not_a_terminal(monkeypatch, caplog):
    """Recording, evaluation, replay, annotation: a log file or pipe hears from a phase every PROGRESS_EVERY_S seconds
    (done/total, rate, time left), not only at its end."""
    import logging

    import hf_vla.cli as cli

    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)
    bar = cli._PhaseLine(10, "recording color_reach", "episodes")
    with caplog.at_level(logging.INFO, logger="hf_vla"):
        for _ in range(3):
            bar.update(1)
        bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and lines[0].startswith("recording color_reach: 1/10 episodes, ") and "s left" in lines[0]
    assert lines[-1].startswith("recording color_reach: 3/10 episodes in ")
