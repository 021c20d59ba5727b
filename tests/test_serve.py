"""Serving and real-time chunking.

Oracles: lerobot's own RTC (`euler_integrate` + `RTCProcessor`) on the same velocity field, an analytic vector-Jacobian
product, in-process `sample_actions` + un-normalisation against the server's replies through the real openpi-client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import REPO, randomize_

import hf_vla.envs  # noqa: F401  (registers ColorReach)
from hf_vla.models.pi05 import PI05Config, PI05ForConditionalGeneration, PI05Processor
from hf_vla.models.pi05.rtc import RTCConfig, guidance_weight, guided_velocity, prefix_weights
from hf_vla.policy import ObservationMap, PolicyRunner, RequestError, add_rtc_arguments, rtc_config_from_args

HEAD = "color_reach::delta_xy"
NORM_STATS = {HEAD: {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]},
                     "actions": {"q01": [-0.1, -0.1], "q99": [0.1, 0.1]}}}


def demo_config(**overrides) -> PI05Config:
    model_config = json.loads((REPO / "hf_vla" / "configs" / "demo.json").read_text())["model_config"]
    return PI05Config(**(model_config | overrides))


@pytest.fixture(scope="module")
def demo_policy(tiny_tokenizer):
    """The demo's architecture with random weights (tests cannot train it), and its processor."""
    model = randomize_(PI05ForConditionalGeneration(demo_config()), seed=3, scale=0.1).eval()
    processor = PI05Processor.from_config(model.config, tiny_tokenizer, norm_stats=NORM_STATS, head_names=[HEAD])
    return model, processor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, demo_policy):
    path = tmp_path_factory.mktemp("served")
    model, processor = demo_policy
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def observations(count: int, seed: int = 0):
    env = gym.make("hf_vla/ColorReach-v0")
    for episode in range(count):
        observation, info = env.reset(seed=seed + episode)
        yield observation, info["task"]


def model_inputs(processor, observation, task):
    images = torch.from_numpy(observation["observation.image"]).permute(2, 0, 1)[None, None]
    inputs = processor(images=images, text=[task], state=observation["observation.state"][None], head=HEAD)
    return {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}


# ---- real-time chunking ------------------------------------------------------------------------------------------
def test_prefix_weights_match_lerobot():
    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig as LeRobotRTCConfig
    from lerobot.policies.rtc.modeling_rtc import RTCProcessor

    for schedule in ("zeros", "ones", "linear", "exp"):
        theirs = RTCProcessor(LeRobotRTCConfig(prefix_attention_schedule=RTCAttentionSchedule(schedule.upper())))
        for delay in range(0, 6):
            for horizon in range(0, 12):
                expected = theirs.get_prefix_weights(delay, horizon, 8)
                torch.testing.assert_close(prefix_weights(delay, horizon, 8, schedule), expected, rtol=0, atol=1e-7,
                                           msg=f"{schedule} delay={delay} horizon={horizon}")


@pytest.mark.parametrize("delay,horizon", [(1, 10), (2, 4), (3, 3), (0, 5)])
def test_rtc_sampling_matches_lerobot(demo_policy, delay, horizon):
    """Guided integration == lerobot's euler_integrate with its RTCProcessor over the same velocity field."""
    from lerobot.policies.common.flow_matching import euler_integrate
    from lerobot.policies.rtc.configuration_rtc import RTCConfig as LeRobotRTCConfig
    from lerobot.policies.rtc.modeling_rtc import RTCProcessor

    model, processor = demo_policy
    observation, task = next(observations(1, seed=delay))
    inputs = model_inputs(processor, observation, task)
    generator = torch.Generator().manual_seed(delay)
    noise = torch.randn(1, 8, 2, generator=generator)
    prev = torch.randn(1, 8 - 3, 2, generator=generator) * 0.5
    ours = model.sample_actions(**inputs, noise=noise, prev_chunk_left_over=prev, inference_delay=delay,
                                execution_horizon=horizon)

    cache = model.prefix_cache(**inputs)
    with torch.no_grad():
        theirs = euler_integrate(
            lambda x, t: model(noise=x, timestep=t, input_ids=inputs["input_ids"], past_key_values=cache,
                               attention_mask=inputs["attention_mask"],
                               pixel_attention_mask=inputs["pixel_attention_mask"]).logits,
            noise, 10, rtc_processor=RTCProcessor(LeRobotRTCConfig(execution_horizon=horizon)), rtc_enabled=True,
            inference_delay=delay, prev_chunk_left_over=prev, execution_horizon=horizon)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    plain = model.sample_actions(**inputs, noise=noise)
    if delay:
        assert (ours[:, :delay] - prev[:, :delay]).abs().max() < 0.2 * (plain[:, :delay] - prev[:, :delay]).abs().max()


