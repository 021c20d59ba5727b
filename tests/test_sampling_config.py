"""`sample_actions`' options as one object (`SamplingConfig`, as `generate` takes a `GenerationConfig`): the object and
the same options by name give the same chunk, a name overrides the object for one call and leaves it unchanged, an
unknown name and a bad value fail in one line, and every option reaches the sampler (each changes the chunk)."""

import pytest
import torch
from conftest import randomize_

from hf_vla.models.common.rtc_config import RTCConfig
from hf_vla.models.common.sampling_config import SamplingConfig
from hf_vla.models.pi05 import PI05ForConditionalGeneration
from hf_vla.tiny import tiny_pi05_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomize_(PI05ForConditionalGeneration(tiny_pi05_config(advantage_indicator="embedding")), seed=1).eval()


def _inputs(config, batch=2, seq=7):
    g = torch.Generator().manual_seed(0)
    size = config.image_size
    return {"input_ids": torch.randint(1, config.vlm_config.text_config.vocab_size, (batch, seq), generator=g),
            "attention_mask": torch.ones(batch, seq, dtype=torch.bool),
            "pixel_values": torch.rand(batch, 2, 3, size, size, generator=g) * 2 - 1,
            "pixel_attention_mask": torch.ones(batch, 2, dtype=torch.bool)}


def _noise(config, batch=2):
    return torch.randn(batch, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(1))


def test_the_object_and_the_names_sample_the_same_chunk(model):
    config = model.config
    inputs, noise = _inputs(config), _noise(config)
    leftover = torch.randn(config.chunk_size - 2, config.max_action_dim, generator=torch.Generator().manual_seed(2))
    guided = {"advantage_ids": torch.full((2,), 2), "uncond_input_ids": inputs["input_ids"],
              "uncond_attention_mask": inputs["attention_mask"]}
    options = {"num_steps": 3, "cfg_beta": 2.0, "prev_chunk_left_over": leftover, "inference_delay": 2,
               "execution_horizon": 4, "rtc_config": RTCConfig(method="guidance", execution_horizon=6)}
    sampling = SamplingConfig(**options)
    with torch.no_grad():
        by_object = model.sample_actions(**inputs, **guided, noise=noise.clone(), sampling_config=sampling)
        by_name = model.sample_actions(**inputs, **guided, noise=noise.clone(), **options)
        torch.testing.assert_close(by_object, by_name, atol=0, rtol=0)
        # every option reaches the sampler: changing any one changes the chunk
        for name, other in {"num_steps": 5, "cfg_beta": 1.0, "inference_delay": 0, "execution_horizon": 1,
                            "prev_chunk_left_over": leftover + 1.0,
                            "rtc_config": RTCConfig(method="guidance", max_guidance_weight=0.5)}.items():
            changed = SamplingConfig(**{**options, name: other, **({"prev_chunk_left_over": None}
                                                                  if name == "inference_delay" else {})})
            moved = model.sample_actions(**inputs, **guided, noise=noise.clone(), sampling_config=changed)
            assert (moved - by_object).abs().max() > 1e-6, name
        # a name overrides the object for this call only
        overridden = model.sample_actions(**inputs, **guided, noise=noise.clone(), sampling_config=sampling,
                                          num_steps=5)
        five = model.sample_actions(**inputs, **guided, noise=noise.clone(), **{**options, "num_steps": 5})
    torch.testing.assert_close(overridden, five, atol=0, rtol=0)
    assert sampling.num_steps == 3


def test_defaults_are_the_model_config(model):
    config = model.config
    inputs, noise = _inputs(config), _noise(config)
    with torch.no_grad():
        default = model.sample_actions(**inputs, noise=noise.clone())
        explicit = model.sample_actions(**inputs, noise=noise.clone(),
                                        sampling_config=SamplingConfig(num_steps=config.num_inference_steps))
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)


def test_bad_options_and_unknown_names_fail_in_one_line(model):
    inputs = _inputs(model.config)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['num_step'\].*SamplingConfig"):
        model.sample_actions(**inputs, num_step=3)
    for options, message in [({"num_steps": 0}, "num_steps=0"), ({"num_steps": 2.5}, "num_steps=2.5"),
                             ({"inference_delay": -1}, "inference_delay=-1"),
                             ({"inference_delay": 2}, "needs prev_chunk_left_over"),
                             ({"subtask": "open the drawer"}, "subtask='open the drawer'"),
                             ({"rtc_config": {"method": "prefix"}}, "an RTCConfig, got dict"),
                             ({"execution_horizon": -3}, "execution_horizon=-3")]:
        with pytest.raises(ValueError, match=message) as caught:
            SamplingConfig(**options)
        assert "\n" not in str(caught.value)
        with pytest.raises(ValueError, match=message):  # the same check where the option comes by name
            model.sample_actions(**inputs, **options)


