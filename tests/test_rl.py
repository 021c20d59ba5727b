"""RL fine-tuning (hf_vla.rl): the Flow-SDE likelihood against independent float64 computations and a Gaussian target
with a known velocity, GRPO advantages and the clipped objective against hand computations, a policy-gradient step on
a toy env with a known optimum, rollouts through the evaluation episode loop (batched = serial per seed, a dead env
worker restarted and its episode discarded), and the command end to end from an hf_vla checkpoint (full and LoRA),
with preemption and resume."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import rl_toy
import torch
from conftest import REPO, randomize_, refused

from hf_vla import PI05ForConditionalGeneration, PI05Processor
from hf_vla.rl.critic import add_value_head, prefix_value
from hf_vla.rl.flow import (
    FlowSDE,
    absorbing_bonus,
    chain_means,
    clipped_objective,
    gae,
    gaussian_log_prob,
    group_advantages,
    sample_chain,
    step_kl,
    step_log_probs,
    value_loss,
)
from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config

HEAD = "color_reach::delta_xy"
# q01/q99 for pi0.5's quantile normalisation, mean/std for pi0's (about the same ranges)
NORM_STATS = {HEAD: {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0], "mean": [0.0, 0.0], "std": [0.5, 0.5]},
                     "actions": {"q01": [-0.1, -0.1], "q99": [0.1, 0.1], "mean": [0.0, 0.0], "std": [0.05, 0.05]}}}


def tiny_policy(seed=0, scale=0.1, policy="pi05", **overrides):
    """A tiny pi0.5 (hf_vla's) or pi0 (transformers' `PI0ForConditionalGeneration`) with its processor."""
    torch.manual_seed(seed)
    dims = {"chunk_size": 4, "max_state_dim": 2, "max_action_dim": 2, "num_inference_steps": 4} | overrides
    if policy == "pi0":
        from transformers import PI0ForConditionalGeneration

        from hf_vla.models.pi0_adapter import PI0HeadProcessor
        from hf_vla.tiny import tiny_pi0_config

        model = randomize_(PI0ForConditionalGeneration(tiny_pi0_config(**dims)), seed=seed, scale=scale)
        return model, PI0HeadProcessor.from_config(model.config, build_tiny_tokenizer(), norm_stats=NORM_STATS,
                                                   head_names=[HEAD])
    model = randomize_(PI05ForConditionalGeneration(tiny_pi05_config(**dims)), seed=seed, scale=scale)
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats=NORM_STATS,
                                          head_names=[HEAD])
    return model, processor


def model_inputs(processor, batch=3, seed=0, model=None):
    from hf_vla.serving.policy import MODEL_INPUTS, model_input_keys

    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 255, (batch, 1, 3, 32, 32), generator=generator, dtype=torch.uint8)
    states = np.random.default_rng(seed).uniform(-1, 1, (batch, 2)).astype(np.float32)
    inputs = processor(images=images, text=["move to the red target"] * batch, state=states, head=HEAD,
                       camera_mask=torch.ones(batch, 1, dtype=torch.bool))
    return {k: inputs[k] for k in (model_input_keys(model) if model is not None else MODEL_INPUTS)}


# ---- the likelihood ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("noise_level", [0.0, 0.7])
def test_the_sde_sampler_keeps_the_flow_marginals_on_a_gaussian_target(noise_level):
    """Data x0 ~ N(m, s^2): the exact velocity E[noise - x0 | x_t] is known in closed form, so the sampler must land on
    N(m, s^2) with or without SDE noise (a sign error in either drift term moves the mean or the spread)."""
    m, s, n = 0.7, 0.3, 100_000  # seeded; sampling error of the std ~0.2% beside the 2.5% tolerance

    def velocity(x, t):
        var = t * t + (1 - t) ** 2 * s * s
        centred = x - (1 - t) * m
        return t * centred / var - (m + (1 - t) * s * s * centred / var)

    sde = FlowSDE(200, noise_level)  # Euler's own error: the std is 9% short at 20 steps, 1% at 200
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, dtype=torch.float64, generator=generator)
    for t, std in zip(sde.times(), sde.stds()):
        x = sde.mean(x, velocity(x, t), t) + std * torch.randn(n, dtype=torch.float64, generator=generator)
    assert abs(x.mean().item() - m) < 0.02
    assert abs(x.std().item() - s) / s < 0.025


def test_the_constant_schedule_leaves_the_marginals_and_keeps_the_mean():
    """`schedule="constant"` (the Euler step plus noise of one std at every step): on the Gaussian target whose velocity
    is known, the samples' mean stays on the target's (the velocity is linear in x, so the noise averages out) and
    their spread grows past the target's: the rollouts leave the policy's distribution, as the flow_sde schedule's do
    not. With noise level 0 it is the deterministic sampler."""
    m, s, n = 0.7, 0.3, 100_000  # seeded; sampling error of the std ~0.2% beside the 2.5% tolerance

    def velocity(x, t):
        var = t * t + (1 - t) ** 2 * s * s
        centred = x - (1 - t) * m
        return t * centred / var - (m + (1 - t) * s * s * centred / var)

    def sample(sde):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(n, dtype=torch.float64, generator=generator)
        for t, std in zip(sde.times(), sde.stds()):
            x = sde.mean(x, velocity(x, t), t) + std * torch.randn(n, dtype=torch.float64, generator=generator)
        return x

    constant = FlowSDE(200, 0.5, "constant")
    assert constant.stds() == [0.5 * math.sqrt(1 / 200)] * 200
    x = sample(constant)
    assert abs(x.mean().item() - m) < 0.02 and x.std().item() > 1.2 * s
    assert abs(sample(FlowSDE(200, 0.5)).std().item() - s) / s < 0.025  # flow_sde: on the target's spread
    torch.testing.assert_close(sample(FlowSDE(200, 0.0, "constant")), sample(FlowSDE(200, 0.0)))
    with pytest.raises(ValueError, match="schedule='brownian'"):
        FlowSDE(4, 0.5, "brownian")


@pytest.mark.parametrize("schedule", ["flow_sde", "constant"])
def test_the_chain_log_probability_equals_an_independent_float64_gaussian(schedule):
    model, processor = tiny_policy()
    inputs = model_inputs(processor)
    sde = FlowSDE(4, 0.6, schedule)
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(3, 4, 2, generator=generator)
    step_noise = torch.randn(3, 4, 4, 2, generator=generator)
    chain, means = sample_chain(model.eval(), inputs, noise, step_noise, sde)
    mask = torch.zeros(4, 2)
    mask[:2] = 1  # two executed actions of the chunk of four
    ours = step_log_probs(chain, means, sde, mask).sum(dim=1)
    # independently: scipy's normal density in float64 over the executed elements of every step
    from scipy.stats import norm

    if schedule == "flow_sde":
        stds = [sde.noise_level * math.sqrt(min(t, 0.75) / (1 - min(t, 0.75))) * math.sqrt(0.25)
                for t in (1, .75, .5, .25)]
    else:
        stds = [sde.noise_level * math.sqrt(0.25)] * 4
    expected = np.zeros(3)
    for k, std in enumerate(stds):
        values = norm.logpdf(chain[:, k + 1, :2].double().numpy(), means[:, k, :2].double().numpy(), std)
        expected += values.sum(axis=(1, 2))
    np.testing.assert_allclose(ours.double().numpy(), expected, rtol=1e-5)
    # the stored chain is what the means give: x_{k+1} = mean_k + std_k * step_noise_k
    for k, std in enumerate(stds):
        torch.testing.assert_close(chain[:, k + 1], means[:, k] + std * step_noise[:, k], rtol=1e-5, atol=1e-6)
    # recomputed under the same weights with gradients (the update's path) the means are the rollout's
    torch.testing.assert_close(chain_means(model, inputs, chain, sde), means, rtol=1e-4, atol=1e-5)
    # and the KL of a policy to itself is zero, to a shifted one the closed form
    assert step_kl(means, means, sde, mask).abs().max() == 0
    shifted = step_kl(means + 0.1, means, sde, mask)
    torch.testing.assert_close(shifted[0], torch.tensor([4 * 0.01 / (2 * s * s) for s in stds]), rtol=1e-4, atol=0)
    assert gaussian_log_prob(chain[:, 1], means[:, 0], stds[0], torch.zeros(4, 2)).abs().max() == 0


@pytest.mark.parametrize("schedule", ["flow_sde", "constant"])
def test_per_chunk_noise_levels_give_each_chain_its_own_gaussian(schedule):
    """A batch of chunks sampled at three noise levels at once (a multi-task batch with `task_noise_levels`): each
    chain's log-probability is scipy's float64 normal density with its own level's stds, its steps are its means plus
    its own std times the normals, the update's recomputed means (which depend on the level under flow_sde) are the
    rollout's, and the KL to a shifted policy has each chunk's closed form."""
    from scipy.stats import norm

    model, processor = tiny_policy()
    inputs = {k: v.expand(3, *v.shape[1:]) for k, v in model_inputs(processor).items()}
    sde = FlowSDE(4, 0.6, schedule)
    levels = [0.6, 0.2, 1.1]
    generator = torch.Generator().manual_seed(2)
    noise = torch.randn(3, 4, 2, generator=generator)
    step_noise = torch.randn(3, 4, 4, 2, generator=generator)
    chain, means = sample_chain(model.eval(), inputs, noise, step_noise, sde, levels=levels)
    mask = torch.zeros(4, 2)
    mask[:2] = 1
    ours = step_log_probs(chain, means, sde, mask, levels).sum(dim=1)
    times = (1, .75, .5, .25)
    for row, level in enumerate(levels):
        if schedule == "flow_sde":
            stds = [level * math.sqrt(min(t, 0.75) / (1 - min(t, 0.75))) * math.sqrt(0.25) for t in times]
        else:
            stds = [level * math.sqrt(0.25)] * 4
        expected = sum(norm.logpdf(chain[row, k + 1, :2].double().numpy(), means[row, k, :2].double().numpy(),
                                   std).sum() for k, std in enumerate(stds))
        np.testing.assert_allclose(ours[row].item(), expected, rtol=1e-5)
        for k, std in enumerate(stds):
            torch.testing.assert_close(chain[row, k + 1], means[row, k] + std * step_noise[row, k], rtol=1e-5,
                                       atol=1e-6)
        shifted = step_kl(means[row:row + 1] + 0.1, means[row:row + 1], sde, mask, [level])
        torch.testing.assert_close(shifted[0], torch.tensor([4 * 0.01 / (2 * s * s) for s in stds]), rtol=1e-4,
                                   atol=0)
    # the first row, at the sde's own level, is what sampling without levels gives
    alone = sample_chain(model, {k: v[:1] for k, v in inputs.items()}, noise[:1], step_noise[:1], sde)[0]
    torch.testing.assert_close(alone, chain[:1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chain_means(model, inputs, chain, sde, levels=levels), means, rtol=1e-4, atol=1e-5)
    if schedule == "flow_sde":  # the mean depends on the level there: the default level's means are not the rows'
        assert not torch.allclose(chain_means(model, inputs, chain, sde)[1:], means[1:], atol=1e-4)
    torch.testing.assert_close(step_kl(means + 0.1, means, sde, mask, levels).sum(dim=1),
                               torch.cat([step_kl(means[i:i + 1] + 0.1, means[i:i + 1], sde, mask, [lv]).sum(dim=1)
                                          for i, lv in enumerate(levels)]))


@pytest.mark.parametrize("policy", ["pi05", "pi0"])
def test_the_cached_prefix_gives_the_gradient_of_full_forwards(policy):
    """The update runs the prefix once and the expert K times on its cache: the same gradient as K full forwards (for
    transformers' pi0 too, whose expert appends to the cache and is cropped back after each call). At noise level 0
    the sampler is the policy's own Euler sampler: its chunk equals `sample_actions` from the same noise."""
    model, processor = tiny_policy(seed=2, policy=policy)
    inputs = model_inputs(processor, batch=2, seed=2, model=model)
    noise = torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(4))
    chain, means = sample_chain(model.eval(), inputs, noise, torch.zeros(2, 4, 4, 2), FlowSDE(4, 0.0))
    torch.testing.assert_close(chain[:, -1], model.sample_actions(**inputs, noise=noise.clone()), rtol=1e-4,
                               atol=1e-5)
    torch.testing.assert_close(chain_means(model, inputs, chain, FlowSDE(4, 0.0)), means, rtol=1e-4, atol=1e-5)
    sde = FlowSDE(4, 0.5)
    chain = torch.randn(2, 5, 4, 2, generator=torch.Generator().manual_seed(3))
    chain_means(model, inputs, chain, sde).square().sum().backward()
    cached = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total = 0
    for k, t in enumerate(sde.times()):
        v = model(noise=chain[:, k], timestep=torch.full((2,), t), **inputs).logits
        total = total + sde.mean(chain[:, k], v, t).square().sum()
    total.backward()
    full = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert cached.keys() == full.keys() and any("vlm" in n for n in full)  # the VLM gets gradients through the cache
    for name in full:
        torch.testing.assert_close(cached[name], full[name], rtol=1e-4, atol=1e-6)