def test_guidance_with_jacobian_is_the_vector_jacobian_product():
    """jacobian=True: correction = (dx1/dx_t)^T err with x1 = x_t - t v(x_t); for v = A x + b that is (I - t A)^T err."""
    generator = torch.Generator().manual_seed(0)
    A, b = torch.randn(2, 2, generator=generator, dtype=torch.float64), torch.randn(2, generator=generator,
                                                                                     dtype=torch.float64)
    x = torch.randn(1, 4, 2, generator=generator, dtype=torch.float64)
    target = torch.randn(1, 4, 2, generator=generator, dtype=torch.float64)
    weights = prefix_weights(1, 3, 4)[None, :, None].double().expand(1, 4, 2)
    time_ = 0.7
    got = guided_velocity(lambda z: z @ A.T + b, x, time_, target, weights, RTCConfig(jacobian=True))
    v = x @ A.T + b
    error = (target - (x - time_ * v)) * weights
    correction = error @ (torch.eye(2, dtype=torch.float64) - time_ * A)
    expected = v - guidance_weight(time_, 10.0) * correction
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert guidance_weight(1.0, 10.0) == 10.0 and guidance_weight(0.0, 10.0) == 0.0
    assert guidance_weight(0.1, 10.0) == pytest.approx((0.81 + 0.01) / 0.09)


def test_rtc_flags_build_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_rtc_arguments(parser)
    assert rtc_config_from_args(parser.parse_args([])) == RTCConfig()
    args = parser.parse_args(["--rtc_jacobian", "--prefix_attention_schedule", "exp", "--max_guidance_weight", "5",
                              "--execution_horizon", "3"])
    assert rtc_config_from_args(args) == RTCConfig(execution_horizon=3, max_guidance_weight=5.0,
                                                   prefix_attention_schedule="exp", jacobian=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix_attention_schedule", "cosine"])


def test_rtc_runner_continues_the_previous_chunk(demo_policy):
    """With delay d the served chunk's first d actions are the previous chunk's next ones (1e-3, normalised units),
    and the jump where the robot switches chunks is smaller with RTC than without."""
    model, processor = demo_policy
    delay, executed = 2, 4
    jumps = {True: [], False: []}
    for rtc in (True, False):
        runner = PolicyRunner(model, processor, seed=7)
        for observation, task in observations(8, seed=100):
            first = runner(observation, task)
            previous = runner.last_chunk.clone()
            chunk = runner(observation, task, inference_delay=delay if rtc else 0,
                           executed_steps=executed if rtc else None)
            normalised = processor.normalize(chunk, "actions", HEAD)
            if rtc:
                torch.testing.assert_close(normalised[:delay], previous[executed : executed + delay], rtol=0, atol=1e-3)
            # the robot executed first[executed : executed + delay], then switches to chunk[delay]
            jumps[rtc].append(np.linalg.norm(chunk[delay] - first[executed + delay - 1]))
    assert np.mean(jumps[True]) < np.mean(jumps[False])


def test_training_time_rtc_sampling(tiny_tokenizer):
    """A model trained with rtc_max_delay: `sample_actions` holds the committed actions exactly (padded dims 0) and
    samples the rest conditioned on them; `auto` uses it up to the trained delay and guidance beyond; `prefix` on a
    delay the model was not trained for is refused, in-process and as a request error of the runner."""
    model = randomize_(PI05ForConditionalGeneration(demo_config(rtc_max_delay=2, max_action_dim=4)), seed=5,
                       scale=0.1).eval()
    processor = PI05Processor.from_config(model.config, tiny_tokenizer, norm_stats=NORM_STATS, head_names=[HEAD])
    observation, task = next(observations(1, seed=3))
    inputs = model_inputs(processor, observation, task)
    noise = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(0))
    remainder = torch.randn(1, 5, 2, generator=torch.Generator().manual_seed(1))
    chunk = model.sample_actions(**inputs, noise=noise, prev_chunk_left_over=remainder, inference_delay=2,
                                 rtc_config=RTCConfig(method="prefix"))
    assert torch.equal(chunk[0, :2, :2], remainder[0, :2]) and torch.equal(chunk[0, :2, 2:], torch.zeros(2, 2))
    other = model.sample_actions(**inputs, noise=noise, prev_chunk_left_over=remainder + 0.5, inference_delay=2,
                                 rtc_config=RTCConfig(method="prefix"))
    assert (other[0, 2:] - chunk[0, 2:]).abs().max() > 1e-3  # the rest is conditioned on the committed actions
    later = remainder.clone()
    later[:, 2:] += 1.0  # the remainder past the delay is not used (no blending with the older plan)
    assert torch.equal(model.sample_actions(**inputs, noise=noise, prev_chunk_left_over=later, inference_delay=2), chunk)
    guided = model.sample_actions(**inputs, noise=noise, prev_chunk_left_over=remainder, inference_delay=3)
    reference = model.sample_actions(**inputs, noise=noise, prev_chunk_left_over=remainder, inference_delay=3,
                                     rtc_config=RTCConfig(method="guidance"))
    assert torch.equal(guided, reference)  # beyond the trained delay, auto falls back to guidance
    with pytest.raises(ValueError, match="rtc_max_delay=2"):
        model.sample_actions(**inputs, noise=noise, prev_chunk_left_over=remainder, inference_delay=3,
                             rtc_config=RTCConfig(method="prefix"))
    runner = PolicyRunner(model, processor, rtc=RTCConfig(method="prefix"))
    runner(observation, task)
    assert runner.last_rtc_method is None  # nothing to continue yet
    with pytest.raises(RequestError, match="trained with rtc_max_delay=2"):
        runner(observation, task, inference_delay=3, executed_steps=2)
    assert runner(observation, task, inference_delay=2, executed_steps=2).shape == (8, 2)
    assert runner.last_rtc_method == "prefix"
    auto = PolicyRunner(model, processor)
    auto(observation, task)
    auto(observation, task, inference_delay=3, executed_steps=2)
    assert auto.last_rtc_method == "guidance"


