"""Errors a user can act on. `python -m hf_vla.train` prints them as one line naming the culprit and exits non-zero.

Each also derives from the builtin a caller would catch (`ValueError`, `FileNotFoundError`, `KeyError`), so code
written against those keeps working. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class VLAError(Exception):
    """Base of the errors that name a bad input, a data fault or a training fault. `exit_code` is the CLI's."""

    exit_code = 1

    def __str__(self) -> str:  # KeyError would otherwise print the message in quotes
        return str(self.args[0]) if self.args else ""


class ConfigError(VLAError, ValueError):
    """A configuration key or value is wrong (found before any model or frame is loaded)."""

    exit_code = 2


class DataError(VLAError, ValueError):
    """A dataset is malformed or inconsistent with its metadata (names the dataset, file, episode, frame)."""


class MissingFileError(VLAError, FileNotFoundError):
    """A file the configuration or a dataset refers to does not exist."""


class FeatureKeyError(VLAError, KeyError):
    """A configured feature key is not in the dataset."""


class CheckpointError(VLAError, ValueError):
    """A checkpoint cannot be written, or cannot be resumed into this run."""


class ConnectionFailedError(VLAError, ConnectionError):
    """A policy server cannot be reached, or refused the connection."""


class NonFiniteError(VLAError, FloatingPointError):
    """A loss, gradient or weight became NaN/inf during training."""


class Preempted(VLAError):
    """Training stopped on a termination signal after writing a complete checkpoint (exit 75: requeue and resume)."""

    exit_code = 75


__all__ = [
    "CheckpointError",
    "Preempted",
    "ConfigError",
    "ConnectionFailedError",
    "DataError",
    "MissingFileError",
    "FeatureKeyError",
    "NonFiniteError",
    "VLAError",
]
