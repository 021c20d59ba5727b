"""What a served policy saw and did, recorded as LeRobot episodes (`python -m hf_vla.serve --record DIR`).

One frame per inference request: the cameras the policy read (as sent, uint8), its state vector, the prompt as the
frame's task, `policy_action` (the first action the robot executes of the returned chunk: index `rtc/inference_delay`
of it, un-normalised) and `action`: the policy's, or the action a person executed instead when the request carries
`intervention` (then `intervention` is 1). An episode is one client episode: it ends when the client sends an
`episode_seed` (which starts the next one, the same seed again too: the policy is reset), sends `episode_end` (with an
optional `success`), or disconnects.

Layout of DIR (each finished episode a complete LeRobot v3.0 dataset of its own, written by lerobot's writer and
renamed into place, so a server killed mid-episode loses that episode only and never a finished one):

    DIR/meta/hf_vla_serve_record.json   the run (checkpoint, head, fps) and every finished episode (frames, success)
    DIR/episodes/000000/ ...            one dataset per episode
    DIR/dataset/                        the episodes joined (lerobot's aggregate_datasets) when the server stops;
                                        `join_recording(DIR)` joins them after a crash

Writing happens on one background thread (frames are queued; lerobot encodes the episode's video at its end), so
serving waits for no disk. A fault of one episode (a camera size the video encoder cannot take, such as an odd side)
costs that episode only, with one logged line; a fault of the disk (full, read-only, I/O error) or a writer
`MAX_QUEUED` frames behind stops the recording with one logged line; serving goes on either way.

One server per DIR: the recorder holds `DIR/_hf_vla_serve_record.lock` (`hf_vla.storage.DirectoryLock`), so a
second server on the same DIR is refused at start-up naming the first. Episodes whose features differ (a client whose
camera size differs from another's) cannot be one LeRobot dataset: the join writes one dataset per shape,
`DIR/dataset` for the first episode's and `DIR/dataset.2`, ... for the others, and says so in one line.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hf_vla.errors import ConfigError, DataError
from hf_vla.storage import DirectoryLock

logger = logging.getLogger("hf_vla.serve")
RUN_FILE = "hf_vla_serve_record.json"
LOCK_NAME = "_hf_vla_serve_record.lock"  # one server per recording directory
# errors of the disk, not of one episode: they stop the recording (every later episode would fail the same way)
DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
WRITER_NICE = 10  # the writer thread's niceness: the CPU goes to inference first, the writer still keeps up
MAX_QUEUED = 4096  # frames waiting for the writer at most; beyond, recording stops (serving never waits for the disk)
STATE, ACTION, POLICY_ACTION, INTERVENTION = "observation.state", "action", "policy_action", "intervention"


def camera_feature(key: str) -> str:
    """The dataset feature of a client's camera key (openpi's `observation/wrist_image` -> `observation.wrist_image`)."""
    return key.replace("/", ".")


@dataclass
class Frame:
    images: dict[str, np.ndarray]  # client key -> HxWx3 uint8
    state: np.ndarray
    task: str
    policy_action: np.ndarray
    action: np.ndarray
    intervention: bool


@dataclass
class _Open:
    """An episode being written (on the writer thread)."""

    index: int
    dataset: object = None
    frames: int = 0
    interventions: int = 0
    shapes: dict = field(default_factory=dict)
    skipped: str | None = None  # why this episode is not written (e.g. camera sizes changed mid-episode)


class ServeRecorder:
    """Records the episodes of every connection of a `PolicyServer` into `root` (see the module docstring).

    run: what identifies the run (the checkpoint, the head): a non-empty `root` recorded by another run is refused, the
        same run's is continued (episode numbers go on). fps: the dataset's frames per second (one frame a request), a
        whole number (LeRobot datasets have whole frames per second). lock: the directory's writer lock, already held
        (`serve` takes it before the model loads); None: taken here."""

    def __init__(self, root: str | os.PathLike, run: dict, fps: int, lock: DirectoryLock | None = None):
        self.root = Path(root)
        if not (isinstance(fps, int | float) and fps >= 1 and float(fps).is_integer()):
            raise ConfigError(f"recording fps {fps}: must be a whole number of frames per second, at least 1")
        self.run, self.fps = dict(run), int(fps)
        self.lock = lock if lock is not None else record_lock(self.root).acquire()
        try:
            self._check_root()
            (self.root / "episodes").mkdir(parents=True, exist_ok=True)
            for leftover in (self.root / "episodes").glob("*.partial"):  # an episode a killed server left open
                logger.warning("recording: removing the unfinished episode %s of a previous server", leftover.name)
                shutil.rmtree(leftover, ignore_errors=True)
            self.summary = self._load_summary()
            self._save_summary()  # at once: a server stopped before its first episode leaves a recording to continue
        except BaseException:
            self.lock.release()
            raise
        # lerobot's writer imported now, at start-up: imported by the writer thread at the first frame, it would hold
        # the interpreter (the import lock, seconds of module code) while a request waits
        from lerobot.configs.video import RGBEncoderConfig  # noqa: F401
        from lerobot.datasets.lerobot_dataset import LeRobotDataset  # noqa: F401

        self._next = max((e["episode"] for e in self.summary["episodes"]), default=-1) + 1
        self._lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue(maxsize=MAX_QUEUED)
        self.stopped: str | None = None  # why recording stopped (a write error); serving goes on
        self._thread = threading.Thread(target=self._loop, name="hf_vla-recorder", daemon=True)
        self._thread.start()

    # ---- the run's directory --------------------------------------------------------------------------------------
    def _check_root(self) -> None:
        check_record_dir(self.root, self.run)
        self.root.mkdir(parents=True, exist_ok=True)

    def _load_summary(self) -> dict:
        meta = self.root / "meta" / RUN_FILE
        if meta.is_file():
            summary = json.loads(meta.read_text())
            done = {int(p.name) for p in (self.root / "episodes").iterdir() if p.name.isdigit()}
            summary["episodes"] = [e for e in summary.get("episodes", []) if e["episode"] in done]
            return summary
        return {"run": self.run, "fps": self.fps, "episodes": []}

    def _save_summary(self) -> None:
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        temporary = meta / (RUN_FILE + ".tmp")
        temporary.write_text(json.dumps(self.summary, indent=2))
        os.replace(temporary, meta / RUN_FILE)

    # ---- the serving threads' side (cheap: a queue put) -------------------------------------------------------------
    def start_episode(self) -> int:
        with self._lock:
            index, self._next = self._next, self._next + 1
        return index

    def add(self, episode: int, frame: Frame) -> None:
        self._put(("frame", episode, frame))

    def end(self, episode: int, success: bool | None = None, reason: str = "") -> None:
        self._put(("end", episode, (success, reason)))

    def _put(self, item: tuple) -> None:
        if self.stopped is not None:
            return
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.stopped = f"the writer fell {MAX_QUEUED} frames behind the requests"
            logger.error("recording stopped (%s); serving goes on; the finished episodes in %s are kept",
                         self.stopped, self.root)

    def close(self, join: bool = True) -> Path | None:
        """Write what is queued (open episodes end as they are), stop the thread, and join the episodes into
        `root/dataset` (None when there is none)."""
        self.queue.put(("close", None, None))  # waits for room: the writer drains the queue
        self._thread.join()
        try:
            if join and self.stopped is None:
                return join_recording(self.root)
            return None
        finally:
            self.lock.release()

    # ---- the writer thread --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:  # below the serving threads (Linux: a thread's own nice value; the encoder's threads inherit it)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        open_episodes: dict[int, _Open] = {}
        while True:
            kind, episode, payload = self.queue.get()
            if self.stopped is not None:
                if kind == "close":
                    return
                continue
            states = ([open_episodes.setdefault(episode, _Open(episode))] if kind == "frame" else
                      [open_episodes.pop(episode)] if kind == "end" and episode in open_episodes else
                      list(open_episodes.values()) if kind == "close" else [])
            for state in states:
                try:
                    if kind == "frame":
                        self._write_frame(state, payload)
                    else:
                        self._finish(state, *(payload if kind == "end" else (None, "server stopped")))
                except Exception as error:  # noqa: BLE001  (a full disk, a broken writer: serving must go on)
                    if _disk_fault(error):  # every later episode would fail the same way: stop recording
                        self.stopped = f"{type(error).__name__}: {error}"
                        logger.error("recording stopped (%s); serving goes on; the finished episodes in %s are kept",
                                     self.stopped, self.root)
                        for other in [*open_episodes.values(), *states]:
                            shutil.rmtree(self._partial(other.index), ignore_errors=True)
                        break
                    # a fault of this episode alone (an image the encoder cannot take): that episode is not kept
                    state.skipped = f"{type(error).__name__}: {error}"
                    logger.warning("recording: episode %d not kept (%s); the other episodes go on", state.index,
                                   " ".join(state.skipped.split())[:300])
                    shutil.rmtree(self._partial(state.index), ignore_errors=True)
                    state.dataset = None
            if kind == "close":
                return

    def _partial(self, index: int) -> Path:
        return self.root / "episodes" / f"{index:06d}.partial"

    def _write_frame(self, state: _Open, frame: Frame) -> None:
        if state.skipped:
            return
        shapes = {key: image.shape for key, image in frame.images.items()} | {STATE: frame.state.shape,
                                                                              ACTION: frame.action.shape}
        if state.dataset is None:
            odd = {key: image.shape[:2] for key, image in frame.images.items()
                   if image.shape[0] % 2 or image.shape[1] % 2}
            if odd:  # H.264 in 4:2:0 (lerobot's video) needs even sides: this episode cannot be written
                state.skipped = (f"camera {', '.join(f'{k} is {h}x{w}' for k, (h, w) in odd.items())}: the video "
                                 "encoder (H.264, 4:2:0) needs an even height and width")
                logger.warning("recording: episode %d not kept: %s", state.index, state.skipped)
                return
            state.dataset, state.shapes = self._create(state.index, frame), shapes
        elif shapes != state.shapes:
            state.skipped = f"shapes changed within the episode ({state.shapes} -> {shapes})"
            logger.warning("recording: episode %d not kept: %s", state.index, state.skipped)
            return
        row = {camera_feature(key): image for key, image in frame.images.items()}
        row |= {STATE: frame.state.astype(np.float32), ACTION: frame.action.astype(np.float32),
                POLICY_ACTION: frame.policy_action.astype(np.float32),
                INTERVENTION: np.array([int(frame.intervention)], np.int64), "task": frame.task}
        state.dataset.add_frame(row)
        state.frames += 1
        state.interventions += int(frame.intervention)

    def _create(self, index: int, frame: Frame):
        from lerobot.configs.video import RGBEncoderConfig
        from lerobot.datasets.lerobot_dataset import LeRobotDataset

        dim = len(frame.action)
        features = {STATE: {"dtype": "float32", "shape": tuple(frame.state.shape), "names": None},
                    ACTION: {"dtype": "float32", "shape": (dim,), "names": [f"a{i}" for i in range(dim)]},
                    POLICY_ACTION: {"dtype": "float32", "shape": (dim,), "names": [f"a{i}" for i in range(dim)]},
                    INTERVENTION: {"dtype": "int64", "shape": (1,), "names": None}}
        for key, image in frame.images.items():
            features[camera_feature(key)] = {"dtype": "video", "shape": tuple(image.shape),
                                             "names": ["height", "width", "channels"]}
        partial = self._partial(index)
        shutil.rmtree(partial, ignore_errors=True)
        return LeRobotDataset.create(f"local/served_{index:06d}", fps=self.fps, features=features, root=partial,
                                     robot_type=self.run.get("robot_type"), use_videos=True,
                                     rgb_encoder=RGBEncoderConfig(vcodec="h264", pix_fmt="yuv420p"))

    def _finish(self, state: _Open, success: bool | None, reason: str) -> None:
        partial = self._partial(state.index)
        if state.dataset is None or state.skipped:
            shutil.rmtree(partial, ignore_errors=True)
            return
        state.dataset.save_episode(parallel_encoding=False)
        state.dataset.finalize()
        os.replace(partial, self.root / "episodes" / f"{state.index:06d}")
        self.summary["episodes"].append({"episode": state.index, "frames": state.frames, "success": success,
                                         "interventions": state.interventions, "ended": reason,
                                         "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.summary["episodes"].sort(key=lambda e: e["episode"])
        self._save_summary()
        logger.info("recording: episode %d kept (%d frames, %d interventions, success %s; %s)", state.index,
                    state.frames, state.interventions, success, reason)


def check_record_dir(root: str | os.PathLike, run: dict) -> None:
    """A recording directory must be new, empty, or a recording of the same run (the fields of `run` it has); else a
    `ConfigError` in one line. Called before the model loads, and again by the recorder with the whole run."""
    root = Path(root)
    meta = root / "meta" / RUN_FILE
    if root.exists() and not root.is_dir():
        raise ConfigError(f"--record {root}: exists and is not a directory")
    if root.exists() and any(p.name != LOCK_NAME for p in root.iterdir()):
        if not meta.is_file():
            if _left_before_its_summary(root):  # a server killed before it wrote its summary (hf_vla < 0.x)
                return
            raise ConfigError(f"--record {root}: not empty and not a recording of hf_vla.serve; choose a new or empty "
                              "directory")
        try:
            theirs = json.loads(meta.read_text()).get("run") or {}
        except (OSError, ValueError, AttributeError) as error:
            raise ConfigError(f"--record {root}: meta/{RUN_FILE} is unreadable ({error}); choose a new "
                              "directory") from None
        differ = [key for key in run if not _same(key, theirs.get(key), run[key])]
        if differ:
            shown = ", ".join(f"{key}: {theirs.get(key)!r} there, {run[key]!r} now" for key in differ)
            raise ConfigError(f"--record {root}: recorded by another run ({shown}); choose a new directory, or serve "
                              "the same checkpoint and head to continue it")
    from hf_vla.cli import check_writable_dir

    check_writable_dir("--record", root)


def _same(key: str, theirs, ours) -> bool:
    """One run's field against another's: checkpoints compared as resolved paths (`base/`, `./base` and its absolute
    path are one checkpoint), the rest as they are."""
    if key == "checkpoint" and isinstance(theirs, str) and isinstance(ours, str):
        return theirs == ours or checkpoint_identity(theirs) == checkpoint_identity(ours)
    if key == "weights" and theirs is None:  # a recording of an hf_vla that did not fingerprint the weights
        return True
    return theirs == ours


def checkpoint_identity(checkpoint: str) -> str:
    """A checkpoint as it is compared between runs: a local directory's resolved path, or the Hub id as given."""
    path = Path(checkpoint).expanduser()
    return str(path.resolve()) if path.exists() else checkpoint


