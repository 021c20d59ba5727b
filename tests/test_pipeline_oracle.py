"""The whole pipeline in robot units against lerobot's own: checkpoints written by lerobot's code at tiny dims
(`PI05Policy.save_pretrained` and its `make_pi05_pre_post_processors` pipelines, saved), one per normalisation mode and
one with relative actions and an excluded gripper, converted by `hf_vla.convert`, give the same action chunk as
lerobot's `predict_action_chunk` through its own processors, for the same observation and noise: through AutoModel +
AutoProcessor by hand, through the policy runner `hf_vla.evaluate` and `hf_vla.serve` use, and (relative) through the
server queried with openpi's client. One training step's loss with relative actions equals lerobot's.
"""

from __future__ import annotations

import json
from unittest import mock

import numpy as np
import pytest
import torch

from hf_vla.models.reference import Dims, _randomize, _tiny_lerobot

STATE_DIM, ACTION_DIM, CAMERA = 3, 2, "observation.images.cam"
ACTION_NAMES = ["shoulder", "gripper"]
TOLERANCE = 1e-5  # robot units, fp32


def _stats(rng):
    """Per-feature statistics as lerobot's dataset stats (every statistic a mode may read; none degenerate)."""
    out = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        low = rng.uniform(-2, -0.5, dim)
        high = rng.uniform(0.5, 2, dim)
        out[key] = {"min": low - 0.5, "max": high + 0.5, "mean": (low + high) / 2 + 0.1, "std": (high - low) / 3,
                    "q01": low, "q10": low + 0.2, "q90": high - 0.2, "q99": high, "count": np.array([1000])}
        out[key] = {k: torch.tensor(v, dtype=torch.float32) for k, v in out[key].items()}
    return out


def _lerobot_checkpoint(path, tokenizer, mode: str | None, relative: bool, seed: int = 3):
    """A tiny lerobot pi0.5 policy and its processors, written by lerobot's own save_pretrained."""
    import lerobot.policies.pi05.modeling_pi05 as module
    import lerobot.policies.pi05.processor_pi05 as processor_module
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors
    from lerobot.processor import TokenizerProcessorStep

    d = Dims()
    kwargs = {}
    if mode is not None:
        kwargs["normalization_mapping"] = {"VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode(mode),
                                           "ACTION": NormalizationMode(mode)}
    if relative:
        kwargs |= {"use_relative_actions": True, "relative_exclude_joints": ["gripper"],
                   "action_feature_names": ACTION_NAMES}
    config = PI05Config(chunk_size=d.chunk, n_action_steps=4, max_state_dim=d.max_state, max_action_dim=d.max_action,
                        image_resolution=(d.image_size, d.image_size), dtype="float32", device="cpu",
                        tokenizer_max_length=48,
                        input_features={CAMERA: PolicyFeature(FeatureType.VISUAL, (3, d.image_size, d.image_size)),
                                        "observation.state": PolicyFeature(FeatureType.STATE, (STATE_DIM,))},
                        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))}, **kwargs)
    with _tiny_lerobot(module, d):
        policy = module.PI05Policy(config)
    _randomize(policy.model, seed)
    policy.eval()
    stats = _stats(np.random.default_rng(seed))
    def tiny(tokenizer_name=None, **kwargs):  # the tiny tokenizer instead of PaliGemma's (no download here)
        return TokenizerProcessorStep(tokenizer=tokenizer, **kwargs)

    with mock.patch.object(processor_module, "TokenizerProcessorStep", tiny):
        pre, post = make_pi05_pre_post_processors(config, dataset_stats=stats)
    policy.save_pretrained(path)
    pre.save_pretrained(path)
    post.save_pretrained(path)
    return policy, pre, post


def _observation(seed: int):
    """An image, a state and lerobot's noise; seeds >= 2 draw states far outside the statistics' range (normalised
    below -1: the prompt's bin -1, as lerobot and openpi discretise it)."""
    rng = np.random.default_rng(seed)
    d = Dims()
    image = rng.integers(0, 256, (d.image_size, d.image_size, 3), dtype=np.uint8)
    state = rng.uniform(-1.5, 1.5, STATE_DIM).astype(np.float32) if seed < 2 else np.array(
        [-6.0, rng.uniform(-1, 1), 6.0], np.float32)
    noise = torch.from_numpy(rng.standard_normal((1, d.chunk, d.max_action)).astype(np.float32))
    return image, state, noise


