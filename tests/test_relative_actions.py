"""Normalisation modes and relative actions at training time: the dataset options, the statistics a head gets (against
lerobot's own `compute_relative_action_stats` over the same data), the refusals, and a training run whose checkpoint
carries them (processor, `norm_stats.json`, deployment contract) and acts in robot units with no flag.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_data import make_dataset

from hf_vla.data import WeightedDatasetMixture
from hf_vla.errors import ConfigError

CAM = "observation.images.cam"


def _named(root, state=None, action=None):
    """Give the toy dataset's state / action dims names (metadata only)."""
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    if state is not None:
        info["features"]["observation.state"]["names"] = state
    if action is not None:
        info["features"]["action"]["names"] = action
    path.write_text(json.dumps(info, indent=4))
    return root


@pytest.fixture(scope="module")
def arm(tmp_path_factory):
    """A toy arm: 3 state dims, 2 actions (a joint and the gripper), 6 episodes of varied, moving values."""
    root = make_dataset(tmp_path_factory.mktemp("relative") / "arm", 6, state_dim=3, action_dim=2)
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    for path in sorted((root / "data").rglob("*.parquet")):  # states and actions that differ frame to frame
        table = pq.read_table(path)
        n = table.num_rows
        state = rng.normal(0, 1, (n, 3)).astype(np.float32).cumsum(0)
        action = state[:, :2] + rng.normal(0, 0.3, (n, 2)).astype(np.float32)
        for name, values in (("observation.state", state), ("action", action)):
            index = table.column_names.index(name)
            table = table.set_column(index, name, pa.array(values.tolist(), type=table.schema.field(name).type))
        pq.write_table(table, path)
    _rewrite_stats(root)
    return _named(root, state=["shoulder.pos", "gripper.pos", "elbow.pos"], action=["shoulder.pos", "gripper.pos"])


def _rewrite_stats(root):
    """meta/stats.json recomputed for the edited values (lerobot's own stats functions)."""
    import pyarrow.parquet as pq
    from lerobot.datasets.compute_stats import get_feature_stats

    tables = [pq.read_table(p) for p in sorted((root / "data").rglob("*.parquet"))]
    path = root / "meta" / "stats.json"
    stats = json.loads(path.read_text())
    for key in ("observation.state", "action"):
        values = np.concatenate([np.asarray(t[key].to_pylist(), np.float64) for t in tables])
        computed = get_feature_stats(values, axis=0, keepdims=False)
        stats[key] = {name: np.asarray(value).tolist() for name, value in computed.items()}
    path.write_text(json.dumps(stats, indent=4))


def _spec(root, **extra):
    return {"root": str(root), "name": "arm", "cameras": [CAM], "robot_type": "arm", "control_mode": "joint"} | extra


def test_relative_statistics_are_lerobots_over_the_chunks_trained_on(arm):
    """lerobot's `compute_relative_action_stats` (every chunk inside one episode, minus the chunk's first state, the
    excluded gripper kept absolute) on the same data: the same mean/std/min/max; its histogram quantiles close to the
    exact ones."""
    from lerobot.datasets.compute_stats import compute_relative_action_stats
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    mixture = WeightedDatasetMixture([_spec(arm, relative_actions=True, normalization={"actions": "MEAN_STD"})],
                                     chunk_size=4)
    stats = mixture.norm_stats["arm::joint"]["actions"]
    assert stats["relative_mask"] == [True, False] and stats["mode"] == "MEAN_STD"
    assert "mode" not in mixture.norm_stats["arm::joint"]["state"]  # QUANTILES, the default
    data = LeRobotDataset("local/arm", root=arm)
    theirs = compute_relative_action_stats(data.hf_dataset, data.meta.features, chunk_size=4,
                                           exclude_joints=["gripper"])
    for name in ("mean", "std", "min", "max"):
        np.testing.assert_allclose(stats[name], theirs[name], rtol=1e-5, atol=1e-5, err_msg=name)
    width = np.asarray(theirs["max"]) - np.asarray(theirs["min"])
    for name in ("q01", "q99"):
        assert np.all(np.abs(np.asarray(stats[name]) - theirs[name]) <= 0.02 * width), name
    absolute = WeightedDatasetMixture([_spec(arm)], chunk_size=4).norm_stats["arm::joint"]["actions"]
    assert abs(stats["mean"][0] - absolute["mean"][0]) > 0.05  # the relative dim's statistics moved
    # the gripper (excluded) is absolute, but over the chunks' steps: close to the frames' own statistics
    assert abs(stats["mean"][1] - absolute["mean"][1]) < 0.1 * absolute["std"][1]