def test_runner_request_errors(demo_policy):
    model, processor = demo_policy
    runner = PolicyRunner(model, processor, obs_map=ObservationMap(cameras=["cam"], state=["joints"]))
    observation = {"cam": np.zeros((32, 32, 3), np.uint8), "joints": np.zeros(2, np.float32), "prompt": "go"}
    assert runner(observation).shape == (8, 2)
    cases = [
        ({k: v for k, v in observation.items() if k != "cam"}, "missing camera(s) ['cam']"),
        (observation | {"joints": np.zeros(3)}, "has 3 values; head 'color_reach::delta_xy' expects 2"),
        ({k: v for k, v in observation.items() if k != "prompt"}, "task string under 'prompt'"),
        (observation | {"cam": np.zeros((32, 32), np.uint8)}, "camera 'cam': expected an HxWx3"),
    ]
    for bad, message in cases:
        with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            runner(bad)
    with pytest.raises(RequestError, match="unknown normalization head 'nope'"):
        runner(observation, head="nope")
    with pytest.raises(RequestError, match=r"inference_delay=8: an integer in \[0, 8\)"):
        runner(observation, inference_delay=8, executed_steps=0)
    with pytest.raises(RequestError, match=r"executed_steps=9"):
        runner(observation, inference_delay=1, executed_steps=9)


# ---- the server, through openpi-client ---------------------------------------------------------------------------
class Server:
    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hf_vla.serve", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.log.append(line)
            if "listening on ws://" in line:
                self.uri = line.strip().rsplit(" ", 1)[-1]
                return
        self.stop()
        raise RuntimeError("server did not start:\n" + "".join(self.log))

    def stop(self) -> str:
        self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return "".join(self.log) + (out or "")


@pytest.fixture(scope="module")
def server(checkpoint):
    running = Server("--checkpoint", str(checkpoint), "--seed", "5")
    yield running
    running.stop()


def test_server_matches_in_process_sampling(server, demo_policy):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    model, processor = demo_policy
    client = WebsocketClientPolicy(server.uri)
    metadata = client.get_server_metadata()
    assert metadata["chunk_size"] == 8 and metadata["action_dims"] == {HEAD: 2} and metadata["policy"] == "pi05"
    generator = torch.Generator().manual_seed(5)  # the server seeds every connection's noise with --seed
    for observation, task in observations(3, seed=20):
        reply = client.infer({**observation, "prompt": task})
        noise = torch.randn(1, 8, 2, generator=generator)
        expected = processor.unnormalize_actions(model.sample_actions(**model_inputs(processor, observation, task),
                                                                      noise=noise), HEAD)[0].numpy()
        assert reply["actions"].shape == (8, 2) and reply["actions"].dtype == np.float32
        np.testing.assert_allclose(reply["actions"], expected, rtol=0, atol=1e-5)
        assert reply["server_timing"]["infer_ms"] > 0


