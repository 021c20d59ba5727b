"""`python -m hf_vla.recap annotate`: each frame's return, value, advantage and RECAP indicator, written into a new
LeRobot v3.0 dataset beside the source (the source is never written).

For every dataset: each episode's outcome gives its frames' normalised returns (`hf_vla.models.value.returns`, on the
value model's scale: its tasks' episode limits and failure cost); the value model predicts each frame's value from its
cameras and task (batched, one decoder per episode, progress in the log), or, cross-fitted, the one of several value
models that held the episode's fold out; the advantage is the N-step estimate (or Monte-Carlo); per task, over every
annotated dataset, a threshold makes `positive_fraction` of the frames positive; frames a person took over (`intervention` 1, as DAgger rounds and `serve --record` write it) are
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

    value: list[str] = field(default_factory=list, metadata={"required": True, "help": "the value model (a "
                             "pi05_value checkpoint: python -m hf_vla.train with policy pi05_value), or one per fold of "
                             "a cross-fitting (each trained with the dataset field hold_out_fold [k, K]): every "
                             "episode is then judged by the model that did not train on it"})
    datasets: list[dict] = field(default_factory=list, metadata={"help": "the LeRobot datasets to annotate, as "
                                 "train's `datasets` entries (root or repo_id, cameras, keys; success for "
                                 "demonstrations); the fields: hf_vla/data/dataset_config.py"})
    output: str | None = field(default=None, metadata={"required": True, "help": "the annotated dataset (one "
                               "dataset), or a directory of one per dataset named by its name (several)"})
    lookahead: int | None = field(default=50, metadata={"help": "N of the N-step advantage (pi*0.6's post-training "
                                  "50); 0 for Monte-Carlo (the return minus the value)", "min": 0})
    positive_fraction: float = field(default=0.3, metadata={"help": "share of each (dataset, task)'s frames marked "
                                     "positive (pi*0.6: 0.3 in pre-training, 0.4 in post-training)"})
    failure_cost: float | None = field(default=None, metadata={"help": "the reward of a failed episode's last step, "
                                       "in steps (default: the value model's, which defaults to each task's episode "
                                       "limit)"})
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
        if self.failure_cost is not None and not (np.isfinite(self.failure_cost) and self.failure_cost > 0):
            raise ConfigError(f"--failure_cost {self.failure_cost}: a finite number of steps > 0")
        if isinstance(self.value, str):
            self.value = [self.value]
        if not self.value:
            raise ConfigError("--value: the value model (or one per fold of a cross-fitting)")
        from hf_vla.parser import check_dataset_specs

        self.datasets[:] = check_dataset_specs(self.datasets)


def annotate(args: AnnotateArguments) -> list[Path]:
    """Annotate every dataset of `args`; returns the written dataset directories."""
    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource, resolve_episode_limits
    from hf_vla.storage import check_output, replace_dir, staging_dir, weights_fingerprint, write_marker

    configs = [DatasetConfig(**spec) for spec in args.datasets]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--datasets: names {names} repeat; give each a distinct name (its output folder)")
    output = Path(args.output)
    roots = {f"dataset {c.name!r}": c.root for c in configs if c.root}
    check_output("--output", output, args.overwrite, inputs={**{f"--value {v}": v for v in args.value
                                                                 if Path(v).exists()}, **roots}, kind=KIND,
                 what="annotated dataset")
    judges = [_load_value_model(checkpoint, args.device) for checkpoint in args.value]
    sources = [LeRobotSource(config, 0) for config in configs]  # each read alone (source index 0 of its reader)
    models = _judges_of(judges, args.value, sources)
    first = judges[0][0].config
    limits = resolve_episode_limits(sources, given=first.episode_limits)
    failure_cost = _failure_cost(args, [m.config for m, _ in judges])
    fingerprints = [weights_fingerprint(v) or str(v) for v in args.value]
    cache = output.parent / f".{output.name}.annotating-values"
    staging = staging_dir(output, "annotating")
    targets = [staging] if len(configs) == 1 else [staging / c.name for c in configs]
    scored = [_score(source, models[source.name], judges, args, cache / source.name, fingerprints, failure_cost)
              for source in sources]
    thresholds = _thresholds(scored, args.positive_fraction)
    summaries = []
    for (source, per_frame, tasks), target in zip(scored, targets):
        summaries.append(_label(source, per_frame, tasks, thresholds, args, target, limits, failure_cost))
    write_marker(staging, KIND, value=[str(v) for v in args.value], datasets=names)
    if len(configs) > 1:
        (staging / SUMMARY).write_text(json.dumps(summaries, indent=1))
    replace_dir(staging, output)
    shutil.rmtree(cache, ignore_errors=True)
    written = [output] if len(configs) == 1 else [output / c.name for c in configs]
    for summary, path in zip(summaries, written):
        logger.info("annotated %s: %d frames of %d episodes, %.1f%% positive -> %s", summary["dataset"],
                    summary["frames"], summary["episodes"], 100 * summary["positive_fraction"], path)
    return written


def _judges_of(judges: list, checkpoints: list[str], sources: list) -> dict[str, list[int]]:
    """Which value model judges each dataset's episodes: one model judges all; with one per fold (cross-fitting),
    episode e of a dataset is judged by the model that held out fold e mod K of it (`held_out_fold`), refused in one
    line where the models are not one complete set of folds, or did not hold the dataset out."""
    if len(judges) == 1:
        return {source.name: [0] for source in sources}
    folds = [model.config.held_out_fold for model, _ in judges]
    missing = [c for c, f in zip(checkpoints, folds) if not f]
    if missing:
        raise ConfigError(f"--value {missing[0]}: not trained for cross-fitting (no held_out_fold: train it with the "
                          "dataset field hold_out_fold [k, K]); give one model, or one per fold")
    count = folds[0]["folds"]
    order = sorted(range(len(folds)), key=lambda i: folds[i]["fold"])
    if len(folds) != count or [folds[i]["fold"] for i in order] != list(range(count)) or any(
            f["folds"] != count for f in folds):
        raise ConfigError(f"--value: {len(folds)} models holding out folds {[(f['fold'], f['folds']) for f in folds]}; "
                          f"cross-fitting needs one model per fold 0..K-1 of one K")
    for source in sources:
        root = str(source.root.resolve())
        for checkpoint, fold in zip(checkpoints, folds):
            if root not in fold["datasets"]:
                raise ConfigError(f"--value {checkpoint}: it did not hold out dataset {source.name!r} ({root}): it "
                                  "trained on all of its episodes, so its values of them are not out-of-sample")
    return {source.name: order for source in sources}


def _failure_cost(args: AnnotateArguments, configs: list) -> float | None:
    """The failure cost of the returns: the value models' (they must agree), or `--failure_cost` where it is theirs."""
    if any(getattr(c, "episode_limits", None) is None for c in configs):
        raise ConfigError("--value: a value model trained before hf_vla recorded its returns' scale (episode limits, "
                          "failure cost); train it again with python -m hf_vla.train (policy pi05_value)")
    costs = {getattr(c, "failure_cost", None) for c in configs}
    if len(costs) > 1:
        raise ConfigError(f"--value: the models were trained with different failure costs {sorted(map(str, costs))}")
    theirs = costs.pop()
    if args.failure_cost is not None and args.failure_cost != theirs:
        used = "each task's episode limit" if theirs is None else f"{theirs:g}"
        raise ConfigError(f"--failure_cost {args.failure_cost:g}: the value model's returns used {used}; its values "
                          "and these returns would be on two scales (leave the flag out)")
    return theirs


