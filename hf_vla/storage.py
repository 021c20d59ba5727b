"""Writing directories safely, one implementation for every command that writes one (train, record, DAgger rounds,
serve --record, the location replay, convert):

- **One writer per directory** (`DirectoryLock`). Two writers of one directory (a job re-launched while the first still
  runs, two servers recording into one folder) destroy each other's files. The writer holds `DIR/<lock name>` (JSON:
  host, pid, start time, command) from start-up to exit; a second one stops at start-up with one line naming the
  holder. The holder touches the file every `HEARTBEAT_S` seconds, so a lock left behind by a writer that died is
  recognised and taken over (with a warning): at once when the holder was on this host and its pid is gone, after
  `STALE_AFTER_S` seconds without a heartbeat otherwise (a preempted job on another node of a shared file system).
  `python -m hf_vla.train` holds `output_dir/_hf_vla_run.lock` (under `accelerate launch`, the main process).
- **Stage, then rename** (`replace_dir`): a new directory is written beside its target and renamed into place, so a
  killed command leaves either the old target or the new one, never half of one.
- **Never destroy an input or what hf_vla did not write** (`check_output`): an output that is, contains or lies inside
  one of the command's inputs is refused, and `--overwrite` replaces only an empty directory or one the same command
  wrote (its marker file), never a folder of other files.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from hf_vla.errors import ConfigError

logger = logging.getLogger("hf_vla")

LOCK_NAME = "_hf_vla_run.lock"  # train's; "_*" is left out of the Trainer's Hub uploads
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class DirectoryLock:
    """`with DirectoryLock(directory, label="--record"):` holds the writer lock of `directory` (module docstring).

    label: how the refusal names the directory (the flag or key the user gave); lock_name: the lock file's name inside
    it; what: who else may hold it, in the refusal ("another run", "another server")."""

    def __init__(self, directory: str | os.PathLike, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S, label: str = "output_dir", lock_name: str = LOCK_NAME,
                 what: str = "another run"):
        self.directory = Path(directory)
        self.label, self.what, self.lock_name = label, what, lock_name
        self.path = self.directory / lock_name
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.info = {"host": socket.gethostname(), "pid": os.getpid(),
                     "started": datetime.now(UTC).isoformat(timespec="seconds"),
                     "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300]}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._created_directory = False

    # ---- holding ---------------------------------------------------------------------------------------------------
    def acquire(self) -> DirectoryLock:
        self._created_directory = not self.directory.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # /proc/x, a read-only mount, a file in the way: one line, not two tracebacks
            raise ConfigError(f"{self.label} {str(self.directory)!r} cannot be created: "
                              f"{error.strerror or error}") from None
        for _ in range(100):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as error:
                raise ConfigError(f"{self.label} {str(self.directory)!r}: cannot write the lock {self.path.name} "
                                  f"({error.strerror or error})") from None
            with os.fdopen(descriptor, "w") as handle:
                json.dump(self.info, handle)
                handle.flush()
                os.fsync(handle.fileno())
            self._thread = threading.Thread(target=self._heartbeat, name="hf_vla-run-lock", daemon=True)
            self._thread.start()
            return self
        raise ConfigError(f"{self.label} {str(self.directory)!r}: could not take the lock {self.path}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            if self._holder() == self.info:  # never remove a lock another run took over
                self.path.unlink(missing_ok=True)
            if self._created_directory and self.directory.is_dir() and not any(self.directory.iterdir()):
                self.directory.rmdir()  # a run that failed before writing anything leaves no empty output_dir

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:  # removed by hand: nothing to keep alive
                return

    # ---- another holder ---------------------------------------------------------------------------------------------
    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _take_over_if_stale(self) -> None:
        holder = self._holder()
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        if holder is None:
            if age < 10:  # being written right now
                time.sleep(0.1)
                return
            reason = f"an unreadable lock file, untouched for {age:.0f} s"
        elif holder.get("host") == self.info["host"] and not _alive(int(holder.get("pid", -1))):
            reason = f"pid {holder.get('pid')} on this host is gone"
        elif age > self.stale_after_s:
            reason = f"no heartbeat for {age:.0f} s (more than {self.stale_after_s:.0f} s)"
        else:
            raise ConfigError(
                f"{self.label} {str(self.directory)!r} is in use by {self.what}: pid {holder.get('pid')} on host "
                f"{holder.get('host')!r}, started {holder.get('started')} ({holder.get('command')}). Wait for it, stop "
                f"it, or choose another {self.label.lstrip('-')} (a lock whose writer died on another host is taken over after "
                f"{self.stale_after_s:.0f} s without heartbeat; delete {self.path} to take it now)")
        # Take it over by renaming: of two runs that both found it stale, one rename succeeds.
        aside = self.path.with_name(f"{self.lock_name}.stale.{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = None
        if moved != holder:  # the file changed between the read and the rename: put it back, look again
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            return
        aside.unlink(missing_ok=True)
        logger.warning("%s %s: taking over the lock of an earlier writer (%s): %s", self.label, self.directory, reason,
                       json.dumps(holder) if holder else "unreadable")



def read_json(path: Path, label: str, missing: str = "not found", error=None, kind: type | None = None):
    """The JSON in `path`, or one line: `<label> <path> not found` (MissingFileError, `missing` says how) or `<label>
    <path> is not valid JSON (...)` (`error`, DataError by default), or, with `kind` (dict, list), `<label> <path> is
    a JSON list, not an object` where its top level is of another type."""
    from hf_vla.errors import DataError, MissingFileError

    if not path.is_file():
        raise MissingFileError(f"{label} {path} {missing}")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as failure:
        raise (error or DataError)(f"{label} {path} is not valid JSON ({failure})") from None
    if kind is not None and not isinstance(content, kind):
        names = {dict: "an object", list: "a list"}
        found = {dict: "object", list: "list", str: "string"}.get(type(content), type(content).__name__)
        raise (error or DataError)(f"{label} {path} is a JSON {found}, not {names.get(kind, kind.__name__)}")
    return content


def cache_root() -> Path:
    """hf_vla's own cache: `$HF_VLA_CACHE`, else `$HF_HOME/hf_vla`. Under it: `scan/` (the data checks and exact
    statistics), `converted/` and `merged/` (checkpoints converted or merged on load), `downloads/`."""
    configured = os.environ.get("HF_VLA_CACHE")
    if configured:
        return Path(configured)
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "hf_vla"


# ---- stage, then rename ---------------------------------------------------------------------------------------------
def staging_dir(target: str | os.PathLike, purpose: str) -> Path:
    """Where a new `target` is written before `replace_dir` renames it into place: `.<name>.<purpose>` beside it (on
    the same file system, so the rename is atomic), emptied of what a killed run left there."""
    import shutil

    target = Path(target)
    staging = target.parent / f".{target.name}.{purpose}"
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def replace_dir(staging: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Rename the complete directory `staging` to `target`. An existing `target` is first renamed aside (to
    `.<name>.previous` beside it) and removed only once the new one is in place, so at any moment one of the two is
    whole. Only `target` itself is replaced: callers have checked it with `check_output`."""
    import shutil

    staging, target = Path(staging), Path(target)
    aside = target.parent / f".{target.name}.previous"
    if target.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
    os.replace(staging, target)
    shutil.rmtree(aside, ignore_errors=True)
    return target