def _left_before_its_summary(root: Path) -> bool:
    """`root` holds only what a recording server writes before its first episode ends: `episodes/` with unfinished
    (`.partial`) episodes or nothing, an empty `meta/`, the lock."""
    names = {p.name for p in root.iterdir()} - {LOCK_NAME}
    if not names <= {"episodes", "meta"} or any((root / "meta").glob("*")):
        return False
    return all(p.name.endswith(".partial") for p in (root / "episodes").iterdir()) if (root / "episodes").is_dir() \
        else True


def _disk_fault(error: BaseException) -> bool:
    """A fault of the disk (full, quota, read-only, I/O), as opposed to one of an episode's frames."""
    seen = error
    for _ in range(5):  # lerobot and PyAV wrap the OSError they met
        if isinstance(seen, OSError) and seen.errno in DISK_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
        if seen is None:
            return False
    return False


def record_lock(root: str | os.PathLike) -> DirectoryLock:
    """The writer lock of a recording directory (not taken yet)."""
    return DirectoryLock(root, label="--record", lock_name=LOCK_NAME, what="another server recording there")


def _features_signature(episode: Path) -> str:
    """What must be equal for episodes to join into one dataset: each feature's dtype and shape."""
    features = json.loads((episode / "meta" / "info.json").read_text())["features"]
    return json.dumps({key: [value.get("dtype"), list(value.get("shape") or [])] for key, value in
                       sorted(features.items())})


