"""Real-time chunking (RTC): guided flow sampling so a new action chunk continues the one the robot is executing.

"Real-Time Execution of Action Chunking Flow Policies" (Black, Galliker, Levine, 2025), as lerobot 0.6 implements it
(`lerobot.policies.rtc.RTCProcessor`); used by `PI05ForConditionalGeneration.sample_actions`. While inference runs, the robot keeps executing the previous chunk for
`inference_delay` more steps; the new chunk is sampled as an inpainting problem: at every Euler step the predicted
clean chunk `x1 = x_t - t * v` is pulled towards the previous chunk's remainder with prefix weights (1 on the first
`inference_delay` actions, then a decay to 0 at `execution_horizon`) and a guidance weight that grows as t -> 0,
capped at `max_guidance_weight`.

The correction is the weighted error itself, as in lerobot (its velocity is computed before `x_t` requires grad, so
the vector-Jacobian product through the network reduces to the identity): one forward pass per step, no backward.
`jacobian=True` propagates the error through the expert as in the paper (one extra backward pass per step).

Training-time RTC ("Training-Time Action Conditioning for Efficient Real-Time Chunking", Black, Ren, Equi, Levine,
2025) needs no guidance: a model trained with `PI05Config.rtc_max_delay` (the trainer gives each sample a committed
prefix, clean at time 0 and left out of the loss) is sampled with the delayed actions held fixed at time 0 and only
the rest integrated (`committed_prefix`, `RTCConfig.method="prefix"`). The rest of the previous chunk is not used:
the new chunk follows the new observation from the delay on.

Time runs from 1 (noise) to 0 (actions), as in openpi and lerobot; the paper's tau is `1 - time`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hf_vla.models.common.rtc_config import METHODS, SCHEDULES, RTCConfig  # noqa: F401  (re-exported)


def _padded_remainder(prev_chunk_left_over: torch.Tensor, chunk_size: int, action_dim: int):
    """The remainder `[B, T, d]` or `[T, d]` zero-padded to `[B, chunk_size, action_dim]`, and its T and d."""
    prev = prev_chunk_left_over.float()
    if prev.ndim == 2:
        prev = prev[None]
    length, dims = prev.shape[1], prev.shape[2]
    if length > chunk_size or dims > action_dim:
        raise ValueError(f"prev_chunk_left_over has shape {tuple(prev.shape[1:])}; at most ({chunk_size}, {action_dim})")
    target = prev.new_zeros(prev.shape[0], chunk_size, action_dim)
    target[:, :length, :dims] = prev
    return target, length, dims


def committed_prefix(prev_chunk_left_over: torch.Tensor, chunk_size: int, action_dim: int,
                     inference_delay: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-time RTC: the previous remainder zero-padded to `[B, chunk_size, action_dim]` (padded action dims
    are 0, as the training targets are) and `[chunk_size]` bool, True on the first `inference_delay` actions (at
    most the remainder's length), which are held at those values."""
    target, length, dims = _padded_remainder(prev_chunk_left_over, chunk_size, action_dim)
    held = torch.arange(chunk_size, device=target.device) < min(inference_delay, length)
    return target, held


def prefix_weights(inference_delay: int, execution_horizon: int, chunk_size: int,
                   schedule: str = "linear") -> torch.Tensor:
    """`[chunk_size]` weights: 1 on `[0, inference_delay)`, decaying over `[inference_delay, execution_horizon)`,
    0 from `execution_horizon` on (lerobot's `get_prefix_weights`)."""
    end = execution_horizon
    start = min(inference_delay, end)
    weights = torch.zeros(chunk_size)
    if schedule == "zeros":
        weights[:start] = 1.0
        return weights
    if schedule == "ones":
        weights[: max(end, 0)] = 1.0
        return weights
    decay_len = min(end, chunk_size) - start
    if decay_len > 0:
        decay = torch.linspace(1, 0, decay_len + 2)[1:-1]
        if schedule == "exp":
            decay = decay * torch.expm1(decay).div(math.e - 1)
        weights[start : start + decay_len] = decay
    weights[: min(start, chunk_size)] = 1.0
    return weights


def guidance_weight(time: float, max_guidance_weight: float) -> float:
    """min(c / r^2, max) with tau = 1 - time, c = (1 - tau) / tau and 1/r^2 = ((1 - tau)^2 + tau^2) / (1 - tau)^2."""
    tau = 1.0 - time
    if tau <= 0.0:  # time 1: c is infinite
        return max_guidance_weight
    if tau >= 1.0:  # time 0: c = 0 and 1/r^2 infinite (lerobot: nan -> 0)
        return 0.0
    inv_r2 = ((1 - tau) ** 2 + tau**2) / (1 - tau) ** 2
    return min((1 - tau) / tau * inv_r2, max_guidance_weight)


