"""DAgger in simulation (`python -m hf_vla.record --strategy dagger --policy CHECKPOINT`, `hf_vla.envs.dagger`).

Oracle: replaying a recorded DAgger task from its seeds with the executed actions (the expert's label where the
frame says the expert acted, else the policy's proposal) visits exactly the recorded states, and the expert's action
at each of them is the recorded label. Who acts is tested on a scripted env and policy (beta, HG-DAgger's gates).
"""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import refused

from hf_vla.envs.dagger import (
    EXECUTED_ACTION,
    INTERVENTION,
    POLICY_ACTION,
    SUCCESS,
    DaggerActor,
    DaggerSettings,
    dagger_episodes,
)
from hf_vla.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A ColorReach expert recording (24 px, 20-step episodes) and a checkpoint trained on it for 2 steps."""
    from conftest import colorreach_run

    base = tmp_path_factory.mktemp("dagger_start")
    out, datasets = colorreach_run(base, 20, "--n_action_steps", "4", "--model_config.num_inference_steps", "2",
                                   "--report_to", "none")
    return {"expert": base / "data", "policy": out, "datasets": datasets, "base": base}


@pytest.fixture(scope="module")
def dagger_run(start):
    from hf_vla.envs.recording import RecordArguments, record

    out = start["base"] / "dagger_1"
    result = record(RecordArguments(env="color_reach", output=out, episodes=3, strategy="dagger",
                                    policy=str(start["policy"]), beta=0.5), progress=False)
    return out, result


def _frames(root: Path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    data = LeRobotDataset("local/dagger", root=root)
    table = data.hf_dataset.with_format("numpy")[:]
    return data, table


def test_the_recorded_labels_are_the_experts_at_the_states_the_policy_visited(dagger_run):
    from hf_vla.envs.reach import ColorReachWithExpert as _ColorReachWithExpert

    root, result = dagger_run
    data, table = _frames(root)
    info = json.loads((root / "meta" / "info.json").read_text())
    assert {INTERVENTION, POLICY_ACTION, SUCCESS} <= set(info["features"])
    marker = json.loads((root / "meta" / "hf_vla_record.json").read_text())
    assert marker["strategy"] == "dagger" and marker["round"] == 1 and marker["policy"].endswith("run")
    assert marker["image_size"] == 24 and marker["max_episode_steps"] == 20 and marker["n_action_steps"] == 4
    episodes = marker["tasks"]["color_reach"]["episodes"]
    assert [e["seed"] for e in episodes] == [1000, 1001, 1002]  # round 1: seeds from 1000
    assert data.meta.total_episodes == 3 and sum(e["steps"] for e in episodes) == len(table["action"])
    # replay the task's episodes in order (the expert's noise generator runs across them, seeded as recorded)
    env = _ColorReachWithExpert(marker["seed"], image_size=24, max_steps=20)
    row = 0
    acted = np.asarray(table[INTERVENTION]).reshape(-1)  # lerobot keeps a (1,) feature as a scalar
    for episode in episodes:
        observation, _ = env.reset(seed=episode["seed"])
        success = False
        for _ in range(episode["steps"]):
            np.testing.assert_allclose(observation["observation.state"], table["observation.state"][row], atol=1e-6)
            label = env.expert_action()
            np.testing.assert_allclose(label, table["action"][row], atol=1e-6)
            executed = table["action"][row] if acted[row] else table[POLICY_ACTION][row]
            observation, _, terminated, truncated, info = env.step(executed)
            success = success or info["is_success"]
            assert bool(np.asarray(table[SUCCESS]).reshape(-1)[row]) == success
            row += 1
        assert terminated or truncated
        assert success == episode["success"]
    assert 0.2 < acted.mean() < 0.8  # beta 0.5: about half the steps
    assert marker["tasks"]["color_reach"]["expert_steps"] == int(acted.sum())
    assert result.frames == len(acted)


def test_training_on_the_aggregate_reports_each_round(start, dagger_run, tmp_path):
    """The expert recording and a DAgger round as one mixture: trained by `hf_vla.train` from the checkpoint with its
    normalisation (`norm_stats_from`), the evaluation reports each dataset (round) on its own."""
    from hf_vla.train import main as train_main

    datasets = [dict(start["datasets"][0], name="expert"),
                dict(start["datasets"][0], root=str(dagger_run[0]), name="dagger_1")]
    out = tmp_path / "aggregate"
    train_main([str(REPO / "configs/demo.json"), "--datasets", json.dumps(datasets), "--output_dir", str(out),
                "--model_name_or_path", str(start["policy"]), "--generate_demo_data", "false",
                "--validation_ratio", "0.34", "--per_device_train_batch_size", "4", "--stream_open_blocks", "2",
                "--max_steps", "2", "--warmup_steps", "0", "--disable_tqdm", "true", "--eval_strategy", "steps",
                "--eval_steps", "2", "--report_to", "none", "--norm_stats_from", str(start["policy"])])
    saved = json.loads((start["policy"] / "norm_stats.json").read_text())["norm_stats"]
    assert json.loads((out / "norm_stats.json").read_text())["norm_stats"] == saved
    evaluation = json.loads((out / "eval_results.json").read_text())
    assert {"eval_by_dataset/expert/mse", "eval_by_dataset/dagger_1/mse"} <= set(evaluation), evaluation


class _Line:
    """A scripted env: the state is the step count, the expert's action is always [1], the reward is constant (0)
    or rises each step."""

    def __init__(self, steps=10, rising=False):
        self.steps, self.rising, self.t = steps, rising, 0

    def reset(self, seed=None):
        self.t = 0
        return self._obs(), {"task": "line"}

    def _obs(self):
        return {"image": np.zeros((2, 2, 3), np.uint8), "state": np.array([self.t], np.float32)}

    def expert_action(self):
        return np.array([1.0], np.float32)

    def step(self, action):
        self.t += 1
        reward = float(self.t) if self.rising else 0.0
        return self._obs(), reward, False, self.t >= self.steps, {"is_success": False}


class _Policy:
    """Chunks of 4 actions; the action proposed for state t is `far` where t is in `bad`, else the expert's [1]."""

    def __init__(self, bad=(), far=5.0):
        self.bad, self.far, self.calls = set(bad), far, []

    def __call__(self, observation, task):
        t = int(observation["state"][0])
        self.calls.append(t)
        return np.array([[self.far if t + i in self.bad else 1.0] for i in range(4)], np.float32)


