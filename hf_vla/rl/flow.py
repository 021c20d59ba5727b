"""The flow policy as a stochastic policy with an exact likelihood (Flow-SDE), and the policy-gradient arithmetic.

pi0 / pi0.5 sample a chunk by integrating the learned velocity from noise (t = 1) to actions (t = 0) with K Euler steps
`x_{t+dt} = x_t + v(x_t, t) dt`, `dt = -1/K`, where `x_t = t * noise + (1 - t) * actions`. That ODE sample has no
tractable likelihood. Flow-SDE (Flow-GRPO, arXiv 2505.05470, eq. 9; pi_RL's "Flow-SDE", arXiv 2510.25889) turns each
Euler step into a Gaussian step with the same marginals,

    mean = x_t (1 + sigma_t^2 / (2t) dt) + v(x_t, t) (1 + sigma_t^2 (1 - t) / (2t)) dt,   std = sigma_t sqrt(-dt),
    sigma_t = a sqrt(t / (1 - t))   (at t = 1, the value of the next time, 1 - 1/K),

so the chain x_1 -> x_{1-1/K} -> ... -> x_0 (the executed chunk) has the log-probability sum_k log N(x_{k+1}; mean_k,
std_k^2). The sampled intermediate x_k are stored at rollout time; at update time the means are recomputed under the
current weights (the prefix once, then K expert passes reading its cache) and the log-probability is differentiable.

The derivation: the score of x_t is -(x_t + (1 - t) v) / t for this interpolant, and the reverse-time SDE with diffusion
sigma_t that keeps the ODE's marginals has drift v - sigma_t^2 / 2 * score; `tests/test_rl.py` checks the sampler on a
Gaussian target whose exact velocity is known (the samples' mean and variance match the target with SDE noise too).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from hf_vla.registry import family_of
from hf_vla.rl.critic import PrefixValue

SCHEDULES = ("flow_sde", "constant")


@dataclass(frozen=True)
class FlowSDE:
    """K Gaussian denoising steps with noise level `a` (`noise_level`); `a = 0` is the deterministic Euler sampler.

    `schedule="flow_sde"` (default): Flow-GRPO's steps above, which keep the ODE's marginals: the samples spread only
    as far as the policy's own distribution does, whatever `a`. `"constant"`: the Euler step's mean `x + v dt` with
    the same std `a sqrt(-dt)` at every step (ReinFlow's noise injection, arXiv 2505.22094, with a fixed instead of a
    learned std): Brownian noise of variance `a^2` over the chain that the flow's later steps partly correct, so the
    samples leave the policy's distribution, which a policy that never varies its choice needs to explore."""

    num_steps: int
    noise_level: float
    schedule: str = "flow_sde"

    def __post_init__(self):
        if self.num_steps < 2:
            raise ValueError(f"num_steps={self.num_steps}: the SDE sampler needs at least 2 denoising steps")
        if not (math.isfinite(self.noise_level) and self.noise_level >= 0):
            raise ValueError(f"noise_level={self.noise_level}: must be a finite number >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}: choose one of {SCHEDULES}")

    @property
    def dt(self) -> float:
        return -1.0 / self.num_steps

    def times(self) -> list[float]:
        """t_k = 1 - k/K, k = 0..K-1 (the time each step starts from)."""
        return [1.0 + k * self.dt for k in range(self.num_steps)]

    # `level`, where the methods take it: a noise level per chunk instead of `noise_level` (`levels_like`'s
    # `[B, 1, 1]` tensor for a batch whose tasks explore at levels of their own, `task_noise_levels`)
    def sigma(self, t: float, level=None):
        a = self.noise_level if level is None else level
        if self.schedule == "constant":
            return a
        t = min(t, 1.0 + self.dt)  # sqrt(t / (1 - t)) is infinite at t = 1: use the next time's value
        return a * math.sqrt(t / (1.0 - t))

    def stds(self, level=None) -> list:
        return [self.sigma(t, level) * math.sqrt(-self.dt) for t in self.times()]

    def mean(self, x: torch.Tensor, velocity: torch.Tensor, t: float, level=None) -> torch.Tensor:
        if self.schedule == "constant":
            return x + velocity * self.dt
        sigma2 = self.sigma(t, level) ** 2
        return x * (1 + sigma2 / (2 * t) * self.dt) + velocity * (1 + sigma2 * (1 - t) / (2 * t)) * self.dt