def _lerobot_chunk(policy, pre, post, image, state, noise, task="pick the cube"):
    batch = {CAMERA: torch.from_numpy(image).permute(2, 0, 1).float()[None] / 255.0,
             "observation.state": torch.from_numpy(state)[None], "task": [task]}
    with torch.no_grad():
        chunk = policy.predict_action_chunk(pre(batch), noise=noise.clone())
    return post(chunk).numpy()[0]


def _convert(lerobot_dir, out, tokenizer_dir):
    from test_processor_convert import _tiny_variants

    from hf_vla import convert

    with _tiny_variants():
        convert.main(["--input", str(lerobot_dir), "--output", str(out), "--tokenizer", str(tokenizer_dir),
                      "--head", "arm::joint"])
    return out


CASES = {"quantiles": ("QUANTILES", False), "quantile10": ("QUANTILE10", False), "mean_std": ("MEAN_STD", False),
         "min_max": ("MIN_MAX", False), "identity": ("IDENTITY", False), "default": (None, False),
         "relative_gripper_absolute": ("MEAN_STD", True)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    base = tmp_path_factory.mktemp("oracle")
    out = {}
    for name, (mode, relative) in CASES.items():
        lerobot = _lerobot_checkpoint(base / f"lerobot_{name}", tiny_tokenizer, mode, relative)
        out[name] = (lerobot, _convert(base / f"lerobot_{name}", base / f"hf_{name}", tiny_tokenizer_dir))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_converted_checkpoints_act_as_lerobot_in_robot_units(checkpoints, name):
    from transformers import AutoModel, AutoProcessor

    import hf_vla  # noqa: F401  (registers pi0.5)
    from hf_vla.serving.policy import ObservationMap, load_policy

    (policy, pre, post), converted = checkpoints[name]
    model = AutoModel.from_pretrained(converted).eval()
    processor = AutoProcessor.from_pretrained(converted)
    mode, relative = CASES[name]
    stats = processor.norm_stats["arm::joint"]
    assert stats["actions"].get("mode", "QUANTILES") == (mode or "QUANTILES")
    assert stats["actions"].get("relative_mask") == ([True, False] if relative else None)
    contract = json.loads((converted / "deployment_config.json").read_text())["heads"]["arm::joint"]
    assert contract["normalization"] == {"state": mode or "QUANTILES", "actions": mode or "QUANTILES"}
    assert contract["relative_actions"] == ([True, False] if relative else None)
    runner = load_policy(converted, obs_map=ObservationMap(cameras=[CAMERA]))
    for seed in (0, 1, 2):
        image, state, noise = _observation(seed)
        expected = _lerobot_chunk(policy, pre, post, image, state, noise)
        # by hand, as the README's inference loop
        inputs = processor(images=image, text="pick the cube", state=state)
        with torch.no_grad():
            chunk = model.sample_actions(**inputs, noise=noise.clone())
        ours = processor.unnormalize_actions(chunk).numpy()[0]
        np.testing.assert_allclose(ours, expected, rtol=0, atol=TOLERANCE)
        if seed == 2:  # the state left the range: its prompt holds bin -1, as lerobot's does
            assert " -1 " in f" {' '.join(map(str, processor.discretize_state(processor.normalize(state, 'state'))))} "
        # the policy runner of evaluate / serve / RL / DAgger (prepare, sample, finish), with lerobot's noise
        runner.reset(seed=0)
        request = runner.prepare({CAMERA: image, "observation.state": state}, task="pick the cube")
        request.noise = noise.clone()
        served = runner.finish(request, runner.sample_batch([request])[0])
        np.testing.assert_allclose(served, expected, rtol=0, atol=TOLERANCE)
    if relative:  # the state is added back: another state moves the relative dim, not the absolute gripper
        image, state, noise = _observation(0)
        moved = state + np.array([0.5, 0.0, 0.0], np.float32)
        shift = _lerobot_chunk(policy, pre, post, image, moved, noise) - _lerobot_chunk(policy, pre, post, image,
                                                                                          state, noise)
        inputs = processor(images=image, text="pick the cube", state=moved)
        with torch.no_grad():
            ours = processor.unnormalize_actions(model.sample_actions(**inputs, noise=noise.clone())).numpy()[0]
        np.testing.assert_allclose(ours, _lerobot_chunk(policy, pre, post, image, moved, noise), rtol=0,
                                   atol=TOLERANCE)
        assert np.abs(shift).max() > 0.01  # the state reaches the actions: a test that could fail


def test_one_training_step_with_relative_actions_gives_lerobots_loss(checkpoints):
    """Targets through each side's own processors (relative, then MEAN_STD), the same noise and time: the flow loss
    over the real action dims equals lerobot's `PI05Policy.forward` loss."""
    from transformers import AutoModel, AutoProcessor

    import hf_vla  # noqa: F401

    (policy, pre, _), converted = checkpoints["relative_gripper_absolute"]
    model = AutoModel.from_pretrained(converted).eval()
    processor = AutoProcessor.from_pretrained(converted)
    d = Dims()
    rng = np.random.default_rng(7)
    image, state, _ = _observation(3)
    chunk = rng.uniform(-1, 1, (d.chunk, ACTION_DIM)).astype(np.float32) + state[:ACTION_DIM]
    noise = torch.from_numpy(rng.standard_normal((1, d.chunk, d.max_action)).astype(np.float32))
    time = torch.tensor([0.37])
    policy.model.sample_noise = lambda shape, device: noise.clone()
    policy.model.sample_time = lambda batch, device: time.clone()
    batch = {CAMERA: torch.from_numpy(image).permute(2, 0, 1).float()[None] / 255.0,
             "observation.state": torch.from_numpy(state)[None], "task": ["pick the cube"],
             "action": torch.from_numpy(chunk)[None]}
    with torch.no_grad():
        expected, _ = policy.forward(pre(batch))
        inputs = processor(images=image, text="pick the cube", state=state, actions=chunk)
        x_t = time[:, None, None] * noise + (1 - time[:, None, None]) * inputs["actions"]
        velocity = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"],
                         noise=x_t, timestep=time).logits
    ours = ((noise - inputs["actions"] - velocity) ** 2)[..., :ACTION_DIM].mean()
    assert abs(float(ours) - float(expected)) <= 1e-5, (float(ours), float(expected))
    # and the targets were relative: the excluded gripper is not
    absolute = processor.normalize(torch.from_numpy(chunk), "actions", "arm::joint")
    assert not torch.allclose(inputs["actions"][0, :, 0], absolute[:, 0])
    torch.testing.assert_close(inputs["actions"][0, :, 1], absolute[:, 1])


