"""The flow-matching objective owned by the trainer, per-sample losses and their aggregation modes.

An element is one valid (chunk step, action dim) of one sample: not `action_is_pad` and inside `action_dim_mask`.
`PerSampleLoss(sum[B], count[B])` is what the trainer reduces and gathers. Aggregation modes choose the denominator
for one optimizer step (all micro-batches, all ranks), see `StepTotals` and `sample_weights`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

LOSS_AGGREGATIONS = ("sample_mean", "token_mean", "group_mean", "constant")
GROUP_KEYS = {"episode": "episode_index", "dataset": "source_index"}


@dataclass
class PerSampleLoss:
    """Masked squared-error sum and element count of each sample."""

    sum: torch.Tensor  # [B]
    count: torch.Tensor  # [B]


def valid_elements(action_is_pad: torch.Tensor, action_dim_mask: torch.Tensor) -> torch.Tensor:
    """[B, chunk, dim] bool: the elements that count."""
    return (~action_is_pad.bool())[:, :, None] & action_dim_mask.bool()[:, None, :]


def per_sample_flow_loss(velocity, noise, actions, action_is_pad, action_dim_mask) -> PerSampleLoss:
    """(noise - actions - v)^2 summed over each sample's valid elements."""
    mask = valid_elements(action_is_pad, action_dim_mask)
    error = (noise.float() - actions.float() - velocity.float()).pow(2) * mask
    return PerSampleLoss(error.sum(dim=(1, 2)), mask.sum(dim=(1, 2)).to(error.dtype))


def _sample_seed(seed: int, step: int, source: int, episode: int, frame: int, *salt: int) -> int:
    key = np.array([seed, step, source, episode, frame, *salt], dtype=np.int64)
    return int.from_bytes(hashlib.blake2b(key.tobytes(), digest_size=8).digest(), "little") >> 1


def _identities(batch: dict) -> list[tuple[int, int, int]]:
    frames = batch["frame_index"].tolist() if "frame_index" in batch else [0] * len(batch["episode_index"])
    return list(zip(batch["source_index"].tolist(), batch["episode_index"].tolist(), frames))


RTC_SALT = 1  # keeps the committed-prefix draw independent of the noise and time draws of the same sample


def committed_steps(batch: dict, seed: int, step: int, max_delay: int) -> torch.Tensor:
    """Training-time real-time chunking: per sample, d ~ Uniform{0..max_delay} committed actions `[B]` (long).

    Keyed by the sample's identity like the noise (so any split into micro-batches and ranks draws the same d)."""
    if max_delay <= 0:
        return torch.zeros(len(batch["episode_index"]), dtype=torch.long)
    return torch.tensor([_sample_seed(seed, step, *identity, RTC_SALT) % (max_delay + 1)
                         for identity in _identities(batch)], dtype=torch.long)


RTC_NOISE_SALT = 2  # and the prefix offset independent of both


def prefix_offsets(batch: dict, shape: Sequence[int], seed: int, step: int, scale: float) -> torch.Tensor:
    """Training-time RTC's prefix noise: per sample, one Gaussian offset of std `scale` `[B, 1, action_dim]`, added
    to every committed action. Keyed by the sample's identity like the noise (exact under any split into micro-batches
    and ranks)."""
    offsets = [torch.randn(tuple(shape), generator=torch.Generator().manual_seed(
        _sample_seed(seed, step, *identity, RTC_NOISE_SALT))) for identity in _identities(batch)]
    return scale * torch.stack(offsets)[:, None, :]