# ---- advantages and the objective ----------------------------------------------------------------------------------
def test_group_advantages_equal_a_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    advantages, informative = group_advantages(rewards, groups)
    std0 = math.sqrt(sum((r - 0.5) ** 2 for r in (1, 0, 0, 1)) / 3)  # unbiased, as TRL
    expected = [0.5 / (std0 + 1e-4), -0.5 / (std0 + 1e-4), -0.5 / (std0 + 1e-4), 0.5 / (std0 + 1e-4), 0, 0,
                -1.5 / (math.sqrt(4.5) + 1e-4), 1.5 / (math.sqrt(4.5) + 1e-4)]
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-9)
    assert informative.tolist() == [True] * 4 + [False] * 2 + [True] * 2  # group 1 all succeeded: no signal
    centred, _ = group_advantages(rewards, groups, scale=False)
    np.testing.assert_allclose(centred.numpy(), [0.5, -0.5, -0.5, 0.5, 0, 0, -1.5, 1.5])


def test_the_clipped_objective_equals_a_hand_computation():
    ratios = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    advantages = torch.tensor([2.0, -1.0])
    loss, clipped = clipped_objective(ratios.log(), advantages, epsilon=0.2, epsilon_high=0.28)
    # A > 0: -min(r A, clip(r) A) = -(0.5*2, 1*2, 1.28*2); A < 0: -min(-r, -clip(r)) = (0.8, 1, 1.5)
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -2.0, -2.56], [0.8, 1.0, 1.5]]))
    assert clipped.tolist() == [[False, False, True], [True, False, False]]


def test_gae_and_the_critic_loss_equal_hand_computations():
    rewards = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    values = torch.tensor([0.5, 0.2, 0.6], dtype=torch.float64)
    advantages, returns = gae(rewards, values, gamma=0.9, lam=0.8)
    # delta_2 = 1 - 0.6; delta_1 = 0.9 * 0.6 - 0.2; delta_0 = 0.9 * 0.2 - 0.5; A_t = delta_t + 0.72 A_{t+1}
    expected = [-0.32 + 0.72 * (0.34 + 0.72 * 0.4), 0.34 + 0.72 * 0.4, 0.4]
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(returns.numpy(), np.array(expected) + [0.5, 0.2, 0.6], rtol=1e-12)
    # lambda = 1: the discounted return minus the value (Monte Carlo); lambda = 0: the one-step TD error
    np.testing.assert_allclose(gae(rewards, values, 0.9, 1.0)[1].numpy(), [0.81, 0.9, 1.0], rtol=1e-12)
    np.testing.assert_allclose(gae(rewards, values, 0.9, 0.0)[0].numpy(), [-0.32, 0.34, 0.4], rtol=1e-12)
    critic = value_loss(torch.tensor([0.6, 0.4]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), clip=0.2)
    # unclipped 0.5 * 0.4^2 each; clipped to [0.2, 0.2]: 0.5 * 0.8^2 and 0.5 * 0.2^2; the larger is kept
    torch.testing.assert_close(critic, torch.tensor([0.32, 0.08]))
    torch.testing.assert_close(value_loss(torch.tensor([0.6]), torch.tensor([1.0]), torch.tensor([0.0]), None),
                               torch.tensor([0.08]))


