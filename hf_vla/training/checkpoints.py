"""Checkpoints that count only when complete, and resume checks that say what is wrong.

A checkpoint directory (`checkpoint-<step>`) is complete when its marker, `hf_vla_checkpoint.json`, exists: it is
written last, after every other file (weights, optimizer with the fp32 masters, scheduler, RNG, trainer state, stream
position) has been written and flushed to disk, and it lists those files with their sizes. A run killed mid-save
leaves a directory without a marker; `--resume_from_checkpoint true` skips it (and says so) and takes the newest
complete one. Rotation (`save_total_limit`) runs only after the new checkpoint is complete, and removes a directory
by renaming it away first, so a kill during deletion never leaves something that looks complete.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path

from hf_vla.errors import CheckpointError

logger = logging.getLogger("hf_vla.training.checkpoints")

MARKER = "hf_vla_checkpoint.json"
STREAM_STATE = "stream_state.json"
TRAINER_STATE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# config.json entries that do not change what a checkpoint's weights mean
_CONFIG_IGNORED = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "auto_map",
                   "_attn_implementation", "attn_implementation", "_attn_implementation_autoset", "use_cache",
                   "output_attentions", "output_hidden_states", "return_dict", "is_causal",
                   "use_bidirectional_attention",
                   # the Trainer aligns these with the tokenizer when training starts
                   "bos_token_id", "eos_token_id", "pad_token_id"}


def _fsync(path: Path):
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(descriptor)


def write_json_atomic(path: str | os.PathLike, data) -> None:
    """Write JSON under a temporary name, flush it to disk, then rename it into place."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync(path.parent)


