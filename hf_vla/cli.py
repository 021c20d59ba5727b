"""What every `python -m hf_vla.<command>` shares: one-line errors and exit codes, and argument checks.

A bad argument or input ends a command with one line on stderr, `<command>: error: <what and which>`, and exit 2
(configuration) or 1 (a data, connection or training fault); `HF_VLA_TRACEBACK=1` re-raises with the traceback.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hf_vla.errors import ConfigError, VLAError

# what huggingface_hub accepts as a repo id: "name" or "namespace/name"
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def lazy_attributes(module: str, public: dict[str, str]):
    """A module-level `__getattr__` for `module` serving each name of `public` (name -> the module defining it,
    absolute or relative to `module`) from its defining module, imported when first asked for.

        __getattr__ = lazy_attributes(__name__, {"PI05Config": ".configuration_pi05"})
    """

    def __getattr__(name: str):
        if name in public:
            return getattr(importlib.import_module(public[name], module), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


# the signals that announce a preemption (a batch system's SIGTERM or SIGUSR1, Ctrl-C): a training run saves and stops
# (`hf_vla.training.preemption`), its DataLoader workers ignore them (`hf_vla.data.stream`)
SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGINT", None),
                            getattr(signal, "SIGUSR1", None)) if s is not None)
VERBOSE_ENV = "HF_VLA_VERBOSE"  # set by --verbose; inherited by workers and rollout processes


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(fragment in str(record.msg) for fragment in self.fragments)


def quiet_libraries() -> None:
    """Silence what libraries print on every run and that tells a user nothing (unless `--verbose` /
    `HF_VLA_VERBOSE=1`): FFmpeg's encoder statistics and muxer notes (`[libx264 @ ...]`, thousands of lines per
    recording), `datasets`' `Map` bars (one per episode written), lerobot's ~200-line torchcodec traceback when system
    FFmpeg is absent (PyAV decodes instead: hf_vla's choice, see the README), DeepSpeed's "Setting accelerator to CPU".
    Warnings and errors of every library still show. Environment variables carry it to worker processes."""
    if os.environ.get(VERBOSE_ENV):
        return
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported
    logging.getLogger("lerobot.utils.import_utils").setLevel(logging.ERROR)
    # DeepSpeed sets its logger's level when imported: a filter survives that
    deepspeed = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropMessages) for f in deepspeed.filters):
        deepspeed.addFilter(_DropMessages("Setting accelerator to CPU"))
    import warnings

    # Meta-World's scripted experts warn on every episode that their outputs exceed [-1, 1]: hf_vla clips them
    warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high")
    # lerobot's SuppressProgressBars re-enables the bars on exit: the environment variable wins, with this warning
    warnings.filterwarnings("ignore", message="Cannot enable progress bars")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    try:
        import av.logging

        av.logging.set_libav_level(av.logging.ERROR)  # lerobot restores FFmpeg's printing callback after encoding
    except ImportError:
        pass


def resolve_device(device: str) -> str:
    """`auto` (the commands' default): cuda where torch sees one, else cpu; any other name as given. Resolved once the
    options parse, so `--help` and option errors answer without importing torch."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def take_verbose(argv: list[str] | None) -> list[str] | None:
    """Remove `--verbose` from the arguments (every command takes it) and let library logs through."""
    given = sys.argv[1:] if argv is None else list(argv)
    if "--verbose" not in given:
        return argv
    os.environ[VERBOSE_ENV] = "1"
    return [a for a in given if a != "--verbose"]


def run(prog: str, main: Callable, argv=None):
    """`main(argv)`, with a `VLAError` turned into one line on stderr and its exit code. Every command takes
    `--verbose` (library logs: FFmpeg, datasets, lerobot, DeepSpeed); without it they are quieted."""
    argv = take_verbose(argv)
    quiet_libraries()
    try:
        return main(argv)
    except VLAError as error:
        release_frames(error)
        if os.environ.get("HF_VLA_TRACEBACK"):
            raise
        message = " ".join(worker_message(str(error)).split())  # one line, whatever the message's own layout
        label = "stopped" if error.exit_code == 75 else "error"  # hf_vla.errors.Preempted: not a fault
        print(f"{prog}: {label}: {message}", file=sys.stderr, flush=True)
        raise SystemExit(error.exit_code) from None
    except BaseException as error:
        release_frames(error)
        raise


def worker_message(text: str) -> str:
    """An error a DataLoader worker raised reaches the main process as the same type with the worker's whole
    traceback as its text (`Caught DataError in DataLoader worker process 0. Original Traceback ...`): its own message
    (the traceback's last line, less the type's name), said to come from a worker."""
    if "\nOriginal Traceback" not in text:
        return text
    last = text.strip().splitlines()[-1]
    return f"{last.split(': ', 1)[-1]} (in a DataLoader worker)"


def release_frames(error: BaseException) -> None:
    """Free what the failed command's frames held, now. A training that fails mid-epoch leaves its DataLoader iterator
    in the traceback's frames; kept until the interpreter exits, its worker processes and queue threads are still
    there when multiprocessing's exit handler joins them, and the process hangs after printing the error. The
    traceback itself (file, line, code) is kept."""
    import gc
    import traceback

    seen = set()
    while error is not None and id(error) not in seen:  # the error and the ones it was raised from
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()


def setup_logging(level: int = logging.INFO) -> None:
    """Log hf_vla's messages at `level` on stderr.

    `logging.basicConfig` alone is not enough: lerobot logs through the root logger while it is imported, which
    configures the root at WARNING first (and makes a later `basicConfig` a no-op), hiding every INFO line of ours.
    """
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not sys.stderr.isatty():  # a log file or a pipe: the libraries' live bars (weights loading, downloads) would
        import huggingface_hub.utils  # write a line per refresh there
        import transformers.utils.logging

        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()
    logging.getLogger("hf_vla").setLevel(level)
    # other libraries' INFO lines (OpenGL, httpx, ...) only with --verbose; their warnings always
    logging.getLogger().setLevel(level if os.environ.get(VERBOSE_ENV) else max(level, logging.WARNING))
    # huggingface_hub prints through its own handler and propagates to the root's too: each line appeared twice
    hub = logging.getLogger("huggingface_hub")
    if hub.handlers:
        hub.propagate = False


def positive(flag: str, value, allow_zero: bool = False):
    """`value` (None passes) is a positive number, or >= 0 with `allow_zero`."""
    if value is not None and not (value >= 0 if allow_zero else value > 0):
        raise ConfigError(f"{flag}={value}: must be {'>= 0' if allow_zero else 'positive'}")
    return value


def model_source(flag: str, value: str) -> str:
    """A local checkpoint directory (it must exist and hold config.json), or a Hub id (resolved when loaded). A path
    that exists nowhere and cannot be a Hub id is refused here, by name."""
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{flag} {value!r}: is a file, not a checkpoint directory")
        if (path / "adapter_config.json").is_file():
            return str(path)  # LoRA adapters: merged with their base when loaded (hf_vla.hub.resolve.merged_adapter)
        if not (path / "config.json").is_file():
            inner = sorted(p.name for p in path.iterdir() if (p / "config.json").is_file())
            hint = f"; it holds {inner[-1]}/, a checkpoint" if inner else ""
            raise ConfigError(f"{flag} {value!r}: not a checkpoint directory (it has no config.json){hint}")
        return str(path)
    if value.startswith((".", "/", "~")) or not HUB_ID.match(value):
        raise ConfigError(f"{flag} {value!r}: no such directory")
    return value


def output_dir(flag: str, value) -> Path | None:
    """A directory that exists or can be created (nothing is created here)."""
    if value is None:
        return None
    check_writable_dir(flag, value)
    return Path(value)


def websocket_uri(flag: str, value: str) -> str:
    if not re.match(r"^wss?://[^/\s]+", value or ""):
        raise ConfigError(f"{flag} {value!r}: expected ws://HOST:PORT (or wss://); the policy server speaks websocket")
    return value


PROGRESS_EVERY_S = 30.0  # a non-terminal log hears from a long phase at least this often


class _PhaseLine:
    """A progress bar's interface for output that is not a terminal (a log file, a pipe, a batch system): one INFO
    line every `PROGRESS_EVERY_S` seconds while the phase runs (done/total, rate, time left) and one when it ends
    (live bars there become one line per refresh, and nested ones leave cursor-movement codes)."""

    def __init__(self, total: int | None, desc: str, unit: str, initial: int = 0, final_line: bool = True):
        self.total, self.desc, self.unit, self.n, self.postfix = total, desc, unit, initial, ""
        self.final_line = final_line  # False where the caller logs the phase's end itself
        self._started, self._closed = time.perf_counter(), False
        self._initial, self._last_line = initial, self._started

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self._last_line >= PROGRESS_EVERY_S:
            self._last_line = now
            rate = (self.n - self._initial) / max(now - self._started, 1e-9)
            left = (f", about {(self.total - self.n) / rate:.0f} s left" if self.total is not None and rate > 0
                    else "")
            done = f"{self.n:,}" + (f"/{self.total:,}" if self.total is not None else "")
            logging.getLogger("hf_vla").info("%s: %s %s, %.2f %s/s%s%s", self.desc, done, self.unit, rate, self.unit,
                                             left, f" ({self.postfix})" if self.postfix else "")

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{key}={value}" for key, value in items.items())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.final_line:
            return
        done = f"{self.n:,}" + (f"/{self.total:,}" if self.total is not None else "")
        logging.getLogger("hf_vla").info("%s: %s %s in %.1f s%s", self.desc, done, self.unit,
                                         time.perf_counter() - self._started, f" ({self.postfix})" if self.postfix else "")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(total: int | None, desc: str, unit: str, enabled: bool = True, final_line: bool = True, **kwargs):
    """tqdm's live bar on a terminal; elsewhere a log line every `PROGRESS_EVERY_S` and one when the phase ends
    (`_PhaseLine`; `final_line=False`: the caller logs the end itself, and a terminal's bar is not left behind);
    nothing if not `enabled`."""
    from tqdm.auto import tqdm

    if not enabled:
        return tqdm(total=total, disable=True)
    if not sys.stderr.isatty():
        return _PhaseLine(total, desc, unit, initial=kwargs.get("initial", 0), final_line=final_line)
    return tqdm(total=total, desc=desc, unit=unit, **({"leave": False} if not final_line else {}), **kwargs)


def check_writable_dir(key: str, path: str | os.PathLike):
    """The directory exists and is writable, or can be created: without creating anything."""
    target = Path(path).expanduser().absolute()
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{key}={str(path)!r}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={str(path)!r}: {probe} is not writable")


__all__ = ["HUB_ID", "check_writable_dir", "progress_bar", "quiet_libraries", "take_verbose", "model_source", "output_dir", "positive", "run", "setup_logging",
           "websocket_uri"]