def join_recording(root: str | os.PathLike) -> Path | None:
    """Join a serve recording's finished episodes into `root/dataset` (lerobot's `aggregate_datasets`), replacing an
    older join atomically; the run's summary (episodes, success) goes into its `meta/`. None when no episode is
    finished."""
    root = Path(root)
    episodes = sorted(p for p in (root / "episodes").iterdir() if p.name.isdigit()) if (root / "episodes").is_dir() \
        else []
    if not episodes:
        return None
    groups: dict[str, list[Path]] = {}
    for episode in episodes:  # in episode order: the first episode's shapes make DIR/dataset
        groups.setdefault(_features_signature(episode), []).append(episode)
    targets = [root / ("dataset" if number == 1 else f"dataset.{number}") for number in range(1, len(groups) + 1)]
    if len(groups) > 1:
        shown = "; ".join(f"{target.name}: episodes {_ranges([int(p.name) for p in group])} "
                          f"({_shapes(group[0])})" for target, group in zip(targets, groups.values()))
        logger.warning("recording: the episodes have %d different feature shapes, which one LeRobot dataset cannot "
                       "hold: joined into one dataset per shape (%s)", len(groups), shown)
    for target, group in zip(targets, groups.values()):
        _join(root, group, target)
    logger.info("recording: %d episode(s) joined into %s", len(episodes), ", ".join(str(t) for t in targets))
    return targets[0]


