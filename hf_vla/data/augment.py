"""Training-time image augmentation, openpi's recipe for pi0 / pi0.5 (`image_augmentation openpi`).

openpi augments every training image after resizing it to the model's size: a random crop of 95% of each side resized
back, a rotation by up to 5 degrees (both skipped for wrist cameras, whose view moves with the gripper anyway), and a
colour jitter of brightness 0.3, contrast 0.4 and saturation 0.5 (every camera). lerobot's pi0 / pi0.5 trainers do not
augment by default. Here the crop and rotation are one affine resampling (bilinear, black outside the image, as a
crop followed by a rotation about the centre), and the jitter factors are drawn uniformly from [1 - x, 1 + x] and
applied in that order, each clamped to [0, 1].

Each sample's draws are keyed by what the sample is (seed, optimizer step, source, episode, frame), like the flow
noise of `hf_vla.training.losses`: any split of a step into micro-batches or ranks, and a resumed run, augment exactly as one
uninterrupted batch would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_vla.errors import ConfigError

AUGMENT_SALT = 3  # keeps these draws independent of the noise, time and RTC draws of the same sample


@dataclass(frozen=True)
class ImageAugmentation:
    crop_scale: float = 0.95  # side of the random crop, as a fraction of the image side
    max_rotation_degrees: float = 5.0
    brightness: float = 0.3
    contrast: float = 0.4
    saturation: float = 0.5


PRESETS = {"none": None, "openpi": ImageAugmentation()}


def preset(name: str) -> ImageAugmentation | None:
    if name not in PRESETS:
        raise ConfigError(f"image_augmentation={name!r}: choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def _draws(generator: torch.Generator, slots: int) -> torch.Tensor:
    """[slots, 6] uniforms in [0, 1): crop x, crop y, rotation, brightness, contrast, saturation."""
    return torch.rand((slots, 6), generator=generator, dtype=torch.float64)


def augment_images(pixel_values: torch.Tensor, seeds: list[int], config: ImageAugmentation,
                   geometric: torch.Tensor | None = None) -> torch.Tensor:
    """`pixel_values` [B, cams, 3, H, W] (or [B, 3, H, W]) in [-1, 1] -> augmented, same shape and dtype.

    seeds: one per sample (its draws); geometric: [B, cams] bool, where crop and rotation apply (default: every slot;
    colour jitter applies everywhere)."""
    squeeze = pixel_values.dim() == 4
    images = pixel_values[:, None] if squeeze else pixel_values
    batch, cams, channels, height, width = images.shape
    if len(seeds) != batch:
        raise ValueError(f"{len(seeds)} seeds for a batch of {batch}")
    draws = torch.stack([_draws(torch.Generator().manual_seed(int(seed)), cams) for seed in seeds])  # [B, cams, 6]
    draws = draws.reshape(batch * cams, 6).to(images.device)
    flat = (images.reshape(batch * cams, channels, height, width).float() + 1.0) / 2.0  # [0, 1]

    # crop then rotate about the centre, as one map from output to input coordinates (normalised to [-1, 1])
    scale = config.crop_scale
    shift_x, shift_y = (2 * draws[:, 0] - 1) * (1 - scale), (2 * draws[:, 1] - 1) * (1 - scale)
    angle = (2 * draws[:, 2] - 1) * math.radians(config.max_rotation_degrees)
    cos, sin = torch.cos(angle), torch.sin(angle)
    aspect = height / width  # rotate in pixel space, not in the normalised square
    theta = torch.stack([torch.stack([scale * cos, -scale * sin * aspect, shift_x], -1),
                         torch.stack([scale * sin / aspect, scale * cos, shift_y], -1)], 1)
    if geometric is not None:
        keep = ~geometric.reshape(-1).to(images.device)
        theta[keep] = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=theta.dtype, device=theta.device)
    grid = F.affine_grid(theta.float(), list(flat.shape), align_corners=False)
    moved = F.grid_sample(flat, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if geometric is not None:
        moved[keep] = flat[keep]  # untouched, not resampled through an identity grid

    # colour jitter: brightness, contrast (towards the mean grey), saturation (towards the luma)
    def factor(column: int, amount: float) -> torch.Tensor:
        return (1 + (2 * draws[:, column] - 1) * amount).float()[:, None, None, None]

    moved = (moved * factor(3, config.brightness)).clamp(0, 1)
    luma = (0.299 * moved[:, 0] + 0.587 * moved[:, 1] + 0.114 * moved[:, 2])[:, None]
    moved = ((moved - luma.mean((2, 3), keepdim=True)) * factor(4, config.contrast)
             + luma.mean((2, 3), keepdim=True)).clamp(0, 1)
    luma = (0.299 * moved[:, 0] + 0.587 * moved[:, 1] + 0.114 * moved[:, 2])[:, None]
    moved = ((moved - luma) * factor(5, config.saturation) + luma).clamp(0, 1)
    out = (moved * 2 - 1).reshape(images.shape).to(pixel_values.dtype)
    return out[:, 0] if squeeze else out