# ---- never destroy an input or what hf_vla did not write ----------------------------------------------------------
OUTPUT_MARKER = ".hf_vla_output.json"  # {"kind": ..., "command": ...}: hf_vla wrote this directory, and what it is


def write_marker(directory: str | os.PathLike, kind: str, **info) -> Path:
    """Mark `directory` (a staged output, before its rename) as an output of `kind` hf_vla wrote, so a later
    `--overwrite` may replace it (and only an output of the same kind: `check_output`)."""
    path = Path(directory) / OUTPUT_MARKER
    path.write_text(json.dumps({"kind": kind, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300],
                                "written": datetime.now(UTC).isoformat(timespec="seconds"), **info}, indent=1))
    return path


def marker_kind(directory: str | os.PathLike) -> str | None:
    """The kind in `directory`'s output marker, or None (no marker, or an unreadable one)."""
    try:
        return json.loads((Path(directory) / OUTPUT_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_output(flag: str, output: str | os.PathLike, overwrite: bool, inputs: dict | None = None,
                 marker: str | None = None, what: str = "directory", kind: str | None = None,
                 legacy=None) -> Path:
    """Refuse, in one line, an output that would destroy something, before anything is read or written:

    - `output` equal to, containing or inside one of `inputs` (flag -> path: the command's inputs, e.g.
      `{"--add_locations": SRC}`; None values are skipped);
    - an existing non-empty `output` without `overwrite`;
    - with `overwrite`, one this command did not write: `kind` (an output kind, e.g. "lerobot_export") needs
      `OUTPUT_MARKER` naming that kind (`legacy(path) -> bool` may recognise an older output of the kind written
      before markers); `marker` (a file relative to `output`, e.g. `meta/hf_vla_record.json`) needs that file.

    Paths are compared resolved (a relative and an absolute spelling, a symlink, are one path). Returns `output` as a
    Path; the caller then stages the new output and renames it into place (`staging_dir`, `replace_dir`)."""
    output = Path(output)
    resolved = output.expanduser().resolve()
    for input_flag, value in (inputs or {}).items():
        if value is None:
            continue
        source = Path(value).expanduser().resolve()
        if _overlaps(resolved, source):
            where = ("is" if resolved == source else "contains" if resolved in source.parents else "is inside")
            raise ConfigError(f"{flag} {str(output)!r} {where} {input_flag} {str(value)!r}: choose a directory beside "
                              "the input, neither it, above it nor in it (nothing was written)")
    if resolved.exists() and not resolved.is_dir():
        raise ConfigError(f"{flag} {str(output)!r} exists and is a file, not a {what}: choose another path")
    if resolved.is_dir() and any(resolved.iterdir()):
        if not overwrite:
            raise ConfigError(f"{flag} {str(output)!r} exists and is not empty: choose a new directory, or pass "
                              "--overwrite to replace it")
        shown = sorted(p.name for p in resolved.iterdir())
        listing = ", ".join(shown[:4]) + (f" and {len(shown) - 4} more" if len(shown) > 4 else "")
        if kind is not None:
            found = marker_kind(resolved)
            if found != kind and not (found is None and legacy is not None and legacy(resolved)):
                held = (f"an hf_vla {found} output, not a {what}" if found else
                        f"files hf_vla did not write ({listing}; no {OUTPUT_MARKER})")
                raise ConfigError(f"{flag} {str(output)!r} holds {held}: --overwrite replaces only a {what} hf_vla "
                                  "wrote, never another folder; choose a new directory (nothing was written)")
        if marker is not None and not (resolved / marker).is_file():
            raise ConfigError(f"{flag} {str(output)!r} holds files this command did not write ({listing}; no "
                              f"{marker}): --overwrite replaces only a {what} it wrote, never another folder; choose "
                              "a new directory")
    return output


def check_creatable(flag: str, path: str | os.PathLike) -> Path:
    """`path` exists as a directory or can be created, tried for real and undone (`/proc/x` passes every permission
    check and fails only at `mkdir`), or one line naming it; nothing is left behind."""
    path = Path(path)
    missing = []
    probe = path.expanduser().absolute()
    while not probe.exists() and probe.parent != probe:
        missing.append(probe)
        probe = probe.parent
    make_dir(flag, path)
    for created in missing:  # deepest first
        try:
            created.rmdir()
        except OSError:
            break
    return path


def make_dir(flag: str, path: str | os.PathLike) -> Path:
    """`path` created (with its parents), or one line naming it and why not (`/proc/x`, a read-only mount, a file in
    the way)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{flag} {str(path)!r} cannot be created: {error.strerror or error}") from None
    return path


def weights_fingerprint(checkpoint: str | os.PathLike) -> str | None:
    """A short fingerprint of a local checkpoint's weights (None for a Hub id or a directory without weight files):
    sha256 over each `*.safetensors` / `*.bin` file's name, size and three 1 MiB samples (the start, with the
    safetensors header; the middle; the end). Cheap for a 3B checkpoint (a few MiB read), and it changes when the weights are replaced by other
    weights (retrained, another step's), which is what a resumed recording must notice."""
    import hashlib

    directory = Path(checkpoint).expanduser()
    if not directory.is_dir():
        return None
    files = sorted(p for p in directory.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
    if not files:
        return None
    digest, sample = hashlib.sha256(), 1 << 20
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as handle:
            for offset in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                handle.seek(offset)
                digest.update(handle.read(sample))
    return digest.hexdigest()[:16]


__all__ = ["DirectoryLock", "HEARTBEAT_S", "LOCK_NAME", "OUTPUT_MARKER", "STALE_AFTER_S", "cache_root", "check_creatable",
           "check_output", "make_dir", "marker_kind", "write_marker",
           "replace_dir", "staging_dir", "weights_fingerprint"]
