"""The collator: stream samples -> the batch contract (the processor's model inputs, the normalised `actions` and their
`action_is_pad`, the provenance columns the evaluation groups by), through the policy's processor.

The processor builds the model inputs exactly as at inference (pi0.5: `PI05Processor`, prompt with the discretized
state; transformers' pi0: `hf_vla.models.pi0_adapter.PI0HeadProcessor`), each row normalized by its own head. The
collator only adds what training needs: the target chunk's padding mask (padded steps zeroed), provenance, and with
the token objective (a processor with a FAST tokenizer) the target tokens `labels`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import get_worker_info

from hf_vla.errors import DataError

# provenance of the batch contract, plus frame_index (the trainer seeds each sample's t and noise by identity)
PROVENANCE = ("dataset_index", "source_index", "episode_index", "frame_index")


class VLACollator:
    """`targets`: with a processor that has a FAST tokenizer, also build the token objective's `labels` (default).
    `subtask_dropout`: with a subtask-trained processor (`subtask_layout`), the share of annotated samples that train
    without their subtask (the plain prompt), so the policy also acts without one; drawn per sample from its identity
    (dataset, episode, frame) and `seed`, so a resumed or re-sharded run drops the same ones. With the factorised
    layout, an annotated sample is a high-level one (`HIGH_LEVEL_SHARE` of them, drawn the same way: the prompt ending
    in `Subtask: `, the subtask its text target, no flow loss) or a low-level one (the subtask in the task's place,
    the flow loss), as lerobot's `subtask.yaml` blend."""

    HIGH_LEVEL_SHARE = 0.3  # lerobot's recipes/subtask.yaml: high_level_subtask 0.30, low_level_execution 0.70

    def __init__(self, processor, targets: bool = True, subtask_dropout: float = 0.0, seed: int = 0):
        self.processor, self.targets = processor, targets
        self.subtask_dropout, self.seed = float(subtask_dropout), int(seed)

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        try:
            inputs = self._inputs(samples)
        except ValueError as error:
            if type(error).__name__ != "IndicatorCutError":  # pi0.5's processor (also its remote-code copy)
                raise
            raise DataError(str(error)) from None
        return self._batch(samples, inputs)

    def _inputs(self, samples: list[dict]) -> dict:
        layout = getattr(self.processor, "subtask_layout", None)
        subtasks = [self._subtask(s) for s in samples] if layout else None
        high = [layout == "factorised" and text is not None and self._draw(s, 0x41) < self.HIGH_LEVEL_SHARE
                for s, text in zip(samples, subtasks or [None] * len(samples))]
        inputs = self._processed(samples, None if subtasks is None else [
            "auto" if is_high else text for text, is_high in zip(subtasks, high)])
        if any(high):  # factorised high-level rows: the prompt asks for the subtask, which is their target
            inputs["subtask_ids"], inputs["subtask_mask"] = self.processor.subtask_tokens(
                [text if is_high else None for text, is_high in zip(subtasks, high)])
            inputs["high_level"] = torch.tensor(high)
        return inputs

    def _draw(self, sample: dict, salt: int) -> float:
        """A number in [0, 1) drawn from the sample's identity and the seed (the same draw on every pass)."""
        key = [self.seed, 0x5B7A5C, salt, int(sample["source_index"]), int(sample["episode_index"]),
               int(sample["frame_index"])]
        return float(np.random.default_rng(key).random())

    def _processed(self, samples: list[dict], subtasks: list | None) -> dict:
        return self.processor(
            images=torch.stack([s["images"] for s in samples]), text=[s["task"] for s in samples],
            state=[s["state"] for s in samples], actions=[s["actions"] for s in samples],
            head=[int(s["dataset_index"]) for s in samples],
            camera_mask=torch.stack([s["camera_mask"] for s in samples]),
            # RECAP's indicator per row (None: none in the prompt), never the processor's inference default
            **({"advantage": [s.get("advantage") for s in samples]} if hasattr(self.processor, "advantage_conditioned")
               else {}),
            **({"subtask": subtasks} if subtasks is not None else {}),
            **({"memory": _memory(samples)} if "memory_mask" in samples[0] else {}),
        )

    def _subtask(self, sample: dict) -> str | None:
        """The sample's annotated subtask, or None where it has none or the dropout drops it."""
        text = sample.get("subtask")
        if not text or not self.subtask_dropout:
            return text or None
        return None if self._draw(sample, 0) < self.subtask_dropout else text

    def _batch(self, samples: list[dict], inputs) -> dict[str, torch.Tensor]:
        batch = dict(inputs)
        batch["action_is_pad"] = torch.stack([s["action_is_pad"] for s in samples])
        high = batch.pop("high_level", None)
        if high is not None:  # a factorised high-level sample trains its subtask alone: no flow loss
            batch["action_is_pad"][high] = True
        if getattr(self.processor, "advantage_conditioned", False):  # RECAP's indicator per row (-1: none), for the
            # evaluation's buckets; in every batch of such a run, so the gathered columns line up
            batch["advantage"] = torch.tensor([-1 if s.get("advantage") is None else int(bool(s["advantage"]))
                                               for s in samples], dtype=torch.long)
        if "value_return" in samples[0]:  # a value model's targets (RECAP): each frame's normalised return
            batch["value_targets"] = torch.tensor([float(s["value_return"]) for s in samples], dtype=torch.float32)
        if self.targets and getattr(self.processor, "fast_config", None):  # the token objective: FAST targets of each chunk
            texts = [s.get("target_text") for s in samples]
            batch["labels"] = self.processor.target_labels(batch["actions"], batch["action_is_pad"],
                                                           texts if any(t is not None for t in texts) else None)
        batch["actions"][batch["action_is_pad"]] = 0.0  # chunk steps past the end: zeros, masked out of the loss
        for key in PROVENANCE:
            batch[key] = torch.tensor([int(s[key]) for s in samples], dtype=torch.long)
        return _in_one_shared_segment(batch) if get_worker_info() is not None else batch


def _memory(samples: list[dict]) -> dict:
    """MEM's past observations of the samples, as the processor takes them (`PI05Processor(memory=...)`)."""
    memory = {"mask": torch.stack([s["memory_mask"] for s in samples]),
              "state": [s["memory_state"] for s in samples]}
    if "memory_images" in samples[0]:
        memory["images"] = torch.stack([s["memory_images"] for s in samples])
    return memory


def _in_one_shared_segment(batch: dict) -> dict:
    """The batch's tensors that are not in shared memory yet, moved into one shared segment (views of one storage).

    A worker sends each storage to the main process as its own file descriptor, over a socket connection with an
    HMAC handshake (multiprocessing's resource sharer): a dozen small tensors per batch cost more CPU than the 19 MB of
    pixels. torch pickles views of one storage once. (`pixel_values` is already shared: the processor writes it into
    a segment faulted in ahead.)
    """
    loose = [(key, value) for key, value in batch.items() if isinstance(value, torch.Tensor) and not value.is_shared()]
    if not loose:
        return batch
    aligned = [(value.numel() * value.element_size() + 63) // 64 * 64 for _, value in loose]
    storage = torch.UntypedStorage._new_shared(sum(aligned))
    offset = 0
    for (key, value), size in zip(loose, aligned):
        view = torch.empty(0, dtype=value.dtype).set_(storage, offset // value.element_size(), value.shape)
        batch[key] = view.copy_(value)
        offset += size
    return batch


PI05Collator = VLACollator  # with a PI05Processor
PI0Collator = VLACollator  # with a PI0HeadProcessor (transformers' pi0)

__all__ = ["PI0Collator", "PI05Collator", "VLACollator"]