def _acted(settings, env=None, policy=None, n_action_steps=4):
    stats = {}
    actor = DaggerActor(env or _Line(), policy or _Policy(), n_action_steps, settings, "image", "state")
    (frames,) = dagger_episodes(actor, 1, iter([3]), stats=stats)
    expert_steps = stats["expert_steps"]
    acted = [int(f["extra"][INTERVENTION][0]) for f in frames]
    assert expert_steps == sum(acted) and all(f["action"][0] == 1.0 for f in frames)  # the label: always the expert's
    return acted, frames


def test_who_acts():
    # plain DAgger (beta 0): the policy acts at every step, a chunk per 4 steps
    policy = _Policy()
    acted, frames = _acted(DaggerSettings(), policy=policy)
    assert acted == [0] * 10 and policy.calls == [0, 4, 8]
    # beta 1: the expert at every step (the policy still proposes, then plans again)
    assert _acted(DaggerSettings(beta=1.0))[0] == [1] * 10
    # the mixture is drawn per step from the episode seed: the same seed, the same steps
    assert _acted(DaggerSettings(beta=0.5))[0] == _acted(DaggerSettings(beta=0.5))[0]
    # HG-DAgger's gate: the policy's action at state 2 departs by 4 > 1: the expert takes over for 3 steps (2, 3, 4),
    # then the policy plans again from state 5
    policy = _Policy(bad={2})
    acted, frames = _acted(DaggerSettings(takeover_threshold=1.0, takeover_steps=3), policy=policy)
    assert acted == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0] and policy.calls == [0, 5, 9]
    assert frames[2]["extra"][POLICY_ACTION][0] == 5.0  # what the policy proposed where it was overruled
    # what the env ran: the expert's action where it took over, the policy's elsewhere (RECAP's training actions)
    executed = [float(f["extra"][EXECUTED_ACTION][0]) for f in frames]
    assert executed == [1.0] * 10 and policy.calls == [0, 5, 9]
    acted, frames = _acted(DaggerSettings(takeover_threshold=10.0, stall_steps=1, takeover_steps=1),
                           policy=_Policy(bad={0, 1, 2, 3}))
    executed = [float(f["extra"][EXECUTED_ACTION][0]) for f in frames]
    proposed = [float(f["extra"][POLICY_ACTION][0]) for f in frames]
    assert executed == [1.0 if by_expert else p for by_expert, p in zip(acted, proposed)] and 5.0 in executed
    assert 1 in acted
    # below the threshold nothing changes
    assert _acted(DaggerSettings(takeover_threshold=10.0), policy=_Policy(bad={2}))[0] == [0] * 10
    # no progress for 3 steps (constant reward): the expert takes over for 2 steps, then the count starts again
    assert _acted(DaggerSettings(stall_steps=3, takeover_steps=2))[0] == [0, 0, 0, 0, 1, 1, 0, 1, 1, 0]
    # a rising reward is progress: no takeover
    assert _acted(DaggerSettings(stall_steps=3, takeover_steps=2), env=_Line(rising=True))[0] == [0] * 10