def test_dense_rewards_credit_a_success_with_the_steps_it_did_not_take():
    """Meta-World ends an episode on success and pays up to 10 a step until its limit: without the absorbing goal
    state, lingering next to the goal for 200 steps earns more than reaching it at step 50."""
    from types import SimpleNamespace

    from hf_vla.envs.episodes import Episode
    from hf_vla.rl.trainer import RLTrainer

    # n = 2, limit 8, success at step 5 (the last decision executed 1 of its 2 steps), last reward 5: the 3 steps
    # left are 1 completing the last chunk (undiscounted), then 2 one decision later (gamma)
    assert absorbing_bonus(5.0, 3, 1, 2, gamma=0.9) == pytest.approx(5 * (1 + 2 * 0.9))
    assert absorbing_bonus(5.0, 3, 1, 2) == pytest.approx(15.0)  # undiscounted: last reward x steps left
    # last chunk executed in full: the next 2 steps are one decision later, the 3rd two decisions later
    assert absorbing_bonus(2.0, 3, 2, 2, gamma=0.5) == pytest.approx(2 * (0.5 + 0.5 + 0.25))
    assert absorbing_bonus(5.0, 0, 1, 2, gamma=0.9) == 0.0
    fake = SimpleNamespace(rl_settings={"max_episode_steps": 8, "n_action_steps": 2})
    won = Episode(seed=0, success=True, steps=5, reward=15.0, step_rewards=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert RLTrainer._bonus(fake, won, 0.9) == pytest.approx(5 * (1 + 2 * 0.9))
    assert RLTrainer._bonus(fake, won) == pytest.approx(15.0)
    lingered = Episode(seed=0, success=False, steps=8, reward=36.0, step_rewards=[1.0, 2.0, 3.0, 4.0] + [6.5] * 4)
    assert RLTrainer._bonus(fake, lingered) == 0.0
    # a success at step 5 paid 9.5 (about what Meta-World pays at the goal) against lingering at 6.5 a step: the
    # dense return alone prefers lingering, with the bonus the success wins
    quick = Episode(seed=0, success=True, steps=5, reward=19.5, step_rewards=[1.0, 2.0, 3.0, 4.0, 9.5])
    assert quick.reward + RLTrainer._bonus(fake, quick) > lingered.reward
    assert quick.reward < lingered.reward  # what the dense return alone said


def test_the_critic_reads_the_prefix_once_and_learns_a_return():
    """The value head: 0 when new; the same value through sampling, the cached update path and a plain forward; its
    loss trains the head and the VLM under it, not the action expert; a few steps fit a target."""
    model, processor = tiny_policy(seed=8)
    add_value_head(model)
    inputs = model_inputs(processor, batch=3)
    noise, step_noise = torch.randn(3, 4, 2), torch.randn(3, 4, 4, 2)
    sde = FlowSDE(4, 0.5)
    chain, _, value = sample_chain(model, inputs, noise, step_noise, sde, value=True)
    assert value.shape == (3,) and value.abs().max() == 0
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    target = torch.tensor([1.0, -0.5, 0.25])
    for step in range(60):
        optimizer.zero_grad()
        means, value = chain_means(model, inputs, chain, sde, value=True)
        value_loss(value, target, value.detach(), None).mean().backward()
        expert_grads = [p.grad for n, p in model.named_parameters() if ".expert." in n and p.grad is not None]
        assert all(g.abs().max() == 0 for g in expert_grads)  # the critic's loss does not move the action expert
        if step:  # (the new head's zero output layer passes no gradient below it at first) a shared trunk
            assert model.model.vlm.language_model.layers[0].mlp.up_proj.weight.grad.abs().max() > 0
        optimizer.step()
    _, value = chain_means(model, inputs, chain, sde, value=True)
    assert (value - target).abs().max() < 0.1, value
    direct = prefix_value(model, inputs)
    sampled = sample_chain(model, inputs, noise, step_noise, sde, value=True)[2]
    torch.testing.assert_close(direct, value.detach())
    torch.testing.assert_close(sampled, value.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_critic_gets_a_learning_rate_of_its_own(tmp_path, dtype):
    """Also for a bf16 model over fp32 master weights (GPU runs): the critic's masters move with it, and the first
    Adam step moves the critic by its rate and the policy by its own."""
    from hf_vla.rl import RLConfig, RLTrainer
    from hf_vla.training.optim import MasterWeightOptimizer

    model, processor = tiny_policy(seed=4)
    model.to(dtype)
    args = RLConfig(output_dir=str(tmp_path / "run"), env="hf_vla_test/PointBandit-v0", num_envs=1, group_size=2,
                    algorithm="ppo", learning_rate=1e-5, critic_learning_rate=1e-3, weight_decay=0.1, use_cpu=True,
                    report_to=[], save_strategy="no", eval_strategy="no", eval_on_start=False, n_action_steps=1)
    trainer = RLTrainer(model, args, processing_class=processor)
    try:
        trainer.create_optimizer_and_scheduler(num_training_steps=10)
    finally:
        trainer.engine.close()
    critic = {id(p) for p in model.value_head.parameters()}
    groups = trainer.optimizer.param_groups
    assert {id(p) for p in groups[-1]["params"]} == critic and groups[-1]["lr"] == 1e-3
    assert groups[-1]["weight_decay"] == 0.0
    assert all(g["lr"] == 1e-5 and not critic & {id(p) for p in g["params"]} for g in groups[:-1])
    optimizer = trainer.optimizer
    assert isinstance(optimizer, MasterWeightOptimizer) == (dtype == torch.bfloat16)
    if dtype == torch.bfloat16:
        pairs = dict(optimizer._pairs())  # parameter -> its fp32 master
        assert len(pairs) == sum(p.requires_grad for p in model.parameters())
        before = {id(p): m.detach().clone() for p, m in pairs.items()}
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        optimizer.step()
        head = model.value_head.out.weight
        moved = (pairs[head].detach() - before[id(head)]).abs()
        torch.testing.assert_close(moved, torch.full_like(moved, 1e-3), rtol=1e-3, atol=0)  # Adam's first step: lr
        weight = model.model.vlm.language_model.layers[0].mlp.up_proj.weight
        moved = (pairs[weight].detach() - before[id(weight)]).abs()
        assert float(moved.max()) < 2e-5 and float(moved.min()) > 5e-6


def test_a_resumed_ppo_run_ends_with_the_critic_and_policy_of_the_uninterrupted_one(tmp_path):
    """The critic (and its optimizer group of its own) is part of the checkpoint: stopping after update 1 and resuming
    gives the weights of two uninterrupted updates."""
    from hf_vla.rl import RLConfig, RLTrainer

    def run(out, resume=None):
        model, processor = tiny_policy(seed=4, scale=0.05)
        args = RLConfig(output_dir=str(out), env="hf_vla_test/PointBandit-v0", num_envs=1, group_size=4,
                        groups_per_update=1, algorithm="ppo", critic_learning_rate=1e-3, max_steps=2, reward="dense",
                        save_steps=1, use_cpu=True, report_to=[], disable_tqdm=True, eval_strategy="no",
                        eval_on_start=False, n_action_steps=1, log_kl=False)
        trainer = RLTrainer(model, args, processing_class=processor)
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            trainer.engine.close()
        return model.state_dict()

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-1"))
    assert whole["value_head.out.weight"].abs().max() > 0  # the critic was trained
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=name)


# ---- a policy-gradient step on a toy env with a known optimum ------------------------------------------------------
def _mean_action(model, processor, draws=256):
    from hf_vla.serving.policy import model_input_keys

    images = torch.full((1, 1, 3, 32, 32), 90, dtype=torch.uint8)
    real = processor(images=images, text=[rl_toy.PointBandit().task], state=np.zeros((1, 2), np.float32), head=HEAD,
                     camera_mask=torch.ones(1, 1, dtype=torch.bool))
    inputs = {k: real[k].expand(draws, *real[k].shape[1:]) for k in model_input_keys(model)}
    noise = torch.randn(draws, 4, 2, generator=torch.Generator().manual_seed(5))
    chunk = model.eval().sample_actions(**inputs, noise=noise)
    return processor.unnormalize_actions(chunk, HEAD)[:, 0].mean(0).numpy()


def _bandit_step(tmp_path, policy, **fields):
    """One SGD update (64 episodes: 4 seeds x 16) of a tiny policy on the bandit: (model, mean action before, after,
    trainer)."""
    from hf_vla.rl import RLConfig, RLTrainer

    model, processor = tiny_policy(seed=4, scale=0.05, policy=policy)
    before = _mean_action(model, processor)
    args = RLConfig(output_dir=str(tmp_path / "run"), env="hf_vla_test/PointBandit-v0", num_envs=1, group_size=16,
                    groups_per_update=4, max_steps=1, reward="dense", optim="sgd", max_grad_norm=0.0, use_cpu=True,
                    report_to=[], disable_tqdm=True, save_strategy="no", eval_strategy="no", eval_on_start=False,
                    n_action_steps=1, seed=0, **fields)
    trainer = RLTrainer(model, args, processing_class=processor)
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    return model, before, _mean_action(model, processor), trainer


@pytest.mark.parametrize("algorithm, policy, schedule", [("grpo", "pi05", "flow_sde"), ("ppo", "pi05", "flow_sde"),
                                                         ("grpo", "pi0", "flow_sde"), ("grpo", "pi05", "constant")])
def test_a_policy_gradient_step_moves_the_policy_toward_the_known_optimum(tmp_path, algorithm, policy, schedule):
    model, before, after, trainer = _bandit_step(tmp_path, policy, algorithm=algorithm, noise_schedule=schedule,
                                                 learning_rate=0.05, log_kl=False)
    toward = rl_toy.TARGET - before
    move = after - before
    cosine = float(move @ toward / (np.linalg.norm(move) * np.linalg.norm(toward)))
    print("mean action", before, "->", after, "optimum", rl_toy.TARGET, "cosine", cosine)
    assert cosine > 0.5, (before, after, rl_toy.TARGET)  # toward the known optimum (64 episodes' estimate)
    # the size: a real step (the distance shrinks by over 10%) that does not overshoot the optimum
    distance = np.linalg.norm(rl_toy.TARGET - after)
    assert distance < 0.9 * np.linalg.norm(toward) and np.linalg.norm(move) < np.linalg.norm(toward), (before, after)
    entry = next(e for e in trainer.state.log_history if "rollout/return" in e)
    assert entry["rollout/decisions_used"] == 64 and entry["rollout/episodes"] == 64
    if algorithm == "ppo":  # the new critic predicted 0 for every decision; its loss was logged
        assert entry["value"] == 0 and entry["value_loss"] > 0 and "explained_variance" in entry
        assert model.value_head.out.weight.abs().max() > 0  # the critic's update


def test_a_time_budget_stops_after_the_update_with_a_checkpoint_and_the_card_says_so(tmp_path, capsys):
    """max_train_minutes (the benchmarks' budget) ends the run after the update during which it passed, saves that
    update's checkpoint although save_steps is not due, shows the minutes on the progress bar, and the card names the
    budget, not max_steps, as the end."""
    from hf_vla.rl import RLConfig, RLTrainer

    model, processor = tiny_policy(seed=4, scale=0.05)
    args = RLConfig(output_dir=str(tmp_path / "run"), env="hf_vla_test/PointBandit-v0", num_envs=1, group_size=2,
                    groups_per_update=1, max_steps=50, max_train_minutes=1e-6, reward="dense", use_cpu=True,
                    report_to=[], disable_tqdm=False, save_strategy="steps", save_steps=40, eval_strategy="no",
                    eval_on_start=False, n_action_steps=1, seed=0, log_kl=False)
    trainer = RLTrainer(model, args, processing_class=processor)
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    assert trainer.state.global_step == 1 and (tmp_path / "run" / "checkpoint-1").is_dir()
    assert " of 1e-06 min" in capsys.readouterr().err  # the budget beside the updates on the progress bar
    summary = trainer.rl_summary()
    assert summary["stopped_by"] == "max_train_minutes=1e-06" and summary["max_steps"] == 50
    card = trainer.create_model_card().text
    assert "1 updates (stopped by max_train_minutes=1e-06)" in card and "max_train_minutes" in card.split(
        "## Reinforcement-learning")[0]  # listed with the training arguments too


@pytest.mark.parametrize("policy", ["pi05", "pi0"])
@pytest.mark.parametrize("sign", [1, -1])
def test_filtered_bc_moves_the_policy_toward_the_optimum_it_is_rewarded_for(tmp_path, sign, policy):
    """Filtered behaviour cloning imitates the episodes above their group's mean (dense reward): one supervised step
    moves the mean action toward the optimum, whichever side it is on (the two optima are mirror images, so a drift
    of imitating the policy's own samples, which does not know the optimum, cannot pass both), and half the episodes
    are imitated."""
    target = sign * rl_toy.TARGET
    _, before, after, trainer = _bandit_step(tmp_path, policy, algorithm="filtered_bc", learning_rate=0.02,
                                             env_kwargs={"target": target.tolist()})
    toward, move = target - before, after - before
    cosine = float(move @ toward / (np.linalg.norm(move) * np.linalg.norm(toward)))
    print("mean action", before, "->", after, "optimum", target, "cosine", cosine)
    assert cosine > 0.5, (before, after, target)
    assert np.linalg.norm(target - after) < 0.9 * np.linalg.norm(toward), (before, after, target)
    entry = next(e for e in trainer.state.log_history if "rollout/return" in e)
    # one decision per episode; the episodes above their group's mean (continuous returns: about half of 64)
    assert entry["rollout/episodes"] == 64 and 20 <= entry["rollout/decisions_used"] <= 44, entry
    assert entry["flow_loss"] > 0 and "kl_to_start" in entry


def test_filtered_bc_with_the_deterministic_sampler_trains_the_supervised_loss_on_the_chosen_chunks(tmp_path):
    """noise_level 0: the rollouts' chunks are the deployed sampler's (`sample_actions` from the stored initial noise);
    the loss equals supervised training's flow-matching MSE computed by hand with plain full forwards (same time and
    noise draws) over the executed steps, weighted 1 / (imitated decisions); only the episodes above their group's
    mean are imitated."""
    from hf_vla.rl import RLConfig, RLTrainer
    from hf_vla.serving.policy import model_input_keys

    model, processor = tiny_policy(seed=4, scale=0.05)
    args = RLConfig(output_dir=str(tmp_path / "run"), env="hf_vla_test/PointBandit-v0", num_envs=1, group_size=4,
                    algorithm="filtered_bc", noise_level=0.0, groups_per_update=2, max_steps=1, reward="dense",
                    use_cpu=True, report_to=[], disable_tqdm=True, save_strategy="no", eval_strategy="no",
                    eval_on_start=False, n_action_steps=1, seed=0)
    trainer = RLTrainer(model, args, processing_class=processor)
    seen = {}
    run = trainer.engine.run

    def recording(*a, **k):
        seen["episodes"], seen["transitions"] = run(*a, **k)
        return seen["episodes"], seen["transitions"]

    trainer.engine.run = recording
    try:
        (batch,) = trainer._generate(0)
    finally:
        trainer.engine.close()
    episodes = seen["episodes"][None]
    chosen = set()
    for g in range(2):  # by hand: each group's episodes above its mean return
        group = episodes[4 * g:4 * g + 4]
        mean = sum(e.reward for e in group) / 4
        chosen |= {e.noise_seed for e in group if e.reward > mean}
    assert 0 < len(chosen) < 8 and batch["chain"].shape[0] == len(chosen)
    assert sorted(tr.noise_seed for tr in seen["transitions"] if tr.noise_seed in chosen) == sorted(chosen)
    assert torch.equal(batch["weights"], torch.full((len(chosen),), 1 / len(chosen)))
    assert not any("kl_to_start" in k for k in trainer._rl_metrics)  # no likelihood: no KL
    inputs = {k: batch[k] for k in model_input_keys(model)}
    with torch.no_grad():  # the deterministic sampler, as deployed
        deployed = model.eval().sample_actions(**inputs, noise=batch["chain"][:, 0])
    torch.testing.assert_close(batch["chain"][:, -1], deployed.float(), rtol=1e-5, atol=1e-6)
    model.train()
    loss = trainer.compute_loss(model, batch)
    chunk = batch["chain"][:, -1]
    # the supervised objective's draws: seeded by the decision's identity (episode noise seed, decision index)
    from hf_vla.training.losses import sample_noise_and_time

    noise, t = sample_noise_and_time(batch, chunk.shape[1:], args.seed, 0, model.config)
    x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * chunk
    velocity = model(noise=x_t, timestep=t, **inputs).logits.float()
    mask = batch["mask"]
    assert mask.sum() == 2  # one executed step, two action dims
    expected = sum((((velocity[i] - (noise[i] - chunk[i])) ** 2) * mask).sum() / mask.sum() / len(chosen)
                   for i in range(len(chosen)))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)