def levels_like(levels, x: torch.Tensor):
    """Per-chunk noise levels `[B]` (a tensor or list) as `[B, 1, 1]` float32 on `x`'s device, to broadcast over a
    chunk's (step, dim) elements; `None` stays `None` (the `FlowSDE`'s own `noise_level`)."""
    if levels is None:
        return None
    return torch.as_tensor(levels, dtype=torch.float32).to(x.device).reshape(-1, 1, 1)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std, mask: torch.Tensor) -> torch.Tensor:
    """sum over the masked trailing (chunk step, action dim) elements of log N(x; mean, std^2): `[...]`; `std` a
    number or a tensor broadcasting over x (one per chunk, `[B, 1, 1]`)."""
    z = (x.float() - mean.float()) / std
    log_std = torch.log(std) if torch.is_tensor(std) else math.log(std)
    element = -0.5 * z * z - log_std - 0.5 * math.log(2 * math.pi)
    return (element * mask).sum(dim=(-2, -1))


def _core(model):
    """The policy module under DDP and peft wrappers (what takes `past_key_values`)."""
    return getattr(model, "module", model)


def _timestep(x: torch.Tensor, t) -> torch.Tensor:
    """`[B]` times: `t` a float (one time for the batch) or a `[B]` tensor (one per chunk)."""
    if torch.is_tensor(t):
        return t.to(device=x.device, dtype=torch.float32).reshape(x.shape[0])
    return torch.full((x.shape[0],), t, dtype=torch.float32, device=x.device)


def velocity_fn(model, inputs: dict, value: bool = False):
    """A function (x, t) -> velocity of `model` on `inputs` (prompt, images), the prefix run once; `t` a float or
    a `[B]` tensor.

    The first call goes through `model` itself (under DDP, its forward prepares the gradient all-reduce) with the
    prefix and fills the prefix cache; later calls run only the expert on the cache. Parameters used by several calls
    get their gradients summed by autograd before DDP's hooks fire, once per backward. With `value`, the first call
    also runs the critic on the prefix (`hf_vla.rl.critic`): `velocity.state["value"]` `[B]` afterwards."""
    state = {"cache": None, "value": None}
    core = _core(model)
    family = family_of(core)
    if family is not None and family.rl_velocity:  # a model not laid out as pi0.5 (transformers' pi0)
        if value:
            raise ValueError(f"{family.name} has no critic (value head): use algorithm='grpo' for {family.name}")
        return family.load("rl_velocity")(model, core, inputs, state)

    # a subtask the actions act on (pi0.5's high-level inference): its tokens join the prefix cache
    span = {"subtask_ids": inputs["subtask_ids"], "subtask_mask": inputs["subtask_mask"]} if "subtask_ids" in inputs \
        else {}
    # MEM's past observations (a memory policy): the prefix reads them; cached calls need their mask
    memory = {key: inputs[key] for key in ("memory_state", "memory_mask") if key in inputs}
    if "advantage_ids" in inputs:  # RECAP's embedding indicator: the expert reads it at every step
        memory["advantage_ids"] = inputs["advantage_ids"]

    def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
        timestep = _timestep(x, t)
        if state["cache"] is None:
            with PrefixValue(model) if value else contextlib.nullcontext():  # the output then carries `value`
                out = model(noise=x, timestep=timestep, input_ids=inputs["input_ids"],
                            pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"],
                            attention_mask=inputs["attention_mask"], use_cache=True, **span, **memory)
            state["cache"], state["value"] = out.past_key_values, out.value if value else None
            return out.logits
        return core(noise=x, timestep=timestep, input_ids=inputs["input_ids"],
                    pixel_attention_mask=inputs["pixel_attention_mask"], attention_mask=inputs["attention_mask"],
                    past_key_values=state["cache"], **({"subtask_mask": span["subtask_mask"]} if span else {}),
                    **{key: memory[key] for key in ("memory_mask", "advantage_ids") if key in memory}).logits

    velocity.state = state
    return velocity


