"""Serving and real-time chunking.

Oracles: lerobot's own RTC (`euler_integrate` + `RTCProcessor`) on the same velocity field, an analytic vector-Jacobian
product, in-process `sample_actions` + un-normalisation against the server's replies through the real openpi-client.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import REPO, randomize_, refused

import hf_vla.envs  # noqa: F401  (registers ColorReach)
from hf_vla.models.common.rtc import RTCConfig, guidance_weight, guided_velocity, prefix_weights
from hf_vla.models.pi05 import PI05Config, PI05ForConditionalGeneration, PI05Processor
from hf_vla.serving.policy import ObservationMap, PolicyRunner, RequestError, rtc_config_from_args

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
    from hf_vla.errors import ConfigError
    from hf_vla.parser import CommandParser
    from hf_vla.serving.arguments import RTCArguments

    parser = CommandParser("serve", (RTCArguments,), "")
    assert rtc_config_from_args(parser.parse([])) == RTCConfig() == parser.parse([]).rtc_config()
    args = parser.parse(["--rtc_jacobian", "--prefix_attention_schedule", "exp", "--max_guidance_weight", "5",
                         "--execution_horizon", "3"])
    assert rtc_config_from_args(args) == RTCConfig(execution_horizon=3, max_guidance_weight=5.0,
                                                   prefix_attention_schedule="exp", jacobian=True)
    with pytest.raises(ConfigError, match="argument --prefix_attention_schedule: invalid choice: 'cosine'"):
        parser.parse(["--prefix_attention_schedule", "cosine"])


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
    fresh = PolicyRunner(model, processor, obs_map=ObservationMap(cameras=["cam"], state=["joints"]))
    with pytest.raises(RequestError, match=r"executed_steps=-1"):  # no previous chunk: still a client's bug
        fresh(observation, executed_steps=-1)
    leftover = np.zeros((4, 2), np.float32)
    for horizon in (-5, 0, 9, 2**63 - 1, True):
        with pytest.raises(RequestError, match=re.escape(f"execution_horizon={horizon!r}: an integer in [1, 8]")):
            runner(observation, inference_delay=1, prev_chunk_left_over=leftover, execution_horizon=horizon)
    with pytest.raises(RequestError, match=re.escape("prev_chunk_left_over: expected [steps in 1..8, action_dim], got "
                                                     "(0, 2)")):
        runner(observation, inference_delay=1, prev_chunk_left_over=np.zeros((0, 2), np.float32))
    assert runner(observation, inference_delay=1, prev_chunk_left_over=leftover, execution_horizon=8).shape == (8, 2)


def test_keepalive_failure_is_one_line_without_a_traceback(capsys):
    """websockets logs a failed keepalive ping (a ping meeting a connection the server is closing) as an ERROR with
    a traceback; the server's filter turns it into one INFO line."""
    import logging

    from hf_vla.serving.server import quiet_keepalive_failures

    quiet_keepalive_failures()
    quiet_keepalive_failures()  # installed once
    source = logging.getLogger("websockets.server")
    assert sum(type(f).__name__ == "_KeepaliveFailure" for f in source.filters) == 1
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    source.addHandler(handler)
    try:
        try:
            raise BrokenPipeError(32, "Broken pipe")
        except BrokenPipeError:
            source.error("keepalive ping failed", exc_info=True)
    finally:
        source.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.strip() == "INFO keepalive ping on a closing connection failed (BrokenPipeError: [Errno 32] Broken pipe)"


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
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    common = dict(episodes=3, save_videos=0, inference_delay=2, rtc=True, n_action_steps=4, device="cpu")
    remote = evaluate_checkpoint(EvaluateArguments(server=server.uri, seed=5, output_dir=tmp_path / "remote", **common),
                                 progress=False)
    local = evaluate_checkpoint(EvaluateArguments(checkpoint, seed=5, output_dir=tmp_path / "local", **common),
                                progress=False)
    assert remote.mean_steps == local.mean_steps and remote.successes == local.successes
    assert remote.boundary_jump == pytest.approx(local.boundary_jump, abs=1e-5)
    assert json.loads((tmp_path / "remote" / "eval_result.json").read_text())["rtc"] is True
    assert remote.rtc_method == local.rtc_method == "guidance"  # as the server's replies and the runner report it
    with pytest.raises(ValueError, match=r"n_action_steps \(7\) \+ inference_delay \(2\) exceeds the chunk size \(8\)"):
        evaluate_checkpoint(EvaluateArguments(server=server.uri, **(common | {"n_action_steps": 7})), progress=False)