def _join(root: Path, episodes: list[Path], target: Path) -> None:
    """`episodes` joined into `target`, staged beside it; a failure (a full disk) leaves neither a half-written
    dataset nor a changed `target`, and says in one line how to join later."""
    from hf_vla.storage import replace_dir, staging_dir

    staging = staging_dir(target, "joining")
    try:
        if len(episodes) == 1:
            shutil.copytree(episodes[0], staging)
        else:
            from lerobot.datasets.aggregate import aggregate_datasets

            aggregate_datasets([f"local/served_{p.name}" for p in episodes], "local/served", roots=episodes,
                               aggr_root=staging)
        summary = root / "meta" / RUN_FILE
        if summary.is_file():
            shutil.copy(summary, staging / "meta" / RUN_FILE)
        replace_dir(staging, target)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise DataError(f"recording: joining the {len(episodes)} finished episodes of {root} failed "
                        f"({error.strerror or error}); they are intact in {root / 'episodes'}; join them later with "
                        f"python -c \"from hf_vla.serving.recorder import join_recording; "
                        f"join_recording('{root}')\"") from None


def _ranges(numbers: list[int]) -> str:
    spans, start = [], None
    for index, number in enumerate(numbers):
        if start is None:
            start = number
        if index + 1 == len(numbers) or numbers[index + 1] != number + 1:
            spans.append(f"{start}" if start == number else f"{start}-{number}")
            start = None
    return ",".join(spans)


def _shapes(episode: Path) -> str:
    features = json.loads((episode / "meta" / "info.json").read_text())["features"]
    return ", ".join(f"{key} {'x'.join(str(n) for n in value['shape'])}" for key, value in features.items()
                     if value.get("dtype") == "video")


__all__ = ["Frame", "LOCK_NAME", "ServeRecorder", "camera_feature", "checkpoint_identity", "join_recording",
           "record_lock"]
