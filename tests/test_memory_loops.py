"""A MEM policy gets lerobot's past frames in every loop that runs it (docs/memory.md).

The oracle (`mem_loop_oracle.py`, lerobot's main branch in a subprocess) runs a two-camera MEM pi0.5 as lerobot-eval
does: `select_action` at each of 42 control steps, a chunk every 5 of them, its own memory queue, padding at the
episode's start. Each of hf_vla's loops runs the converted checkpoint over the same observations with the same noise
(a generator seeded alike, drawn once per chunk) and must execute lerobot's actions: the loop the docs give users
(`observe` between chunks), the server's `observe_only` steps through openpi's client, the lerobot plugin under
lerobot's `select_action`, the episode loop of `hf_vla.evaluate` and RL (every step observed), DAgger and
`record --strategy policy`.
"""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest
import torch
from test_memory import ORACLE, _run_oracle

needs_oracle = pytest.mark.skipif(not ORACLE.is_dir(), reason=f"lerobot's main-branch oracle is absent ({ORACLE})")
pytestmark = needs_oracle

WRIST, BASE = "observation.images.wrist", "observation.images.base"  # the oracle's slot order
STATE = "observation.state"
TASK, NOISE_SEED, N_ACTION_STEPS = "pick the cube", 7, 5
ACTION_TOLERANCE = 1e-5  # absolute, robot units


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, tiny_tokenizer_dir):
    from hf_vla import convert

    base = tmp_path_factory.mktemp("mem_loop_oracle")
    _run_oracle("mem_loop_oracle.py", base, tiny_tokenizer_dir)
    convert.main(["--input", str(base / "lerobot"), "--output", str(base / "hf"), "--tokenizer",
                  str(tiny_tokenizer_dir), "--head", "arm::joint", "--vision_heads", "2"])
    return base / "hf", dict(np.load(base / "oracle.npz"))


def _observation(o, step: int) -> dict:
    return {WRIST: o["images"][step, 0], BASE: o["images"][step, 1], STATE: o["states"][step]}


def _runner(checkpoint, **kwargs):
    from hf_vla.serving.policy import ObservationMap, load_policy

    return load_policy(checkpoint, obs_map=ObservationMap(cameras=[WRIST, BASE]), **kwargs)


def _assert_lerobots(executed, o) -> None:
    executed = np.asarray(executed)
    assert executed.shape == o["executed"].shape
    assert np.abs(executed - o["executed"]).max() <= ACTION_TOLERANCE


def test_the_contract_keeps_lerobots_camera_order(oracle):
    from hf_vla.deployment.contract import read

    checkpoint, _ = oracle
    contract = read(checkpoint)
    keys = [camera["key"] for camera in contract.head(None)["cameras"]]
    assert keys == [WRIST, BASE]


def test_the_documented_loop(oracle):
    """docs/memory.md: `runner.observe(observation)` at the steps without a chunk, `runner(observation, task)` at the
    others."""
    checkpoint, o = oracle
    runner = _runner(checkpoint)
    runner.reset(seed=NOISE_SEED)
    executed = []
    for step in range(len(o["states"])):
        if step % N_ACTION_STEPS == 0:
            chunk = runner(_observation(o, step), task=TASK)
        else:
            runner.observe(_observation(o, step))
        executed.append(chunk[step % N_ACTION_STEPS])
    _assert_lerobots(executed, o)
    # the oracle's past: padded at the start (step 5: ages 9 and 6 before the episode), full later
    assert o["past_is_pad"][5].tolist() == [True, True, False, False] and not o["past_is_pad"][40].any()


def test_a_loop_that_loses_the_chunk_steps_would_be_caught(oracle):
    """The check is sharp: the old bug (a chunk step's own observation never entering the history, the past anchored
    one step back) is far outside the tolerance."""
    from hf_vla.serving.policy import Continuation

    checkpoint, o = oracle
    runner = _runner(checkpoint)
    runner.reset(seed=NOISE_SEED)
    executed = []
    for step in range(len(o["states"])):
        if step % N_ACTION_STEPS:
            runner.observe(_observation(o, step))
        else:
            lost = Continuation(recorded=0) if step else None  # "already recorded": it was not
            request = runner.prepare(_observation(o, step), TASK, continuation=lost)
            chunk = runner.finish(request, runner.sample_batch([request])[0])
        executed.append(chunk[step % N_ACTION_STEPS])
    assert np.abs(np.asarray(executed) - o["executed"]).max() > 1e-3


