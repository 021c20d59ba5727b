"""One training run per `output_dir`.

Two runs writing one output directory (a job re-launched while the first still runs) delete each other's checkpoints.
`python -m hf_vla.train` therefore holds `output_dir/_hf_vla_run.lock` (JSON: host, pid, start time, command) from
start-up to exit; under `accelerate launch` the main process holds it. A second run stops at start-up with one line
naming the holder. The holder touches the file every `HEARTBEAT_S` seconds, so a lock left behind by a run that died
is recognised and taken over (with a warning): at once when the holder was on this host and its pid is gone, after
`STALE_AFTER_S` seconds without a heartbeat otherwise (a preempted job on another node of a shared file system).
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

logger = logging.getLogger("hf_vla.train")

LOCK_NAME = "_hf_vla_run.lock"  # "_*" is left out of the Trainer's Hub uploads
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


class RunLock:
    """`with RunLock(output_dir):` holds the run lock of `output_dir` (see the module docstring)."""

    def __init__(self, output_dir: str | os.PathLike, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S):
        self.directory = Path(output_dir)
        self.path = self.directory / LOCK_NAME
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.info = {"host": socket.gethostname(), "pid": os.getpid(),
                     "started": datetime.now(UTC).isoformat(timespec="seconds"),
                     "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300]}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._created_directory = False

    # ---- holding ---------------------------------------------------------------------------------------------------
    def acquire(self) -> RunLock:
        self._created_directory = not self.directory.exists()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:  # /proc/x, a read-only mount, a file in the way: one line, not two tracebacks
            raise ConfigError(f"output_dir {str(self.directory)!r} cannot be created: "
                              f"{error.strerror or error}") from None
        for _ in range(100):
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as error:
                raise ConfigError(f"output_dir {str(self.directory)!r}: cannot write the run lock {self.path.name} "
                                  f"({error.strerror or error})") from None
            with os.fdopen(descriptor, "w") as handle:
                json.dump(self.info, handle)
                handle.flush()
                os.fsync(handle.fileno())
            self._thread = threading.Thread(target=self._heartbeat, name="hf_vla-run-lock", daemon=True)
            self._thread.start()
            return self
        raise ConfigError(f"output_dir {str(self.directory)!r}: could not take the run lock {self.path}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            if self._holder() == self.info:  # never remove a lock another run took over
                self.path.unlink(missing_ok=True)
            if self._created_directory and self.directory.is_dir() and not any(self.directory.iterdir()):
                self.directory.rmdir()  # a run that failed before writing anything leaves no empty output_dir

    def __enter__(self) -> RunLock:
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
                f"output_dir {str(self.directory)!r} is in use by another run: pid {holder.get('pid')} on host "
                f"{holder.get('host')!r}, started {holder.get('started')} ({holder.get('command')}). Wait for it, stop "
                f"it, or choose another output_dir (a lock whose run died on another host is taken over after "
                f"{self.stale_after_s:.0f} s without heartbeat; delete {self.path} to take it now)")
        # Take it over by renaming: of two runs that both found it stale, one rename succeeds.
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
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
        logger.warning("output_dir %s: taking over the run lock of an earlier run (%s): %s", self.directory, reason,
                       json.dumps(holder) if holder else "unreadable")


__all__ = ["HEARTBEAT_S", "LOCK_NAME", "RunLock", "STALE_AFTER_S"]
