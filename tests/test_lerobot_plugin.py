"""lerobot's tools run hf_vla checkpoints through the `lerobot_policy_hf_vla` plugin (#75, the first door).

Oracle: hf_vla's own runner (`load_policy`, what `hf_vla.evaluate` and `hf_vla.serve` run) on the original
checkpoint; lerobot's side is its own discovery (`register_third_party_plugins`), factory (`get_policy_class`,
`make_policy`, `make_pre_post_processors`) and, in the last test, the `lerobot-eval` command.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, colorreach_run

from hf_vla.convert import main as convert_main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def plugin_dir(checkpoint: Path, output: Path, *flags: str) -> Path:
    convert_main(["--input", str(checkpoint), "--to", "lerobot_plugin", "--output", str(output), *flags])
    return output


def lerobot_policy(directory: Path):
    """What lerobot-eval / lerobot-record do with `--policy.path=directory`: discover plugins, read the config, build
    the policy class its type names and the processors saved beside it."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()
    config = PreTrainedConfig.from_pretrained(directory)
    policy = get_policy_class(config.type).from_pretrained(directory)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(directory))
    return policy, pre, post


def lerobot_frame(image: np.ndarray) -> torch.Tensor:
    """An env's uint8 HWC frame as lerobot's `preprocess_observation` hands it on: float CHW in [0, 1]."""
    return torch.from_numpy(image).permute(2, 0, 1).float() / 255.0


@pytest.fixture(scope="module")
def colorreach(tmp_path_factory):
    base = tmp_path_factory.mktemp("plugin_colorreach")
    run, _ = colorreach_run(base, 20)
    return run, plugin_dir(run, base / "lerobot")


@pytest.fixture(scope="module")
def two_cameras(tmp_path_factory):
    """A 2-step run on DROID-shaped data with two cameras (exterior, wrist) at 32 px."""
    from hf_vla.data.synthetic import DROID_CAMERAS, DroidLike, droid_dataset_config, write_droid_like
    from hf_vla.train import main as train_main

    base = tmp_path_factory.mktemp("plugin_two_cameras")
    cameras = list(DROID_CAMERAS[1:])
    data = write_droid_like(base / "data", DroidLike(episodes=4, mean_length=30, cameras=cameras, state_dim=2,
                                                     action_dim=2), progress=False)
    dataset = droid_dataset_config(data, keep_ranges=False) | {"cameras": cameras}
    run = base / "run"
    train_main([str(REPO / "configs/demo.json"), "--datasets", json.dumps([dataset]), "--output_dir", str(run),
                "--generate_demo_data", "false", "--validation_ratio", "0", "--per_device_train_batch_size", "4",
                "--stream_open_blocks", "2", "--max_steps", "2", "--warmup_steps", "0", "--disable_tqdm", "true",
                "--rollout_env", "null", "--max_episode_steps", "null"])
    return run, plugin_dir(run, base / "lerobot"), cameras


def test_installing_hf_vla_installs_the_plugin_lerobot_discovers(colorreach):
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class
    from lerobot.utils.import_utils import register_third_party_plugins

    distribution = importlib.metadata.distribution("lerobot_policy_hf_vla")  # the name lerobot's discovery looks for
    assert distribution.version
    register_third_party_plugins()
    assert "hf_vla" in PreTrainedConfig.get_known_choices()
    assert get_policy_class("hf_vla").__name__ == "HFVLAPolicy"
    _, directory = colorreach
    config = json.loads((directory / "config.json").read_text())
    assert config["type"] == "hf_vla" and config["checkpoint"] == "../run"  # relative: the pair moves together
    assert {p.name for p in directory.iterdir()} >= {"policy_preprocessor.json", "policy_postprocessor.json"}