def _load_value_model(checkpoint: str, device: str):
    from hf_vla.hub.resolve import load_scorer

    return load_scorer(checkpoint, device, "--value", "value_model", "a value model (train one with python -m "
                       "hf_vla.train and policy pi05_value)")


def _head(processor, source) -> str:
    if source.norm_key in processor.norm_stats:
        return source.norm_key
    if len(processor.norm_stats) == 1:
        return next(iter(processor.norm_stats))
    raise ConfigError(f"dataset {source.name!r}: its head {source.norm_key!r} is not one the value model was trained "
                      f"on ({sorted(processor.norm_stats)}); set the dataset's robot_type / control_mode to one of them")


def _score(source, order: list[int], judges: list, args: AnnotateArguments, cache: Path, fingerprints: list[str],
           failure_cost: float | None) -> tuple:
    """One dataset's frames: return, value (each episode's from its judge: `order[e mod K]`, or the one model) and
    advantage per episode, and each episode's task. -> (source, per_frame, tasks)"""
    outcomes = source.episode_outcomes(args.allow_unlabelled)
    episodes, lengths = source.episodes["episode_index"].tolist(), source.episodes["length"].tolist()
    values: dict[int, np.ndarray] = {}
    for position, judge in enumerate(order):
        model, processor = judges[judge]
        mine = [e for e in episodes if len(order) == 1 or e % len(order) == position]
        values.update(_values(source, model, processor, args, cache / f"model_{judge}", fingerprints[judge], mine))
    per_frame: dict[int, dict[str, np.ndarray]] = {}
    tasks: dict[int, str] = {}
    empty = 0
    for row, episode in enumerate(episodes):
        if int(lengths[row]) == 0:  # listed in meta/episodes with no frame: nothing to annotate
            per_frame[episode] = {key: np.zeros(0, dtype=bool if key == "intervention" else np.float64)
                                  for key in ("return", "value", "advantage", "intervention")}
            empty += 1
            continue
        table = source._episode_rows(episode, row, int(lengths[row]), _columns(source))
        tasks[episode] = source.episode_task(row)
        outcome, value = outcomes[row], values[episode]
        limit = source.episode_limit(episode)
        if np.isnan(outcome):
            returns = advantage = np.full(len(value), np.nan)
        else:
            returns = source.frame_returns(episode, failure_cost)
            advantage = advantages(returns, value, bool(outcome), limit, args.lookahead or None, failure_cost)
        intervention = (table["intervention"].to_numpy().reshape(-1) > 0 if "intervention" in table.column_names
                        else np.zeros(len(value), dtype=bool))
        per_frame[episode] = {"return": returns, "value": value, "advantage": advantage, "intervention": intervention}
    if empty:
        logger.warning("dataset %r: %d episode(s) of zero frames in meta/episodes, skipped", source.name, empty)
    return source, per_frame, tasks


