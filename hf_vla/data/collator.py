"""The collator: stream samples -> the batch contract of DESIGN.md, through the policy's processor.

The processor builds the model inputs exactly as at inference (pi0.5: `PI05Processor`, prompt with the discretized
state; transformers' pi0: `hf_vla.models.pi0_adapter.PI0HeadProcessor`), each row normalized by its own head. The
collator only adds what training needs: the target chunk's padding mask (padded steps zeroed) and provenance.
"""

from __future__ import annotations

import torch

# provenance of the batch contract, plus frame_index (the trainer seeds each sample's t and noise by identity)
PROVENANCE = ("dataset_index", "source_index", "episode_index", "frame_index")


class VLACollator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        inputs = self.processor(
            images=torch.stack([s["images"] for s in samples]), text=[s["task"] for s in samples],
            state=[s["state"] for s in samples], actions=[s["actions"] for s in samples],
            head=[int(s["dataset_index"]) for s in samples],
            camera_mask=torch.stack([s["camera_mask"] for s in samples]),
        )
        batch = dict(inputs)
        batch["action_is_pad"] = torch.stack([s["action_is_pad"] for s in samples])
        batch["actions"][batch["action_is_pad"]] = 0.0  # chunk steps past the end: zeros, masked out of the loss
        for key in PROVENANCE:
            batch[key] = torch.tensor([int(s[key]) for s in samples], dtype=torch.long)
        return batch


PI05Collator = VLACollator  # with a PI05Processor
PI0Collator = VLACollator  # with a PI0HeadProcessor (transformers' pi0)

__all__ = ["PI0Collator", "PI05Collator", "VLACollator"]
