"""MEM observation memory (docs/memory.md) against lerobot's main-branch pi0.5, which has it (`../shared/oracles/`,
run in a subprocess: PyPI's lerobot predates it): a checkpoint written by lerobot's own code with visual and
proprioceptive memory converts, gives lerobot's flow loss on one batch and lerobot's action chunks in robot units over
an episode (the runner keeping the past as lerobot's queue does), eager and sdpa; it exports back and lerobot's code
acts the same with the export. The stream's past frames are lerobot's `delta_timestamps` frames, episode starts
included; the server keeps one memory per session; a memory-free checkpoint computes what it did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_vla.data import WeightedDatasetMixture
from hf_vla.data.stream import FrameReader, memory_indices
from hf_vla.serving.memory import ObservationMemory

ORACLE = Path(__file__).resolve().parents[2] / "shared" / "oracles" / "lerobot-7427f31" / "src"
TOLERANCE = 1e-5
needs_oracle = pytest.mark.skipif(not ORACLE.is_dir(), reason=f"lerobot's main-branch oracle is absent ({ORACLE})")


def _run_oracle(script: str, *args) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ORACLE), str(Path(__file__).resolve().parents[1])]),
               HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name(script)), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, tiny_tokenizer_dir):
    from hf_vla import convert

    base = tmp_path_factory.mktemp("mem_oracle")
    _run_oracle("mem_oracle.py", base, tiny_tokenizer_dir)
    convert.main(["--input", str(base / "lerobot"), "--output", str(base / "hf"), "--tokenizer",
                  str(tiny_tokenizer_dir), "--head", "arm::joint", "--vision_heads", "2"])
    return base, dict(np.load(base / "oracle.npz"))


@needs_oracle
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_one_batch_gives_lerobots_flow_loss(oracle, attention):
    from transformers import AutoModel, AutoProcessor

    base, o = oracle
    model = AutoModel.from_pretrained(base / "hf", attn_implementation=attention).eval()
    processor = AutoProcessor.from_pretrained(base / "hf")
    assert model.config.use_visual_memory and model.config.use_proprioceptive_memory
    images, states = torch.from_numpy(o["train_images"]), torch.from_numpy(o["train_states"])
    real = ~torch.from_numpy(o["train_is_pad"])
    inputs = processor(images=images[:, -1][:, None], text=["pick the cube", "open the drawer"], state=states[:, -1],
                       actions=torch.from_numpy(o["train_actions"]),
                       memory={"images": images[:, None, :-1], "state": states[:, :-1], "mask": real[:, :-1]})
    # lerobot's MEM prompt: no state in it (proprioceptive memory carries it)
    assert torch.equal(inputs["input_ids"], torch.from_numpy(o["train_tokens"]))
    assert inputs["pixel_values"].shape[2] == 3 and inputs["memory_state"].shape[1] == 3
    noise, time = torch.from_numpy(o["train_noise"]), torch.from_numpy(o["train_time"])
    with torch.no_grad():
        out = model(**{k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask",
                                              "memory_state", "memory_mask")},
                    actions=inputs["actions"], noise=noise, timestep=time)
    losses = ((noise - inputs["actions"] - out.logits) ** 2).numpy()
    assert abs(out.loss.item() - o["train_losses"].mean()) <= 1e-6 * o["train_losses"].mean()  # relative
    # element-wise: the squared velocity error of each action step and dim, within 2e-6 of the largest (~8)
    assert np.abs(losses - o["train_losses"]).max() <= 2e-6 * o["train_losses"].max()


def _episode_chunks(checkpoint, o, attention="sdpa"):
    from hf_vla.serving.policy import load_policy

    runner = load_policy(checkpoint)
    runner.model.set_attn_implementation(attention)
    runner.reset(seed=0)
    chunks = []
    for step in range(len(o["episode_states"])):
        observation = {"cam": o["episode_images"][step], "state": o["episode_states"][step]}
        request = runner.prepare(observation, "pick the cube")
        request.noise = torch.from_numpy(o["episode_noise"][step])  # lerobot's noise of this step
        chunks.append(runner.finish(request, runner.sample_batch([request])[0]))
    return np.stack(chunks)


@needs_oracle
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_an_episode_gives_lerobots_chunks_in_robot_units(oracle, attention):
    base, o = oracle
    chunks = _episode_chunks(base / "hf", o, attention)
    assert np.abs(chunks - o["episode_chunks"]).max() <= TOLERANCE  # absolute, in robot units
    # the memory matters: a runner that forgets the past between steps acts otherwise once there is one
    from hf_vla.serving.policy import load_policy

    runner = load_policy(base / "hf")
    late = []
    for step in (0, 4):
        runner.reset(seed=0)
        request = runner.prepare({"cam": o["episode_images"][step], "state": o["episode_states"][step]},
                                 "pick the cube")
        request.noise = torch.from_numpy(o["episode_noise"][step])
        late.append(runner.finish(request, runner.sample_batch([request])[0]))
    assert np.abs(late[0] - o["episode_chunks"][0]).max() <= TOLERANCE  # step 0 has no past either way
    assert np.abs(late[1] - o["episode_chunks"][4]).max() > 1e-3


@needs_oracle
def test_the_export_runs_in_lerobot_as_the_original(oracle, tmp_path, tiny_tokenizer_dir):
    from hf_vla import convert

    base, o = oracle
    convert.main(["--input", str(base / "hf"), "--output", str(tmp_path / "export"), "--to", "lerobot"])
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["use_visual_memory"] and config["use_proprioceptive_memory"]
    assert (config["memory_frames"], config["memory_stride"], config["memory_temporal_attention_every"]) == (3, 2, 2)
    np.savez(tmp_path / "episode.npz", **{k: v for k, v in o.items() if k.startswith("episode_")})
    _run_oracle("mem_oracle_replay.py", tmp_path / "export", tmp_path / "episode.npz", tmp_path / "replayed.npy",
                tiny_tokenizer_dir)
    assert np.abs(np.load(tmp_path / "replayed.npy") - o["episode_chunks"]).max() <= 1e-6  # the same weights and code


def test_the_stream_reads_lerobots_past_frames(tmp_path):
    """Past states and frames of every sample equal lerobot's `LeRobotDataset` with the `delta_timestamps` lerobot's
    factory gives MEM (`range(-(T-1) * stride, 1, stride)` frames / fps), padding at episode starts included."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from test_data import CAM, make_dataset

    root = make_dataset(tmp_path / "data", 3, cameras={CAM: (32, 32)}, lengths=[9, 14, 11])
    memory = {"frames": 4, "stride": 3, "visual": True, "proprio": True}
    offsets = list(range(-(memory["frames"] - 1) * memory["stride"], 1, memory["stride"]))
    lerobot = LeRobotDataset("local/mem", root=root, video_backend="pyav",
                             delta_timestamps={CAM: [i / 10 for i in offsets],
                                               "observation.state": [i / 10 for i in offsets]})
    mixture = WeightedDatasetMixture([dict(root=str(root), name="a", cameras=[CAM], control_mode="joint")],
                                     validation_ratio=0.0)
    source = mixture.sources[0]
    reader = FrameReader([source], [0], 1, 32, 4, memory=memory)
    starts = np.cumsum([0, 9, 14])
    for block in mixture.train_blocks[0]:
        for frame in range(block.start, block.end):
            sample = reader.sample(0, block, frame)
            row = lerobot[int(starts[block.episode]) + frame]
            assert int(row["frame_index"]) == frame and int(row["episode_index"]) == block.episode
            want_pad = row["observation.state_is_pad"][:-1].numpy()
            assert sample["memory_mask"].numpy().tolist() == (~want_pad).tolist()
            assert torch.allclose(sample["memory_state"], row["observation.state"][:-1])
            theirs = (row[CAM][:-1] * 255).round().to(torch.uint8)
            assert (sample["memory_images"][0].int() - theirs.int()).abs().max() <= 1
            assert (sample["images"][0].int() - (row[CAM][-1] * 255).round().int()).abs().max() <= 1
        reader.release(0, block)
    assert memory_indices(2, memory)[1].tolist() == [False, False, False]