def test_the_server_with_observe_only_steps(oracle):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from test_serve import Server

    checkpoint, o = oracle
    server = Server("--checkpoint", str(checkpoint))
    try:
        client = WebsocketClientPolicy(server.uri)
        executed = []
        for step in range(len(o["states"])):
            request = {**_observation(o, step), "prompt": TASK}
            if step == 0:
                request["episode_seed"] = NOISE_SEED
            if step % N_ACTION_STEPS == 0:
                chunk = client.infer(request)["actions"]
            else:
                assert client.infer({**request, "observe_only": True}) == {"observed": True}
            executed.append(chunk[step % N_ACTION_STEPS])
    finally:
        server.stop()
    _assert_lerobots(executed, o)


def test_the_lerobot_plugin_under_select_action(oracle, tmp_path):
    """What lerobot-eval runs: the plugin's `select_action` at every step through lerobot's own processors."""
    from test_lerobot_plugin import lerobot_frame, lerobot_policy, plugin_dir

    checkpoint, o = oracle
    directory = plugin_dir(checkpoint, tmp_path / "plugin")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "seed": NOISE_SEED}))  # lerobot's --policy.seed
    policy, pre, post = lerobot_policy(directory)
    assert policy.n_action_steps == N_ACTION_STEPS
    policy.reset()
    executed = []
    for step in range(len(o["states"])):
        batch = {WRIST: lerobot_frame(o["images"][step, 0])[None], BASE: lerobot_frame(o["images"][step, 1])[None],
                 STATE: torch.from_numpy(o["states"][step])[None], "task": [TASK]}
        executed.append(post(policy.select_action(pre(batch))).numpy()[0])
    _assert_lerobots(executed, o)


class ReplayEnv(gym.Env):
    """The oracle's observations in order, whatever the actions; the executed actions are kept."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, o):
        self.o, self.step_index, self.actions = o, 0, []
        self.observation_space = gym.spaces.Dict({})
        self.action_space = gym.spaces.Box(-np.inf, np.inf, (o["executed"].shape[1],), np.float32)
        self.task = TASK

    def reset(self, seed=None, options=None):
        self.step_index, self.actions = 0, []
        return _observation(self.o, 0), {"task": TASK}

    def step(self, action):
        self.actions.append(np.asarray(action, np.float32).reshape(-1))
        self.step_index += 1
        done = self.step_index >= len(self.o["states"])
        observation = _observation(self.o, min(self.step_index, len(self.o["states"]) - 1))
        return observation, 0.0, False, done, {"is_success": False}

    def expert_action(self):
        return np.zeros(self.action_space.shape, np.float32)

    def render(self):
        return self.o["images"][self.step_index, 0]


def test_the_episode_loop_of_evaluate(oracle):
    """`hf_vla.evaluate`'s loop (`EpisodeRunner`): every step observed, each chunk from the observation just taken."""
    from hf_vla.envs.episodes import EpisodeRunner

    checkpoint, o = oracle
    env = ReplayEnv(o)
    runner = _runner(checkpoint)
    EpisodeRunner([env], runner, n_action_steps=N_ACTION_STEPS, chunk_size=8).run([NOISE_SEED], progress=False)
    _assert_lerobots(env.actions, o)


def test_rl_rollouts(oracle):
    """RL's rollouts: the stochastic policy in the same loop (deterministic sampler, the chunk noise drawn as lerobot's
    from its own generator: the Gaussian steps' normals also come from the slot's)."""
    from hf_vla.envs.episodes import EpisodeRunner
    from hf_vla.rl.flow import FlowSDE
    from hf_vla.rl.rollout import StochasticPolicy

    checkpoint, o = oracle
    loaded = _runner(checkpoint)
    chunk_noise = torch.Generator().manual_seed(NOISE_SEED)

    class Probe(StochasticPolicy):
        def prepare(self, *args, **kwargs):
            request = super().prepare(*args, **kwargs)
            request.noise = torch.randn(request.noise.shape, generator=chunk_noise)
            return request

    policy = Probe(loaded.model, loaded.processor, obs_map=loaded.obs_map, sde=FlowSDE(10, 0.0),
                   n_action_steps=N_ACTION_STEPS)
    env = ReplayEnv(o)
    EpisodeRunner([env], policy, n_action_steps=N_ACTION_STEPS, chunk_size=8).run([NOISE_SEED], progress=False)
    _assert_lerobots(env.actions, o)
    assert len(policy.transitions) == 9  # steps 0, 5, ..., 40
    # the transition keeps the past it was sampled from: the update recomputes the same chain
    assert policy.transitions[-1].inputs["memory_mask"].all() and not policy.transitions[1].inputs["memory_mask"].all()