def test_lerobot_runs_a_colorreach_checkpoint_as_hf_vla_does(colorreach):
    from hf_vla.envs.reach import ColorReachEnv
    from hf_vla.serving.policy import load_policy

    run, directory = colorreach
    policy, pre, post = lerobot_policy(directory)
    runner = load_policy(run, seed=0)  # the plugin's runner draws its noise from the same seed
    env = ColorReachEnv(image_size=24)
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        task = env.unwrapped.task
        batch = {"observation.image": lerobot_frame(obs["observation.image"]),
                 "observation.state": torch.from_numpy(obs["observation.state"]), "task": task}
        chunk = post(policy.predict_action_chunk(pre(batch)))
        expected = runner(obs, task)
        assert chunk.shape == (1, *expected.shape) and chunk.dtype == torch.float32
        np.testing.assert_allclose(chunk[0].numpy(), expected, atol=1e-5, rtol=0)  # robot units (un-normalised)
    # select_action executes the contract's n_action_steps of one chunk, then predicts the next
    contract = json.loads((run / "deployment_config.json").read_text())
    steps = contract["n_action_steps"]
    policy.reset(), runner.reset()
    obs, _ = env.reset(seed=7)
    batch = pre({"observation.image": lerobot_frame(obs["observation.image"]),
                 "observation.state": torch.from_numpy(obs["observation.state"]), "task": env.unwrapped.task})
    expected = runner(obs, env.unwrapped.task)
    executed = [post(policy.select_action(batch))[0].numpy() for _ in range(steps)]
    np.testing.assert_allclose(np.stack(executed), expected[:steps], atol=1e-5, rtol=0)
    assert policy.n_action_steps == steps and not policy._queue
    following = runner(obs, env.unwrapped.task)  # a new chunk with the next noise
    np.testing.assert_allclose(post(policy.select_action(batch))[0].numpy(), following[0], atol=1e-5, rtol=0)


def test_lerobot_runs_best_of_n_as_hf_vla_does(colorreach):
    """`--policy.best_of=4` (lerobot's config override): the chunk hf_vla's runner picks among its 4 candidates."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    from hf_vla.envs.reach import ColorReachEnv
    from hf_vla.serving.policy import load_policy

    run, directory = colorreach
    lerobot_policy(directory)  # discovers the plugin
    config = PreTrainedConfig.from_pretrained(directory)
    config.best_of = 4
    config.__post_init__()
    policy = get_policy_class(config.type).from_pretrained(directory, config=config)
    pre, post = make_pre_post_processors(policy.config, pretrained_path=str(directory))
    runner = load_policy(run, seed=0, best_of=4)
    obs, _ = ColorReachEnv(image_size=24).reset(seed=3)
    task = "move to the red target"
    batch = {"observation.image": lerobot_frame(obs["observation.image"]),
             "observation.state": torch.from_numpy(obs["observation.state"]), "task": task}
    chunk = post(policy.predict_action_chunk(pre(batch)))
    np.testing.assert_allclose(chunk[0].numpy(), runner(obs, task), atol=1e-5, rtol=0)
    assert policy.runner.last_selection.index == runner.last_selection.index
    config.critic, config.selector = str(run), None  # a policy given as the critic: refused in one line
    with pytest.raises(ValueError, match="not a chunk critic"):
        get_policy_class(config.type).from_pretrained(directory, config=config)


def test_lerobot_runs_a_two_camera_checkpoint_by_key(two_cameras):
    from hf_vla.serving.policy import load_policy

    run, directory, cameras = two_cameras
    policy, pre, post = lerobot_policy(directory)
    runner = load_policy(run, seed=0)
    rng = np.random.default_rng(0)
    frames = {key: rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for key in cameras}
    state = rng.normal(size=2).astype(np.float32)
    expected = runner({**frames, "observation.state": state}, "open the drawer")
    # lerobot's batch in the other key order: cameras go to the checkpoint's slots by key
    batch = {key: lerobot_frame(frames[key]) for key in reversed(cameras)}
    batch |= {"observation.state": torch.from_numpy(state), "task": "open the drawer"}
    chunk = post(policy.predict_action_chunk(pre(batch)))[0].numpy()
    np.testing.assert_allclose(chunk, expected, atol=1e-5, rtol=0)
    runner.reset()
    swapped = runner({cameras[0]: frames[cameras[1]], cameras[1]: frames[cameras[0]], "observation.state": state},
                     "open the drawer")
    assert np.abs(swapped - expected).max() > 1e-4  # the two slots are not interchangeable: the key mapping matters


def test_a_feature_mismatch_is_refused_naming_both(colorreach, two_cameras):
    """lerobot-eval's own `make_policy` with Meta-World's features (`observation.image` 480 px, a 4-dim state)."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.envs.configs import MetaworldEnv
    from lerobot.policies.factory import make_policy
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()
    for (_, directory, *_), wanted in ((two_cameras, ["'observation.images.exterior_2_left'", "'observation.image'"]),
                                       (colorreach, ["state feature has 4 dims", "has 2"])):
        config = PreTrainedConfig.from_pretrained(directory)
        config.pretrained_path = directory
        with pytest.raises(ValueError) as refused:
            make_policy(config, env_cfg=MetaworldEnv(task="reach-v3"))
        message = str(refused.value)
        assert "\n" not in message and all(part in message for part in wanted), message