def test_past_frames_are_decoded_once_per_block(tmp_path, monkeypatch):
    from test_data import CAM, make_dataset

    from hf_vla.data import video

    root = make_dataset(tmp_path / "data", 2, cameras={CAM: (32, 32)}, lengths=[20, 15])
    mixture = WeightedDatasetMixture([dict(root=str(root), name="a", cameras=[CAM], control_mode="joint")],
                                     validation_ratio=0.0)
    decoded = []
    original = video.VideoReader.frame
    monkeypatch.setattr(video.VideoReader, "frame", lambda self, index, out=None: (decoded.append(index),
                                                                                   original(self, index, out))[1])
    reader = FrameReader(mixture.sources, [0], 1, 32, 4, memory={"frames": 6, "stride": 3, "visual": True,
                                                                    "proprio": False})
    block = mixture.train_blocks[0][0]
    for frame in range(block.start, block.end):
        reader.sample(0, block, frame)
    assert sorted(decoded) == list(range(block.start, block.end))  # each frame once, for itself and as a past one
    assert len(reader._histories[next(iter(reader._histories))].frames) <= 5 * 3 + 1  # the horizon, not the block


def test_observation_memory_samples_by_age_like_lerobots_queue():
    memory = ObservationMemory(frames=3, stride=2, visual=False, proprio=True)
    for step in range(6):
        memory.record(None, np.array([step], np.float32))
        past = memory.past()
        ages = [4, 2]
        assert past["mask"][0].tolist() == [step >= age for age in ages]
        assert past["state"][0, :, 0].tolist() == [float(max(0, step - age)) for age in ages]