@pytest.mark.parametrize("expert_labels", [False, True], ids=["record_strategy_policy", "dagger"])
def test_dagger_and_record_strategy_policy(oracle, expert_labels):
    from hf_vla.envs.dagger import DaggerActor, DaggerSettings, dagger_episodes

    checkpoint, o = oracle
    env = ReplayEnv(o)
    actor = DaggerActor(env, _runner(checkpoint), N_ACTION_STEPS, DaggerSettings(expert_labels=expert_labels),
                        camera=(WRIST, BASE), state=STATE)
    frames = next(dagger_episodes(actor, 1, iter([NOISE_SEED])))
    _assert_lerobots(env.actions, o)
    assert len(frames) == len(o["states"])


def test_a_delayed_request_samples_the_past_of_its_own_observation(oracle):
    """With an inference delay the episode loop acts on an observation `d` steps older than the newest it observed:
    the past is sampled from that observation, as training indexes it (not from the newest)."""
    from hf_vla.envs.episodes import EpisodeRunner

    checkpoint, o = oracle
    runner = _runner(checkpoint)
    seen = []
    original = runner.prepare

    def prepare(observation, *args, **kwargs):
        request = original(observation, *args, **kwargs)
        step = next(i for i in range(len(o["states"])) if np.array_equal(o["states"][i], observation[STATE]))
        seen.append((step, request.inputs["memory_state"][0, :-1].clone(), request.inputs["memory_mask"][0].clone()))
        return request

    runner.prepare = prepare
    EpisodeRunner([ReplayEnv(o)], runner, n_action_steps=3, inference_delay=2, chunk_size=8).run(
        [NOISE_SEED], progress=False)
    reference = _runner(checkpoint)
    assert len(seen) > 5 and any(step >= 9 for step, _, _ in seen)
    for step, past_state, mask in seen:  # the past a fresh runner that saw steps 0..step gives
        reference.reset()
        for earlier in range(step):
            reference.observe(_observation(o, earlier))
        want = reference._model_inputs({"images": reference._camera_images(_observation(o, step))[0][None],
                                        "states": o["states"][step][None], "tasks": [TASK],
                                        "camera_mask": torch.ones(1, 2, dtype=torch.bool),
                                        "memory": (reference.memory.record(
                                            reference._camera_images(_observation(o, step))[0], o["states"][step]),
                                            reference.memory.past())[1]}, reference.head_name())
        assert torch.equal(mask, want["memory_mask"][0])
        assert torch.allclose(past_state, want["memory_state"][0, :-1])


def test_a_camera_that_changes_size_within_an_episode_is_one_line(oracle):
    """A MEM policy's past frames are stacked with the new one: a camera of another size mid-episode is refused in one
    line at each such step (observe-only or acting), and the episode goes on at the old size; a new episode may
    change it."""
    from hf_vla.serving.policy import RequestError

    checkpoint, o = oracle
    runner = _runner(checkpoint)
    runner.reset(seed=NOISE_SEED)
    runner(_observation(o, 0), task=TASK)
    bigger = {WRIST: np.zeros((48, 48, 3), np.uint8), BASE: np.zeros((48, 48, 3), np.uint8), STATE: o["states"][1]}
    for call in (runner.observe, lambda observation: runner(observation, task=TASK)):
        with pytest.raises(RequestError, match=r"this episode's earlier observations were \(2, 3, 32, 32\)"):
            call(bigger)
    runner(_observation(o, 1), task=TASK)  # the episode goes on
    runner.reset(seed=NOISE_SEED)
    runner(bigger, task=TASK)  # a new episode: its own size
