"""An exponential moving average of the trainable weights, as openpi's pi0.5 recipes train and ship (`ema_decay`).

    python -m hf_vla.train configs/pi05_libero.json --ema_decay 0.999

After every optimizer step, `ema = decay * ema + (1 - decay) * weights` in fp32, over the trainable parameters only
(with LoRA: the adapters and the trained heads). Until `ema_start_step` the average just follows the weights (openpi
starts averaging at once; a later start keeps the first, fast-moving steps out of it). Each rank averages what it holds:

- one process and DDP: the whole parameters (one identical copy per rank, 4 bytes per trainable parameter);
- FSDP2: the rank's shard of each parameter (`DTensor.to_local()`), so the average is sharded like the fp32
  parameters and no rank holds a full copy;
- DeepSpeed ZeRO-3: the rank's partition of each parameter (`ds_tensor`); ZeRO-2 keeps whole parameters on every
  rank, so its average is whole too.

Checkpoints save the average beside the weights (`ema_rank<R>.pt`, written before the completion marker, so a
checkpoint is complete with it or not at all) and a resume restores it bit for bit. Evaluation (`evaluate`, the
action metrics) and the rollout snapshots use the averaged weights; the final `save_pretrained` and the Hub push
write them as the model unless `ema_save_raw`, and the model card says which weights it holds.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from transformers import TrainerCallback

logger = logging.getLogger("hf_vla.training.ema")


def _local(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: its FSDP2 shard, its ZeRO-3 partition, or the parameter itself."""
    if hasattr(param, "ds_tensor"):  # DeepSpeed ZeRO-3
        return param.ds_tensor
    if hasattr(param, "to_local"):  # FSDP2 DTensor
        return param.to_local()
    return param


class WeightEMA(TrainerCallback):
    """The average of `trainer`'s trainable parameters (see the module docstring); a callback updating it."""

    def __init__(self, trainer, decay: float, start_step: int = 0):
        self.trainer, self.decay, self.start_step = trainer, float(decay), int(start_step)
        self.names: list[str] = []
        self.shadow: list[torch.Tensor] | None = None  # fp32, one per trainable parameter (this rank's part)

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        model = self.trainer.model_wrapped if self.trainer.model_wrapped is not None else self.trainer.model
        return [(name, param) for name, param in model.named_parameters() if param.requires_grad]

    def _source(self, param: torch.Tensor) -> torch.Tensor:
        """What the average follows: the fp32 master of a bf16 parameter under `MasterWeightOptimizer` (one process,
        DDP), else what this rank holds of the parameter."""
        optimizer = self.trainer._master_optimizer() if self.trainer.optimizer is not None else None
        if optimizer is not None and optimizer._masters_synced:
            if getattr(self, "_masters", None) is None:
                self._masters = {id(p): m for p, m in optimizer._pairs()}
            master = self._masters.get(id(param))
            if master is not None:
                return master
        return _local(param)

    def _ensure(self) -> None:
        if self.shadow is None:
            params = self._params()
            self.names = [name for name, _ in params]
            with torch.no_grad():
                self.shadow = [self._source(p).detach().float().clone() for _, p in params]

    # ---- updates -------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._ensure()
        resume = getattr(self.trainer, "_resumed_from", None)
        if resume:
            self.load(resume)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self._ensure()
        with torch.no_grad():
            follow = state.global_step <= self.start_step
            for average, (_, param) in zip(self.shadow, self._params()):
                local = self._source(param).detach()
                if follow:
                    average.copy_(local)
                else:  # ema <- decay * ema + (1 - decay) * w
                    average.mul_(self.decay).add_(local.float(), alpha=1.0 - self.decay)
        return control

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def file(self, folder) -> str:
        return os.path.join(str(folder), f"ema_rank{self.trainer.args.process_index}.pt")

    def save(self, folder) -> None:
        """Every rank writes its part into the checkpoint folder (before the completion marker)."""
        self._ensure()
        from hf_vla.training import checkpoints

        checkpoints.save_tensor_file(self.file(folder), {"names": self.names, "shadow": self.shadow,
                                                        "decay": self.decay, "start_step": self.start_step})

    def load(self, folder) -> None:
        from hf_vla.errors import CheckpointError

        path = self.file(folder)
        if not os.path.isfile(path):
            raise CheckpointError(f"resume_from_checkpoint={str(folder)!r} has no EMA of rank "
                                  f"{self.trainer.args.process_index} ({os.path.basename(path)}) but ema_decay is set: "
                                  "it was trained without EMA, or on another number of processes")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        shapes = [tuple(t.shape) for t in self.shadow]
        if saved["names"] != self.names or [tuple(t.shape) for t in saved["shadow"]] != shapes:
            raise CheckpointError(f"{path}: the saved EMA does not fit this run's trainable parameters (another model, "
                                  "LoRA preset or number of processes)")
        with torch.no_grad():
            for average, value in zip(self.shadow, saved["shadow"]):
                average.copy_(value)

    # ---- using the average -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def swapped(self):
        """The averaged weights in the model for the duration (every rank swaps its part; no collective)."""
        self._ensure()
        params = self._params()
        raw = []
        with torch.no_grad():
            for average, (_, param) in zip(self.shadow, params):
                local = _local(param)
                raw.append(local.detach().clone())
                local.copy_(average.to(local.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for value, (_, param) in zip(raw, params):
                    _local(param).copy_(value)


__all__ = ["WeightEMA"]
