"""Camera images into a policy's input: any accepted form to `[B, n_cams, 3, H, W]` (`as_image_batch`), then SigLIP's
aspect-preserving resize with padding to [-1, 1] (`resize_with_pad`, as openpi), written into shared memory inside a
DataLoader worker. Shared by every policy's processor; torch and numpy only, so it travels with a checkpoint's remote
code (`remote_code.py`)."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import get_worker_info


class _SharedBuffers:
    """Float32 tensors in shared memory for a DataLoader worker's batches, each faulted in ahead on a helper thread.

    A worker hands every batch to the main process through shared memory. A fresh shared segment costs a page fault
    per 4 kB page on first write: 19 ms for the 19 MB of 32 frames at 224x224 on a 2-core VM (20 kB/us), a third of
    the worker's time per batch, on its one Python thread. Here the next batch's segment is allocated and zeroed while
    the worker decodes (torch releases the GIL in `zero_`), so the worker only converts into mapped memory. A segment
    is never reused: the main process owns it once sent, as with torch's `default_collate`.
    """

    def __init__(self):
        self.pid = os.getpid()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_vla-shm")
        self.pending: tuple[int, Future] | None = None

    @staticmethod
    def allocate(numel: int) -> torch.Tensor:
        storage = torch.UntypedStorage._new_shared(numel * 4)  # float32
        return torch.empty(0).set_(storage, 0, (numel,)).zero_()

    def take(self, numel: int) -> torch.Tensor:
        if self.pending is not None and self.pending[0] == numel:
            buffer = self.pending[1].result()
        else:
            buffer = self.allocate(numel)
        self.pending = (numel, self.executor.submit(self.allocate, numel))
        return buffer


_shared_buffers: _SharedBuffers | None = None


def _float_copy(images: torch.Tensor) -> torch.Tensor:
    """`images.float()`; inside a DataLoader worker, written into shared memory faulted in ahead (`_SharedBuffers`),
    so sending the batch to the main process costs neither a copy nor page faults on the worker's thread."""
    global _shared_buffers
    if get_worker_info() is None or images.device.type != "cpu":
        return images.float()
    if _shared_buffers is None or _shared_buffers.pid != os.getpid():
        _shared_buffers = _SharedBuffers()
    return _shared_buffers.take(images.numel()).view(images.shape).copy_(images)


def resize_with_pad(images: torch.Tensor, size: int) -> torch.Tensor:
    """Aspect-preserving bilinear resize of `[..., 3, H, W]` images to `size`x`size`, centred black padding.

    Accepts uint8 (0..255) or float in [0, 1]; returns float32 in [-1, 1] (SigLIP's normalisation), as openpi does.
    """
    # In-place arithmetic on tensors made here (never on the caller's): a batch of 32 224x224 frames is converted in
    # 5 ms instead of 20-40 ms of allocations, with the same values bit for bit.
    owned = images.dtype == torch.uint8
    lead, (channels, height, width) = images.shape[:-3], images.shape[-3:]
    if owned:  # the result when no resize is needed: the stream delivers frames at `size` already
        images = (_float_copy(images) if (height, width) == (size, size) else images.float()).div_(255.0)
    else:
        images = images.float()
    if channels != 3:
        raise ValueError(f"expected channels-first RGB images [..., 3, H, W], got shape {tuple(images.shape)}")
    flat = images.reshape(-1, channels, height, width)
    if (height, width) != (size, size):
        ratio = max(width / size, height / size)
        new_h, new_w = int(height / ratio), int(width / ratio)
        flat = F.interpolate(flat, size=(new_h, new_w), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
        pad_h, pad_w = size - new_h, size - new_w
        flat = F.pad(flat, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
        owned = True
    flat = flat.mul_(2.0).sub_(1.0) if owned else flat * 2.0 - 1.0
    return flat.reshape(*lead, channels, size, size)


def _pil_to_array(images):
    """PIL images, in (nested) lists, -> a uint8 array [..., H, W, 3]; anything else unchanged."""
    try:  # Pillow is optional: without it no PIL image can have been passed (and transformers' remote-code loader, which
        from PIL import Image  # requires every import it finds, leaves those inside a try block out)
    except ImportError:
        return images
    if isinstance(images, Image.Image):
        return np.array(images.convert("RGB"))  # a writable copy (torch warns about a read-only array, and may write)
    if isinstance(images, list | tuple) and images and (
            isinstance(images[0], Image.Image) or (isinstance(images[0], list | tuple) and images[0]
                                                   and isinstance(images[0][0], Image.Image))):
        return np.stack([_pil_to_array(item) for item in images])
    return images


def as_image_batch(images, batch_size: int | None = None) -> torch.Tensor:
    """Camera images as the model's `[B, n_cams, 3, H, W]` tensor, uint8 or float in [0, 1].

    Accepted: torch tensors or numpy arrays, channels-first `[..., 3, H, W]` or channels-last `[..., H, W, 3]` (what
    cameras, gym envs and the policy server deliver); uint8 (0..255) or float in [0, 1]; PIL images (one, a list of
    cameras, or a list of such lists per sample). Leading dims: `[B, n_cams]`; `[n_cams]` (one sample), or `[B]` (one
    camera each) when `batch_size` > 1 is the first dim; or none (one image, one camera). Anything else is refused in
    one line."""
    images = _pil_to_array(images)
    if not isinstance(images, torch.Tensor):
        array = np.asarray(images)
        if array.dtype == object:
            raise ValueError("images: expected an array of pixels (uint8 0..255 or float 0..1) or PIL images; got "
                             "ragged or mixed values (cameras of different sizes go in as one array per size)")
        images = torch.from_numpy(np.ascontiguousarray(array))
    if images.ndim not in (3, 4, 5):
        raise ValueError(f"images: expected [3, H, W], [n_cams, 3, H, W] or [B, n_cams, 3, H, W] (or channels last), "
                         f"got shape {tuple(images.shape)}")
    if images.shape[-3] != 3 and images.shape[-1] == 3:  # channels last: H x W x 3
        images = images.movedim(-1, -3)
    if images.shape[-3] != 3:
        raise ValueError(f"images: expected RGB images [..., 3, H, W] or [..., H, W, 3], got shape {tuple(images.shape)}")
    if images.ndim == 4 and batch_size is not None and batch_size > 1 and images.shape[0] == batch_size:
        images = images[:, None]  # one camera per sample
    while images.ndim < 5:
        images = images[None]
    if images.dtype == torch.uint8:
        return images
    if not images.is_floating_point():
        raise ValueError(f"images: dtype {images.dtype} is not accepted; pass uint8 (0..255) or float in [0, 1]")
    if images.numel():
        low, high = float(images.min()), float(images.max())
        if not (low >= -1e-3 and high <= 1.0 + 1e-3):  # NaN fails this too
            raise ValueError(f"images: float pixels must be in [0, 1], got values in [{low:g}, {high:g}]; divide "
                             "0..255 values by 255 (or pass them as uint8)")
    return images


__all__ = ["as_image_batch", "resize_with_pad"]
