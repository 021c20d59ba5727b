"""RECAP (pi*0.6's learning from experience, #94): returns, value bins, advantages and thresholds against float64
computations written here; the advantage indicator in pi0.5's prompt; classifier-free guidance against two separate
forwards; the indicator's dropout in the episode-shuffle stream."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import randomize_

from hf_vla.recap import advantages, bin_centers, episode_returns, hl_gauss_targets, positive_threshold, value_to_bin


# ---- the arithmetic -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("success", [True, False])
def test_returns_against_a_float64_sum_of_rewards(success):
    length, limit, cost = 37, 50, 1000.0
    expected = []
    for t in range(length):
        total = 0.0
        for k in range(t, length):
            total += (0.0 if success else -cost) if k == length - 1 else -1.0
        expected.append(min(0.0, max(-1.0, total / limit)))
    got = episode_returns(length, success, limit, cost)
    assert got.dtype == np.float64 and got.tolist() == expected
    if success:
        assert got[-1] == 0.0 and got[0] == -(length - 1) / limit
    else:
        assert (got == -1.0).all()  # a failure costs more than any limit: the bottom bin


def test_bins_are_the_nearest_centre_and_hl_gauss_sums_to_one():
    centres = bin_centers(201)
    assert len(centres) == 201 and centres[0] == -1.0 and centres[-1] == 0.0
    values = np.array([-1.0, -0.5, 0.0, -0.0026, -0.0024, -0.31234, 0.2, -7.0])
    expected = [int(np.argmin(np.abs(centres - min(0.0, max(-1.0, v))))) for v in values]
    assert value_to_bin(values).tolist() == expected == [0, 100, 200, 199, 200, 138, 200, 0]
    targets = hl_gauss_targets(values, 201, 0.75)
    assert targets.shape == (8, 201) and np.allclose(targets.sum(1), 1.0, atol=1e-12)
    interior = [1, 5]  # (near an end the outer bin also holds the tail beyond it)
    assert (targets[interior].argmax(1) == value_to_bin(values)[interior]).all()
    # the mass of bin i is the Gaussian's between the half-way edges (float64, math.erf)
    width, sigma, v = 1 / 200, 0.75 / 200, -0.5
    cdf = lambda x: 0.5 * (1 + math.erf((x - v) / (sigma * math.sqrt(2))))  # noqa: E731
    assert abs(targets[1, 101] - (cdf(centres[101] + width / 2) - cdf(centres[101] - width / 2))) < 1e-12


def test_the_n_step_advantage_on_a_hand_made_episode():
    """5 frames, success, limit 10, N = 2, values chosen by hand: A_t = r_t/10 + r_{t+1}/10 + V_{t+2} - V_t, and the
    Monte-Carlo rest of the return where t + 2 passes the end."""
    returns = episode_returns(5, True, 10)  # [-0.4, -0.3, -0.2, -0.1, 0.0]
    values = np.array([-0.5, -0.2, -0.25, -0.05, -0.02])
    got = advantages(returns, values, True, 10, lookahead=2)
    expected = [-0.1 - 0.1 + values[2] - values[0], -0.1 - 0.1 + values[3] - values[1],
                -0.1 - 0.1 + values[4] - values[2], returns[3] - values[3], returns[4] - values[4]]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(advantages(returns, values, True, 10, lookahead=None), returns - values)
    failed = advantages(episode_returns(5, False, 10), values, False, 10, lookahead=2)
    # the failure's cost sits in the last step: inside a window only through the (clipped) return
    np.testing.assert_allclose(failed, [-0.2 + values[2] - values[0], -0.2 + values[3] - values[1],
                                        -0.2 + values[4] - values[2], -1 - values[3], -1 - values[4]], atol=1e-15)


@pytest.mark.parametrize("fraction", [0.3, 0.4, 0.55])
def test_the_threshold_gives_the_requested_positive_fraction(fraction):
    rng = np.random.default_rng(0)
    for n in (10, 333, 1000):
        values = rng.normal(size=n)
        threshold = positive_threshold(values, fraction)
        assert abs(int((values > threshold).sum()) - fraction * n) <= 0.5  # to one frame


# ---- the indicator in the prompt ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(tiny_tokenizer):
    from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
    from hf_vla.tiny import tiny_pi05_config

    config = tiny_pi05_config(tokenizer_max_length=64)
    model = randomize_(PI05ForConditionalGeneration(config), seed=3).eval()
    stats = {"arm": {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}, "actions": {"q01": [-1.0] * 3, "q99": [1.0] * 3}}}
    processor = PI05Processor.from_config(config, tiny_tokenizer, norm_stats=stats)
    processor.advantage_conditioned = True
    return model, processor


def _inputs(processor, rows=2, **kwargs):
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 255, (rows, 2, 3, 32, 32), generator=generator, dtype=torch.uint8)
    state = torch.rand(rows, 2, generator=generator) * 2 - 1
    return processor(images=images, text=["pick the cube"] * rows, state=state, **kwargs)


def test_the_indicator_follows_the_task_as_lerobots_branch_writes_it(policy):
    _, processor = policy
    state = torch.zeros(2)
    decode = processor.tokenizer.decode
    positive = _inputs(processor, 1, advantage=True)
    text = decode(positive["input_ids"][0][positive["attention_mask"][0]], skip_special_tokens=True)
    plain = processor.build_prompt("pick the cube", state).split(", State:")[0]
    assert plain == "Task: pick the cube"
    assert text.startswith("Task: pick the cube Advantage: positive, State: "), text
    negative = _inputs(processor, 1, advantage=False)
    assert "Advantage: negative, State:" in decode(negative["input_ids"][0], skip_special_tokens=True)
    none = _inputs(processor, 1, advantage=None)
    assert "Advantage" not in decode(none["input_ids"][0], skip_special_tokens=True)
    # inference ("auto"): an advantage-conditioned processor asks for positive, with no flag
    assert torch.equal(_inputs(processor, 1)["input_ids"], positive["input_ids"])
    assert "uncond_input_ids" not in _inputs(processor, 1)  # beta = 1: one prompt, one forward


def test_guidance_is_refused_where_it_cannot_apply(policy, tiny_tokenizer):
    from hf_vla.models.pi05 import PI05Processor

    _, processor = policy
    plain = PI05Processor.from_config(policy[0].config, tiny_tokenizer, norm_stats=processor.norm_stats)
    with pytest.raises(ValueError, match="guidance needs an advantage-conditioned policy"):
        _inputs(plain, 1, cfg_beta=2.0)
    with pytest.raises(ValueError, match="a finite beta >= 0"):
        _inputs(processor, 1, cfg_beta=float("nan"))
    with pytest.raises(ValueError, match="must ask for it"):
        _inputs(processor, 1, cfg_beta=2.0, advantage=False)


# ---- classifier-free guidance -------------------------------------------------------------------------------------
def _sample(model, inputs, noise, steps=10):
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "uncond_input_ids",
            "uncond_attention_mask", "cfg_beta")
    return model.sample_actions(**{k: inputs[k] for k in keys if k in inputs}, noise=noise.clone(), num_steps=steps)


def _noise(model, rows=2):
    config = model.config
    return torch.randn(rows, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(5))


def test_beta_one_is_the_conditioned_sample_and_beta_zero_the_unconditioned_bit_for_bit(policy):
    model, processor = policy
    noise = _noise(model)
    conditioned = _sample(model, _inputs(processor, advantage=True), noise)
    unconditioned = _sample(model, _inputs(processor, advantage=None), noise)
    assert not torch.equal(conditioned, unconditioned)  # the indicator changes what the policy does
    assert torch.equal(_sample(model, _inputs(processor, cfg_beta=1.0), noise), conditioned)
    assert torch.equal(_sample(model, _inputs(processor, cfg_beta=0.0), noise), unconditioned)


@pytest.mark.parametrize("beta", [0.5, 1.5, [2.0, 0.25]])
def test_the_batched_guided_velocity_equals_two_separate_forwards(policy, beta):
    """One forward over 2B rows per step against a reference Euler loop that runs the conditioned and unconditioned
    prompts through two separate prefix caches and forwards, in float64 arithmetic for the combination."""
    model, processor = policy
    noise = _noise(model)
    guided = _inputs(processor, cfg_beta=beta)
    assert guided["cfg_beta"].tolist() == ([beta] * 2 if isinstance(beta, float) else beta)
    got = _sample(model, guided, noise, steps=10)
    cond, uncond = _inputs(processor, advantage=True), _inputs(processor, advantage=None)
    caches = [model.prefix_cache(i["input_ids"], i["pixel_values"], i["pixel_attention_mask"], i["attention_mask"])
              for i in (cond, uncond)]
    betas = guided["cfg_beta"].double().view(-1, 1, 1)
    x, dt = noise.clone().double(), -1.0 / 10
    for step in range(10):
        timestep = torch.full((2,), 1.0 + step * dt, dtype=torch.float32)
        v = [model(noise=x.float(), timestep=timestep, input_ids=i["input_ids"], attention_mask=i["attention_mask"],
                   pixel_attention_mask=i["pixel_attention_mask"], past_key_values=c).logits.double()
             for i, c in zip((cond, uncond), caches)]
        x = x + dt * (v[1] + betas * (v[0] - v[1]))
    torch.testing.assert_close(got.double(), x, rtol=0, atol=1e-6)