def test_the_per_step_split_of_the_grpo_loss_sums_to_it(tmp_path):
    """`_policy_gradient_loss(per_step=True)` (what benchmarks/closed_loop/rl_gradient_snr.py differentiates) is the loss split by
    denoising step: K parts summing to `compute_loss`; PPO and a KL term are refused."""
    from hf_vla.rl import RLConfig, RLTrainer

    model, processor = tiny_policy(seed=4, scale=0.05)
    args = RLConfig(output_dir=str(tmp_path / "run"), env="hf_vla_test/PointBandit-v0", num_envs=1, group_size=4,
                    groups_per_update=2, reward="dense", use_cpu=True, report_to=[], disable_tqdm=True,
                    eval_on_start=False, n_action_steps=1, log_kl=False)
    trainer = RLTrainer(model, args, processing_class=processor)
    try:
        (batch,) = trainer._generate(0)
    finally:
        trainer.engine.close()
    model.train()
    parts = trainer._policy_gradient_loss(model, batch, per_step=True)
    assert parts.shape == (trainer.sde.num_steps,)
    # At ratio 1 (the rollout weights) each part's value is -sum(w A) over its step, about 0 (GRPO's advantages are
    # centred per group), so the values agree only to rounding; the gradients, what the split is for, must add up.
    params = [p for p in model.parameters() if p.requires_grad]

    def gradient(loss):
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)])

    split = [gradient(part) for part in parts]
    assert all(g.abs().sum() > 0 for g in split)  # every denoising step carries a gradient
    whole = gradient(trainer.compute_loss(model, batch))
    torch.testing.assert_close(sum(split), whole, rtol=1e-4, atol=1e-6 * whole.abs().max().item())
    torch.testing.assert_close(parts.sum(), trainer.compute_loss(model, batch), rtol=1e-5, atol=1e-6)
    args.beta = 0.1
    with pytest.raises(ValueError, match="per_step splits GRPO's policy term alone"):
        trainer._policy_gradient_loss(model, batch, per_step=True)


