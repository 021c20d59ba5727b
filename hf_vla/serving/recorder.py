"""What a served policy saw and did, recorded as LeRobot episodes (`python -m hf_vla.serve --record DIR`).

One frame per inference request: the cameras the policy read (as sent, uint8), its state vector, the prompt as the
frame's task, `policy_action` (the first action the robot executes of the returned chunk: index `rtc/inference_delay`
of it, un-normalised) and `action`: the policy's, or the action a person executed instead when the request carries
`intervention` (then `intervention` is 1). An episode is one client episode: it ends when the client sends another
`episode_seed`, sends `episode_end` (with an optional `success`), or disconnects.

Layout of DIR (each finished episode a complete LeRobot v3.0 dataset of its own, written by lerobot's writer and
renamed into place, so a server killed mid-episode loses that episode only and never a finished one):

    DIR/meta/hf_vla_serve_record.json   the run (checkpoint, head, fps) and every finished episode (frames, success)
    DIR/episodes/000000/ ...            one dataset per episode
    DIR/dataset/                        the episodes joined (lerobot's aggregate_datasets) when the server stops;
                                        `join_recording(DIR)` joins them after a crash

Writing happens on one background thread (frames are queued; lerobot encodes the episode's video at its end), so
serving waits for no disk. Any write error (a full disk), or a writer `MAX_QUEUED` frames behind, stops the recording
with one logged line; serving goes on.
"""

from __future__ import annotations

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

from hf_vla.errors import ConfigError

logger = logging.getLogger("hf_vla.serve")
RUN_FILE = "hf_vla_serve_record.json"
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
        same run's is continued (episode numbers go on). fps: the dataset's frames per second (one frame a request)."""

    def __init__(self, root: str | os.PathLike, run: dict, fps: int):
        self.root = Path(root)
        self.run, self.fps = dict(run), max(1, int(round(fps)))
        self._check_root()
        (self.root / "episodes").mkdir(parents=True, exist_ok=True)
        for leftover in (self.root / "episodes").glob("*.partial"):  # an episode a killed server left open
            logger.warning("recording: removing the unfinished episode %s of a previous server", leftover.name)
            shutil.rmtree(leftover, ignore_errors=True)
        self.summary = self._load_summary()
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
        if join and self.stopped is None:
            return join_recording(self.root)
        return None

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
            try:
                if kind == "frame":
                    self._write_frame(open_episodes.setdefault(episode, _Open(episode)), payload)
                elif kind == "end":
                    if episode in open_episodes:
                        self._finish(open_episodes.pop(episode), *payload)
                else:  # close: finish what is open
                    for state in list(open_episodes.values()):
                        self._finish(state, None, "server stopped")
                    return
            except Exception as error:  # noqa: BLE001  (a full disk, a broken writer: serving must go on)
                self.stopped = f"{type(error).__name__}: {error}"
                logger.error("recording stopped (%s); serving goes on; the finished episodes in %s are kept",
                             self.stopped, self.root)
                for state in open_episodes.values():
                    shutil.rmtree(self._partial(state.index), ignore_errors=True)
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
    if root.exists() and any(root.iterdir()):
        if not meta.is_file():
            raise ConfigError(f"--record {root}: not empty and not a recording of hf_vla.serve; choose a new or empty "
                              "directory")
        theirs = json.loads(meta.read_text()).get("run") or {}
        differ = [key for key in run if theirs.get(key) != run[key]]
        if differ:
            shown = ", ".join(f"{key}: {theirs.get(key)!r} there, {run[key]!r} now" for key in differ)
            raise ConfigError(f"--record {root}: recorded by another run ({shown}); choose a new directory, or serve "
                              "the same checkpoint and head to continue it")
    from hf_vla.cli import check_writable_dir

    check_writable_dir("--record", root)


def join_recording(root: str | os.PathLike) -> Path | None:
    """Join a serve recording's finished episodes into `root/dataset` (lerobot's `aggregate_datasets`), replacing an
    older join atomically; the run's summary (episodes, success) goes into its `meta/`. None when no episode is
    finished."""
    root = Path(root)
    episodes = sorted(p for p in (root / "episodes").iterdir() if p.name.isdigit()) if (root / "episodes").is_dir() \
        else []
    if not episodes:
        return None
    staging = root / ".dataset.joining"
    shutil.rmtree(staging, ignore_errors=True)
    if len(episodes) == 1:
        shutil.copytree(episodes[0], staging)
    else:
        from lerobot.datasets.aggregate import aggregate_datasets

        aggregate_datasets([f"local/served_{p.name}" for p in episodes], "local/served", roots=episodes,
                           aggr_root=staging)
    summary = root / "meta" / RUN_FILE
    if summary.is_file():
        shutil.copy(summary, staging / "meta" / RUN_FILE)
    target = root / "dataset"
    if target.exists():
        os.replace(target, root / ".dataset.previous")
    os.replace(staging, target)
    shutil.rmtree(root / ".dataset.previous", ignore_errors=True)
    logger.info("recording: %d episode(s) joined into %s", len(episodes), target)
    return target


__all__ = ["Frame", "ServeRecorder", "camera_feature", "join_recording"]