def _thresholds(scored: list, positive_fraction: float) -> dict[str, float]:
    """Per task, over every annotated dataset's frames of it: the advantage above which `positive_fraction` of them
    lie (pi*0.6 sets the quota per task)."""
    pooled: dict[str, list] = {}
    for _, per_frame, tasks in scored:
        for episode, task in tasks.items():
            pooled.setdefault(task, []).append(per_frame[episode]["advantage"])
    thresholds = {}
    for task, parts in sorted(pooled.items()):
        values = np.concatenate(parts)
        values = values[np.isfinite(values)]
        thresholds[task] = positive_threshold(values, positive_fraction) if len(values) else float("inf")
    return thresholds


def _label(source, per_frame: dict, tasks: dict, thresholds: dict, args: AnnotateArguments, target: Path,
           limits: dict, failure_cost: float | None) -> dict:
    """Each frame's indicator (above its task's threshold, or a person's intervention), the dataset written with
    them, and its summary."""
    positives = 0
    for episode, frames in per_frame.items():
        advantage = frames["advantage"]
        threshold = thresholds.get(tasks.get(episode), float("inf"))  # an empty episode has no task
        frames["positive"] = (np.isfinite(advantage) & (advantage > threshold)) | frames["intervention"]
        positives += int(frames["positive"].sum())
    outcomes = source.episode_outcomes(allow_unlabelled=True)
    frames_total = int(sum(len(f["value"]) for f in per_frame.values()))
    by_outcome = {}
    for name, wanted in (("success", 1.0), ("failure", 0.0)):
        rows = [f["positive"] for e, f in per_frame.items() if outcomes[source.row(e)] == wanted]
        by_outcome[name] = float(np.mean(np.concatenate(rows))) if rows and sum(map(len, rows)) else None
    summary = {"dataset": source.name, "source": str(source.root), "value": [str(v) for v in args.value],
               "lookahead": args.lookahead or None, "positive_fraction_asked": args.positive_fraction,
               "failure_cost": failure_cost, "episode_limits": {t: limits[t] for t in sorted(set(tasks.values()))},
               "episodes": len(per_frame), "frames": frames_total,
               "positive_fraction": positives / max(frames_total, 1),
               "positive_fraction_by_outcome": by_outcome,
               "unlabelled_episodes": int(np.isnan(outcomes).sum()),
               "interventions": int(sum(f["intervention"].sum() for f in per_frame.values())),
               "tasks": {task: {"threshold": thresholds[task],
                                "positive_fraction": float(np.mean(np.concatenate(
                                    [per_frame[e]["positive"] for e, t in tasks.items() if t == task]))),
                                **value_quality({e: f for e, f in per_frame.items() if tasks.get(e) == task},
                                                {e: outcomes[source.row(e)] for e in per_frame})}
                         for task in sorted(set(tasks.values()))}}
    for task, figures in summary["tasks"].items():
        if figures["value_return_correlation"] is not None and figures["value_return_correlation"] < 0.3:
            logger.warning("%s, task %r: the values barely track the returns (correlation %.2f over its frames): the "
                           "labels then come from the returns alone; train the value model longer or on more "
                           "episodes of this task before trusting them (docs/recap.md)", source.name, task,
                           figures["value_return_correlation"])
    _write(source, target, per_frame, summary)
    return summary


