"""Run `hf_vla.train` and record every trainable parameter, whole, after each optimizer step (before the EMA update
of that step reads it), for a float64 reference of the EMA.

    python tests/ema_run.py RECORD.pt CONFIG.json [--key value ...]

Under FSDP2 and ZeRO-3 the whole parameters are gathered (collectives: every rank takes part); rank 0 writes
RECORD.pt: {"names": [...], "steps": [[tensor, ...] per step]} with names as the unwrapped model has them.
"""

import os
import sys

import torch

from hf_vla.training.ema import WeightEMA

record = sys.argv[1]
rank = int(os.environ.get("RANK", "0"))
steps: list[list[torch.Tensor]] = []
original = WeightEMA.on_step_end


def whole(param):
    if hasattr(param, "ds_tensor"):  # ZeRO-3
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.detach().double().cpu().clone()
    if hasattr(param, "full_tensor"):  # FSDP2
        return param.full_tensor().detach().double().cpu()
    return param.detach().double().cpu().clone()


def on_step_end(self, args, state, control, **kwargs):
    values = [whole(p) for _, p in self._params()]
    if rank == 0:
        steps.append(values)
        names = [n.removeprefix("module.") for n, _ in self._params()]
        torch.save({"names": names, "steps": steps}, record)
    return original(self, args, state, control, **kwargs)


WeightEMA.on_step_end = on_step_end

from hf_vla.train import cli  # noqa: E402

cli(sys.argv[2:])