def guidance_target(prev_chunk_left_over: torch.Tensor, chunk_size: int, action_dim: int,
                    execution_horizon: int, inference_delay: int, schedule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous remainder zero-padded to `[B, chunk_size, action_dim]` and its weights `[B, chunk_size, dims]`.

    Only the remainder's own action dims are guided (lerobot pads missing dims with zeros and pulls them to 0; here a
    remainder given in a head's real dims leaves the model's padded dims free)."""
    target, length, dims = _padded_remainder(prev_chunk_left_over, chunk_size, action_dim)
    weights = prefix_weights(inference_delay, min(execution_horizon, length), chunk_size, schedule).to(target.device)
    mask = target.new_zeros(1, chunk_size, action_dim)
    mask[..., :dims] = weights[:, None]
    return target, mask


def guided_velocity(velocity_fn: Callable[[torch.Tensor], torch.Tensor], x_t: torch.Tensor, time: float,
                    target: torch.Tensor, weights: torch.Tensor, config: RTCConfig) -> torch.Tensor:
    """The velocity at `x_t`, corrected towards `target` where `weights` > 0 (one Euler step of RTC sampling)."""
    if config.jacobian:
        with torch.enable_grad():
            x_t = x_t.detach().requires_grad_(True)
            velocity = velocity_fn(x_t)
            x1 = x_t - time * velocity
            error = ((target - x1) * weights).detach()
            correction = torch.autograd.grad(x1, x_t, error)[0]
        velocity = velocity.detach()
    else:
        velocity = velocity_fn(x_t)
        correction = (target - (x_t - time * velocity)) * weights
    return velocity - guidance_weight(time, config.max_guidance_weight) * correction


def euler_integrate(velocity: Callable, noise: torch.Tensor, num_steps: int, rtc_max_delay: int = 0,
                    prev_chunk_left_over: torch.Tensor | None = None, inference_delay: int = 0,
                    execution_horizon: int | None = None, rtc_config: RTCConfig | None = None) -> torch.Tensor:
    """Integrate `velocity(x_t, timestep)` from t=1 (`noise` `[B, chunk, d]`) to t=0 with `num_steps` Euler steps;
    with `prev_chunk_left_over`, continuing it as `rtc_config.method` says (guidance, or a prefix held clean at time
    0 for a model trained with `rtc_max_delay`), as `PI05ForConditionalGeneration.sample_actions` documents."""
    batch_size, chunk_size, action_dim = noise.shape
    device = noise.device
    guidance = committed = None
    if prev_chunk_left_over is not None:
        rtc_config = rtc_config or RTCConfig()
        method = rtc_config.resolve_method(inference_delay, rtc_max_delay)
        if method == "prefix":
            committed = committed_prefix(prev_chunk_left_over.to(device), chunk_size, action_dim, inference_delay)
        else:
            horizon = rtc_config.execution_horizon if execution_horizon is None else execution_horizon
            guidance = guidance_target(prev_chunk_left_over.to(device), chunk_size, action_dim, horizon,
                                       inference_delay, rtc_config.prefix_attention_schedule)
    x_t = noise
    if committed is not None:  # the committed actions are clean from the start and stay so
        target, held = committed
        x_t = torch.where(held[None, :, None], target, x_t)
    dt = -1.0 / num_steps
    for step in range(num_steps):
        time = 1.0 + step * dt
        timestep = torch.full((batch_size,), time, dtype=torch.float32, device=device)
        if committed is not None:
            timestep = torch.where(held, 0.0, timestep[:, None])  # [B, chunk]: time 0 on the committed actions

        def at_time(x, timestep=timestep):
            return velocity(x, timestep)

        if guidance is not None:
            v_t = guided_velocity(at_time, x_t, time, *guidance, rtc_config)
        elif committed is not None:
            v_t = at_time(x_t).masked_fill(held[None, :, None], 0.0)
        else:
            v_t = at_time(x_t)
        x_t = x_t + dt * v_t
    return x_t


__all__ = ["euler_integrate", "RTCConfig", "committed_prefix", "prefix_weights", "guidance_weight", "guidance_target", "guided_velocity"]