def pi0_velocity_fn(model, core, inputs: dict, state: dict):
    """transformers' pi0 (`PI0ForConditionalGeneration`): the state is a tensor input, and the expert appends its keys
    and values to the prefix cache, which is cropped back to the prefix after every call (as its `sample_actions`
    does); cropping slices, so gradients still reach the prefix through the cache."""
    prefix = inputs["attention_mask"].shape[1]

    def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
        timestep = _timestep(x, t)
        common = dict(state=inputs["state"], noise=x, timestep=timestep, attention_mask=inputs["attention_mask"],
                      pixel_attention_mask=inputs["pixel_attention_mask"])
        if state["cache"] is None:
            out = model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"], **common)
            state["cache"] = out.past_key_values
        else:
            out = core(past_key_values=state["cache"], **common)
        appended = state["cache"].get_seq_length() - prefix
        if appended > 0:  # a negative length removes tokens in every transformers (from 5.16 a positive one raises)
            state["cache"].crop(-appended)
        return out.logits

    velocity.state = state
    return velocity


def chain_means(model, inputs: dict, chain: torch.Tensor, sde: FlowSDE, value: bool = False, levels=None):
    """The Gaussian means of every step of stored chains `[B, K+1, chunk, dim]` under `model`: `[B, K, chunk, dim]`;
    with `value`, (means, the critic's values `[B]`). `levels`: each chain's noise level `[B]` (default the sde's)."""
    velocity = velocity_fn(model, inputs, value=value)
    level = levels_like(levels, chain)
    means = []
    for k, t in enumerate(sde.times()):
        x = chain[:, k]
        means.append(sde.mean(x.float(), velocity(x, t).float(), t, level))
    means = torch.stack(means, dim=1)
    return (means, velocity.state["value"]) if value else means


@torch.no_grad()
def sample_chain(model, inputs: dict, noise: torch.Tensor, step_noise: torch.Tensor, sde: FlowSDE,
                 value: bool = False, levels=None):
    """Sample chains from x_1 = `noise` `[B, chunk, dim]` with the Gaussian steps' standard normals `step_noise`
    `[B, K, chunk, dim]`: returns (chain `[B, K+1, chunk, dim]`, means `[B, K, chunk, dim]`), and with `value` the
    critic's values `[B]` too; chain[:, -1] is the chunk. `levels`: each chain's noise level `[B]` (default the
    sde's)."""
    velocity = velocity_fn(model, inputs, value=value)
    x = noise.float()
    level = levels_like(levels, x)
    chain, means = [x], []
    for k, (t, std) in enumerate(zip(sde.times(), sde.stds(level))):
        mean = sde.mean(x, velocity(x, t).float(), t, level)
        x = mean + std * step_noise[:, k].to(mean)
        chain.append(x)
        means.append(mean)
    out = torch.stack(chain, dim=1), torch.stack(means, dim=1)
    return (*out, velocity.state["value"]) if value else out


def step_log_probs(chain: torch.Tensor, means: torch.Tensor, sde: FlowSDE, mask: torch.Tensor,
                   levels=None) -> torch.Tensor:
    """log N(x_{k+1}; mean_k, std_k^2) of each step, summed over the masked elements: `[B, K]`; `levels`: each
    chain's noise level `[B]` (default the sde's)."""
    return torch.stack([gaussian_log_prob(chain[:, k + 1], means[:, k], std, mask)
                        for k, std in enumerate(sde.stds(levels_like(levels, chain)))], dim=1)


def step_kl(means: torch.Tensor, reference: torch.Tensor, sde: FlowSDE, mask: torch.Tensor,
            levels=None) -> torch.Tensor:
    """KL between the Gaussian steps of two policies at the same x_k (equal stds): sum |m - m_ref|^2 / (2 std^2),
    `[B, K]`; summed over k it is the KL of the chains along the sampled path (the chain rule of the KL). `levels`:
    each chain's noise level `[B]` (default the sde's)."""
    out = []
    for k, std in enumerate(sde.stds(levels_like(levels, means))):
        diff = (means[:, k].float() - reference[:, k].float()) * mask
        out.append((diff * diff / (2 * std * std)).sum(dim=(-2, -1)))
    return torch.stack(out, dim=1)