def test_an_explicit_mask_and_the_processor_targets(arm, tiny_tokenizer):
    """openpi's mask (`make_bool_mask(1, -1)`), and the processor's targets: each step minus the row's state on the
    masked dims, then normalised; predictions get the state added back."""
    from hf_vla import PI05Processor
    from hf_vla.tiny import tiny_pi05_config

    mixture = WeightedDatasetMixture([_spec(arm, relative_actions=[True, False])], chunk_size=4)
    stats = mixture.norm_stats["arm::joint"]
    assert stats["actions"]["relative_mask"] == [True, False]
    config = tiny_pi05_config()
    processor = PI05Processor.from_config(config, tiny_tokenizer, norm_stats=mixture.norm_stats)
    state = np.array([0.5, -1.0, 2.0], np.float32)
    chunk = np.stack([state[:2] + step for step in (0.1, 0.2, 0.3, 0.4)]).astype(np.float32)
    batch = processor(text="go", state=state, actions=chunk)
    relative = torch.from_numpy(chunk - np.array([state[0], 0.0], np.float32))
    torch.testing.assert_close(batch["actions"][0, :, :2], processor.normalize(relative, "actions", "arm::joint"))
    back = processor.unnormalize_actions(batch["actions"], state=torch.from_numpy(state)[None])
    torch.testing.assert_close(back[0], torch.from_numpy(chunk), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="predicts relative actions: pass the observation's state"):
        PI05Processor.from_config(config, tiny_tokenizer, norm_stats=mixture.norm_stats).unnormalize_actions(
            batch["actions"])


