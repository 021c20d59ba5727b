"""`python -m hf_vla.convert --to lerobot`: an hf_vla pi0.5 checkpoint in lerobot's native `pi05` format (#75, the
second door).

Oracles: lerobot's own `PI05Policy.from_pretrained` and `make_pre_post_processors(pretrained_path=...)` on the export
against hf_vla's runner on the original checkpoint, the same noise, robot units; lerobot's async-inference
`PolicyServer` on localhost, driven over gRPC with the messages its `robot_client` sends. The architecture is the
tiny one both build (`hf_vla.models.reference`), which lerobot builds under `lerobot_at_dims`.
"""

from __future__ import annotations

import json
import pickle
import time
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_pipeline_oracle import ACTION_DIM, CAMERA, STATE_DIM, TOLERANCE, _convert, _lerobot_checkpoint, _observation

from hf_vla.convert import main as convert_main
from hf_vla.errors import ConfigError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TASK = "pick the cube"


def _stats(seed: int, mode: str | None = None) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for key, dim in (("state", STATE_DIM), ("actions", ACTION_DIM)):
        low, high = rng.uniform(-2, -0.5, dim), rng.uniform(0.5, 2, dim)
        out[key] = {"q01": low.tolist(), "q99": high.tolist(), "mean": ((low + high) / 2).tolist(),
                    "std": ((high - low) / 3).tolist(), "min": (low - 0.5).tolist(), "max": (high + 0.5).tolist()}
        if mode:
            out[key]["mode"] = mode
    return out


def hf_vla_checkpoint(path, tokenizer, heads=("arm::joint",), value_head=False, relative_mask=None):
    """A tiny pi0.5 built by hf_vla at the reference dims, random weights, its processor and deployment contract
    (`relative_mask`: every head's relative actions)."""
    from hf_vla.deployment.contract import DeploymentConfig
    from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
    from hf_vla.models.reference import Dims, _randomize, hf_pi05_config

    config = hf_pi05_config(Dims())
    config.tokenizer_max_length, config.value_head = 48, value_head
    model = PI05ForConditionalGeneration(config)
    _randomize(model, 5)
    stats = {head: _stats(i, "MEAN_STD" if i else None) for i, head in enumerate(heads)}
    if relative_mask is not None:
        for head_stats in stats.values():
            head_stats["actions"]["relative_mask"] = list(relative_mask)
    processor = PI05Processor.from_config(config, tokenizer, norm_stats=stats)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    spec = {"cameras": [{"key": CAMERA, "height": 32, "width": 32}], "state": {"key": "observation.state",
            "dim": STATE_DIM}, "action": {"key": "action", "dim": ACTION_DIM}, "instruction": "task"}
    DeploymentConfig(policy="pi05", chunk_size=config.chunk_size, n_action_steps=3, image_size=32,
                     heads={head: dict(spec) for head in heads}, default_head=heads[0]).save(path)
    return path


def export(source, output, *flags):
    return convert_main(["--input", str(source), "--to", "lerobot", "--output", str(output), *flags])


class _PaliGemmaTokenizer:
    """lerobot's files name PaliGemma's tokenizer, which cannot be downloaded here: the tiny one stands in (the
    exports' checkpoints were trained with it)."""

    def __init__(self, tokenizer):
        from lerobot.processor import TokenizerProcessorStep

        original = TokenizerProcessorStep.__post_init__

        def post_init(step):
            if step.tokenizer is None and step.tokenizer_name == "google/paligemma-3b-pt-224":
                step.tokenizer = tokenizer
            original(step)

        self.patch = mock.patch.object(TokenizerProcessorStep, "__post_init__", post_init)

    def __enter__(self):
        return self.patch.__enter__()

    def __exit__(self, *exc):
        return self.patch.__exit__(*exc)


def lerobot_load(directory, checkpoint, tokenizer):
    """What lerobot does with the directory, no hf_vla code: PI05Policy.from_pretrained and the saved processors."""
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from transformers import AutoConfig

    from hf_vla.hub.export import lerobot_at_dims

    with lerobot_at_dims(AutoConfig.from_pretrained(checkpoint)):  # lerobot's classes at the tiny dims
        policy = PI05Policy.from_pretrained(directory).eval()
    with _PaliGemmaTokenizer(tokenizer):
        pre, post = make_pre_post_processors(policy.config, pretrained_path=str(directory))
    return policy, pre, post


def lerobot_chunk(policy, pre, post, image, state, noise):
    batch = {CAMERA: torch.from_numpy(image).permute(2, 0, 1).float()[None] / 255.0,
             "observation.state": torch.from_numpy(state)[None], "task": [TASK]}
    with torch.no_grad():
        return post(policy.predict_action_chunk(pre(batch), noise=noise.clone())).numpy()[0]