def test_filtered_bc_and_noise_schedule_settings_are_checked():
    from hf_vla.errors import ConfigError
    from hf_vla.rl import RLConfig

    common = dict(output_dir="unused", use_cpu=True, report_to=[])
    assert RLConfig(algorithm="filtered_bc", noise_level=0.0, **common).noise_level == 0.0
    with pytest.raises(ConfigError, match="noise_level=0.0: must be a positive number"):
        RLConfig(algorithm="grpo", noise_level=0.0, **common)
    with pytest.raises(ConfigError, match="beta=0.1: filtered_bc has no likelihood ratio"):
        RLConfig(algorithm="filtered_bc", beta=0.1, **common)
    with pytest.raises(ConfigError, match="noise_schedule='linear': choose one of"):
        RLConfig(noise_schedule="linear", **common)
    assert RLConfig(task_noise_levels={"door-open-v3": 0.2}, **common).task_noise_levels == {"door-open-v3": 0.2}
    with pytest.raises(ConfigError, match=r"task_noise_levels\['door-open-v3'\]=0: must be a positive number"):
        RLConfig(task_noise_levels={"door-open-v3": 0}, **common)
    with pytest.raises(ConfigError, match=r"task_noise_levels\['door'\]='low': must be a positive number"):
        RLConfig(task_noise_levels={"door": "low"}, **common)
    assert RLConfig(algorithm="filtered_bc", task_noise_levels={"a": 0}, **common).task_noise_levels == {"a": 0}
    with pytest.raises(ConfigError, match="task_noise_levels=0.2: a non-empty mapping of task names"):
        RLConfig(task_noise_levels=0.2, **common)
    with pytest.raises(ConfigError, match="group_size=1: filtered_bc with reward='dense'"):
        RLConfig(algorithm="filtered_bc", reward="dense", group_size=1, **common)
    assert RLConfig(algorithm="filtered_bc", group_size=1, **common).group_size == 1  # successes need no groups


def test_task_noise_levels_must_name_tasks_of_the_run(tmp_path):
    """A level for a task the run does not roll out is a typo, refused by name before any env starts."""
    from hf_vla.errors import ConfigError
    from hf_vla.rl import RLConfig, RLTrainer

    model, processor = tiny_policy(seed=4, scale=0.05)
    args = RLConfig(output_dir=str(tmp_path / "run"), env="hf_vla_test/PointBandit-v0", use_cpu=True, report_to=[],
                    n_action_steps=1, task_noise_levels={"door-open-v3": 0.2})
    with pytest.raises(ConfigError, match=r"task_noise_levels names \['door-open-v3'\], not tasks of this run"):
        RLTrainer(model, args, processing_class=processor)


# ---- rollouts through the evaluation episode loop -------------------------------------------------------------------
def _stochastic(model, processor, **kwargs):
    from hf_vla.rl import StochasticPolicy

    return StochasticPolicy(model=model, processor=processor, head=HEAD, sde=FlowSDE(4, 0.5), n_action_steps=2,
                            action_dims=2, **kwargs)