def test_server_survives_bad_requests_and_disconnects(server):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    observation, task = next(observations(1))
    client = WebsocketClientPolicy(server.uri)
    good = {**observation, "prompt": task}
    bad_requests = [
        ({"prompt": task}, "no image in the observation"),
        (good | {"observation.state": np.zeros(5, np.float32)}, "has 5 values; head 'color_reach::delta_xy' expects 2"),
        (good | {"head": "aloha::joints"}, "unknown normalization head 'aloha::joints'"),
        (good | {"rtc/inference_delay": 3, "rtc/prev_chunk_left_over": np.zeros((3, 7), np.float32)},
         "prev_chunk_left_over: actions has 7 dims"),
    ]
    for request, message in bad_requests:
        with pytest.raises(RuntimeError, match=message):
            client.infer(request)
        assert client.infer(good)["actions"].shape == (8, 2)  # the same connection still serves
    client._ws.send("not msgpack")  # a text frame: answered with an error, not a crash
    assert "expected a binary msgpack message" in client._ws.recv()
    client._ws.close()  # a client that disconnects does not take the server down
    again = WebsocketClientPolicy(server.uri)
    assert again.infer(good)["actions"].shape == (8, 2)
    with urllib.request.urlopen(server.uri.replace("ws://", "http://") + "/healthz", timeout=10) as response:
        assert response.status == 200 and response.read() == b"OK\n"


def test_server_real_time_chunking(server):
    """The client says how much of the last chunk it executed; the reply continues that chunk (same as sending the
    remainder explicitly)."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    observation, task = next(observations(1, seed=40))
    client = WebsocketClientPolicy(server.uri)
    reply = client.infer({**observation, "prompt": task})
    assert "rtc/method" not in reply  # nothing continued
    first = reply["actions"]
    reply = client.infer({**observation, "prompt": task, "rtc/inference_delay": 2, "rtc/executed_steps": 3})
    second = reply["actions"]
    assert reply["rtc/method"] == "guidance"  # the demo policy was not trained with committed prefixes
    np.testing.assert_allclose(second[:2], first[3:5], rtol=0, atol=1e-6)
    explicit = client.infer({**observation, "prompt": task, "rtc/inference_delay": 2,
                             "rtc/prev_chunk_left_over": first[3:]})["actions"]
    np.testing.assert_allclose(explicit[:2], first[3:5], rtol=0, atol=1e-6)


def test_evaluate_through_the_server_equals_in_process(server, checkpoint, tmp_path):
    """`evaluate --server` with a simulated delay and RTC gives the episodes in-process evaluation gives (same seed)."""
    from hf_vla.evaluate import evaluate_checkpoint

    common = dict(episodes=3, save_videos=0, progress=False, inference_delay=2, rtc=True, n_action_steps=4)
    remote = evaluate_checkpoint(server=server.uri, seed=5, output_dir=tmp_path / "remote", **common)
    local = evaluate_checkpoint(checkpoint, seed=5, output_dir=tmp_path / "local", **common)
    assert remote.mean_steps == local.mean_steps and remote.successes == local.successes
    assert remote.boundary_jump == pytest.approx(local.boundary_jump, abs=1e-5)
    assert json.loads((tmp_path / "remote" / "eval_result.json").read_text())["rtc"] is True
    assert remote.rtc_method == local.rtc_method == "guidance"  # as the server's replies and the runner report it
    with pytest.raises(ValueError, match=r"n_action_steps \(7\) \+ inference_delay \(2\) exceeds the chunk size \(8\)"):
        evaluate_checkpoint(server=server.uri, **(common | {"n_action_steps": 7}))


def test_serve_cli_rejects_an_unknown_head(checkpoint):
    result = subprocess.run([sys.executable, "-m", "hf_vla.serve", "--checkpoint", str(checkpoint), "--port", "0",
                             "--head", "nope::x"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 2 and "--head: unknown normalization head 'nope::x'" in result.stderr


def test_observation_map_file(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"cameras": ["a"], "state": ["s1", "s2"], "prompt": "instruction"}))
    mapped = ObservationMap.from_json(path)
    assert mapped.cameras == ["a"] and mapped.state == ["s1", "s2"] and mapped.prompt == "instruction"
    assert mapped.state_vector({"s1": [1.0], "s2": np.array([2.0, 3.0])}).tolist() == [1.0, 2.0, 3.0]
    path.write_text(json.dumps({"camera": ["a"]}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['camera'\]"):
        ObservationMap.from_json(path)


def test_server_seed_is_per_connection(server):
    """Each connection starts its noise stream at --seed: the same observation gives the same first chunk."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    observation, task = next(observations(1, seed=60))
    chunks = [WebsocketClientPolicy(server.uri).infer({**observation, "prompt": task})["actions"] for _ in range(2)]
    np.testing.assert_array_equal(chunks[0], chunks[1])