def runner_chunk(runner, image, state, noise):
    runner.reset(seed=0)
    request = runner.prepare({CAMERA: image, "observation.state": state}, task=TASK)
    request.noise = noise.clone()
    return runner.finish(request, runner.sample_batch([request])[0])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    """hf_vla-built (two heads, exported per head) and imported from lerobot (relative actions, mean/std)."""
    base = tmp_path_factory.mktemp("export")
    built = hf_vla_checkpoint(base / "built", tiny_tokenizer, heads=("arm::joint", "other::joint"))
    _lerobot_checkpoint(base / "lerobot_relative", tiny_tokenizer, "MEAN_STD", True)
    imported = _convert(base / "lerobot_relative", base / "imported", tiny_tokenizer_dir)
    # a relative mask shorter than the actions: hf_vla keeps the dims past it absolute, and so must lerobot
    short = hf_vla_checkpoint(base / "short_mask", tiny_tokenizer, relative_mask=[True])
    return {"built": (built, "arm::joint"), "built_second_head": (built, "other::joint"),
            "imported_relative": (imported, "arm::joint"), "short_mask": (short, "arm::joint"), "base": base}


@pytest.mark.parametrize("name", ["built", "built_second_head", "imported_relative", "short_mask"])
def test_lerobot_runs_the_export_as_hf_vla_runs_the_checkpoint(checkpoints, name, tiny_tokenizer):
    from hf_vla.serving.policy import ObservationMap, load_policy

    checkpoint, head = checkpoints[name]
    out = export(checkpoint, checkpoints["base"] / f"exported_{name}", "--head", head)
    config = json.loads((out / "config.json").read_text())
    assert config["type"] == "pi05" and config["chunk_size"] == 5 and list(config["input_features"]) == [
        CAMERA, "observation.state"]
    assert config["output_features"]["action"]["shape"] == [ACTION_DIM]
    mode = "QUANTILES" if name in ("built", "short_mask") else "MEAN_STD"
    assert config["normalization_mapping"] == {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode}
    assert config["use_relative_actions"] == (name in ("imported_relative", "short_mask"))
    assert config["n_action_steps"] == json.loads((checkpoint / "deployment_config.json").read_text())[
        "n_action_steps"]
    policy, pre, post = lerobot_load(out, checkpoint, tiny_tokenizer)
    runner = load_policy(checkpoint, head=head, obs_map=ObservationMap(cameras=[CAMERA]))
    for seed in (0, 1, 2):  # seed 2: a state outside the statistics' range
        image, state, noise = _observation(seed)
        np.testing.assert_allclose(lerobot_chunk(policy, pre, post, image, state, noise),
                                   runner_chunk(runner, image, state, noise), rtol=0, atol=TOLERANCE)


def test_the_round_trip_is_bitwise(checkpoints, tiny_tokenizer_dir):
    """hf_vla -> lerobot -> hf_vla: the same weights and the same statistics, bit for bit."""
    base = checkpoints["base"]
    for name in ("built", "imported_relative"):
        checkpoint, head = checkpoints[name]
        out = export(checkpoint, base / f"round_{name}", "--head", head)
        back = _convert(out, base / f"back_{name}", tiny_tokenizer_dir)
        first, second = load_file(checkpoint / "model.safetensors"), load_file(back / "model.safetensors")
        assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
        stats = json.loads((checkpoint / "processor_config.json").read_text())["norm_stats"][head]
        returned = json.loads((back / "processor_config.json").read_text())["norm_stats"]["arm::joint"]
        for key in ("state", "actions"):
            for stat, values in stats[key].items():
                if isinstance(values, list) and stat != "relative_mask":  # as both pipelines compute: float32
                    assert np.array_equal(np.float32(values), np.float32(returned[key][stat])), (key, stat)
                else:
                    assert returned[key][stat] == values, (key, stat)
        assert set(returned["actions"]) == set(stats["actions"]) and returned.get("state", {}).get(
            "mode") == stats["state"].get("mode")
    checkpoint, head = checkpoints["short_mask"]  # [True] for 2 dims comes back as the same mask, spelled in full
    back = _convert(export(checkpoint, base / "round_short"), base / "back_short", tiny_tokenizer_dir)
    assert json.loads((back / "processor_config.json").read_text())["norm_stats"]["arm::joint"]["actions"][
        "relative_mask"] == [True, False]