def test_one_object_for_the_processor_and_the_model(tiny_tokenizer):
    """The processor reads the same object's guidance (it adds the unconditioned prompt), the model its steps: both
    calls given one `SamplingConfig` sample what the options given by name sample."""
    from hf_vla.models.pi05 import PI05Processor

    config = tiny_pi05_config(tokenizer_max_length=64, advantage_indicator="embedding")
    model = randomize_(PI05ForConditionalGeneration(config), seed=3).eval()
    stats = {"arm": {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}, "actions": {"q01": [-1.0] * 3, "q99": [1.0] * 3}}}
    processor = PI05Processor.from_config(config, tiny_tokenizer, norm_stats=stats)
    processor.advantage_conditioned = True
    generator = torch.Generator().manual_seed(0)
    observation = {"images": torch.randint(0, 255, (2, 2, 3, 32, 32), generator=generator, dtype=torch.uint8),
                   "text": ["pick the cube"] * 2, "state": torch.rand(2, 2, generator=generator) * 2 - 1}
    sampling = SamplingConfig(cfg_beta=2.5, num_steps=4)
    by_object = processor(**observation, sampling_config=sampling)
    by_name = processor(**observation, cfg_beta=2.5)
    assert by_object.keys() == by_name.keys() and "uncond_input_ids" in by_object
    for key in by_name:
        assert torch.equal(by_object[key], by_name[key]), key
    noise = _noise(config)
    with torch.no_grad():
        chunk = model.sample_actions(**{k: v for k, v in by_object.items() if k != "cfg_beta" and k != "state"},
                                     noise=noise.clone(), sampling_config=sampling)
        named = model.sample_actions(**{k: v for k, v in by_name.items() if k != "state"}, noise=noise.clone(),
                                     num_steps=4)
        unguided = model.sample_actions(**{k: v for k, v in by_name.items() if k not in ("state", "cfg_beta")},
                                        noise=noise.clone(), num_steps=4, cfg_beta=1.0)
    torch.testing.assert_close(chunk, named, atol=0, rtol=0)
    assert (chunk - unguided).abs().max() > 1e-5  # the object's beta reached the sampler


@pytest.mark.parametrize("case", ["plain", "guided", "rtc"])
def test_candidates_share_one_prefix_and_each_is_the_single_sample_of_its_noise(model, case, monkeypatch):
    """Best-of-N's candidates: `num_candidates` N returns `[B, N, T, d]`, candidate j of a row equal to one sample of
    that row with candidate j's noise (plain, guided towards "positive", continuing a chunk per row), from one prefix
    computation per call."""
    config, n = model.config, 3
    inputs = _inputs(config)
    options = {"num_steps": 4}
    if case == "guided":
        inputs |= {"advantage_ids": torch.full((2,), 2), "uncond_input_ids": inputs["input_ids"],
                   "uncond_attention_mask": inputs["attention_mask"]}
        options["cfg_beta"] = torch.tensor([2.0, 0.5])
    if case == "rtc":
        options |= {"prev_chunk_left_over": torch.randn(2, config.chunk_size - 2, config.max_action_dim,
                                                        generator=torch.Generator().manual_seed(3)),
                    "inference_delay": 2, "rtc_config": RTCConfig(method="guidance")}
    noise = torch.randn(2, n, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(4))
    calls = []
    original = model.prefix_cache
    monkeypatch.setattr(model, "prefix_cache", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        chunks = model.sample_actions(**inputs, noise=noise.clone(), num_candidates=n, **options)
        assert len(calls) == 1 and chunks.shape == noise.shape
        for j in range(n):
            alone = model.sample_actions(**inputs, noise=noise[:, j].clone(), **options)
            torch.testing.assert_close(chunks[:, j], alone, atol=1e-5, rtol=1e-5)
    assert (chunks[:, 0] - chunks[:, 1]).abs().max() > 1e-3  # different noise, different candidates


def test_candidates_refuse_a_noise_of_the_wrong_shape(model):
    config = model.config
    inputs = _inputs(config)
    with pytest.raises(ValueError, match=r"noise of shape \(2, 5, 6\); \(2, 3, 5, 6\) expected \(rows, candidates"):
        model.sample_actions(**inputs, noise=torch.zeros(2, config.chunk_size, config.max_action_dim),
                             num_candidates=3)
    with pytest.raises(ValueError, match="num_candidates=0"):
        SamplingConfig(num_candidates=0)
