"""`python -m hf_vla.recap annotate`: each frame's return, value, advantage and RECAP indicator, written into a new
LeRobot v3.0 dataset beside the source (the source is never written).

For every dataset: each episode's outcome gives its frames' normalised returns (`hf_vla.models.value.returns`); the value
model predicts each frame's value from its cameras and task (batched, one decoder per episode, progress in the log);
the advantage is the N-step estimate (or Monte-Carlo); per (dataset, task) a threshold makes `positive_fraction` of
the frames positive; frames a person took over (`intervention` 1, as DAgger rounds and `serve --record` write it) are
positive whatever their advantage. The output holds the source's files (hard links where the file system allows,
copies otherwise: the parquet files are rewritten, so the source's stay as they were) with four more columns per frame:
`recap.return`, `recap.value`, `recap.advantage` (float32) and `advantage_positive` (bool), and
`meta/hf_vla_recap.json` with the settings, each threshold and the positive fraction it gave.

Stage then rename (`hf_vla.storage`): a killed run leaves no output, and the values computed so far in
`.<output>.annotating-values/` beside it, which a rerun reuses where the value model, the dataset entry and the data
files are the same (`_cache_key`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hf_vla.errors import ConfigError, DataError
from hf_vla.models.value.returns import advantages, positive_threshold

logger = logging.getLogger("hf_vla")

COLUMNS = {"recap.return": "float32", "recap.value": "float32", "recap.advantage": "float32",
           "advantage_positive": "bool"}
SUMMARY = "hf_vla_recap.json"  # in the output's meta/
KIND = "recap_annotation"  # the output marker's kind (hf_vla.storage)


@dataclass
class AnnotateArguments:
    """What `python -m hf_vla.recap annotate` reads and writes."""

    value: str | None = field(default=None, metadata={"required": True, "help": "the value model (a pi05_value "
                              "checkpoint: python -m hf_vla.train with policy pi05_value)"})
    datasets: list[dict] = field(default_factory=list, metadata={"help": "the LeRobot datasets to annotate, as "
                                 "train's `datasets` entries (root or repo_id, cameras, keys; success for "
                                 "demonstrations); the fields: hf_vla/data/dataset_config.py"})
    output: str | None = field(default=None, metadata={"required": True, "help": "the annotated dataset (one "
                               "dataset), or a directory of one per dataset named by its name (several)"})
    lookahead: int | None = field(default=50, metadata={"help": "N of the N-step advantage (pi*0.6's post-training "
                                  "50); 0 for Monte-Carlo (the return minus the value)", "min": 0})
    positive_fraction: float = field(default=0.3, metadata={"help": "share of each (dataset, task)'s frames marked "
                                     "positive (pi*0.6: 0.3 in pre-training, 0.4 in post-training)"})
    failure_cost: float = field(default=1000.0, metadata={"help": "the reward of a failed episode's last step, in "
                                "steps"})
    allow_unlabelled: bool = field(default=False, metadata={"help": "annotate episodes without an outcome as "
                                   "negative with no return (counted in the log) instead of refusing them"})
    batch_size: int = field(default=64, metadata={"help": "frames per value-model forward", "min": 1})
    device: str = field(default="cpu", metadata={"help": "torch device of the value model"})
    overwrite: bool = field(default=False, metadata={"help": "replace an existing --output this command wrote"})

    def __post_init__(self):
        if not self.datasets:
            raise ConfigError("--datasets: at least one LeRobot dataset to annotate")
        if not 0.0 < self.positive_fraction < 1.0:
            raise ConfigError(f"--positive_fraction {self.positive_fraction}: a share in (0, 1)")
        if not (np.isfinite(self.failure_cost) and self.failure_cost > 0):
            raise ConfigError(f"--failure_cost {self.failure_cost}: a finite number of steps > 0")
        from hf_vla.training.config_checks import check_dataset_specs

        self.datasets[:] = check_dataset_specs(self.datasets)


def annotate(args: AnnotateArguments) -> list[Path]:
    """Annotate every dataset of `args`; returns the written dataset directories."""
    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.storage import check_output, replace_dir, staging_dir, weights_fingerprint, write_marker

    configs = [DatasetConfig(**spec) for spec in args.datasets]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--datasets: names {names} repeat; give each a distinct name (its output folder)")
    output = Path(args.output)
    roots = {f"dataset {c.name!r}": c.root for c in configs if c.root}
    check_output("--output", output, args.overwrite, inputs={"--value": args.value if Path(args.value).exists()
                                                              else None, **roots}, kind=KIND,
                 what="annotated dataset")
    model, processor = _load_value_model(args.value, args.device)
    fingerprint = weights_fingerprint(args.value) or str(args.value)
    cache = output.parent / f".{output.name}.annotating-values"
    staging = staging_dir(output, "annotating")
    targets = [staging] if len(configs) == 1 else [staging / c.name for c in configs]
    summaries = []
    for config, target in zip(configs, targets):
        summaries.append(_annotate_one(config, target, model, processor, args, cache / config.name, fingerprint))
    write_marker(staging, KIND, value=str(args.value), datasets=names)
    if len(configs) > 1:
        (staging / SUMMARY).write_text(json.dumps(summaries, indent=1))
    replace_dir(staging, output)
    shutil.rmtree(cache, ignore_errors=True)
    written = [output] if len(configs) == 1 else [output / c.name for c in configs]
    for summary, path in zip(summaries, written):
        logger.info("annotated %s: %d frames of %d episodes, %.1f%% positive -> %s", summary["dataset"],
                    summary["frames"], summary["episodes"], 100 * summary["positive_fraction"], path)
    return written


def _load_value_model(checkpoint: str, device: str):
    from transformers import AutoConfig

    import hf_vla.models.auto  # noqa: F401  (registers pi05_value with AutoConfig)

    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError) as error:
        raise ConfigError(f"--value {checkpoint!r}: no loadable config ({str(error).splitlines()[0]})") from None
    from hf_vla.registry import find_policy

    family = find_policy(config.model_type)
    if family is None or not family.value_model:
        raise ConfigError(f"--value {checkpoint!r}: a {config.model_type!r} checkpoint, not a value model (train one "
                          "with python -m hf_vla.train and policy pi05_value)")
    from hf_vla.hub.convert import check_weight_files

    check_weight_files(checkpoint)
    model = family.load("model").from_pretrained(checkpoint).eval().to(device)
    return model, family.load("processor").from_pretrained(checkpoint)


def _head(processor, source) -> str:
    if source.norm_key in processor.norm_stats:
        return source.norm_key
    if len(processor.norm_stats) == 1:
        return next(iter(processor.norm_stats))
    raise ConfigError(f"dataset {source.name!r}: its head {source.norm_key!r} is not one the value model was trained "
                      f"on ({sorted(processor.norm_stats)}); set the dataset's robot_type / control_mode to one of them")


def _annotate_one(config, target: Path, model, processor, args: AnnotateArguments, cache: Path,
                  fingerprint: str) -> dict:
    from hf_vla.data.sources import LeRobotSource

    source = LeRobotSource(config, 0)
    outcomes = source.episode_outcomes(args.allow_unlabelled)
    limit = source.episode_limit()
    values = _values(source, model, processor, args, cache, fingerprint)
    episodes = source.episodes["episode_index"]
    lengths = source.episodes["length"]
    per_frame: dict[int, dict[str, np.ndarray]] = {}
    tasks: dict[int, str] = {}
    empty = 0
    for row, episode in enumerate(episodes.tolist()):
        if int(lengths[row]) == 0:  # listed in meta/episodes with no frame: nothing to annotate
            per_frame[episode] = {key: np.zeros(0, dtype=bool if key in ("intervention", "positive") else np.float64)
                                  for key in ("return", "value", "advantage", "intervention")}
            empty += 1
            continue
        table = source._episode_rows(episode, row, int(lengths[row]), _columns(source))
        task_index = table["task_index"].to_numpy()
        tasks[episode] = source.task(int(task_index[0]), episode)
        outcome = outcomes[row]
        value = values[episode]
        if np.isnan(outcome):
            returns = np.full(len(value), np.nan)
            advantage = np.full(len(value), np.nan)
        else:
            returns = source.frame_returns(episode, args.failure_cost)
            advantage = advantages(returns, value, bool(outcome), limit, args.lookahead or None, args.failure_cost)
        intervention = (table["intervention"].to_numpy().reshape(-1) > 0 if "intervention" in table.column_names
                        else np.zeros(len(value), dtype=bool))
        per_frame[episode] = {"return": returns, "value": value, "advantage": advantage, "intervention": intervention}
    thresholds = {}
    for task in sorted(set(tasks.values())):
        members = [e for e, t in tasks.items() if t == task]
        pooled = np.concatenate([per_frame[e]["advantage"] for e in members])
        pooled = pooled[np.isfinite(pooled)]
        thresholds[task] = positive_threshold(pooled, args.positive_fraction) if len(pooled) else float("inf")
    positives = 0
    if empty:
        logger.warning("dataset %r: %d episode(s) of zero frames in meta/episodes, skipped", source.name, empty)
    for episode, frames in per_frame.items():
        advantage = frames["advantage"]
        threshold = thresholds.get(tasks.get(episode), float("inf"))  # an empty episode has no task
        frames["positive"] = (np.isfinite(advantage) & (advantage > threshold)) | frames["intervention"]
        positives += int(frames["positive"].sum())
    frames_total = int(sum(len(f["value"]) for f in per_frame.values()))
    summary = {"dataset": source.name, "source": str(source.root), "value": str(args.value),
               "lookahead": args.lookahead or None, "positive_fraction_asked": args.positive_fraction,
               "failure_cost": args.failure_cost, "max_episode_steps": limit, "episodes": len(per_frame),
               "frames": frames_total, "positive_fraction": positives / max(frames_total, 1),
               "unlabelled_episodes": int(np.isnan(outcomes).sum()),
               "interventions": int(sum(f["intervention"].sum() for f in per_frame.values())),
               "tasks": {task: {"threshold": thresholds[task],
                                "positive_fraction": float(np.mean(np.concatenate(
                                    [per_frame[e]["positive"] for e, t in tasks.items() if t == task])))}
                         for task in thresholds}}
    _write(source, target, per_frame, summary)
    return summary


def _columns(source) -> list[str]:
    present = set(source.meta.features)
    return ["task_index", "episode_index"] + (["intervention"] if "intervention" in present else [])


def _values(source, model, processor, args: AnnotateArguments, cache: Path, fingerprint: str) -> dict[int, np.ndarray]:
    """Each episode's frame values `[n]` (float64), from the cache of an interrupted run with the same value model or
    from the model in batches of `args.batch_size`."""
    import torch

    from hf_vla.cli import progress_bar
    from hf_vla.data.blocks import Block
    from hf_vla.data.stream import FrameReader

    cache.mkdir(parents=True, exist_ok=True)
    stamp = cache / "value_model.txt"
    fingerprint = _cache_key(source, processor, fingerprint)
    if not stamp.is_file() or stamp.read_text() != fingerprint:  # another model, data, prompt or setting: start over
        shutil.rmtree(cache)
        cache.mkdir(parents=True)
        stamp.write_text(fingerprint)
    head = _head(processor, source)
    num_cameras = len(source.config.cameras)
    reader = FrameReader([source], [0], num_cameras, processor.image_size, processor.chunk_size, decoder_threads=1)
    episodes, lengths = source.episodes["episode_index"].tolist(), source.episodes["length"].tolist()
    done = {int(p.stem.split("_")[1]) for p in cache.glob("episode_*.npy")}
    out: dict[int, np.ndarray] = {}
    bar = progress_bar(int(sum(lengths)), f"value of {source.name}'s frames", "frames",
                       initial=int(sum(n for e, n in zip(episodes, lengths) if e in done)))
    try:
        for episode, length in zip(episodes, lengths):
            path = cache / f"episode_{episode}.npy"
            if length == 0:  # listed with no frame
                out[episode] = np.zeros(0)
                continue
            if episode in done:
                out[episode] = np.load(path)
                continue
            block = Block(0, episode, 0, length)
            values = []
            for start in range(0, length, args.batch_size):
                samples = [reader.sample(0, block, frame) for frame in range(start, min(start + args.batch_size,
                                                                                          length))]
                inputs = processor(images=torch.stack([s["images"] for s in samples]),
                                   text=[s["task"] for s in samples], state=[s["state"] for s in samples],
                                   head=head, camera_mask=torch.stack([s["camera_mask"] for s in samples]),
                                   advantage=None)
                with torch.no_grad():
                    values.append(model.value(**{k: v.to(model.device) for k, v in inputs.items()
                                                 if hasattr(v, "to")}).double().cpu().numpy())
                bar.update(len(samples))
            reader.release(0, block)
            out[episode] = np.concatenate(values)
            np.save(path, out[episode])  # resumable: a killed run keeps the episodes it finished
    finally:
        reader.close()
        bar.close()
    return out


def _cache_key(source, processor, model_fingerprint: str) -> str:
    """What an episode's cached values depend on: the value model's weights, the dataset entry (its task, cameras,
    keys, head), the processor's image size, and the data itself (every file's path, size and modification time under
    data/, videos/ and meta/, and each episode's length): a source re-recorded at the same path, or a corrected task,
    starts the values over."""
    import hashlib
    from dataclasses import asdict

    files = []
    for folder in ("data", "videos", "meta"):
        for path in sorted((source.root / folder).rglob("*")) if (source.root / folder).is_dir() else []:
            if path.is_file():
                stat = path.stat()
                files.append([str(path.relative_to(source.root)), stat.st_size, stat.st_mtime_ns])
    key = {"model": model_fingerprint, "dataset": asdict(source.config), "image_size": processor.image_size,
           "lengths": [int(n) for n in source.episodes["length"].tolist()], "files": files}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _write(source, target: Path, per_frame: dict, summary: dict) -> None:
    """The source's files at `target` (hard links, else copies), its data parquet files rewritten with the four
    columns, info.json's features and stats.json extended, and the summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = source.root
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        destination = target / relative
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        if relative.parts[0] == "data" and path.suffix == ".parquet":
            table = pq.read_table(path)
            episodes, frames = table["episode_index"].to_numpy(), table["frame_index"].to_numpy()
            for name, kind, key in (("recap.return", "float32", "return"), ("recap.value", "float32", "value"),
                                    ("recap.advantage", "float32", "advantage"),
                                    ("advantage_positive", "bool", "positive")):
                column = np.asarray([per_frame[int(e)][key][int(f)] for e, f in zip(episodes, frames)], dtype=kind)
                if name in table.column_names:  # annotating an annotated dataset: the new values replace the old
                    table = table.drop_columns([name])
                table = table.append_column(name, pa.array(column))
            pq.write_table(table.replace_schema_metadata(None), destination)
            continue
        if relative.parts[0] == "meta" and relative.name in ("info.json", "stats.json", SUMMARY):
            continue
        try:
            os.link(path, destination)
        except OSError:
            shutil.copy2(path, destination)
    info = json.loads((root / "meta" / "info.json").read_text())
    for name, kind in COLUMNS.items():
        info["features"][name] = {"dtype": kind, "shape": [1], "names": None}
    (target / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    stats_path = root / "meta" / "stats.json"
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    for name, key in (("recap.return", "return"), ("recap.value", "value"), ("recap.advantage", "advantage"),
                      ("advantage_positive", "positive")):
        values = np.concatenate([f[key] for f in per_frame.values()]).astype(np.float64)
        values = values[np.isfinite(values)]
        if len(values):
            stats[name] = {"min": [float(values.min())], "max": [float(values.max())], "mean": [float(values.mean())],
                           "std": [float(values.std())], "count": [int(len(values))]}
    (target / "meta" / "stats.json").write_text(json.dumps(stats, indent=4))
    (target / "meta" / SUMMARY).write_text(json.dumps(summary, indent=1))
    if not (target / "meta" / "info.json").is_file():
        raise DataError(f"annotate: writing {target} failed")


__all__ = ["AnnotateArguments", "annotate"]