def test_a_model_without_memory_computes_what_it_did():
    """Memory off (the default): no new module, and the same numbers as a model built before MEM existed."""
    from hf_vla.models.pi05 import PI05ForConditionalGeneration
    from hf_vla.tiny import tiny_pi05_config

    torch.manual_seed(0)
    model = PI05ForConditionalGeneration(tiny_pi05_config()).eval()
    assert model.model.proprio_history_proj is None
    assert not any("Memory" in type(m).__name__ for m in model.modules())
    assert "memory_state" not in json.dumps(model.config.to_dict()) or not model.config.uses_memory


@needs_oracle
def test_the_server_keeps_one_memory_per_session(oracle):
    """Two openpi clients interleaving their episodes (with observe-only steps) get what each gets alone in-process:
    each connection keeps its own past."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from test_serve import Server

    from hf_vla.serving.policy import load_policy

    base, o = oracle
    camera = "observation.images.cam"
    episodes = {7: list(range(7)), 8: [6, 5, 4, 3, 2, 1, 0]}  # episode seed -> which oracle observations, in order

    def request(index, **extra):
        return {camera: o["episode_images"][index], "observation.state": o["episode_states"][index],
                "prompt": "pick the cube", **extra}

    def alone(seed, order):
        runner = load_policy(base / "hf")
        runner.reset(seed=seed)
        chunks = []
        for step, index in enumerate(order):
            if step % 2:  # every other step only observed
                runner.observe(request(index))
            else:
                chunks.append(runner(request(index), task="pick the cube"))
        return chunks

    server = Server("--checkpoint", str(base / "hf"))
    try:
        clients = {seed: WebsocketClientPolicy(server.uri) for seed in episodes}
        got = {seed: [] for seed in episodes}
        for step in range(7):
            for seed, order in episodes.items():
                extra = {"episode_seed": seed} if step == 0 else {}
                if step % 2:
                    assert clients[seed].infer(request(order[step], observe_only=True, **extra))["observed"]
                else:
                    got[seed].append(clients[seed].infer(request(order[step], **extra))["actions"])
    finally:
        server.stop()
    for seed, order in episodes.items():
        np.testing.assert_allclose(np.stack(got[seed]), np.stack(alone(seed, order)), rtol=0, atol=1e-5)
    assert np.abs(np.stack(got[7]) - np.stack(got[8])).max() > 1e-3  # the sessions did differ


@needs_oracle
def test_the_lerobot_plugin_keeps_one_memory_per_env(oracle, tmp_path):
    """lerobot's tools run a MEM checkpoint through the plugin with a batch of two envs: each row acts as a runner of
    its own that saw every step of its env (chunks at the contract's n_action_steps, observations between)."""
    from test_lerobot_plugin import lerobot_frame, lerobot_policy, plugin_dir

    from hf_vla.serving.policy import load_policy

    base, o = oracle
    policy, pre, post = lerobot_policy(plugin_dir(base / "hf", tmp_path / "plugin"))
    camera, steps = "observation.images.cam", policy.n_action_steps
    orders = [list(range(7)), [6, 5, 4, 3, 2, 1, 0]]
    policy.reset()
    executed = []
    for step in range(7):
        rows = [order[step] for order in orders]
        batch = {camera: torch.stack([lerobot_frame(o["episode_images"][i]) for i in rows]),
                 "observation.state": torch.from_numpy(o["episode_states"][rows]), "task": ["pick the cube"] * 2}
        executed.append(post(policy.select_action(pre(batch))).numpy())
    for row, order in enumerate(orders):
        runner = load_policy(base / "hf", seed=policy.runner.seed + row)
        runner.reset()
        for step, index in enumerate(order):
            observation = {camera: o["episode_images"][index], "observation.state": o["episode_states"][index]}
            if step % steps == 0:
                chunk = runner(observation, task="pick the cube")
            else:
                runner.observe(observation)
            np.testing.assert_allclose(executed[step][row], chunk[step % steps], atol=1e-5, rtol=0)


def test_the_stride_is_the_same_time_at_the_robots_rate():
    """The contract's stride counts the data's frames; at another control rate it is converted where whole, else
    refused in one line naming both rates."""
    from hf_vla.deployment.contract import DeploymentConfig, memory_stride
    from hf_vla.errors import ConfigError

    contract = DeploymentConfig(policy="pi05", chunk_size=10, n_action_steps=5, image_size=32, heads={"a": {}},
                                memory={"frames": 6, "stride": 30, "visual": True, "proprio": True, "fps": 30.0})
    assert memory_stride(contract, 30, "env") == 30
    assert memory_stride(contract, 20, "env") == 20  # one second either way
    assert memory_stride(contract, None, "env") is None  # a rate unknown: the checkpoint's stride
    with pytest.raises(ConfigError, match=r"30 data frames back \(1 s at the data's 30 fps\).*12.5 control steps at 12.5 Hz"):
        memory_stride(contract, 12.5, "--env x")
    assert DeploymentConfig.from_dict(contract.to_dict()).memory == contract.memory


@pytest.mark.slow  # flex_attention's first call on the CPU compiles for ~30 s
def test_flex_attention_computes_what_eager_does_with_memory():
    from hf_vla.models.pi05 import PI05ForConditionalGeneration
    from hf_vla.tiny import tiny_pi05_config, tiny_vlm_config

    vlm = tiny_vlm_config()
    vlm["vision_config"]["num_hidden_layers"] = 4
    torch.manual_seed(0)
    model = PI05ForConditionalGeneration(tiny_pi05_config(
        vlm_config=vlm, use_visual_memory=True, use_proprioceptive_memory=True, memory_frames=3, memory_stride=2,
        memory_temporal_attention_every=2)).eval()
    generator = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(2, 100, (2, 10), generator=generator),
              "pixel_values": torch.rand(2, 2, 3, 3, 32, 32, generator=generator) * 2 - 1,
              "memory_state": torch.randn(2, 3, 8, generator=generator),
              "memory_mask": torch.tensor([[False, True, True], [True, True, True]]),
              "noise": torch.randn(2, 5, 6, generator=generator), "timestep": torch.tensor([0.3, 0.7])}
    out = {}
    for backend in ("eager", "flex_attention"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            out[backend] = model(**inputs).logits
    assert (out["eager"] - out["flex_attention"]).abs().max() < 1e-5