def test_relative_and_mode_settings_are_refused_in_one_line(arm, tmp_path):
    cases = [
        (dict(relative_exclude_joints=["wrist"], relative_actions=True), "relative_exclude_joints 'wrist' matches no "
                                                                         "action name; the action names are"),
        (dict(relative_actions=[True, True, True]), "the mask has 3 entries, the actions 2 dims"),
        (dict(relative_exclude_joints=["gripper"]), "relative_exclude_joints names action dims kept absolute with "
                                                    "relative_actions: true"),
        (dict(relative_actions="yes"), "relative_actions must be true/false or a list"),
        (dict(normalization={"actions": "ZSCORE"}), "normalization mode 'ZSCORE' is not one of"),
        (dict(normalization={"VISUAL": "MEAN_STD"}), "only IDENTITY is honoured"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            WeightedDatasetMixture([_spec(arm, **extra)], chunk_size=4)
    # a state that is not the action's joints at the same index
    import shutil

    swapped = tmp_path / "swapped"
    shutil.copytree(arm, swapped)
    _named(swapped, state=["gripper.pos", "shoulder.pos", "elbow.pos"])
    with pytest.raises(ConfigError, match=r"action dim 0 is 'shoulder.pos', which is state dim 1"):
        WeightedDatasetMixture([_spec(swapped, relative_actions=True)], chunk_size=4)
    # a relative dim past the state: no state value to offset from
    narrow = make_dataset(tmp_path / "narrow", 3, state_dim=1, action_dim=2)
    with pytest.raises(ConfigError, match="action dim 1 is relative but the state 'observation.state' has 1 dims"):
        WeightedDatasetMixture([_spec(narrow, relative_actions=[True, True])], chunk_size=4)
    # a statistic the mode needs that the data lacks (quantiles from the metadata, which has none here)
    bare = tmp_path / "bare"
    shutil.copytree(arm, bare)
    path = bare / "meta" / "stats.json"
    stats = json.loads(path.read_text())
    for key in ("observation.state", "action"):
        stats[key].pop("q10")
    path.write_text(json.dumps(stats))
    with pytest.raises(ConfigError, match=r"dataset 'arm': QUANTILE10 normalisation of actions \('action'\) needs "
                                          r"q10, which its meta/stats.json lacks"):
        WeightedDatasetMixture([_spec(bare, normalization={"actions": "QUANTILE10"}, quantile_stats="metadata")])
    # one head, two ways: refused
    with pytest.raises(ConfigError, match="its datasets differ in relative_actions"):
        WeightedDatasetMixture([_spec(arm, relative_actions=True), _spec(swapped, name="other")], chunk_size=4)


def test_a_relative_run_carries_its_pipeline_to_the_checkpoint(arm, tmp_path):
    """`python -m hf_vla.train` with `relative_actions` and MEAN_STD actions: the saved processor, norm_stats.json and
    deployment contract carry the mode and the mask, and the loaded checkpoint acts in robot units with no flag
    (the observation's state added back: a state moved on the relative joint moves the action by as much)."""
    from test_failures import base_config, write_config
    from transformers import AutoModel, AutoProcessor

    from hf_vla.train import cli

    out = tmp_path / "out"
    config = base_config(arm, out, max_steps=2)
    config["datasets"][0] |= {"relative_actions": True, "normalization": {"actions": "MEAN_STD"},
                              "robot_type": "arm", "control_mode": "joint"}
    config["model_config"]["max_state_dim"] = 4
    cli([str(write_config(tmp_path, config))])
    saved = json.loads((out / "norm_stats.json").read_text())["norm_stats"]["arm::joint"]["actions"]
    assert saved["relative_mask"] == [True, False] and saved["mode"] == "MEAN_STD"
    contract = json.loads((out / "deployment_config.json").read_text())["heads"]["arm::joint"]
    assert contract["relative_actions"] == [True, False]
    assert contract["normalization"] == {"state": "QUANTILES", "actions": "MEAN_STD"}
    model = AutoModel.from_pretrained(out).eval()
    processor = AutoProcessor.from_pretrained(out)
    image = np.zeros((48, 64, 3), np.uint8)
    state = np.array([0.2, 0.1, -0.3], np.float32)
    noise = torch.randn(1, model.config.chunk_size, model.config.max_action_dim, generator=torch.Generator().manual_seed(0))

    def act(state, offset):
        inputs = processor(images=image, text="reach target 0", state=state)
        with torch.no_grad():
            chunk = model.sample_actions(**inputs, noise=noise.clone())
        # the same normalised chunk read against another state: the relative joint follows it, the gripper does not
        return processor.unnormalize_actions(chunk, state=torch.from_numpy(state + offset)[None])[0]

    moved = act(state, np.array([1.0, 0.0, 0.0], np.float32)) - act(state, np.zeros(3, np.float32))
    torch.testing.assert_close(moved[:, 0], torch.ones(moved.shape[0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(moved[:, 1], torch.zeros(moved.shape[0]), atol=1e-6, rtol=0)


def test_pi0_refuses_what_its_processor_cannot_apply(arm, tmp_path, capsys):
    """hf_vla's pi0 processor normalises with mean/std and absolute actions: another mode, or relative actions, with
    policy pi0 is one line at start-up, never silently ignored."""
    from test_failures import base_config, run_fails, write_config

    for extra, culprit in (({"relative_actions": True}, "relative_actions with policy 'pi0'"),
                           ({"normalization": {"actions": "QUANTILES"}}, "normalization ['QUANTILES'] with policy "
                                                                        "'pi0'")):
        config = base_config(arm, tmp_path / "out", policy="pi0", model_config={"chunk_size": 4})
        config["datasets"][0] |= extra
        _, message = run_fails(capsys, write_config(tmp_path, config), code=2)
        assert culprit in message, message