def test_batched_rollouts_equal_serial_ones_per_seed():
    """Each episode's chain is a function of its env seed and noise seed: 1 env or 2 envs in workers give the same
    decisions, log-probabilities and outcomes."""
    from hf_vla.rl import RolloutEngine

    model, processor = tiny_policy(seed=6)
    seeds = {None: [0, 0, 1, 1]}
    noise = {None: [10, 11, 12, 13]}
    runs = []
    for num_envs in (1, 2):
        engine = RolloutEngine("hf_vla/ColorReach-v0", [None], num_envs, {"max_episode_steps": 6}, 2, 4)
        try:
            runs.append(engine.run(_stochastic(model, processor), seeds, noise))
        finally:
            engine.close()
    (serial, serial_tr), (batched, batched_tr) = runs
    assert [(e.seed, e.noise_seed, e.steps, e.success) for e in serial[None]] == \
        [(e.seed, e.noise_seed, e.steps, e.success) for e in batched[None]]
    key = lambda tr: (tr.noise_seed, tr.index)  # noqa: E731
    assert sorted(map(key, serial_tr)) == sorted(map(key, batched_tr)) and len(serial_tr) == 4 * 3
    by_key = {key(tr): tr for tr in batched_tr}
    for tr in serial_tr:
        torch.testing.assert_close(tr.chain, by_key[key(tr)].chain, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(tr.log_probs, by_key[key(tr)].log_probs, rtol=1e-4, atol=1e-3)
    # two episodes from one env seed differ only in the policy's noise
    first = [tr for tr in serial_tr if tr.noise_seed in (10, 11) and tr.index == 0]
    assert not torch.allclose(first[0].chain[-1], first[1].chain[-1])


@pytest.mark.parametrize("own_levels", [None, {"b": 0.1}], ids=["one-level", "task-b-at-0.1"])
def test_every_task_rolls_out_at_once_with_one_batched_call_per_control_step(monkeypatch, own_levels):
    """With several tasks, the engine runs them in one loop: each policy call batches the live envs of every task (2
    tasks x 2 envs -> calls of 4), and every episode is the one its task gives alone (same chains, same outcomes),
    also when one task explores at a noise level of its own (each decision records its task's level)."""
    from hf_vla.evaluation.envs import make_env
    from hf_vla.rl import RolloutEngine, StochasticPolicy

    model, processor = tiny_policy(seed=8)
    sizes = []
    original = StochasticPolicy.sample_batch

    def counting(self, requests):
        sizes.append(len(requests))
        return original(self, requests)

    monkeypatch.setattr(StochasticPolicy, "sample_batch", counting)
    seeds = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    noise = {"a": [10, 11, 12, 13], "b": [14, 15, 16, 17]}
    engine = RolloutEngine("hf_vla/ColorReach-v0", [None], 2, {"max_episode_steps": 6}, 2, 4)
    engine.close()
    try:
        engine.tasks = ["a", "b"]
        engine.envs = {task: [make_env("hf_vla/ColorReach-v0", None, {"max_episode_steps": 6}, worker=False)
                              for _ in range(2)] for task in engine.tasks}
        together, together_tr = engine.run(_stochastic(model, processor, task_noise_levels=own_levels), seeds, noise)
        calls_together = list(sizes)
        alone, alone_tr = {}, []
        for task in engine.tasks:
            sizes.clear()
            episodes, transitions = engine.run(_stochastic(model, processor, task_noise_levels=own_levels),
                                               {task: seeds[task]}, {task: noise[task]})
            alone[task], alone_tr = episodes[task], alone_tr + transitions
            assert max(sizes) == 2  # one task: its 2 envs
    finally:
        engine.close()
    assert calls_together and max(calls_together) == 4 and sum(calls_together) == len(together_tr)
    assert len(calls_together) == 2 * 3  # 2 waves of 3 decisions (6 steps, 2 executed a call) for all 8 episodes
    for task in ("a", "b"):
        assert [(e.seed, e.noise_seed, e.steps, e.success) for e in together[task]] == \
            [(e.seed, e.noise_seed, e.steps, e.success) for e in alone[task]]
    key = lambda tr: (tr.noise_seed, tr.index)  # noqa: E731
    by_key = {key(tr): tr for tr in alone_tr}
    assert sorted(map(key, together_tr)) == sorted(by_key)
    for tr in together_tr:
        torch.testing.assert_close(tr.chain, by_key[key(tr)].chain, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(tr.log_probs, by_key[key(tr)].log_probs, rtol=1e-4, atol=1e-3)
    task_of = {n: task for task, seeds_ in noise.items() for n in seeds_}
    assert {tr.level for tr in together_tr if task_of[tr.noise_seed] == "a"} == {0.5}
    assert {tr.level for tr in together_tr if task_of[tr.noise_seed] == "b"} == {(own_levels or {}).get("b", 0.5)}


def test_a_dead_env_worker_is_restarted_and_its_episode_discarded_and_counted():
    from hf_vla.envs.worker import InWorker
    from hf_vla.rl import RolloutEngine

    model, processor = tiny_policy(seed=7)
    engine = RolloutEngine("hf_vla/ColorReach-v0", [None], 2, {"max_episode_steps": 8}, 2, 4)
    made = []

    def crashing(task, slot):
        made.append(slot)
        env = InWorker(functools.partial(rl_toy.CrashingReach, max_steps=8), name="crashing reach")
        engine.envs[task][slot] = env
        return env

    try:
        engine.envs[None] = [InWorker(functools.partial(rl_toy.CrashingReach, max_steps=8), name="crashing reach")
                             for _ in range(2)]
        engine._restart = crashing
        seeds = [0, 1, 2, rl_toy.CRASH_SEED, 4, 5]
        episodes, transitions = engine.run(_stochastic(model, processor), {None: seeds})
    finally:
        engine.close()
    outcome = {e.seed: e for e in episodes[None]}
    assert outcome[rl_toy.CRASH_SEED].discarded and engine.discarded == 1 and len(made) == 1
    assert all(not outcome[s].discarded and outcome[s].steps == 8 or outcome[s].success for s in seeds
               if s != rl_toy.CRASH_SEED)
    assert {tr.noise_seed for tr in transitions} >= {0, 1, 2, 4, 5}


# ---- the command ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """An hf_vla output directory with a deployment contract: ColorReach recorded at 24 px (20-step limit), 2 steps."""
    from conftest import colorreach_run

    return colorreach_run(tmp_path_factory.mktemp("rl_start"), 20, "--n_action_steps", "4",
                          "--model_config.num_inference_steps", "4")[0]


def _rl_command(config, out, *extra):
    return [sys.executable, "-m", "hf_vla.rl", str(config), "--output_dir", str(out), *extra]


def _config(tmp_path, start, **fields):
    config = {"model_name_or_path": str(start), "num_envs": 2, "group_size": 2, "groups_per_update": 1,
              "max_steps": 2, "eval_episodes": 2, "eval_steps": 2, "save_steps": 1, "learning_rate": 1e-3,
              "use_cpu": True, "report_to": [], "disable_tqdm": True} | fields
    path = tmp_path / "rl.json"
    path.write_text(json.dumps(config))
    return path


def _run(command, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, **kwargs)


# PPO with LoRA is `slow` (a second one-minute command run); the default suite runs the GRPO one
@pytest.mark.parametrize("algorithm, lora", [("grpo", False), pytest.param("ppo", True, marks=pytest.mark.slow)],
                         ids=["grpo-full-ema", "ppo-lora"])
def test_the_command_improves_a_checkpoint_and_writes_a_loadable_model_and_card(sft_checkpoint, tmp_path, algorithm,
                                                                                lora):
    out = tmp_path / "rl"
    extra = ["--lora_preset", "expert"] if lora else ["--ema_decay", "0.5"]  # EMA: evaluated and saved averaged
    if not lora:  # with the expert data replayed beside the RL loss (a JSON list on the command line)
        extra += ["--bc_datasets", json.dumps(_replay_spec(sft_checkpoint)), "--per_device_train_batch_size", "4",
                  "--stream_open_blocks", "2"]
    extra += ["--algorithm", algorithm, "--disable_tqdm", "false"]  # progress on, into a pipe (not a terminal)
    done = _run(_rl_command(_config(tmp_path, sft_checkpoint), out, *extra))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out success" in done.stdout and str(out) in done.stdout
    # into a log: one line per finished phase, no live bars' cursor codes (nested bars left "\x1b[A" and a line each
    # refresh); the updates' rollouts (0 and 1) and the held-out evaluations (before, after update 2)
    assert "\x1b[A" not in done.stderr
    phases = [m.group(1) for m in re.finditer(r"INFO[: ]hf_vla: ?(.+?): [\d,]+/[\d,]+ episodes in ", done.stderr)]
    assert phases == ["held-out evaluation", "rollouts (update 0)", "rollouts (update 1)", "held-out evaluation"], \
        done.stderr[-3000:]
    summary = json.loads((out / "rl_result.json").read_text())
    assert summary["updates"] == 2 and summary["episodes"] == 4 and summary["before"] is not None
    assert summary["env"] == "hf_vla/ColorReach-v0"  # from the checkpoint's contract, not a flag
    card = (out / "README.md").read_text()
    assert "Reinforcement-learning fine-tuning" in card and str(sft_checkpoint) in card and algorithm.upper() in card
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logged = {k for entry in state["log_history"] for k in entry}
    assert {"rollout/success", "rollout/return", "rollout/episode_length", "rollout/episodes_per_s", "noise_std",
            "entropy", "eval_success"} <= logged
    if not lora:
        assert "kl_to_start" in logged and "bc_loss" in logged and "color_reach::delta_xy/mse" in logged
        assert "on the expert data color_reach" in summary["method"]
    if algorithm == "ppo":
        assert {"value", "value_loss"} <= logged
    assert (out / "deployment_config.json").exists()  # the contract travels with the improved policy
    from hf_vla.serving.policy import load_policy

    policy = load_policy(out)  # AutoModel + processor: the merged model under LoRA
    start = load_policy(sft_checkpoint)
    start_weights = start.model.state_dict()
    moved = max((value - start_weights[name]).abs().max().item() for name, value in policy.model.state_dict().items()
                if name in start_weights)
    assert moved > 0
    if algorithm == "ppo":  # the critic is part of the saved model (a later PPO run continues with it), frozen there
        assert policy.model.value_head is not None and not policy.model.value_head.out.weight.requires_grad
    if lora:
        assert (out / "adapter" / "adapter_config.json").exists()


def test_the_command_refuses_bad_input_in_one_line(sft_checkpoint, tmp_path, capsys, monkeypatch):
    import hf_vla.rl.__main__ as command
    from hf_vla.rl.__main__ import cli

    def rl(config, out, *extra) -> str:
        return refused(cli, [str(config), "--output_dir", str(out), *extra], capsys)

    assert "group_size=1" in rl(_config(tmp_path, sft_checkpoint, group_size=1), tmp_path / "a")
    assert "noise_level" in rl(_config(tmp_path, sft_checkpoint), tmp_path / "b", "--nois_level", "0.3")  # did-you-mean
    last = rl(_config(tmp_path, sft_checkpoint), tmp_path / "c", "--n_action_steps", "3")
    assert "n_action_steps" in last and "--override" in last and last.startswith("hf_vla.rl: error: "), last

    def no_loading(args):
        raise AssertionError("the model was loaded before the env was checked")

    monkeypatch.setattr(command, "load_start", no_loading)  # an env named on the command line is checked first
    last = rl(_config(tmp_path, sft_checkpoint), tmp_path / "d", "--env", "NoSuchEnv-v9")
    assert "env='NoSuchEnv-v9'" in last and "doesn't exist" in last, last


def test_ppo_on_a_pi0_checkpoint_is_refused_before_its_weights_load(tmp_path):
    """The model type comes from config.json: a folder with a pi0 config and no weights at all is refused for PPO by
    name (a full-size pi0 would otherwise load 3B parameters to be told so), and GRPO goes on to load it."""
    from hf_vla.errors import ConfigError
    from hf_vla.rl import RLConfig
    from hf_vla.rl.__main__ import load_start
    from hf_vla.tiny import tiny_pi0_config

    tiny_pi0_config(chunk_size=4, max_state_dim=2, max_action_dim=2).save_pretrained(tmp_path / "pi0")
    args = RLConfig(output_dir=str(tmp_path / "out"), env="hf_vla/ColorReach-v0", use_cpu=True, algorithm="ppo",
                    model_name_or_path=str(tmp_path / "pi0"))
    with pytest.raises(ConfigError, match="use algorithm='grpo' for pi0"):
        load_start(args)
    args.algorithm = "grpo"
    with pytest.raises(ConfigError, match="could not be loaded"):  # no weights: the loader's own error, by name
        load_start(args)


@pytest.mark.slow  # the preemption machinery is the SFT trainer's, tested in the default suite by test_preemption
def test_sigterm_saves_a_checkpoint_exits_75_and_the_run_resumes(sft_checkpoint, tmp_path):
    out = tmp_path / "rl"
    config = _config(tmp_path, sft_checkpoint, max_steps=4, eval_on_start=False, eval_steps=4, save_steps=4)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    process = subprocess.Popen(_rl_command(config, out, "--disable_tqdm", "false"), cwd=REPO, env=env,
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = ""
    for line in iter(process.stderr.readline, ""):  # the second rollout batch: update 1 is done
        seen += line
        if "rollouts (update 1)" in line:
            process.send_signal(signal.SIGTERM)
            break
    rest = process.communicate(timeout=600)[1]
    assert process.returncode == 75, (seen + rest)[-3000:]
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    assert checkpoints in (["checkpoint-2"], ["checkpoint-1"]), checkpoints
    done = _run(_rl_command(config, out, "--resume_from_checkpoint", "true"))
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4
    episodes = [e["rollout/episodes"] for e in state["log_history"] if "rollout/episodes" in e]
    assert episodes[-1] == 2 * (4 - int(checkpoints[0].split("-")[1]))  # the resumed run rolled out the rest only


def test_two_processes_update_with_the_gradient_of_one_process_on_the_union_of_their_rollouts(sft_checkpoint,
                                                                                              tmp_path):
    """Under DDP each rank rolls out its own seeds and replays its own shard of the expert data; the update's
    gradient (PPO: policy and critic; the replayed supervised loss) is the one-process gradient of the loss over every
    rank's decisions (the loss weight 1 / all ranks' decisions, DDP's average undone, advantages whitened over both
    ranks) plus the mean of the supervised loss over every rank's replayed batches."""
    from rl_distributed import Recording, config

    out = tmp_path / "grads.pt"
    spec = _replay_spec(sft_checkpoint)
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT="29531")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29531", str(REPO / "tests" / "rl_distributed.py"), str(out), json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    saved = torch.load(out, weights_only=False)
    assert saved["world_size"] == 2 and len(saved["batches"]) == 4  # 2 ranks x GA 2
    decisions = [b for b in saved["batches"] if (b["weights"] > 0).any()]
    assert sum(len(b["weights"]) for b in decisions) == 8  # 4 episodes per rank, one decision each
    assert all(abs(float(b["weights"][0]) - 1 / 8) < 1e-9 for b in decisions)  # normalised over both ranks
    advantages = torch.cat([b["advantages"] for b in decisions]).double()
    assert abs(advantages.mean().item()) < 1e-6 and abs(advantages.std().item() - 1) < 1e-6  # whitened on the union
    first = saved["batches"][0]["chain"]
    assert not any(torch.equal(first, b["chain"]) for b in saved["batches"][2:])  # the ranks rolled out other seeds
    replayed = saved["replayed"]
    assert len(replayed) == 4  # one expert batch per micro-batch and rank
    identities = [set(zip(b["episode_index"].tolist(), b["frame_index"].tolist())) for b in replayed]
    assert not identities[0] & identities[2] and not identities[1] & identities[3]  # each rank its own shard
    model, processor = tiny_policy(seed=4, scale=0.05)
    # one process, the union: all four micro-batches of decisions, all four replayed batches (as GA 4)
    trainer = Recording(model, config(str(tmp_path / "one"), False, spec, gradient_accumulation_steps=4),
                        processing_class=processor)
    trainer.seen, trainer.replayed = [], []
    trainer._replay_batches = iter(replayed)
    try:
        total = sum(trainer.compute_loss(model.train(), b) for b in saved["batches"])
    finally:
        trainer.engine.close()
    total.backward()
    assert saved["grads"].keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, grad in saved["grads"].items():
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("config", sorted((REPO / "configs" / "rl").glob("*.json")), ids=lambda p: p.name)
def test_every_rl_config_validates(config, tmp_path):
    from hf_vla.rl.__main__ import parse_rl_config

    args = parse_rl_config(config, ["--output_dir", str(tmp_path / "out")])
    assert args.model_name_or_path and args.max_steps > 0 and args.eval_strategy == "steps"


def test_help_lists_the_rl_fields_and_the_command_is_listed(capsys):
    import hf_vla.__main__
    from hf_vla.rl.__main__ import cli

    assert cli(["--help"]) is None
    help_text = capsys.readouterr().out
    assert "--group_size (default: 8)" in help_text
    assert "--learning_rate (default: 1e-05; training's: 2.5e-05)" in help_text
    hf_vla.__main__.main()
    assert "python -m hf_vla.rl " in capsys.readouterr().out


def test_meta_world_rollouts_and_an_update_through_the_benchmark_wrapper(tmp_path):
    """The benchmark path: lerobot's Meta-World wrapper in worker processes, two tasks at once, one exploring at a
    noise level of its own, the dense reward, one update. Its one optimizer step recomputes every decision's
    likelihood at that decision's level under the rollout weights: ratio 1, nothing clipped."""
    from hf_vla.rl import RLConfig, RLTrainer

    torch.manual_seed(0)
    config = tiny_pi05_config(chunk_size=4, max_state_dim=4, max_action_dim=4, num_inference_steps=4)
    model = randomize_(PI05ForConditionalGeneration(config), seed=1, scale=0.05)
    head = "metaworld::delta_xyz_gripper"
    stats = {head: {"state": {"q01": [-1.0] * 4, "q99": [1.0] * 4}, "actions": {"q01": [-1.0] * 4, "q99": [1.0] * 4}}}
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats=stats, head_names=[head])
    args = RLConfig(output_dir=str(tmp_path / "run"), env="metaworld", task="reach-v3,push-v3", num_envs=2,
                    group_size=2, groups_per_update=1, max_steps=1, reward="dense", n_action_steps=2,
                    max_episode_steps=6, env_kwargs={"image_size": 32}, eval_episodes=2, eval_steps=1,
                    save_strategy="no", use_cpu=True, report_to=[], disable_tqdm=True, learning_rate=1e-3,
                    task_noise_levels={"push-v3": 0.15})
    trainer = RLTrainer(model, args, processing_class=processor)
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    entry = next(e for e in trainer.state.log_history if "rollout/return" in e)
    assert entry["rollout/episode_length"] == 6 and entry["rollout/decisions"] == 2 * 2 * 3
    assert entry["rollout/return"] > 0 and entry["rollout/decisions_used"] == 12  # dense returns differ in a group
    assert entry["grad_norm"] > 0 and "rollout/reach-v3/success" in entry and "rollout/push-v3/success" in entry
    assert abs(entry["ratio"] - 1) < 1e-4 and entry["clip_fraction"] == 0
    sde = trainer.sde  # half the decisions at 0.5, half at push's 0.15
    expected = (sum(sde.stds(0.5)) + sum(sde.stds(0.15))) / (2 * sde.num_steps)
    assert entry["noise_std"] == pytest.approx(expected, rel=1e-6)
    assert "level 0.5 (push-v3 0.15)" in trainer.rl_summary()["method"]
    evals = [e for e in trainer.state.log_history if "eval_success" in e]
    assert [e["step"] for e in evals] == [0, 1] and "eval_reach-v3/success" in evals[0]


def test_each_episode_is_credited_the_decisions_that_made_it(sft_checkpoint, tmp_path):
    """The oracle of credit assignment: replaying an episode from its seed with the chunks of the decisions credited
    to it (matched by noise seed, in decision order) gives, at every decision, the observation the stored model
    inputs were built from, and at the end the episode's steps and outcome. Two envs run each group's episodes side
    by side, so a decision credited to a batch-mate would show here."""
    from hf_vla.evaluation.envs import make_env
    from hf_vla.rl.__main__ import load_start, parse_rl_config
    from hf_vla.rl.trainer import RLTrainer

    config = _config(tmp_path, sft_checkpoint, group_size=4, groups_per_update=2)
    args = parse_rl_config(str(config), ["--output_dir", str(tmp_path / "out")])
    model, processor = load_start(args)
    trainer = RLTrainer(model, args, processing_class=processor)
    try:
        seeds, noise_seeds = trainer._seeds(0)
        episodes, transitions = trainer.engine.run(trainer._policy(stochastic=True), seeds, noise_seeds)
    finally:
        trainer.engine.close()
    settings, runner = trainer.rl_settings, trainer._policy(stochastic=False)
    replayed = [e for items in episodes.values() for e in items]
    assert len(replayed) == 8 and len(transitions) == sum(-(-e.steps // settings["n_action_steps"]) for e in replayed)
    for episode in replayed:
        mine = sorted((t for t in transitions if t.noise_seed == episode.noise_seed), key=lambda t: t.index)
        assert [t.index for t in mine] == list(range(len(mine))) and mine
        env = make_env(settings["env"], None, settings["env_kwargs"], worker=False)
        observation, info = env.reset(seed=episode.seed)
        steps, success, ended = 0, False, False
        for decision in mine:
            assert not ended  # no decision after the episode's end
            request = runner.prepare(observation, info["task"], settings["head"])
            for key, value in decision.inputs.items():
                torch.testing.assert_close(request.inputs[key], value, rtol=0, atol=0)
            chunk = processor.unnormalize_actions(decision.chain[-1].clone(), settings["head"]).numpy()
            for action in chunk[: settings["n_action_steps"]]:
                observation, _, terminated, truncated, info = env.step(action)
                steps, success = steps + 1, success or info["is_success"]
                if terminated or truncated:
                    ended = True
                    break
        env.close()
        assert (steps, success) == (episode.steps, episode.success)


# ---- expert data replayed beside the RL loss ------------------------------------------------------------------------
def _replay_spec(sft_checkpoint) -> list[dict]:
    """The ColorReach episodes the `sft_checkpoint` fixture recorded, as `bc_datasets` (head color_reach::delta_xy)."""
    spec = json.loads((REPO / "configs/demo.json").read_text())["datasets"]
    spec[0]["root"] = str(sft_checkpoint.parent / "data")
    return spec


def _replay_args(tmp_path, sft_checkpoint, name="run", **fields):
    from hf_vla.rl import RLConfig

    return RLConfig(**{"output_dir": str(tmp_path / name), "env": "hf_vla_test/PointBandit-v0", "num_envs": 1,
                       "group_size": 4, "groups_per_update": 2, "max_steps": 1, "reward": "dense", "use_cpu": True,
                       "report_to": [], "disable_tqdm": True, "save_strategy": "no", "eval_strategy": "no",
                       "eval_on_start": False, "n_action_steps": 1, "seed": 0, "log_kl": False,
                       "bc_datasets": _replay_spec(sft_checkpoint), "per_device_train_batch_size": 4,
                       "stream_open_blocks": 2, "dataloader_num_workers": 0} | fields)


def test_the_replayed_expert_loss_is_supervised_trainings_loss_on_the_policys_normalisation(sft_checkpoint, tmp_path):
    """With bc_datasets the loss is the RL loss plus bc_coef times supervised training's flow-matching loss (its
    seeded time and noise, per-sample means averaged) on a batch of the expert data, computed here by hand with plain
    full forwards, as one of the update's two micro-batches (half of it); the expert actions are normalised with the policy's statistics (q01/q99 = -+0.1: raw / 0.1), not
    the data's own."""
    import pandas as pd

    from hf_vla.rl import RLTrainer
    from hf_vla.serving.policy import model_input_keys
    from hf_vla.training.losses import sample_noise_and_time

    model, processor = tiny_policy(seed=4, scale=0.05)
    trainer = RLTrainer(model, _replay_args(tmp_path, sft_checkpoint, bc_coef=0.5, gradient_accumulation_steps=2),
                        processing_class=processor)
    try:
        batch = trainer._generate(0)[0]  # one of the update's two micro-batches
    finally:
        trainer.engine.close()
    replay = next(iter(trainer._loader(trainer.train_dataset.replay, trainer._replay_collate)))
    trainer._replay_batches = iter([replay])
    model.train()
    with torch.no_grad():
        total = trainer.compute_loss(model, batch)
        rl = trainer._policy_gradient_loss(model, batch)
        inputs = {k: replay[k] for k in model_input_keys(model)}
        actions = replay["actions"]
        noise, t = sample_noise_and_time(replay, actions.shape[1:], trainer.args.seed, 0, model.config)
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
        velocity = model(noise=x_t, timestep=t, **inputs).logits.float()
    valid = (~replay["action_is_pad"])[:, :, None] & replay["action_dim_mask"][:, None, :].bool()
    per_sample = [((velocity[i] - (noise[i] - actions[i])) ** 2)[valid[i]].mean() for i in range(len(actions))]
    expected = torch.stack(per_sample).mean()
    torch.testing.assert_close(total - rl, 0.5 * expected / 2, rtol=1e-4, atol=1e-7)  # the micro-batch's share
    assert trainer._rl_metrics["bc_loss"][-1] == pytest.approx(expected.item(), rel=1e-4)
    frames = pd.concat(pd.read_parquet(p) for p in sorted((sft_checkpoint.parent / "data" / "data").rglob("*.parquet")))
    for row in range(len(actions)):  # the chunk's first action, from the file, over the policy's q99 (0.1)
        episode, frame = int(replay["episode_index"][row]), int(replay["frame_index"][row])
        raw = frames[(frames["episode_index"] == episode) & (frames["frame_index"] == frame)]["action"].iloc[0]
        torch.testing.assert_close(actions[row, 0], torch.tensor(np.asarray(raw, np.float32) / 0.1), rtol=1e-4,
                                   atol=1e-5)


class _RecordingReplay:
    """Mixed into RLTrainer: records the (episode, frame) of every replayed sample, per update."""

    def _loader(self, dataset, collate_fn=None):
        loader = super()._loader(dataset, collate_fn)
        if collate_fn is None:
            return loader
        self.replayed = []

        def recorded():
            for batch in loader:
                self.replayed.append(list(zip(batch["episode_index"].tolist(), batch["frame_index"].tolist())))
                yield batch
        return recorded()


def test_a_resumed_run_replays_the_expert_batches_the_uninterrupted_one_would_have(sft_checkpoint, tmp_path):
    from hf_vla.rl import RLTrainer

    class Recording(_RecordingReplay, RLTrainer):
        pass

    runs = {}
    for name, resume in (("whole", None), ("resumed", True)):
        model, processor = tiny_policy(seed=4, scale=0.05)
        args = _replay_args(tmp_path, sft_checkpoint, name="whole" if resume else name, max_steps=3, save_steps=1,
                            save_strategy="steps", save_total_limit=None, learning_rate=1e-3)
        if resume:  # from the whole run's checkpoint-1, into a fresh trainer (its stream at the saved position)
            args.output_dir = str(tmp_path / "resumed")
            resume = str(tmp_path / "whole" / "checkpoint-1")
        trainer = Recording(model, args, processing_class=processor)
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            trainer.engine.close()
        runs[name] = trainer
    whole, resumed = runs["whole"].replayed, runs["resumed"].replayed
    assert len(whole) >= 3 and len(set(map(tuple, whole[:3]))) == 3  # three updates, three different batches
    assert resumed[:2] == whole[1:3]
    state = json.loads((tmp_path / "whole" / "checkpoint-2" / "stream_state.json").read_text())
    assert state["batches_consumed"] == 2 and state["batch_size"] == 4
    logged = [e for e in runs["whole"].state.log_history if "bc_loss" in e]
    assert len(logged) == 3 and all(e["bc_loss"] > 0 for e in logged)


def test_replay_settings_are_checked(sft_checkpoint, tmp_path):
    from hf_vla.errors import ConfigError
    from hf_vla.rl import RLConfig, RLTrainer

    common = dict(output_dir="unused", use_cpu=True, report_to=[])
    with pytest.raises(ConfigError, match="bc_coef=0.0: must be a positive number"):
        RLConfig(bc_coef=0.0, **common)
    with pytest.raises(ConfigError, match=r"bc_datasets\[0\].*'rot'"):
        RLConfig(bc_datasets=[{"rot": "x", "name": "a"}], **common)
    with pytest.raises(ConfigError, match="bc_datasets=\\[\\]: a non-empty list"):
        RLConfig(bc_datasets=[], **common)
    model = randomize_(PI05ForConditionalGeneration(tiny_pi05_config(chunk_size=4, max_state_dim=2,
                                                                     max_action_dim=2)), seed=0)
    other = "other_robot::delta_xy"
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats={other: NORM_STATS[HEAD]},
                                          head_names=[other])
    with pytest.raises(ConfigError, match=r"bc_datasets: head\(s\) \['color_reach::delta_xy'\] are not the policy's"):
        RLTrainer(model, _replay_args(tmp_path, sft_checkpoint), processing_class=processor)


@pytest.mark.slow  # one RL update beside the other RL tests; the freeze is what it adds
def test_a_token_loss_policy_improves_by_its_flow_objective(sft_checkpoint, tmp_path):
    """A policy trained with pi0.5's token objective (its processor holds FAST) starts RL: the RL objective and the
    replayed expert loss are the flow policy's (no token targets in the replayed batches), the target-token path is
    frozen as in flow-only training, and one update runs."""
    from hf_vla.models.pi05.fast_tokenizer import FASTActionTokenizer
    from hf_vla.rl import RLTrainer

    model, processor = tiny_policy(seed=4, scale=0.05, token_loss=True)
    assert model.model.vlm.language_model.norm.weight.requires_grad
    chunks = np.random.default_rng(0).uniform(-1, 1, (40, 4, 2))
    processor.set_fast_tokenizer(FASTActionTokenizer.fit(chunks, vocab_size=256), 1024)
    trainer = RLTrainer(model, _replay_args(tmp_path, sft_checkpoint), processing_class=processor)
    try:
        assert not model.config.token_loss and not model.model.vlm.language_model.norm.weight.requires_grad
        replay = next(iter(trainer._loader(trainer.train_dataset.replay, trainer._replay_collate)))
        assert "labels" not in replay and "actions" in replay
        trainer.train()
    finally:
        trainer.engine.close()
    assert trainer.state.global_step == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
