"""Training-time image augmentation (`image_augmentation openpi`): where the crop and rotation move a point, the colour
jitter against a float64 hand computation, wrist slots left unmoved, draws keyed by the sample and step, and the
trainer augmenting training batches only."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_vla.data.augment import AUGMENT_SALT, ImageAugmentation, _draws, augment_images, preset
from hf_vla.errors import ConfigError

GEOMETRY_ONLY = ImageAugmentation(crop_scale=0.8, max_rotation_degrees=20.0, brightness=0.0, contrast=0.0, saturation=0.0)
JITTER_ONLY = ImageAugmentation(crop_scale=1.0, max_rotation_degrees=0.0)


def _dot_image(size: int, row: float, col: float) -> torch.Tensor:
    """[1, 1, 3, size, size] in [-1, 1]: black with a small white Gaussian blob at (row, col) (pixel centres)."""
    ys, xs = torch.meshgrid(torch.arange(size, dtype=torch.float64), torch.arange(size, dtype=torch.float64),
                            indexing="ij")
    blob = torch.exp(-((ys - row) ** 2 + (xs - col) ** 2) / (2 * 1.5 ** 2))
    return (blob * 2 - 1).float().expand(3, size, size)[None, None].clone()


def _centroid(image: torch.Tensor) -> tuple[float, float]:
    weight = (image[0, 0, 0].double() + 1) / 2
    weight = torch.where(weight > 0.05, weight, 0)
    ys, xs = torch.meshgrid(torch.arange(weight.shape[0], dtype=torch.float64),
                            torch.arange(weight.shape[1], dtype=torch.float64), indexing="ij")
    return float((weight * ys).sum() / weight.sum()), float((weight * xs).sum() / weight.sum())


def test_crop_and_rotation_move_a_point_where_the_map_says():
    """The output pixel at p shows the input at s R p + t (normalised coordinates about the centre): a blob at q in
    the input appears at R^-1 (q - t) / s, within 0.3 px."""
    size, seed = 64, 1  # a draw of -10.6 degrees and a shift of (-0.18, -0.11)
    image = _dot_image(size, 22.0, 40.0)
    out = augment_images(image, [seed], GEOMETRY_ONLY)
    u = _draws(torch.Generator().manual_seed(seed), 1)[0].tolist()
    s = GEOMETRY_ONLY.crop_scale
    t = np.array([(2 * u[0] - 1) * (1 - s), (2 * u[1] - 1) * (1 - s)])
    angle = (2 * u[2] - 1) * math.radians(GEOMETRY_ONLY.max_rotation_degrees)
    rotation = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
    q = np.array([(40.0 + 0.5) / (size / 2) - 1, (22.0 + 0.5) / (size / 2) - 1])  # (x, y), align_corners=False
    p = np.linalg.solve(rotation, (q - t) / s)
    expected = ((p[1] + 1) * size / 2 - 0.5, (p[0] + 1) * size / 2 - 0.5)
    assert abs(angle) > math.radians(10) and np.abs(t).min() > 0.1  # a real move, not the identity
    assert _centroid(out) == pytest.approx(expected, abs=0.3)
    assert _centroid(out) != pytest.approx(_centroid(image), abs=1.0)


def test_colour_jitter_equals_a_float64_hand_computation():
    generator = torch.Generator().manual_seed(0)
    image = torch.rand((1, 1, 3, 8, 8), generator=generator) * 2 - 1
    out = augment_images(image, [77], JITTER_ONLY)
    u = _draws(torch.Generator().manual_seed(77), 1)[0].numpy()
    x = (image[0, 0].double().numpy() + 1) / 2
    x = np.clip(x * (1 + (2 * u[3] - 1) * 0.3), 0, 1)
    luma = 0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]
    x = np.clip((x - luma.mean()) * (1 + (2 * u[4] - 1) * 0.4) + luma.mean(), 0, 1)
    luma = 0.299 * x[0] + 0.587 * x[1] + 0.114 * x[2]
    x = np.clip((x - luma) * (1 + (2 * u[5] - 1) * 0.5) + luma, 0, 1)
    np.testing.assert_allclose(out[0, 0].double().numpy(), x * 2 - 1, atol=1e-5)
    assert float((out - image).abs().max()) > 0.05


def test_no_augmentation_settings_give_the_image_back_and_wrist_slots_are_not_moved():
    image = torch.rand((2, 2, 3, 16, 16), generator=torch.Generator().manual_seed(1)) * 2 - 1
    identity = ImageAugmentation(crop_scale=1.0, max_rotation_degrees=0.0, brightness=0.0, contrast=0.0, saturation=0.0)
    torch.testing.assert_close(augment_images(image, [5, 6], identity), image, atol=1e-5, rtol=0)
    # slot 1 a wrist camera: no crop or rotation there (jitter off here, so it is untouched), slot 0 moved
    geometric = torch.tensor([[True, False], [True, False]])
    out = augment_images(image, [5, 6], GEOMETRY_ONLY, geometric)
    torch.testing.assert_close(out[:, 1], image[:, 1], atol=1e-6, rtol=0)
    assert float((out[:, 0] - image[:, 0]).abs().max()) > 0.1


def test_draws_are_keyed_by_the_sample_not_its_place_in_the_batch():
    images = torch.rand((3, 1, 3, 16, 16), generator=torch.Generator().manual_seed(2)) * 2 - 1
    whole = augment_images(images, [10, 11, 12], preset("openpi"))
    alone = augment_images(images[2:], [12], preset("openpi"))
    torch.testing.assert_close(whole[2:], alone, atol=1e-6, rtol=0)
    other = augment_images(images[2:], [13], preset("openpi"))
    assert float((other - alone).abs().max()) > 1e-3
    with pytest.raises(ConfigError, match="image_augmentation='flip'"):
        preset("flip")


def test_the_trainer_augments_training_batches_only(tmp_path):
    """`image_augmentation openpi`: the training loss sees augmented pixels (keyed by identity and step: the same
    batch twice gives the same loss), evaluation the real ones."""
    from conftest import randomize_

    from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
    from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config
    from hf_vla.training.losses import _identities, _sample_seed
    from hf_vla.training.trainer import VLATrainer, VLATrainingArguments

    # random weights everywhere: zero-initialised gates would hide the image from the expert
    model = randomize_(PI05ForConditionalGeneration(tiny_pi05_config(chunk_size=4, max_state_dim=2, max_action_dim=2)))
    stats = {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}, "actions": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}}
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats={"h": stats},
                                          head_names=["h"])
    images = torch.randint(0, 255, (2, 1, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    batch = dict(processor(images=images, text=["pick"] * 2, state=np.zeros((2, 2), np.float32),
                           actions=[np.zeros((4, 2), np.float32)] * 2, head="h",
                           camera_mask=torch.ones(2, 1, dtype=torch.bool)))
    batch["action_is_pad"] = torch.zeros(2, 4, dtype=torch.bool)
    for key, values in {"dataset_index": [0, 0], "source_index": [0, 0], "episode_index": [0, 1],
                        "frame_index": [5, 9]}.items():
        batch[key] = torch.tensor(values)

    def trainer(augmentation):
        args = VLATrainingArguments(output_dir=str(tmp_path / augmentation), max_steps=1, use_cpu=True, report_to=[],
                                    image_augmentation=augmentation)
        return VLATrainer(model=model, args=args, processing_class=processor)

    plain, augmented = trainer("none"), trainer("openpi")
    model.train()
    with torch.no_grad():
        a, _ = augmented.per_sample_loss(model, batch, step=3)
        b, _ = augmented.per_sample_loss(model, batch, step=3)
        c, _ = plain.per_sample_loss(model, batch, step=3)
        seeds = [_sample_seed(augmented.args.seed, 3, *identity, AUGMENT_SALT) for identity in _identities(batch)]
        by_hand = dict(batch, pixel_values=augment_images(batch["pixel_values"], seeds, preset("openpi")))
        d, _ = plain.per_sample_loss(model, by_hand, step=3)
    torch.testing.assert_close(a.sum, b.sum)
    torch.testing.assert_close(a.sum, d.sum)  # what the trainer does: the module's augmentation with these seeds
    assert float((a.sum - c.sum).abs().min()) > 1e-3
    model.eval()
    with torch.no_grad():
        e, _ = augmented.per_sample_loss(model, batch, step=3)
    torch.testing.assert_close(e.sum, c.sum)
    with pytest.raises(ConfigError, match="image_augmentation='crop'"):
        VLATrainingArguments(output_dir=str(tmp_path / "bad"), max_steps=1, use_cpu=True, image_augmentation="crop")


def test_rl_refuses_augmentation_by_name(tmp_path):
    from hf_vla.rl import RLConfig

    with pytest.raises(ConfigError, match="image_augmentation='openpi': RL trains on the observations"):
        RLConfig(output_dir=str(tmp_path), env="hf_vla/ColorReach-v0", use_cpu=True, image_augmentation="openpi")