def value_quality(per_frame: dict, outcomes: dict) -> dict:
    """How well a value model judged these episodes: the correlation of its frame values with their returns, and
    the AUC of an episode's mean value for its success (None where there is nothing to compare)."""
    values = [f["value"] for f in per_frame.values() if len(f["value"])]
    returns = [f["return"] for f in per_frame.values() if len(f["value"])]
    correlation = None
    if values:
        values, returns = np.concatenate(values), np.concatenate(returns)
        finite = np.isfinite(values) & np.isfinite(returns)
        if finite.sum() > 2 and values[finite].std() > 0 and returns[finite].std() > 0:
            correlation = float(np.corrcoef(values[finite], returns[finite])[0, 1])
    means = {e: float(np.mean(f["value"])) for e, f in per_frame.items() if len(f["value"])}
    won = [m for e, m in means.items() if outcomes.get(e) == 1.0]
    lost = [m for e, m in means.items() if outcomes.get(e) == 0.0]
    auc = None
    if won and lost:
        won, lost = np.asarray(won)[:, None], np.asarray(lost)[None, :]
        auc = float((won > lost).mean() + 0.5 * (won == lost).mean())
    return {"value_return_correlation": correlation, "value_auc": auc}


def _columns(source) -> list[str]:
    present = set(source.meta.features)
    return ["task_index", "episode_index"] + (["intervention"] if "intervention" in present else [])


def _values(source, model, processor, args: AnnotateArguments, cache: Path, fingerprint: str,
            wanted: list[int]) -> dict[int, np.ndarray]:
    """The frame values `[n]` (float64) of the episodes `wanted`, from the cache of an interrupted run with the same
    value model, data and settings or from the model in batches of `args.batch_size`."""
    import torch

    from hf_vla.cli import progress_bar
    from hf_vla.data.blocks import Block
    from hf_vla.data.stream import FrameReader

    cache.mkdir(parents=True, exist_ok=True)
    stamp = cache / "value_model.txt"
    fingerprint = _cache_key(source, processor, fingerprint + f" episodes {sorted(wanted)}")
    if not stamp.is_file() or stamp.read_text() != fingerprint:  # another model, data, prompt or setting: start over
        shutil.rmtree(cache)
        cache.mkdir(parents=True)
        stamp.write_text(fingerprint)
    head = _head(processor, source)
    num_cameras = len(source.config.cameras)
    reader = FrameReader([source], [0], num_cameras, processor.image_size, processor.chunk_size, decoder_threads=1)
    wanted = set(wanted)
    pairs = [(e, n) for e, n in zip(source.episodes["episode_index"].tolist(), source.episodes["length"].tolist())
             if e in wanted]
    episodes, lengths = [e for e, _ in pairs], [n for _, n in pairs]
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
