"""The deployment contract: how a checkpoint must be run, saved beside it as `deployment_config.json`.

A policy's closed-loop success depends on settings that are not in its weights: the image size the data was recorded
at, the actions executed per predicted chunk, which observation keys fill which camera slot, the control mode and
normalisation head, the episode step limit it was validated with. Retyped by hand, a wrong one silently changes
success (lerobot #4614: `n_action_steps` 50 instead of 10 costs 15-23 points on LIBERO). So every checkpoint hf_vla
writes (training checkpoints and the final output, rollout snapshots, `hf_vla.convert`, the Hub push) carries them,
in the spirit of transformers' `generation_config.json`, and `hf_vla.evaluate` / `hf_vla.serve` take them from there:
a flag is needed only for what the checkpoint cannot know, and a flag that contradicts it is refused by name unless
`--override FIELD` accepts it (`resolve`).

The file is plain JSON, versioned (`version`), readable without torch or hf_vla (`json.load`). Fields (version 1):

- `policy`: "pi05" or "pi0".
- `chunk_size`: actions per predicted chunk. `n_action_steps`: how many of them are executed before the next chunk
  is predicted (training argument `n_action_steps`; default half the chunk, what `hf_vla.evaluate` always used).
- `image_size`: the side of the model's input images (the processor resizes with padding to it).
- `default_head`: the normalisation head used when a request names none (None: the checkpoint has several heads and
  the robot must say which).
- `heads`: per normalisation head `robot_type::control_mode`, what its data looked like:
  - `robot_type`, `control_mode`, `fps` (frames per second of the data: one chunk step);
  - `cameras`: the observation key of each camera slot in slot order, with the height and width the data was
    recorded at (`{"key": "observation.image", "height": 96, "width": 96}`; a slot the data leaves empty has key null);
  - `state` / `action`: `{"key": ..., "dim": ...}`;
  - `instruction`: "task" (each episode's task string from the data) or the fixed string every frame was trained with;
  - `normalization`: the mode of `state` and `actions` (lerobot's names: QUANTILES, MEAN_STD, MIN_MAX,
    QUANTILE10, IDENTITY) and `relative_actions`: the mask of action dims that are offsets from the state (None:
    absolute). The processor's statistics carry both and apply them; these say it to a runner outside hf_vla;
  - `datasets`: the names of the datasets of this head;
  - `benchmark`: for data recorded in a simulator by `hf_vla.record`, the settings to evaluate it with: `env`
    (`metaworld`, a gymnasium id, ...), `tasks`, `max_episode_steps` (the training argument `max_episode_steps` when
    set, else the recording's), `image_size` (the render size), `env_kwargs` (other arguments the env was recorded
    with), `data_seeds` ([lowest, highest] env seed the recording tried: evaluation seeds must avoid them) and
    `fast_render`. None for other data.
- `source`: what wrote it (`hf_vla.train`, `hf_vla.convert`, ...) and from what.
- `advantage`: for a policy trained with RECAP's advantage indicator (docs/recap.md), `{"conditioned": true,
  "cfg_beta": 1.0, "indicator": "text"}`: every call asks for "Advantage: positive" (in the indicator's form: a prompt
  segment of its own, the expert's embedding, or appended to the task for checkpoints trained before the segment),
  and with `cfg_beta` != 1 the velocity is guided, `v_u + beta (v_c - v_u)`. None (absent) otherwise.
- `best_of`: best-of-N bundled with the checkpoint (docs/best_of_n.md; `python -m hf_vla.convert --critic`):
  `{"candidates": 8, "selector": "critic", "critic": "critic"}`, the candidate chunks drawn per observation, the
  selector, and the chunk critic's folder inside the checkpoint (None: no critic). `evaluate`, `serve`, `record` and
  the lerobot plugin run it unless their flags say otherwise (`--best_of 1`: one sample). None (absent) otherwise.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hf_vla.errors import ConfigError
from hf_vla.models.common.contract_io import DEPLOYMENT_FILE as FILE_NAME  # one definition, carried by remote code

VERSION = 1


@dataclass
class DeploymentConfig:
    """The contract of one checkpoint (see the module docstring for every field)."""

    policy: str
    chunk_size: int
    n_action_steps: int
    image_size: int
    heads: dict[str, dict]
    default_head: str | None = None
    source: dict = field(default_factory=dict)
    version: int = VERSION
    advantage: dict | None = None  # RECAP: {"conditioned": true, "cfg_beta": 1.0}; the runner asks for "positive"
    # pi0.5's high-level inference: {"layout": "joint", "every_chunks": k}: the runner decodes a subtask every k chunks
    subtask: dict | None = None
    # MEM: {"frames", "stride" (dataset frames), "visual", "proprio", "fps" (the data's; None: unknown)}
    memory: dict | None = None
    # best-of-N: {"candidates": N, "selector": ..., "critic": a folder inside the checkpoint, or None}
    best_of: dict | None = None

    def __post_init__(self):
        if not 1 <= int(self.n_action_steps) <= int(self.chunk_size):
            raise ValueError(f"n_action_steps={self.n_action_steps}: must be 1..chunk_size ({self.chunk_size})")

    def head(self, name: str | None = None) -> dict:
        """The settings of head `name` (default: `default_head`, or the only head)."""
        if name is None:
            name = self.default_head if self.default_head is not None else (
                next(iter(self.heads)) if len(self.heads) == 1 else None)
        if name not in self.heads:
            raise KeyError(f"the deployment contract has no head {name!r}; it has {sorted(self.heads)}")
        return self.heads[name]

    def to_dict(self) -> dict:
        return {"version": self.version, **{k: v for k, v in asdict(self).items() if k != "version" and not (
            k in ("advantage", "subtask", "memory", "best_of") and v is None)}}  # (no such field for the policies trained without it)

    @classmethod
    def from_dict(cls, data: dict, where: str = FILE_NAME) -> DeploymentConfig:
        version = data.get("version")
        if version != VERSION:
            raise ValueError(f"{where}: deployment contract version {version!r}; this hf_vla reads version {VERSION} "
                             "(upgrade hf_vla, or rewrite the file)")
        known = {"policy", "chunk_size", "n_action_steps", "image_size", "heads", "default_head", "source", "version",
                 "advantage", "subtask", "memory", "best_of"}
        unknown = sorted(set(data) - known)
        if unknown:  # fields a later hf_vla added within this version: read what this one knows
            logging.getLogger("hf_vla.deployment.contract").warning("%s: ignoring field(s) %s that this hf_vla does not know",
                                                           where, unknown)
        missing = sorted({"policy", "chunk_size", "n_action_steps", "image_size", "heads"} - set(data))
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, directory: str | os.PathLike) -> Path:
        path = Path(directory) / FILE_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def read(checkpoint: str | os.PathLike, revision: str | None = None) -> DeploymentConfig | None:
    """The contract of a checkpoint directory or Hub id; None when it has none (written before contracts, or by
    another tool). A damaged file is a `ValueError` naming it."""
    path = Path(checkpoint) / FILE_NAME
    if not path.is_file():
        if Path(checkpoint).exists():
            return None
        try:  # a Hub id: the file from the cache (or the Hub), when the repo has one
            from huggingface_hub import hf_hub_download
            from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

            path = Path(hf_hub_download(str(checkpoint), FILE_NAME, revision=revision))
        except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, OSError, ValueError):
            return None
    try:
        return DeploymentConfig.from_dict(json.loads(path.read_text()), str(path))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as error:
        from hf_vla.errors import DataError

        raise DataError(f"{path}: not a deployment contract ({error})") from None


# ---- from what a run knows -------------------------------------------------------------------------------------------
RECORD_MARKER = "hf_vla_record.json"  # written by hf_vla.record into meta/


def _camera_sizes(features: dict, key: str | None) -> dict:
    if key is None:
        return {"key": None, "height": None, "width": None}
    shape = list((features.get(key) or {}).get("shape") or [])
    names = list((features.get(key) or {}).get("names") or [])
    height = width = None
    if len(shape) == 3:  # LeRobot stores [height, width, channels] (names say so); older files [channels, h, w]
        if names[:2] == ["channels", "height"] or (shape[0] == 3 and shape[-1] != 3):
            height, width = shape[1], shape[2]
        else:
            height, width = shape[0], shape[1]
    return {"key": key, "height": height, "width": width}


def benchmark_of(root: str | os.PathLike, max_episode_steps: int | None = None) -> dict | None:
    """The benchmark settings of a dataset recorded by `hf_vla.record` (its `meta/hf_vla_record.json`), else None."""
    marker = Path(root) / "meta" / RECORD_MARKER
    if not marker.is_file():
        return None
    record = json.loads(marker.read_text())
    from hf_vla.registry import contract_env, task_env

    env = contract_env(record.get("env"))
    tasks = list(record.get("tasks") or {})
    seeds = record.get("data_seeds")
    if seeds is None:  # a recording from before data_seeds: seed, seed + 1, ... as many as the most tries of a task
        tries = [int(t.get("kept", 0)) + int(t.get("rejected", 0)) for t in (record.get("tasks") or {}).values()]
        first = int(record.get("seed", 0))
        seeds = [first, first + max(tries, default=1) - 1]
    return {"env": env, "tasks": tasks if task_env(env) is not None else None,
            "max_episode_steps": max_episode_steps or record.get("max_episode_steps"),
            "image_size": record.get("image_size"), "env_kwargs": record.get("env_kwargs") or {},
            "data_seeds": seeds, "fast_render": record.get("fast_render")}


def _merge_benchmarks(first: dict | None, other: dict | None, names: tuple[str, str] = ("", "")) -> dict | None:
    """One head's benchmark over several recordings of one env (e.g. one dataset per Meta-World task): the tasks of
    all, the seeds of all; recordings of different envs, image sizes or env arguments (a crop) keep the first's
    settings, with a warning naming both datasets (`names`) and what differs: the contract then runs every task the
    first recording's way, which silently changes success on the others'."""
    if first is None or other is None:
        return first or other
    differ = [key for key in ("env", "image_size", "env_kwargs") if (first.get(key) or None) != (other.get(key) or None)]
    if differ:
        logging.getLogger("hf_vla.deployment.contract").warning(
            "datasets %r and %r share a normalisation head but were recorded differently (%s); the checkpoint's "
            "deployment contract keeps %r's, so evaluation and RL run every task that way; record them alike "
            "(the same env, image size and --crop) for a contract that fits all", names[0], names[1],
            "; ".join(f"{key}: {first.get(key)!r} vs {other.get(key)!r}" for key in differ), names[0])
        return first
    merged = dict(first)
    if first.get("tasks") is not None or other.get("tasks") is not None:
        merged["tasks"] = list(dict.fromkeys((first.get("tasks") or []) + (other.get("tasks") or [])))
    seeds = [s for s in (first.get("data_seeds"), other.get("data_seeds")) if s]
    merged["data_seeds"] = [min(s[0] for s in seeds), max(s[1] for s in seeds)] if seeds else None
    steps = [s for s in (first.get("max_episode_steps"), other.get("max_episode_steps")) if s]
    merged["max_episode_steps"] = max(steps) if steps else None
    return merged


def from_training(mixture, processor, config, policy: str, n_action_steps: int | None = None,
                  max_episode_steps: int | None = None, source: dict | None = None) -> DeploymentConfig:
    """The contract of a run: cameras, keys, dims and fps from each head's first dataset's metadata, the benchmark
    from a recording's marker, the chunk settings from the model config and the training arguments."""
    heads: dict[str, dict] = {}
    for source_index, data in enumerate(mixture.sources):
        head_name = mixture.head_names[mixture.head_of_source[source_index]]
        entry = heads.get(head_name)
        if entry is not None:  # another dataset of the head: its name, and its recording merged into the benchmark
            entry["datasets"].append(data.name)
            entry["benchmark"] = _merge_benchmarks(entry["benchmark"], benchmark_of(data.root, max_episode_steps),
                                                   (entry["datasets"][0], data.name))
            continue
        features = data.meta.features
        heads[head_name] = {
            "robot_type": data.robot_type, "control_mode": data.config.control_mode,
            "fps": float(data.meta.fps) if data.meta.fps else None,
            "cameras": [_camera_sizes(features, key) for key in data.config.cameras],
            "state": {"key": data.config.state_key, "dim": int(data.state_dim)},
            "action": {"key": data.config.action_key, "dim": int(data.action_dim)},
            "instruction": data.config.task if data.config.task is not None else "task",
            "datasets": [data.name],
            "benchmark": benchmark_of(data.root, max_episode_steps),
            **pipeline_fields(getattr(processor, "norm_stats", {}).get(head_name)),
        }
    chunk = int(config.chunk_size)
    return DeploymentConfig(
        policy=policy, chunk_size=chunk, n_action_steps=int(n_action_steps or max(1, chunk // 2)),
        image_size=int(processor.image_size), heads=heads,
        default_head=mixture.head_names[0] if len(mixture.head_names) == 1 else None,
        source=dict(source or {"made_by": "hf_vla.train"}),
        advantage={"conditioned": True, "cfg_beta": float(getattr(processor, "cfg_beta", 1.0)),
                   "indicator": getattr(processor, "advantage_indicator", "appended")} if getattr(
            processor, "advantage_conditioned", False) else None,
        subtask={"layout": config.subtask_layout, "every_chunks": 1} if getattr(config, "subtask_layout", None)
        else None,
        memory=_memory(getattr(processor, "memory", None), next((h["fps"] for h in heads.values() if h["fps"]), None)))


def _memory(settings: dict | None, fps: float | None) -> dict | None:
    return None if not settings else {**settings, "fps": fps}


def memory_stride(contract: DeploymentConfig | None, control_fps: float | None, where: str) -> int | None:
    """A MEM policy's stride in the robot's control steps: the contract's stride counts the training data's frames,
    which must be the same time at inference. At another control rate it is converted where that is a whole number of
    steps, else refused in one line. None: the contract has no memory (or nothing to convert: a rate unknown)."""
    memory = (contract.memory if contract is not None else None) or None
    if not memory or not control_fps or not memory.get("fps"):
        return None
    stride, fps = int(memory["stride"]), float(memory["fps"])
    steps = stride * float(control_fps) / fps
    if abs(steps - round(steps)) > 1e-6 or round(steps) < 1:
        raise ConfigError(f"{where}: the policy's memory looks {stride} data frames back ({stride / fps:g} s at the "
                          f"data's {fps:g} fps), which is {steps:g} control steps at {float(control_fps):g} Hz: not a "
                          "whole number; run the robot at a rate that makes it whole, or retrain with another "
                          "memory_stride")
    return int(round(steps))


def pipeline_fields(stats: dict | None) -> dict:
    """A head's `normalization` (mode of state and actions) and `relative_actions` (its mask, or None), as its
    statistics say (`hf_vla.models.common.normalization`): what a robot runner outside hf_vla must apply."""
    from hf_vla.models.common.normalization import mode_of, relative_mask

    stats = stats or {}
    return {"normalization": {key: mode_of(stats[key]) for key in ("state", "actions") if key in stats},
            "relative_actions": relative_mask(stats.get("actions") or {})}


def from_lerobot(lerobot_config: dict, head: str, image_size: int, chunk_size: int, source: str,
                 norm_stats: dict | None = None) -> DeploymentConfig:
    """The contract of a lerobot pi0/pi0.5 checkpoint, from its `config.json`: `n_action_steps`, the image features
    (slot order, recorded size), the state/action features and the normalisation mode."""
    features = lerobot_config.get("input_features") or {}
    # lerobot's `empty_cameras` adds `observation.images.empty_camera_<i>` features that no robot sends: empty slots
    cameras = [{"key": None if ".empty_camera_" in key else key, "height": (spec.get("shape") or [None] * 3)[-2],
                "width": (spec.get("shape") or [None] * 3)[-1]}
               for key, spec in features.items() if (spec or {}).get("type") == "VISUAL"]
    named = sum(1 for camera in cameras if camera["key"] is None)
    cameras += [{"key": None, "height": None, "width": None}] * max(0, int(lerobot_config.get("empty_cameras") or 0)
                                                                    - named)
    state_key = next((key for key, spec in features.items() if (spec or {}).get("type") == "STATE"), "observation.state")
    outputs = lerobot_config.get("output_features") or {}
    action_key = next((key for key, spec in outputs.items() if (spec or {}).get("type") == "ACTION"), "action")
    state_dim = ((features.get(state_key) or {}).get("shape") or [None])[-1]
    action_dim = ((outputs.get(action_key) or {}).get("shape") or [None])[-1]
    robot_type, _, control_mode = head.partition("::")
    steps = lerobot_config.get("n_action_steps")  # checked against the chunk by the conversion (lerobot_pipeline)
    steps = max(1, int(chunk_size) // 2) if steps is None else int(steps)
    return DeploymentConfig(
        policy=str(lerobot_config.get("type", "pi05")), chunk_size=int(chunk_size),
        n_action_steps=steps, image_size=int(image_size),
        heads={head: {"robot_type": robot_type or None, "control_mode": control_mode or None, "fps": None,
                      "cameras": cameras, "state": {"key": state_key, "dim": state_dim},
                      "action": {"key": action_key, "dim": action_dim}, "instruction": "task",
                      "datasets": [], "benchmark": None,
                      "normalization_mapping": lerobot_config.get("normalization_mapping"),
                      **pipeline_fields(norm_stats)}},
        default_head=head, source={"made_by": "hf_vla.convert", "from": source, "lerobot_type": lerobot_config.get("type")},
        memory=_memory(_lerobot_memory(lerobot_config), None))


def _lerobot_memory(lerobot_config: dict) -> dict | None:
    """MEM's settings of a lerobot checkpoint (its defaults where a field is absent)."""
    visual, proprio = bool(lerobot_config.get("use_visual_memory")), bool(lerobot_config.get("use_proprioceptive_memory"))
    if not (visual or proprio):
        return None
    return {"frames": int(lerobot_config.get("memory_frames", 6)), "stride": int(lerobot_config.get("memory_stride", 30)),
            "visual": visual, "proprio": proprio}


# ---- what a run of evaluate / serve uses -----------------------------------------------------------------------------
@dataclass
class Setting:
    value: object
    source: str  # "checkpoint", "flag", "flag (override)" or "default"


class ContractError(ConfigError):
    """A flag contradicts the checkpoint's contract (the message names both values and the override)."""


def choose(name: str, flag, contract_value, default, overrides: set[str], flag_name: str | None = None,
           equal=None) -> Setting:
    """One setting: the flag when given (refused when it contradicts the contract, unless `name` is in `overrides`),
    else the contract's value, else the default."""
    flag_name = flag_name or f"--{name}"
    same = equal or (lambda a, b: a == b)
    if flag is not None:
        if contract_value is not None and not same(flag, contract_value):
            if name not in overrides:
                raise ContractError(f"{flag_name} {_show(flag)} contradicts the checkpoint, which was trained with "
                                    f"{name}={_show(contract_value)} ({FILE_NAME}); drop the flag, or pass "
                                    f"--override {name} to run with {_show(flag)} anyway")
            return Setting(flag, "flag (override)")
        return Setting(flag, "flag")
    if contract_value is not None:
        return Setting(contract_value, "checkpoint")
    return Setting(default, "default")


def _show(value) -> str:
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value)
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return str(int(value))
    return str(value)


def refuse_repeated_cameras(flag: str, cameras: list[str] | None) -> None:
    """Each camera fills one slot: a key given twice is refused by name."""
    twice = sorted({key for key in cameras or () if cameras.count(key) > 1})
    if twice:
        raise ConfigError(f"{flag}: {twice} given more than once; each camera fills one slot")


def square_size(cameras: list[dict]) -> int | None:
    """The common side of the recorded camera images when they are all square and of one size, else None."""
    sizes = {(c.get("height"), c.get("width")) for c in cameras if c.get("key") is not None}
    if len(sizes) == 1:
        height, width = next(iter(sizes))
        if height is not None and height == width:
            return int(height)
    return None


def head_spec(contract, head: str | None) -> dict | None:
    """The contract's settings of `head` (default: its default or only head); None without a contract, or when the
    checkpoint has several heads and none is named (the robot must say which; the processor refuses that later)."""
    if contract is None:
        return None
    try:
        return contract.head(head)
    except KeyError:
        if head is None:
            return None
        raise ConfigError(f"--head {head!r}: the checkpoint has the heads {sorted(contract.heads)}") from None


def served_cameras(contract, head: str | None, cameras: list[str] | None, num_camera_slots: int | None,
                   overrides=()) -> tuple[list[str] | None, int | None]:
    """The camera keys a server reads and its camera slots: the contract's keys unless `cameras` (`--cameras`, or an
    obs map) names the client's, which must be as many, once each (a robot's keys may differ from the data's; they
    fill the slots in order); `num_camera_slots` must agree with the contract. A contradiction is refused unless
    `overrides` names it."""
    spec = head_spec(contract, head) if contract is not None else None
    refuse_repeated_cameras("--cameras", cameras)
    trained = [c["key"] for c in spec["cameras"]] if spec else None
    if trained and cameras and len(cameras) != len(trained) and "cameras" not in overrides:
        raise ContractError(f"--cameras {' '.join(cameras)}: {len(cameras)} camera(s), but the checkpoint was trained "
                            f"with {len(trained)} ({' '.join(str(k) for k in trained)}); pass --override cameras to "
                            "serve it anyway")
    if trained and not cameras:
        cameras = [key for key in trained if key is not None]  # the keys the data had, in slot order
    elif trained and cameras and cameras != trained:
        logging.getLogger("hf_vla.serve").info("cameras %s fill the checkpoint's slots %s", cameras, trained)
    slots = choose("num_camera_slots", num_camera_slots, len(trained) if trained else None, None, set(overrides)).value
    return cameras, slots


__all__ = ["head_spec", "served_cameras", "ContractError", "DeploymentConfig", "FILE_NAME", "Setting", "VERSION", "benchmark_of", "choose",
           "from_lerobot", "from_training", "read", "refuse_repeated_cameras", "square_size"]
