"""Preemption: SIGTERM, SIGINT or SIGUSR1 during training saves a complete checkpoint and exits with `EXIT_PREEMPTED`.

SLURM (`--signal=USR1@120` ahead of the end of a job, SIGTERM at the end) and Kubernetes (SIGTERM, then SIGKILL
after the grace period) announce a preemption with a signal. `PreemptionCallback`, which `VLATrainer` always carries:

- the first signal sets a flag; the optimizer step in progress finishes on every rank;
- at that step's end the ranks agree (a max all-reduce of the flag, so a signal that reached one rank stops all of
  them at the same step), a checkpoint is written in the usual atomic format, and training stops;
- a signal that arrives while a checkpoint is being saved lets the save finish, and training stops right after it
  (that checkpoint is the one to resume from);
- a second signal exits at once (status 128 + the signal's number), writing nothing more: a checkpoint cut off
  there has no completion marker, and resume skips it;
- `python -m hf_vla.train` then logs where the checkpoint is and how to resume, and exits with `EXIT_PREEMPTED` (75,
  `EX_TEMPFAIL`: "try again"), which a requeue script can tell from success (0), a bad input (2) or a fault (1).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
from transformers import TrainerCallback

from hf_vla.cli import SIGNALS

logger = logging.getLogger("hf_vla.training.preemption")
EXIT_PREEMPTED = 75


class PreemptionCallback(TrainerCallback):
    """Turns a termination signal into a checkpoint at the end of the current step and a clean stop."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.received: int | None = None  # the first signal's number, on this rank
        self.stopped_at: int | None = None  # the step training stopped at, once the ranks agreed
        self._previous: dict = {}
        self._saving = False

    # ---- signals -----------------------------------------------------------------------------------------------
    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None:
            logger.error("second %s: exiting now, without a checkpoint of this step", name)
            logging.shutdown()
            os._exit(128 + signum)
        self.received = signum
        logger.warning("%s received: finishing the current optimizer step, then saving a checkpoint and exiting "
                       "(send it again to exit at once)", name)

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._handler)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.restore_signals()
        return control

    def restore_signals(self) -> None:
        """Give the signals back to the handlers they had before training (idempotent). `VLATrainer.train` also calls
        it when training raised, where `on_train_end` never runs: a notebook or service whose training failed would
        otherwise keep a handler that turns its next SIGTERM into a flag for a trainer that is gone."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    # ---- agreement ---------------------------------------------------------------------------------------------
    def _agreed(self) -> bool:
        """Whether any rank received a signal (every rank calls this at the same point of the same step)."""
        import torch.distributed as dist

        flag = self.received is not None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = self.trainer.args.device if dist.get_backend() == "nccl" else torch.device("cpu")
            tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            flag = bool(tensor.item())
        return flag

    def _stop(self, state, control) -> None:
        self.stopped_at = state.global_step
        if self.received is None:  # another rank got it
            self.received = int(signal.SIGTERM)
        control.should_training_stop = True

    def on_step_end(self, args, state, control, **kwargs):
        if self._agreed():
            self._stop(state, control)
            control.should_save = True  # this step's checkpoint, in the usual atomic format
        return control

    def on_save(self, args, state, control, **kwargs):
        # a signal that came during the save: the save finished; stop here instead of after one more step
        if self.stopped_at is None and self._agreed():
            self._stop(state, control)
        return control

    @property
    def preempted(self) -> bool:
        return self.stopped_at is not None




def raise_if_preempted(trainer) -> None:
    """After `trainer.train()` returned: `Preempted` (exit 75) naming the complete checkpoint of the step a signal
    stopped at, so the command ends resumable (`python -m hf_vla.train`, `python -m hf_vla.rl`)."""
    callback = trainer._preemption
    if not callback.preempted:
        return
    from pathlib import Path

    from hf_vla.errors import Preempted

    trainer.accelerator.wait_for_everyone()
    step = callback.stopped_at
    folder = Path(trainer.args.output_dir) / f"checkpoint-{step}"
    raise Preempted(f"stopped by {signal.Signals(callback.received).name} at step {step}: the checkpoint {folder} is "
                    f"complete; run the same command with --resume_from_checkpoint true to continue (exit status 75)")


__all__ = ["EXIT_PREEMPTED", "PreemptionCallback", "SIGNALS", "raise_if_preempted"]