def test_lerobot_eval_scores_an_hf_vla_metaworld_checkpoint(tmp_path):
    """`lerobot-eval --policy.path=DIR --env.type=metaworld`, no other policy flag: lerobot's env (480 px frames, the
    checkpoint's 64 px crop-and-resize done by the plugin), lerobot's rollout loop and its JSON."""
    from hf_vla.envs.recording import RecordArguments, record
    from hf_vla.train import main as train_main

    data = tmp_path / "reach"
    record(RecordArguments(env="metaworld", output=data, task="reach", episodes=1, image_size=64),
           {"crop": [144, 96, 400, 352]}, progress=False)
    run = tmp_path / "run"
    dataset = {"root": str(data), "name": "metaworld", "cameras": ["observation.image"],
               "control_mode": "delta_xyz_gripper"}
    train_main([str(REPO / "configs/pi05_metaworld.json"), "--datasets", json.dumps([dataset]), "--output_dir",
                str(run), "--max_steps", "2", "--save_strategy", "no", "--validation_ratio", "0",
                "--stream_open_blocks", "2", "--per_device_train_batch_size", "4", "--warmup_steps", "0",
                "--disable_tqdm", "true", "--rollout_env", "null", "--max_episode_steps", "null",
                "--n_action_steps", "16"])
    directory = plugin_dir(run, tmp_path / "lerobot")
    lerobot_eval = Path(sys.executable).with_name("lerobot-eval")
    out = tmp_path / "eval"
    # as on a headless machine with nothing set: the plugin chooses EGL (the README's command carries no MUJOCO_GL)
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM", "DISPLAY")}
    env |= {"OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([str(lerobot_eval), f"--policy.path={directory}", "--env.type=metaworld",
                             "--env.task=reach-v3", "--eval.n_episodes=1", "--eval.batch_size=1",
                             f"--output_dir={out}", "--policy.device=cpu"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    info = json.loads((out / "eval_info.json").read_text())
    assert info["overall"]["n_episodes"] == 1 and 0.0 <= info["overall"]["pc_success"] <= 100.0, info["overall"]


def test_lerobot_records_with_the_checkpoint_as_its_policy(colorreach):
    """lerobot-record's and lerobot-rollout's loads: `make_policy` with the dataset's features (the ColorReach
    recording the checkpoint was trained on passes the checks) and `from_pretrained(path, config=...)`."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.datasets.lerobot_dataset import LeRobotDatasetMetadata
    from lerobot.policies.factory import get_policy_class, make_policy
    from lerobot.utils.import_utils import register_third_party_plugins

    register_third_party_plugins()
    run, directory = colorreach
    config = PreTrainedConfig.from_pretrained(directory)
    config.pretrained_path = directory
    policy = make_policy(config, ds_meta=LeRobotDatasetMetadata("local/color_reach", root=run.parent / "data"))
    assert type(policy).__name__ == "HFVLAPolicy" and policy.cameras[0]["key"] == "observation.image"
    rollout = get_policy_class("hf_vla").from_pretrained(directory, config=PreTrainedConfig.from_pretrained(directory))
    assert rollout.n_action_steps == policy.n_action_steps


def test_lerobot_runs_a_pi0_checkpoint(tmp_path):
    """transformers' pi0 trained by hf_vla (the demo config as pi0) through the same plugin."""
    from hf_vla.envs.reach import ColorReachEnv
    from hf_vla.serving.policy import load_policy

    config = json.loads((REPO / "configs/demo.json").read_text())
    config["policy"] = "pi0"
    config["model_config"].pop("tokenizer_max_length", None)  # pi0.5's field; transformers' pi0 has none
    (tmp_path / "pi0.json").write_text(json.dumps(config))
    run, _ = colorreach_run(tmp_path, 20, config=tmp_path / "pi0.json")
    assert json.loads((run / "config.json").read_text())["model_type"] == "pi0"
    policy, pre, post = lerobot_policy(plugin_dir(run, tmp_path / "lerobot"))
    runner = load_policy(run, seed=0)
    obs, _ = ColorReachEnv(image_size=24).reset(seed=2)
    task = "move to the red target"
    batch = {"observation.image": lerobot_frame(obs["observation.image"]),
             "observation.state": torch.from_numpy(obs["observation.state"]), "task": task}
    np.testing.assert_allclose(post(policy.predict_action_chunk(pre(batch)))[0].numpy(), runner(obs, task),
                               atol=1e-5, rtol=0)