def save_tensor_file(path: str | os.PathLike, data) -> None:
    """`torch.save` under a temporary name, flushed to disk, then renamed into place."""
    import torch

    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        torch.save(data, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def read_marker(folder: str | os.PathLike) -> dict:
    """What the completion marker of a checkpoint records (step, world size, ...); {} when it has none."""
    path = Path(folder) / MARKER
    return json.loads(path.read_text()) if path.is_file() else {}


def mark_complete(folder: str | os.PathLike, info: dict) -> None:
    """Flush every file of `folder` to disk, then write the marker listing them (the checkpoint now counts)."""
    folder = Path(folder)
    files = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != MARKER:
            _fsync(path)
            files[str(path.relative_to(folder))] = path.stat().st_size
    _fsync(folder)
    write_json_atomic(folder / MARKER, {**info, "files": files})


def incomplete_reason(folder: str | os.PathLike) -> str | None:
    """None for a complete checkpoint; otherwise why it is not one."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        return (f"no {MARKER}: it was being written when the run stopped, or by an older hf_vla "
                f"(holds {present[:8]}{'...' if len(present) > 8 else ''})")
    try:
        info = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError) as error:
        return f"unreadable {MARKER} ({error})"
    for name, size in info.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when it was written (truncated or replaced)"
    return None


def checkpoint_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """`checkpoint-<step>` directories of `output_dir`, oldest step first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def last_complete_checkpoint(output_dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint, and the newer incomplete ones that were passed over (with the reason)."""
    skipped = []
    for folder in reversed(checkpoint_dirs(output_dir)):
        reason = incomplete_reason(folder)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    return None, skipped


def resolve_resume(output_dir: str | os.PathLike) -> Path:
    """`--resume_from_checkpoint true`: the newest complete checkpoint, logging the incomplete ones skipped."""
    folder, skipped = last_complete_checkpoint(output_dir)
    for path, reason in skipped:
        logger.warning("skipping incomplete checkpoint %s: %s", path, reason)
    if folder is None:
        detail = f"; incomplete: {[f'{p.name} ({r})' for p, r in skipped]}" if skipped else ""
        raise CheckpointError(f"resume_from_checkpoint=true: no complete checkpoint in output_dir {output_dir}{detail}")
    logger.info("resuming from %s", folder)
    return folder


def check_resumable(path: str | os.PathLike) -> Path:
    """A resume path given explicitly must be a complete checkpoint directory."""
    folder = Path(path)
    if not folder.exists():
        raise CheckpointError(f"resume_from_checkpoint={str(path)!r}: no such directory")
    if not folder.is_dir():
        raise CheckpointError(f"resume_from_checkpoint={str(path)!r}: a file, not a checkpoint directory")
    if not (folder / TRAINER_STATE).is_file() and not (folder / MARKER).is_file():
        hint = ""
        inner = checkpoint_dirs(folder)
        if inner:
            hint = f"; it holds checkpoints, e.g. {inner[-1]} (or pass --resume_from_checkpoint true with output_dir there)"
        raise CheckpointError(f"resume_from_checkpoint={str(path)!r}: not a checkpoint (no {TRAINER_STATE} or {MARKER})"
                              f"{hint}")
    reason = incomplete_reason(folder)
    if reason is not None:
        previous, _ = last_complete_checkpoint(folder.parent)
        hint = f"; the newest complete one is {previous}" if previous is not None else ""
        raise CheckpointError(f"resume_from_checkpoint={str(path)!r} is incomplete: {reason}{hint}")
    return folder


def _config_differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current), key=str):
        if key in _CONFIG_IGNORED:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint {a!r}, this run {b!r}")
    return out


def check_compatible(folder: str | os.PathLike, info: dict, config: dict | None) -> None:
    """The checkpoint was written by a run of the same model, precision and optimizer as this one."""
    folder = Path(folder)
    saved = json.loads((folder / MARKER).read_text())
    for key, label in (("model_type", "model type"), ("lora", "LoRA"), ("dtype", "parameter dtype"),
                       ("optimizer", "optimizer")):
        if key in saved and key in info and saved[key] != info[key]:
            hint = ""
            if key == "dtype":
                hint = f": resume with --dtype {saved[key]}"
            elif key == "optimizer":
                hint = " (master_weights or optim differ)"
            raise CheckpointError(f"resume_from_checkpoint={str(folder)!r}: {label} is {saved[key]!r} in the "
                                  f"checkpoint but {info[key]!r} in this run{hint}")
    config_file = folder / "config.json"
    if config is not None and config_file.is_file():
        differences = _config_differences(json.loads(config_file.read_text()), config)
        if differences:
            raise CheckpointError(f"resume_from_checkpoint={str(folder)!r}: the checkpoint is of another model "
                                  f"configuration ({'; '.join(differences[:5])}"
                                  f"{'; ...' if len(differences) > 5 else ''})")


def remove_checkpoint(folder: str | os.PathLike) -> None:
    """Rename away, then delete: a kill mid-way never leaves a directory that still looks complete."""
    folder = Path(folder)
    doomed = folder.with_name(f".deleting-{folder.name}")
    if doomed.exists():
        shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def rotate(output_dir: str | os.PathLike, keep: int | None, protect: set[str]) -> None:
    """Keep the newest `keep` complete checkpoints (and `protect`); remove older ones and stale incomplete ones."""
    folders = checkpoint_dirs(output_dir)
    for leftover in Path(output_dir).glob(".deleting-checkpoint-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    complete = [f for f in folders if incomplete_reason(f) is None]
    if not complete:
        return
    newest = complete[-1]
    protected = {os.path.realpath(p) for p in protect if p} | {os.path.realpath(newest)}
    for folder in folders:
        if folder not in complete and folder.name != newest.name and _step(folder) < _step(newest):
            logger.info("removing incomplete checkpoint %s", folder)
            remove_checkpoint(folder)
    if keep is None or keep <= 0:
        return
    for folder in complete[: max(0, len(complete) - keep)]:
        if os.path.realpath(folder) not in protected:
            logger.info("deleting older checkpoint %s (save_total_limit=%d)", folder, keep)
            remove_checkpoint(folder)


def _step(folder: Path) -> int:
    return int(_CHECKPOINT.match(folder.name).group(1))


def previous_checkpoint_note(run_dir: str, disk_full: bool = False) -> str:
    """What a failed save's message adds: the last complete checkpoint, intact, and how to resume from it."""
    previous, _ = last_complete_checkpoint(run_dir)
    if previous is None:
        return "; there is no earlier complete checkpoint"
    then = "free space, then " if disk_full else ""
    return f"; the previous checkpoint {previous} is intact ({then}--resume_from_checkpoint true resumes from it)"


def norm_stats_change(folder: str | os.PathLike, norm_stats: dict | None) -> str | None:
    """The first difference between the normalisation statistics saved with the checkpoint in `folder` (its
    processor_config.json) and `norm_stats`, as `head 'h': actions q99[0] 0.1017 -> 0.1043`; None when they are
    equal, or when either side has none (a processor without statistics, a checkpoint without a processor)."""
    path = Path(folder) / "processor_config.json"
    if norm_stats is None or not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text()).get("norm_stats")
    except (OSError, ValueError):
        return None
    if saved is None:
        return None
    current = json.loads(json.dumps(norm_stats))  # as it would be saved (lists of floats)
    for head in sorted(set(saved) | set(current)):
        if head not in saved or head not in current:
            return f"head {head!r} is {'new' if head not in saved else 'gone'}"
        for key in ("state", "actions"):
            for setting in ("mode", "relative_mask"):  # how the statistics are applied (hf_vla.models.common.normalization)
                old, new = (saved[head].get(key) or {}).get(setting), (current[head].get(key) or {}).get(setting)
                if old != new:
                    return f"head {head!r}: {key} {setting} {old!r} -> {new!r}"
            for stat in ("q01", "q99", "mean", "std"):
                old, new = (saved[head].get(key) or {}).get(stat), (current[head].get(key) or {}).get(stat)
                if old is None or new is None:
                    continue
                if len(old) != len(new):
                    return f"head {head!r}: {key} {stat} has {len(new)} dims, the checkpoint's {len(old)}"
                for index, (a, b) in enumerate(zip(old, new)):
                    if a != b:
                        return f"head {head!r}: {key} {stat}[{index}] {a:.6g} -> {b:.6g}"
    return None


def no_space(folder: str | os.PathLike, error: BaseException) -> tuple[bool, int | None]:
    """Whether the disk is the likely cause of `error` writing `folder`, and the free bytes there (None: unknown)."""
    probe = Path(folder)
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    full = getattr(error, "errno", None) == errno.ENOSPC or "iostream error" in str(error) or (
        free is not None and free < 64 * 2**20)
    return full, free


def describe_save_error(folder: str | os.PathLike, error: BaseException) -> str:
    """What went wrong writing `folder`, with the free space when the disk is the likely cause."""
    full, free = no_space(folder, error)
    text = f"{type(error).__name__}: {error}"
    if full:
        text = f"no space left on the device ({free / 2**20:.1f} MiB free)" if free is not None else \
            "no space left on the device"
        text += f" [{type(error).__name__}: {error}]"
    return f"saving checkpoint {folder} failed: {text}"


__all__ = [
    "MARKER",
    "check_compatible",
    "check_resumable",
    "incomplete_reason",
    "last_complete_checkpoint",
    "mark_complete",
    "no_space",
    "norm_stats_change",
    "resolve_resume",
    "rotate",
]