# ---- advantages and the clipped objective ---------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, scale: bool = True, eps: float = 1e-4):
    """GRPO (DeepSeekMath, arXiv 2402.03300; TRL's `scale_rewards="group"`): each episode's return minus its group's
    mean, divided by the group's (unbiased) standard deviation + eps when `scale`. Returns (advantages, informative):
    `informative` is False for episodes of groups whose returns are all equal (no learning signal: dropped by dynamic
    sampling, DAPO arXiv 2503.14476)."""
    rewards = rewards.double()
    advantages = torch.zeros_like(rewards)
    informative = torch.zeros_like(rewards, dtype=torch.bool)
    for group in groups.unique():
        members = groups == group
        values = rewards[members]
        centred = values - values.mean()
        if values.numel() > 1:
            std = values.std()
            advantages[members] = centred / (std + eps) if scale else centred
            informative[members] = bool(std > 0)
    return advantages, informative


def absorbing_bonus(last_reward: float, remaining_steps: int, executed_in_last: int, n_action_steps: int,
                    gamma: float = 1.0) -> float:
    """The dense reward an episode that ended in success did not collect: the goal state held for the
    `remaining_steps` steps up to the episode limit, each paying the reward of the successful step (the goal state as
    absorbing). Envs that end an episode on success with a shaped reward (Meta-World pays up to 10 a step until the
    limit) otherwise pay more for lingering near the goal than for reaching it. Steps are discounted per decision
    (`gamma` for each executed chunk of `n_action_steps`): the first `n_action_steps - executed_in_last` of them
    complete the last decision's chunk (undiscounted, added to its reward), the next `n_action_steps` one decision
    later (`gamma`), and so on; `gamma` 1 gives `last_reward * remaining_steps` (an episode's undiscounted return)."""
    fill = n_action_steps - executed_in_last
    total = 0.0
    for i in range(1, max(0, int(remaining_steps)) + 1):
        total += gamma ** max(0, math.ceil((i - fill) / n_action_steps))
    return float(last_reward) * total


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float):
    """Generalized advantage estimation (Schulman et al., arXiv 1506.02438) over the decisions of one episode that ends
    after its last decision (success terminates it; the step limit is part of the task, so it ends it too: the value
    after the last decision is 0). `rewards`, `values`: `[T]`. Returns (advantages, returns = advantages + values),
    the critic's targets (PPO's "returns")."""
    rewards, values = rewards.double(), values.double()
    advantages = torch.zeros_like(rewards)
    running, next_value = 0.0, 0.0
    for t in reversed(range(rewards.numel())):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        next_value = values[t]
    return advantages, advantages + values


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, clip: float | None):
    """PPO's critic loss `0.5 (V - R)^2` per element; with `clip`, the larger of it and the loss of V kept within
    `clip` of the rollout's value (PPO2's value clipping, as TRL's PPOTrainer `cliprange_value`)."""
    values, returns = values.float(), returns.to(values.device).float()
    loss = 0.5 * (values - returns) ** 2
    if clip is not None:
        old_values = old_values.to(values.device).float()
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, 0.5 * (clipped - returns) ** 2)
    return loss


def clipped_objective(log_ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float):
    """PPO's clipped surrogate as a loss (Schulman et al., arXiv 1707.06347), with DAPO's separate upper clip:
    `-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)` elementwise, r = exp(log_ratio); advantages broadcast over
    the trailing dims of `log_ratio`. Returns (loss elements, clipped mask: where the clipped term was the minimum and
    differs from the unclipped one)."""
    ratio = torch.exp(log_ratio)
    while advantages.dim() < ratio.dim():
        advantages = advantages[..., None]
    advantages = advantages.to(ratio.dtype)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, clipped < unclipped


__all__ = ["FlowSDE", "absorbing_bonus", "chain_means", "clipped_objective", "gae", "gaussian_log_prob",
           "group_advantages", "levels_like", "sample_chain", "step_kl", "step_log_probs", "value_loss", "velocity_fn"]