def test_serve_cli_rejects_an_unknown_head(checkpoint, capsys, monkeypatch):
    from hf_vla.serve import cli
    from hf_vla.serving.server import PolicyServer

    def serves(*args, **kwargs):  # in this process: a server that got this far would never return
        raise AssertionError("--head nope::x was not refused before serving")

    monkeypatch.setattr(PolicyServer, "serve", serves)
    last = refused(cli, ["--checkpoint", str(checkpoint), "--port", "0", "--head", "nope::x"], capsys)
    assert "--head: unknown normalization head 'nope::x'" in last, last


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




# ---- garbage in, no action out (issue: serving under load and bad input) ------------------------------------------
def _garbage(observation: dict) -> list[tuple[dict, str]]:
    """(request, message text) pairs a policy must refuse: each would otherwise yield a normal-looking action chunk."""
    image = observation["observation.image"]
    float_image = image.astype(np.float32) / 255
    return [
        (observation | {"observation.state": np.array([np.nan, 0.0], np.float32)},
         "state 'observation.state': value(s) at index [0] are NaN or inf"),
        (observation | {"observation.state": np.array([0.0, np.inf], np.float32)}, "at index [1] are NaN or inf"),
        (observation | {"observation.state": np.array([0.0, 1e39])}, "at index [1] are NaN or inf"),  # float32 overflow
        (observation | {"observation.state": np.array([0.0, 3e4], np.float32)}, "lies 1.5e+04 widths outside head"),
        (observation | {"observation.image": np.where(float_image > 0.5, np.inf, float_image)},
         "pixel value(s) are NaN or inf"),
        (observation | {"observation.image": float_image * 255}, "float pixels must lie in [0, 1], got "),
        (observation | {"observation.image": image.astype(np.int64)}, "expected uint8 (0..255) or float"),
        (observation | {"observation.image": np.zeros((0, 32, 3), np.uint8)}, "image of 0x32 pixels"),
        (observation | {"prompt": 7}, "task string under 'prompt' (got int)"),
        (observation | {"prompt": "x" * 2001}, "task string of 2001 characters; at most 2000"),
    ]


def test_runner_refuses_garbage(demo_policy):
    """PolicyRunner (in-process) refuses each bad observation before the model runs; the next good one is served."""
    from hf_vla.serving.policy import InputLimits

    model, processor = demo_policy
    runner = PolicyRunner(model, processor, limits=InputLimits(max_image_side=64))
    observation, task = next(observations(1, seed=70))
    good = {**observation, "prompt": task}
    expected = runner(good)
    calls = []
    original = model.sample_actions
    model.sample_actions = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for request, message in _garbage(good) + [
            (good | {"observation.image": np.zeros((65, 32, 3), np.uint8)}, "each side must be 1...64"),
            (good | {"observation.state": np.array(["a", "b"])}, "state 'observation.state': expected numbers"),
        ]:
            with pytest.raises(RequestError, match=re.escape(message)):
                runner(request)
        with pytest.raises(RequestError, match="prev_chunk_left_over: holds NaN or inf"):
            runner(good, inference_delay=1, prev_chunk_left_over=np.full((4, 2), np.nan, np.float32))
        with pytest.raises(RequestError, match="states: NaN or inf in the batch"):
            runner.predict(torch.zeros(1, 1, 3, 32, 32, dtype=torch.uint8), np.array([[np.nan, 0.0]]), [task],
                           torch.ones(1, 1, dtype=torch.bool))
        assert calls == []  # the model never ran on any of them
    finally:
        del model.sample_actions
    assert runner(good).shape == expected.shape