def loss_padding(batch: dict, seed: int, step: int, config) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[B, chunk]` bool: chunk steps the loss leaves out (`action_is_pad`, and with `config.rtc_max_delay` the
    committed prefix), and the committed mask itself (None without training-time RTC)."""
    pad = batch["action_is_pad"].bool()
    max_delay = getattr(config, "rtc_max_delay", 0) or 0
    if max_delay <= 0:
        return pad, None
    delay = committed_steps(batch, seed, step, max_delay).to(pad.device)
    committed = torch.arange(pad.shape[1], device=pad.device)[None, :] < delay[:, None]
    return pad | committed, committed


def sample_noise_and_time(batch: dict, shape: Sequence[int], seed: int, step: int, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded noise [B, *shape] and t [B] per sample identity (step, source, episode, frame).

    Keyed by what the sample *is*, not where it sits, so any split of a step into micro-batches and ranks draws the
    same noise as one big batch (the exactness of gradient accumulation and data parallelism relies on it), and a
    resumed run draws what the uninterrupted one drew. t ~ Beta(alpha, beta) * scale + offset by inverse CDF.
    """
    noise, uniform = [], []
    for source, episode, frame in _identities(batch):
        generator = torch.Generator().manual_seed(_sample_seed(seed, step, source, episode, frame))
        noise.append(torch.randn(tuple(shape), generator=generator))
        uniform.append(torch.rand((), generator=generator, dtype=torch.float64).item())
    # scipy.stats here, not at the top: importing it costs ~1.3 s of CPU, and `import hf_vla` (inference, serving,
    # every command's start-up) does not need it
    from scipy.stats import beta as beta_distribution

    alpha, beta = config.time_sampling_beta_alpha, config.time_sampling_beta_beta
    t = beta_distribution.ppf(np.asarray(uniform), alpha, beta)
    t = torch.as_tensor(t, dtype=torch.float32) * config.time_sampling_scale + config.time_sampling_offset
    return torch.stack(noise), t


MODEL_INPUTS = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "state", "memory_state",
                "memory_mask", "advantage_ids")


def policy_per_sample_loss(model, inputs: dict, seed: int, step: int) -> tuple[PerSampleLoss, object]:
    """The trainer-owned objective for any velocity-predicting policy.

    Seeded t and noise per sample, x_t = t*noise + (1-t)*actions, the policy's velocity at (x_t, t) (passed as
    `noise`/`timestep`, without `actions`), masked per-sample sums and counts. Returns them and the model output.
    With `rtc_max_delay` in the policy's config (training-time real-time chunking), each sample's committed prefix
    has time 0 (x_t holds those actions clean, or shifted by one offset per sample of std `rtc_prefix_noise`;
    `timestep` is then `[B, chunk]`) and is left out of the loss.
    """
    unwrapped = getattr(model, "module", model)
    actions = inputs["actions"]
    noise, t = sample_noise_and_time(inputs, actions.shape[1:], seed, step, unwrapped.config)
    noise, t = noise.to(actions.device), t.to(actions.device)
    padding, committed = loss_padding(inputs, seed, step, unwrapped.config)
    if committed is not None:
        t = torch.where(committed, 0.0, t[:, None])  # [B, chunk]
    t_x = t[..., None] if t.ndim == 2 else t[:, None, None]
    x_t = t_x * noise + (1 - t_x) * actions
    scale = getattr(unwrapped.config, "rtc_prefix_noise", 0.0) or 0.0
    if committed is not None and scale > 0:
        # The committed prefix a robot sends is the policy's own output, off by its errors, never the demonstration:
        # a per-sample offset on the prefix keeps the model from continuing it blindly (padded dims stay 0).
        offsets = prefix_offsets(inputs, actions.shape[2:], seed, step, scale).to(actions.device, actions.dtype)
        x_t = x_t + committed[..., None] * inputs["action_dim_mask"][:, None, :] * offsets
    # the token objective's targets, and a subtask the expert reads and the backbone predicts
    extra = {k: inputs[k] for k in ("labels", "subtask_ids", "subtask_mask") if k in inputs}
    outputs = model(noise=x_t.to(unwrapped.dtype), timestep=t, **{k: inputs[k] for k in MODEL_INPUTS if k in inputs},
                    **extra)
    loss = per_sample_flow_loss(outputs.logits, noise, actions, padding, inputs["action_dim_mask"])
    return loss, outputs


def value_per_sample_loss(model, inputs: dict) -> tuple[PerSampleLoss, object]:
    """A value model's objective (RECAP): the cross-entropy of each sample's predicted return distribution against
    its target (`value_targets`: the normalised return, binned by the model's config), one element per sample."""
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")
    if getattr(getattr(model, "module", model), "reads_chunk", False):  # a chunk critic: Q(o, chunk executed)
        keys += ("actions", "action_is_pad")
    outputs = model(**{k: inputs[k] for k in keys if k in inputs}, value_targets=inputs["value_targets"])
    per_sample = outputs.per_sample_loss
    return PerSampleLoss(per_sample, torch.ones_like(per_sample)), outputs


@dataclass
class StepTotals:
    """Denominators spanning one optimizer step, after a gather over ranks."""

    num_samples: int  # samples with at least one valid element
    num_elements: float
    group_counts: dict = field(default_factory=dict)  # group id -> elements
    tokens: StepTotals | None = None  # the token objective's totals over target tokens (`hf_vla.training.cotraining`)

    @classmethod
    def from_counts(cls, counts: Sequence[float], groups: Sequence[int] | None = None) -> StepTotals:
        counts = [float(c) for c in counts]
        group_counts: dict = {}
        if groups is not None:
            for group, count in zip(groups, counts):
                group_counts[int(group)] = group_counts.get(int(group), 0.0) + count
        return cls(sum(c > 0 for c in counts), sum(counts), {g: c for g, c in group_counts.items() if c > 0})


def sample_weights(mode: str, per_sample: PerSampleLoss, totals: StepTotals, groups: torch.Tensor | None = None,
                   divisor: float | None = None) -> torch.Tensor:
    """w_i such that the step loss is sum_i w_i * sum_i over every sample of the step (fully padded samples: 0)."""
    count = per_sample.count
    present = count > 0
    if mode == "token_mean":
        weights = torch.full_like(count, 1.0 / max(totals.num_elements, 1.0))
    elif mode == "sample_mean":
        weights = 1.0 / (max(totals.num_samples, 1) * count.clamp(min=1.0))
    elif mode == "constant":
        weights = torch.full_like(count, 1.0 / (divisor * max(totals.num_samples, 1)))
    elif mode == "group_mean":
        if groups is None:
            raise ValueError("group_mean needs group ids (episode_index or source_index) in the batch")
        group_size = torch.tensor([totals.group_counts.get(int(g), 1.0) for g in groups.tolist()], dtype=count.dtype,
                                  device=count.device)
        weights = 1.0 / (max(len(totals.group_counts), 1) * group_size)
    else:
        raise ValueError(f"unknown loss_aggregation {mode!r}; choose one of {LOSS_AGGREGATIONS}")
    return torch.where(present, weights, torch.zeros_like(weights))


def bucket_mse(per_sample: PerSampleLoss, keys: torch.Tensor, names: Sequence[str] | None = None) -> dict[str, float]:
    """Σsum / Σcount per bucket (`keys[i]` is sample i's bucket, e.g. its head or dataset), never a mean of means;
    buckets without a valid element are left out. Named by `names[key]` (or the key itself)."""
    out = {}
    for key in sorted(set(keys.tolist())):
        rows = keys == key
        count = float(per_sample.count[rows].sum())
        if count > 0:
            name = names[key] if names is not None and key < len(names) else str(key)
            out[name] = float(per_sample.sum[rows].sum()) / count
    return out


def aggregate(mode: str, per_sample: PerSampleLoss, groups: torch.Tensor | None = None,
              divisor: float | None = None) -> torch.Tensor:
    """The loss of a batch taken as a whole step: single batches, the exactness tests' reference, and evaluation's
    `eval_loss` over the whole validation pass (the same weights as training)."""
    totals = StepTotals.from_counts(per_sample.count.tolist(), groups.tolist() if groups is not None else None)
    return (sample_weights(mode, per_sample, totals, groups, divisor) * per_sample.sum).sum()