def test_the_server_acts_as_lerobot_for_openpis_client(checkpoints):
    """The relative checkpoint served (`python -m hf_vla.serve`) and queried with openpi's own client: the chunk is
    lerobot's for the noise the server draws (its connection's generator, seeded by the request's `episode_seed`)."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from test_serve import Server

    (policy, pre, post), converted = checkpoints["relative_gripper_absolute"]
    server = Server("--checkpoint", str(converted))
    try:
        client = WebsocketClientPolicy(server.uri)
        d = Dims()
        for seed in (0, 1):
            image, state, _ = _observation(seed)
            noise = torch.randn(1, d.chunk, d.max_action, generator=torch.Generator().manual_seed(100 + seed))
            reply = client.infer({CAMERA: image, "observation.state": state, "prompt": "pick the cube",
                                  "episode_seed": 100 + seed})
            np.testing.assert_allclose(reply["actions"], _lerobot_chunk(policy, pre, post, image, state, noise),
                                       rtol=0, atol=TOLERANCE)
    finally:
        server.stop()


def test_a_continued_chunk_of_a_relative_head_is_compared_in_the_models_space(checkpoints):
    """Real-time chunking with relative actions: the previous chunk's remainder (the runner's own, or a client's in
    robot units) is re-expressed as offsets from the new observation's state before it guides or is spliced in, so the
    actions the robot executes while the new chunk is computed are the previous chunk's, in robot units, though the
    state moved."""
    from hf_vla.serving.policy import ObservationMap, load_policy

    _, converted = checkpoints["relative_gripper_absolute"]
    runner = load_policy(converted, obs_map=ObservationMap(cameras=[CAMERA]))
    image, state, _ = _observation(0)
    moved = state + np.array([0.4, -0.2, 0.1], np.float32)
    runner.reset(seed=3)
    first = runner({CAMERA: image, "observation.state": state}, task="pick the cube")
    second = runner({CAMERA: image, "observation.state": moved}, task="pick the cube", executed_steps=1,
                    inference_delay=2)
    np.testing.assert_allclose(second[:2], first[1:3], rtol=0, atol=1e-5)
    runner.reset(seed=3)
    third = runner({CAMERA: image, "observation.state": moved}, task="pick the cube", inference_delay=2,
                   prev_chunk_left_over=first[1:])
    np.testing.assert_allclose(third[:2], first[1:3], rtol=0, atol=1e-5)
    assert np.abs(moved - state)[:1].max() > 0.1  # the relative joint's state did move
