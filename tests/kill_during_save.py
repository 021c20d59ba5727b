"""Run `hf_vla.train` and SIGKILL the process at a chosen moment of the checkpoint save of step `KILL_STEP`.

    python tests/kill_during_save.py CONFIG.json MOMENT KILL_STEP [--key value ...]

Moments:
- `after_weights`: model.safetensors is written, nothing else yet;
- `mid_optimizer`: optimizer.pt is half written (the file exists, truncated);
- `before_marker`: every file is written, the completion marker is not;
- `mid_rotation`: the new checkpoint is complete and an old one is being deleted (renamed away, not yet removed).
"""

import os
import signal
import sys

import torch

from hf_vla.train import main
from hf_vla.training import checkpoints


def _kill():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install(moment: str, step: int, state: dict):
    from hf_vla.training.trainer import VLATrainer

    original_save_checkpoint = VLATrainer._save_checkpoint

    def save_checkpoint(self, model, trial):
        state["armed"] = self.state.global_step == step
        return original_save_checkpoint(self, model, trial)

    VLATrainer._save_checkpoint = save_checkpoint

    if moment == "after_weights":
        from transformers import modeling_utils

        original = modeling_utils.safe_save_file

        def save_file(*args, **kwargs):
            result = original(*args, **kwargs)
            if state.get("armed"):
                _kill()
            return result

        modeling_utils.safe_save_file = save_file
    elif moment == "mid_optimizer":
        original = torch.save

        def save(obj, f, *args, **kwargs):
            if state.get("armed") and str(f).endswith("optimizer.pt"):
                original(obj, f, *args, **kwargs)
                size = os.path.getsize(f)
                with open(f, "r+b") as handle:
                    handle.truncate(size // 2)
                _kill()
            return original(obj, f, *args, **kwargs)

        torch.save = save
    elif moment == "before_marker":
        original = checkpoints.mark_complete

        def mark_complete(folder, info):
            if state.get("armed"):
                _kill()
            return original(folder, info)

        checkpoints.mark_complete = mark_complete
    elif moment == "mid_rotation":
        original_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            result = original_replace(src, dst, *args, **kwargs)
            if state.get("armed") and os.path.basename(str(dst)).startswith(".deleting-checkpoint-"):
                _kill()
            return result

        checkpoints.os.replace = replace
    else:
        raise SystemExit(f"unknown moment {moment!r}")


if __name__ == "__main__":
    config, moment, kill_step, *overrides = sys.argv[1:]
    install(moment, int(kill_step), {})
    main([config, *overrides])
    raise SystemExit(f"the run finished without being killed at step {kill_step} ({moment})")