@pytest.fixture(scope="module")
def guarded_server(checkpoint):
    """A server with an API key, a 1 MiB message bound, 256 px images at most and its camera named."""
    running = Server("--checkpoint", str(checkpoint), "--api_key", "s3cret", "--max_message_mb", "1",
                     "--max_image_side", "256", "--cameras", "observation.image")
    yield running
    running.stop()


def test_server_refuses_garbage_and_stays_up(guarded_server):
    """Through the real openpi-client: every garbage request gets its error (never a traceback), no actions, and the
    same connection then serves a good request."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    observation, task = next(observations(1, seed=80))
    good = {**observation, "prompt": task}
    client = WebsocketClientPolicy(guarded_server.uri, api_key="s3cret")
    assert client.get_server_metadata()["limits"]["max_message_mb"] == 1
    cases = _garbage(good) + [
        ({k: v for k, v in good.items() if k != "observation.image"}, "missing camera(s) ['observation.image']"),
        (good | {"observation.image": np.zeros((300, 32, 3), np.uint8)}, "image of 300x32 pixels; each side must be"),
        (good | {"rtc/inference_delay": "2"}, "rtc/inference_delay: expected an integer"),
        (good | {"observation.state": np.array(["a", "b"])}, "observation.state: array dtype '<U1' ('U' kind): only "
                                                             "bool, integer and float arrays"),
        (good | {"head": ["a"]}, "head: expected a string"),
    ]
    for request, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)) as caught:
            client.infer(request)
        assert "Traceback" not in str(caught.value) and "bad request (request " in str(caught.value)
        assert client.infer(good)["actions"].shape == (8, 2)


# ---- hostile input (issue: nothing a client sends can crash the server) ------------------------------------------
FUZZ_FIELDS = ("observation.image", "observation.state", "prompt", "head", "rtc/inference_delay", "rtc/executed_steps",
               "rtc/prev_chunk_left_over", "rtc/execution_horizon")


def _wire(dtype, shape, data=None, item=None):
    """An ndarray as openpi's msgpack_numpy writes it, with whatever dtype/shape/data a client claims."""
    if item is not None:
        return {b"__npgeneric__": True, b"data": item, b"dtype": dtype}
    if data is None:
        itemsize = np.dtype(dtype).itemsize if isinstance(dtype, str) else 8
        data = bytes(range(256)) * (int(np.prod(shape)) * itemsize // 256 + 1)
        data = data[: int(np.prod(shape)) * itemsize]
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


FUZZ_VALUES = {
    "object": _wire("|O", [2]),
    "structured object field": _wire({"names": ["a"], "formats": ["|O"]}, [2]),
    "structured object string": _wire("f4,O", [2], data=b"\x01" * 24),
    "subarray": _wire("(2,)f4", [2], data=b"\x01" * 16),
    "void": _wire("|V8", [2]),
    "datetime": _wire("<M8[ns]", [2]),
    "bytes": _wire("|S4", [2]),
    "unicode": _wire("<U4", [2]),
    "complex": _wire("<c8", [2]),
    "long double": _wire("<f16", [2], data=b"\x01" * 32),
    "big-endian float": _wire(">f4", [2]),
    "big-endian image": _wire(">f4", [32, 32, 3], data=np.full((32, 32, 3), 0.5, ">f4").tobytes()),
    "zero-size": _wire("<f4", [0]),
    "zero-size image": _wire("|u1", [0, 0, 3], data=b""),
    "huge shape": _wire("<f4", [2**40, 2**40], data=b"\x00" * 8),
    "negative shape": _wire("<f4", [-1], data=b""),
    "shape not a list": _wire("<f4", "ab", data=b"\x00" * 8),
    "too many dims": _wire("|u1", [1] * 40, data=b"\x00"),
    "data not bytes": _wire("<f4", [2], data="abcdefgh"),
    "dtype not a string": _wire(7, [2], data=b"\x00" * 8),
    "object scalar": _wire("|O", None, item=12345),
    "datetime scalar": _wire("<M8[ns]", None, item=5),
    "scalar of a string": _wire("<i8", None, item="7"),
    "nested object": [_wire("|O", [2])],
}


def test_server_survives_every_dtype_in_every_field(server):
    """A fuzz over the wire format: every field of a request, every dtype kind a client can claim (object, structured,
    void, datetime, strings, complex, long double, big-endian, zero-size, huge or malformed shapes). Each request
    gets a reply on the same connection (an action chunk or a bad request naming the field, never an internal error),
    and the server process stays alive and serves a good request after all of them."""
    import websockets.sync.client

    from hf_vla.serving.codec import packb, unpackb

    observation, task = next(observations(1, seed=90))
    good = {**observation, "prompt": task}
    with websockets.sync.client.connect(server.uri, max_size=None) as ws:
        unpackb(ws.recv())  # metadata
        answered = {}
        for field in FUZZ_FIELDS:
            for name, value in FUZZ_VALUES.items():
                request = good | {field: value}
                if field.startswith("rtc/") and field != "rtc/inference_delay":
                    request["rtc/inference_delay"] = 1
                ws.send(packb(request))
                reply = ws.recv(timeout=60)
                assert server.process.poll() is None, f"the server died on {field} = {name}"
                if isinstance(reply, str):
                    assert reply.startswith("bad request"), (field, name, reply)
                    answered[field, name] = reply
                else:
                    actions = unpackb(reply)["actions"]
                    assert np.isfinite(actions).all() and actions.shape == (8, 2), (field, name)
                    answered[field, name] = "actions"
        assert len(answered) == len(FUZZ_FIELDS) * len(FUZZ_VALUES)
        # what must be refused is refused, naming the field
        for field in FUZZ_FIELDS:
            for name in ("object", "structured object field", "void", "datetime", "unicode", "complex",
                         "huge shape", "object scalar"):
                assert answered[field, name].startswith("bad request") and field in answered[field, name], \
                    (field, name, answered[field, name])
        assert "only bool, integer and float arrays" in answered["rtc/executed_steps", "object"]
        assert answered["observation.state", "big-endian float"] == "actions"  # a numeric array in any byte order
        ws.send(packb(good))
        assert unpackb(ws.recv(timeout=60))["actions"].shape == (8, 2)
    assert server.process.poll() is None


def test_rtc_leftover_is_range_checked(server, demo_policy):
    """A leftover far outside the head's action range is a bad request (the state's range policy), in the server and
    in-process, never blended into the chunk and never an internal error."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    observation, task = next(observations(1, seed=91))
    good = {**observation, "prompt": task}
    client = WebsocketClientPolicy(server.uri)
    client.infer(good)
    for value, shown in ((1e6, "1e+06"), (3e38, "3e+38"), (-1e6, "-1e+06")):
        with pytest.raises(RuntimeError, match=re.escape(f"prev_chunk_left_over: action {shown} at step 0, dim 0 "
                                                         f"lies ")) as caught:
            client.infer(good | {"rtc/inference_delay": 2,
                                 "rtc/prev_chunk_left_over": np.full((5, 2), value, np.float32)})
        assert "bad request" in str(caught.value) and "widths outside head 'color_reach::delta_xy'" in str(caught.value)
    near = np.full((5, 2), 0.15, np.float32)  # outside q01..q99 (+-0.1) but within the limit: accepted
    assert client.infer(good | {"rtc/inference_delay": 2, "rtc/prev_chunk_left_over": near})["actions"].shape == (8, 2)
    model, processor = demo_policy
    runner = PolicyRunner(model, processor)
    with pytest.raises(RequestError, match="prev_chunk_left_over: action 1e\\+06 at step 3, dim 1"):
        leftover = np.zeros((5, 2), np.float32)
        leftover[3, 1] = 1e6
        runner(good, inference_delay=1, prev_chunk_left_over=leftover)


def test_default_max_connections():
    from hf_vla.serving.limits import CONNECTION_MEMORY_FACTOR, default_max_connections

    assert CONNECTION_MEMORY_FACTOR == 6
    assert default_max_connections(73, available_bytes=24 * 2**30) == 24 * 2**30 // 2 // (6 * 73 * 2**20) == 28
    assert default_max_connections(73, available_bytes=100 * 2**20) == 1  # always room for one robot
    assert default_max_connections(1, available_bytes=2**50) == 256


def test_server_refuses_connections_beyond_max_connections(checkpoint):
    """With --max_connections 2, a third client is refused at the handshake with HTTP 503 and a message saying why; a
    closed connection frees its place."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from websockets.exceptions import InvalidStatus

    running = Server("--checkpoint", str(checkpoint), "--max_connections", "2")
    try:
        first, second = WebsocketClientPolicy(running.uri), WebsocketClientPolicy(running.uri)
        assert first.get_server_metadata()["limits"]["max_connections"] == 2
        with pytest.raises(InvalidStatus) as refused:
            WebsocketClientPolicy(running.uri)
        assert refused.value.response.status_code == 503
        assert b"server full: 2 connections open, --max_connections 2" in refused.value.response.body
        observation, task = next(observations(1, seed=92))
        assert second.infer({**observation, "prompt": task})["actions"].shape == (8, 2)
        first._ws.close()
        deadline = time.monotonic() + 20
        while True:  # the server notices the close on its handler thread
            try:
                third = WebsocketClientPolicy(running.uri)
                break
            except InvalidStatus:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert third.infer({**observation, "prompt": task})["actions"].shape == (8, 2)
    finally:
        log = running.stop()
    assert re.search(r"refused a connection from 127\.0\.0\.1:\d+: 2 connections open \(--max_connections 2\)", log), log


def test_server_limits_and_api_key(guarded_server):
    """An oversized message closes its connection unread (1009) and the server goes on; a missing or wrong key is
    refused at the handshake (401) and logged; `Bearer` is accepted too; clients that vanish are not errors."""
    import socket

    import websockets.sync.client
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    observation, task = next(observations(1, seed=81))
    good = {**observation, "prompt": task}
    client = WebsocketClientPolicy(guarded_server.uri, api_key="s3cret")
    with pytest.raises(ConnectionClosed) as closed:
        client.infer(good | {"observation.image": np.zeros((700, 700, 3), np.uint8)})  # 1.4 MiB > 1 MiB
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    for key in (None, "wrong"):
        with pytest.raises(InvalidStatus) as refused:
            WebsocketClientPolicy(guarded_server.uri, api_key=key)
        assert refused.value.response.status_code == 401
    with websockets.sync.client.connect(guarded_server.uri, max_size=None,
                                        additional_headers={"Authorization": "Bearer s3cret"}) as bearer:
        assert unpackb_reply(bearer.recv())["policy"] == "pi05"
    host, port = guarded_server.uri.removeprefix("ws://").rsplit(":", 1)
    for _ in range(3):  # a client that connects and leaves at once
        socket.create_connection((host, int(port))).close()
    again = WebsocketClientPolicy(guarded_server.uri, api_key="s3cret")
    assert again.infer(good)["actions"].shape == (8, 2)
    time.sleep(0.5)
    log = guarded_server.stop()
    assert "refused a connection from 127.0.0.1" in log and "wrong API key" in log and "no API key" in log
    assert "exceeds limit" in log and "--max_message_mb 1" in log
    assert " ERROR " not in log and "Traceback" not in log, log


def unpackb_reply(message):
    from hf_vla.serving.codec import unpackb

    return unpackb(message)


class ThreadServer:
    """A `PolicyServer` on a thread of this process (so a test can break its model or watch its batches)."""

    def __init__(self, server):
        import threading

        self.server, started = server, threading.Event()
        self.thread = threading.Thread(target=server.serve, args=("127.0.0.1", 0),
                                       kwargs={"ready": lambda port: (setattr(self, "port", port), started.set())},
                                       daemon=True)
        self.thread.start()
        assert started.wait(30)
        self.uri = f"ws://127.0.0.1:{self.port}"

    def stop(self):
        self.server.shutdown()
        self.thread.join(timeout=10)


def test_internal_error_reply_names_a_request_id_not_a_traceback(demo_policy, caplog):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from hf_vla.serving.server import PolicyServer

    model, processor = demo_policy

    class Broken(torch.nn.Module):
        config = model.config

        def sample_actions(self, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access at /secret/path/kernel.cu")

    runner = PolicyRunner(model, processor)
    runner.model = Broken()
    served = ThreadServer(PolicyServer(runner))
    try:
        client = WebsocketClientPolicy(served.uri)
        observation, task = next(observations(1))
        with caplog.at_level("ERROR", logger="hf_vla.serve"), pytest.raises(RuntimeError) as caught:
            client.infer({**observation, "prompt": task})
        reply = str(caught.value)
        assert "inference failed (request " in reply and "/secret/path" not in reply and "Traceback" not in reply
        request_id = reply.split("(request ")[1].split(")")[0]
        logged = [r for r in caplog.records if request_id in r.getMessage()]
        assert logged and "/secret/path" in logged[0].exc_text  # the traceback is in the log, under that id
    finally:
        served.stop()


def test_batcher_runs_waiting_requests_in_one_forward(demo_policy):
    """Requests that wait while a forward runs share the next one; each row equals its own batch-1 sample (1e-5)."""
    import threading

    from hf_vla.serving.batcher import Batcher

    model, processor = demo_policy
    runners = [PolicyRunner(model, processor, seed=i) for i in range(4)]
    requests = [runner.prepare({**o, "prompt": t}) for runner, (o, t) in zip(runners, observations(4, seed=90))]
    alone = [sample_batch_one(model, request) for request in requests]
    gate, entered = threading.Event(), threading.Event()
    original = model.sample_actions

    def gated(*args, **kwargs):
        entered.set()
        assert gate.wait(30)
        return original(*args, **kwargs)

    model.sample_actions = gated
    try:
        batcher = Batcher(model, "cpu", max_batch=8)
        results = [None] * 4

        def submit(i):
            results[i] = batcher.submit(requests[i])

        threads = [threading.Thread(target=submit, args=(0,))]
        threads[0].start()
        assert entered.wait(30)  # request 0 is in the model; 1-3 queue behind it
        threads += [threading.Thread(target=submit, args=(i,)) for i in (1, 2, 3)]
        for thread in threads[1:]:
            thread.start()
        deadline = time.monotonic() + 30
        while batcher.queue.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        for thread in threads:
            thread.join(30)
    finally:
        del model.sample_actions
    assert batcher.batch_sizes == [1, 3]
    for got, expected in zip(results, alone):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def sample_batch_one(model, request):
    from hf_vla.serving.policy import sample_batch

    return sample_batch(model, [request], "cpu")[0]


@pytest.mark.slow
def test_serve_load_benchmark_small():
    """benchmarks/speed/serve_load.py at CI size: every request of 4 concurrent clients answered with a finite chunk, RSS
    grows less than 30 MB over 200 connect/disconnect cycles, and the server log has no ERROR line."""
    result = subprocess.run([sys.executable, "benchmarks/speed/serve_load.py", "--clients", "1", "4", "--requests", "8",
                             "--cycles", "200", "--batching_repeats", "0"], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    for run in report["load"]:
        assert run["answered"] == run["requests"] and run["failures"] == 0, run
    assert report["churn"]["requests_answered"] == 40 and report["churn"]["rss_growth_mb"] < 30, report["churn"]
    assert report["server_log_errors"] == [], report["server_log_errors"]