@pytest.mark.parametrize("bad, message", [
    (dict(beta=1.5), r"--beta 1.5: the expert's share"),
    (dict(takeover_threshold=0.0), r"--takeover_threshold 0.0: must be a positive finite number"),
    (dict(takeover_threshold=float("nan")), r"--takeover_threshold nan: must be a positive finite number"),
    (dict(takeover_steps=0), r"--takeover_steps 0"),
    (dict(stall_steps=0), r"--stall_steps 0"),
])
def test_bad_settings_are_refused(bad, message):
    with pytest.raises(ConfigError, match=message):
        DaggerSettings(**bad)


def test_bad_input_is_refused_in_one_line_and_writes_nothing(start, tmp_path, capsys):
    from hf_vla.record import cli

    policy = str(start["policy"])
    out = tmp_path / "out"
    cases = [
        (["--env", "color_reach", "--strategy", "dagger", "--episodes", "1"], "--strategy dagger needs --policy"),
        (["--env", "color_reach", "--policy", policy, "--episodes", "1"], "only --strategy dagger or policy runs a policy"),
        # the checkpoint's contract: ColorReach at 24 px
        (["--env", "metaworld", "--strategy", "dagger", "--policy", policy, "--episodes", "1"],
         "its data was recorded in 'hf_vla/ColorReach-v0', not 'metaworld'"),
        (["--env", "color_reach", "--strategy", "dagger", "--policy", policy, "--episodes", "1", "--image_size", "32"],
         "--image_size 32 contradicts the checkpoint"),
        (["--env", "color_reach", "--strategy", "dagger", "--policy", policy, "--episodes", "1", "--beta", "2"],
         "--beta 2.0"),
        (["--env", "color_reach", "--strategy", "dagger", "--policy", str(tmp_path / "missing"), "--episodes", "1"],
         "--policy '" + str(tmp_path / "missing")),
    ]
    for argv, message in cases:
        line = refused(cli, [*argv, "--output", str(out)], capsys)
        assert message in line, (argv, line)
        assert not out.exists() and not (tmp_path / ".out.recording").exists()


def test_norm_stats_from_refuses_another_robots_statistics(start, tmp_path):
    from hf_vla.training.builders import saved_norm_stats

    saved = json.loads((start["policy"] / "norm_stats.json").read_text())["norm_stats"]
    (head,) = saved
    assert saved_norm_stats(str(start["policy"]), saved) == saved
    with pytest.raises(ConfigError, match="has no head 'other'"):
        saved_norm_stats(str(start["policy"]), {"other": saved[head]})
    wider = {head: {k: {s: list(v) + [0.0] for s, v in stats.items()} for k, stats in saved[head].items()}}
    with pytest.raises(ConfigError, match=f"head '{head}' state has 2 dims in .* but 3 in the mixture"):
        saved_norm_stats(str(start["policy"] / "norm_stats.json"), wider)
    with pytest.raises(ConfigError, match="no norm_stats.json or processor_config.json there"):
        saved_norm_stats(str(tmp_path), saved)


def test_an_interrupted_round_continues_only_with_its_own_settings(start, tmp_path, monkeypatch):
    """A DAgger round killed mid-way leaves no dataset; rerun with another beta, or with other weights under the
    policy's path, it is refused (naming what differs); with its own settings and weights it completes, whatever the
    policy's spelling (relative, trailing slash)."""
    import shutil

    from hf_vla.envs.recording import RecordArguments, record

    out = tmp_path / "round"
    policy = tmp_path / "policy"
    shutil.copytree(start["policy"], policy)

    def interrupted(first):
        yield first
        raise KeyboardInterrupt  # killed while drawing the second episode's seed

    with pytest.raises(KeyboardInterrupt):
        record(RecordArguments(env="color_reach", output=out, episodes=2, strategy="dagger", policy=str(policy)),
               progress=False, seeds=interrupted)
    assert not out.exists() and (tmp_path / ".round.recording" / "plan.json").is_file()
    with pytest.raises(ConfigError, match=r"interrupted recording with other settings \(dagger: "):
        record(RecordArguments(env="color_reach", output=out, episodes=2, strategy="dagger", policy=str(policy),
                               beta=0.5), progress=False)
    weights = policy / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-8] + b"\x00" * 8)  # the checkpoint directory now holds other weights
    with pytest.raises(ConfigError, match=r"interrupted recording with other settings \(weights: "):
        record(RecordArguments(env="color_reach", output=out, episodes=2, strategy="dagger", policy=str(policy)),
               progress=False)
    weights.write_bytes(original)
    monkeypatch.chdir(tmp_path)
    result = record(RecordArguments(env="color_reach", output=out, episodes=2, strategy="dagger", policy="policy/"),
                    progress=False)
    assert result.tasks["color_reach"]["kept"] == 2 and not (tmp_path / ".round.recording").exists()
    marker = json.loads((out / "meta" / "hf_vla_record.json").read_text())
    assert marker["policy"] == str(policy.resolve())