def test_what_lerobot_cannot_hold_is_refused_or_dropped_in_one_line(checkpoints, tiny_tokenizer, tmp_path, caplog):
    built, _ = checkpoints["built"]
    with pytest.raises(ConfigError, match=r"2 heads \['arm::joint', 'other::joint'\].*--head NAME") as refused:
        export(built, tmp_path / "no_head")
    assert "\n" not in str(refused.value) and not (tmp_path / "no_head").exists()
    with pytest.raises(ConfigError, match="--head 'nope'"):
        export(built, tmp_path / "bad_head", "--head", "nope")
    with pytest.raises(ConfigError, match="is --input"):
        export(built, built, "--head", "arm::joint")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="--overwrite"):
        export(built, tmp_path / "taken", "--head", "arm::joint")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="LoRA adapters; export the run's merged output"):
        export(adapters, tmp_path / "from_adapters")
    critic = hf_vla_checkpoint(tmp_path / "critic", tiny_tokenizer, value_head=True)
    with caplog.at_level("WARNING", logger="hf_vla.hub.export"):
        out = export(critic, tmp_path / "critic_export")
    assert any("not exported: the PPO critic" in r.getMessage() for r in caplog.records)
    assert not [k for k in load_file(out / "model.safetensors") if "value" in k]


def test_a_checkpoint_of_another_vocabulary_is_refused(tmp_path, tiny_tokenizer):
    from hf_vla.deployment.contract import DeploymentConfig
    from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
    from hf_vla.tiny import tiny_pi05_config

    config = tiny_pi05_config()  # the demo's: a small vocabulary lerobot's PaliGemma-sized pi0.5 cannot hold
    PI05ForConditionalGeneration(config).save_pretrained(tmp_path / "demo")
    PI05Processor.from_config(config, tiny_tokenizer, norm_stats={"a::b": _stats(0)}).save_pretrained(tmp_path / "demo")
    spec = {"cameras": [{"key": CAMERA, "height": 32, "width": 32}], "state": {"key": "observation.state", "dim": 2},
            "action": {"key": "action", "dim": 2}}
    DeploymentConfig(policy="pi05", chunk_size=config.chunk_size, n_action_steps=2, image_size=32,
                     heads={"a::b": spec}).save(tmp_path / "demo")
    with pytest.raises(ConfigError, match="PaliGemma's 257,152-token vocabulary"):
        export(tmp_path / "demo", tmp_path / "out")


def test_lerobots_async_policy_server_serves_the_export(checkpoints, tiny_tokenizer, tmp_path, monkeypatch):
    """lerobot's `PolicyServer` on localhost over gRPC, sent what `robot_client` sends: Ready, the policy
    instructions (type pi05, the exported directory, the robot's features), one observation (motor values and a
    camera frame, as a robot reads them), then GetActions: the chunk equals hf_vla's runner's for the same noise."""
    monkeypatch.chdir(tmp_path)  # lerobot's server logs to ./logs/ from the moment its module is imported
    from concurrent import futures

    import grpc
    from lerobot.async_inference.configs import PolicyServerConfig
    from lerobot.async_inference.helpers import RemotePolicyConfig, TimedObservation
    from lerobot.async_inference.policy_server import PolicyServer
    from lerobot.transport import services_pb2, services_pb2_grpc
    from lerobot.transport.utils import send_bytes_in_chunks
    from lerobot.utils.feature_utils import hw_to_dataset_features
    from transformers import AutoConfig

    from hf_vla.hub.export import lerobot_at_dims
    from hf_vla.serving.policy import ObservationMap, load_policy

    checkpoint, head = checkpoints["imported_relative"]
    out = export(checkpoint, checkpoints["base"] / "served", "--head", head)
    motors = ["shoulder.pos", "elbow.pos", "gripper.pos"]
    features = hw_to_dataset_features({**dict.fromkeys(motors, float), "cam": (32, 32, 3)}, "observation",
                                      use_video=False)
    policy_server = PolicyServer(PolicyServerConfig(host="127.0.0.1", port=1))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    services_pb2_grpc.add_AsyncInferenceServicer_to_server(policy_server, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stub = services_pb2_grpc.AsyncInferenceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stub.Ready(services_pb2.Empty())
        instructions = RemotePolicyConfig("pi05", str(out), features, actions_per_chunk=4, device="cpu")
        with lerobot_at_dims(AutoConfig.from_pretrained(checkpoint)), _PaliGemmaTokenizer(tiny_tokenizer):
            stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(instructions)))
        image, state, noise = _observation(1)
        policy_server.policy.model.sample_noise = lambda shape, device: noise.clone()  # the oracle's noise
        raw = {**dict(zip(motors, map(float, state), strict=True)), "cam": image, "task": TASK}
        observation = TimedObservation(timestamp=time.time(), timestep=0, observation=raw, must_go=True)
        stub.SendObservations(send_bytes_in_chunks(pickle.dumps(observation), services_pb2.Observation))
        actions = pickle.loads(stub.GetActions(services_pb2.Empty()).data)
    finally:
        server.stop(0)
    assert [a.get_timestep() for a in actions] == [0, 1, 2, 3]
    chunk = np.stack([a.get_action().numpy() for a in actions])
    runner = load_policy(checkpoint, head=head, obs_map=ObservationMap(cameras=[CAMERA]))
    np.testing.assert_allclose(chunk, runner_chunk(runner, image, state, noise)[:4], rtol=0, atol=TOLERANCE)
