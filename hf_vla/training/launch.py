"""How every training command runs (`python -m hf_vla.train`, `python -m hf_vla.rl`): the start-up checks, one run per
output directory, and a launched multi-process run's exit."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path


def run_checked(args, run):
    """`run()` after the start-up checks every training command makes: the Hub and wandb (main process, before any
    data is read or model built), logging, and one run per output_dir (the main process holds its lock until the run
    ends, `hf_vla.training.run_lock`); a run that fails before writing anything leaves no empty output directory."""
    if args.process_index == 0:
        from hf_vla.training.preflight import check_services

        check_services(args)
    from hf_vla.cli import setup_logging
    from hf_vla.training.run_lock import RunLock

    setup_logging(logging.INFO if args.should_log else logging.WARNING)
    output = Path(args.output_dir)
    if args.process_index == 0:
        warn_previous_run(output, args.resume_from_checkpoint)
    created = not output.exists()
    try:
        with RunLock(args.output_dir) if args.process_index == 0 else contextlib.nullcontext():
            return run()
    except BaseException:
        if created and args.process_index == 0 and output.is_dir() and not any(output.iterdir()):
            output.rmdir()
        raise


def warn_previous_run(output: Path, resume) -> None:
    """One line when `output` holds another run's checkpoints or model and this run does not resume it: it starts
    from scratch and its saves replace what is there."""
    if resume or not output.is_dir():
        return
    checkpoints = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])
                         if p.name.split("-")[1].isdigit() else -1)
    held = ([checkpoints[-1].name] if checkpoints else []) + (["a saved model"] if (output / "model.safetensors")
                                                              .is_file() else [])
    if held:
        logging.getLogger("hf_vla").warning(
            "output_dir %s holds a previous run (%s): this run starts from scratch and replaces it as it saves; "
            "--resume_from_checkpoint true continues that run instead", output, " and ".join(held))


def launched_cli(prog: str, main, argv: list[str] | None = None):
    """`hf_vla.cli.run(prog, main, argv)`; in a launched multi-process run, each process then leaves through
    `_leave_launched_run` with the run's exit status (`python -m hf_vla.train`, `python -m hf_vla.rl`)."""
    from hf_vla.cli import run

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return run(prog, main, argv)
    code = 1
    try:
        run(prog, main, argv)
        code = 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    _leave_launched_run(code)


def _leave_launched_run(code: int):
    """End a process of a launched (multi-process) run with `code`, skipping the interpreter's teardown.

    On CPU (gloo), a finished rank was seen to abort in its teardown ("terminate called without an active
    exception", SIGABRT: a native thread object destroyed while still joinable), about one run in three on a loaded
    machine, even after the process group was destroyed and every rank had met at a barrier; the launcher then kills
    the other ranks and reports the run failed. Everything the run writes is written and flushed by now, so the
    process group is destroyed, the wandb run (if any) finished and the streams flushed, and the process exits.
    """
    import torch.distributed as dist

    try:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        wandb = sys.modules.get("wandb")
        if wandb is not None and getattr(wandb, "run", None) is not None:
            wandb.finish(exit_code=code)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


__all__ = ["launched_cli", "run_checked"]
