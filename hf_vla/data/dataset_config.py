"""`DatasetConfig`: how one LeRobot dataset feeds the model (its feature mapping), checked field by field without
touching data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hf_vla.errors import ConfigError

NUMERIC_DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")


@dataclass
class DatasetConfig:
    """How one LeRobot dataset feeds the model (its feature mapping). Everything is configuration, no code.

    repo_id / root: the dataset's Hub id (e.g. `lerobot/droid_1.0.1`) and its local directory (either or both). With a repo_id
        and no root the dataset lives in lerobot's cache (`$HF_LEROBOT_HOME/<repo_id>`): its metadata is fetched
        first, then only the data and video files of the episodes and cameras the run uses (resumable, with a
        progress bar; with `HF_HUB_OFFLINE=1` a dataset already there trains offline).
    revision: the Hub revision (branch, tag or commit) of a repo_id dataset (default: lerobot's codebase version tag).
    name: display name for metrics (`eval_by_dataset/<name>/mse`); defaults to the repo id or directory name.
    weight: mixture weight (relative frequency of its frames in training batches).
    cameras: source camera key for each model camera slot, in slot order; `null` leaves a slot empty
        (`pixel_attention_mask=False`).
    state_key / action_key: the dataset's state and action features (numeric vectors).
    robot_type / control_mode: the normalization head is `robot_type::control_mode` (robot_type defaults to the
        dataset's metadata). Without both, the head is the dataset name.
    fps: expected frame rate; a mismatch with the metadata is an error (chunks are in dataset frames).
    task: override the task string of every frame.
    keep_ranges: `{"<episode key>": [[start, end], ...]}` (a dict, a JSON file path, `hf://[datasets/]ns/name/path`
        or an http(s) URL, fetched once and cached): only these frame ranges
        (`start` inclusive, `end` exclusive) are used, each as its own block; episodes absent from it are dropped.
        Reversed, empty and out-of-episode ranges and malformed entries are reported (a warning naming counts and
        examples while some ranges survive; an error when none does); ranges reaching past an episode's end are
        clipped to it.
    keep_ranges_key: how an episode's key is derived: a format string over the episode's metadata columns plus
        `episode_index`, `repo_id` and `name` (default `"{episode_index}"`).
    shuffle_tasks_seed: a language-blind control: every episode gets the task of another episode (a seeded
        permutation), so instructions carry no information about the episode.
    quantile_stats: `"exact"` (default) computes q01/q99 from the state/action columns (no video is read; at most
        2M frames, subsampled with a fixed seed); `"metadata"` uses `meta/stats.json`, whose quantiles lerobot builds
        as a frame-weighted mean of per-episode quantiles (too narrow when episodes cover different ranges). Either
        way the start-up scan checks every state/action value for NaN/inf.
    target_text_key: a per-frame string column (e.g. a subtask annotation) the backbone learns to predict after the
        chunk's FAST tokens under `token_loss` (docs/cotraining.md); a training target only (never a model input).
        Checked at start-up in every used row: present, a string.
    subtask_key: each frame's subtask (pi0.5's high-level inference, docs/subtasks.md): a per-frame string column
        (`hf_vla.record` writes `subtask` for Meta-World), or lerobot's `language_persistent` column (as
        `lerobot-annotate` writes it: the `subtask` row active at the frame's timestamp). A frame without one trains
        as the plain prompt. Needs a model with `subtask_layout`.
    action_chunk_key: a per-frame column holding the frame's whole target chunk, `[H x action_dim]` flattened (H at
        least the model's chunk size; its first chunk-size steps are used, none padded), instead of the chunk being
        read from the next frames' actions: a DAgger recording's `action_plan`, the expert's own chunk from each
        visited state (hf_vla.envs.dagger). Same units as the actions (normalised with their statistics).
    normalization: how the head's state and actions are normalised, `{"state": MODE, "actions": MODE}` with lerobot's
        modes (`QUANTILES`, pi0.5's default; `MEAN_STD`, lerobot's pi0.5 LIBERO recipe; `MIN_MAX`, `QUANTILE10`,
        `IDENTITY`); lerobot's `normalization_mapping` keys (`STATE`, `ACTION`, `VISUAL`: IDENTITY only) work too.
        Saved with the processor and in the deployment contract; datasets of one head must agree.
    relative_actions: actions as offsets from the frame's state (openpi's `DeltaActions`, lerobot's
        `use_relative_actions`): `true` (every action dim but those `relative_exclude_joints` names, lerobot's rule),
        or an explicit mask as openpi's `make_bool_mask` (`[true] * 7 + [false]`: 7 joints delta, gripper absolute;
        dims past the mask are absolute). Every step of a chunk is relative to the frame's own state; the action
        statistics are computed at start-up over the relative chunks trained on (`chunk_size` steps), never taken
        from `meta/stats.json`. Inference adds the observation's state back (recorded with the checkpoint).
    relative_exclude_joints: with `relative_actions: true`, action names kept absolute (default `["gripper"]`; a dim
        is excluded when a name equals its action name or is a substring of it, case-insensitively). A name given
        here that matches no action name is refused.
    advantage: RECAP's advantage indicator in the prompt (pi*0.6; docs/recap.md): `{"key": COLUMN, "dropout": 0.3}`
        reads each frame's indicator from a bool column (`advantage_positive`, written by `python -m hf_vla.recap
        annotate`); `{"value": true}` gives every frame of the dataset one indicator (demonstrations taken as
        positive). "Advantage: positive" or "Advantage: negative" then follows the task in the prompt, left out with
        probability `dropout` (default 0.3, the paper's), seeded per sample, so the policy also acts unconditioned
        (what classifier-free guidance needs). The checkpoint then asks for "positive" at inference.
    success: every episode's outcome, for a value model's returns (RECAP, docs/recap.md): `true` for demonstrations
        (each succeeded). Without it the outcome is read from the data: lerobot's per-frame `next.success` (DAgger and
        policy recordings, `serve --record` with success), else an `hf_vla.record` expert recording (successful by
        construction); an episode with no outcome is refused, naming it.
    max_episode_steps: the task's episode limit the returns are normalised by (a success k steps away has return
        -k / limit); default the recording's (`hf_vla.record`), else the dataset's longest episode.
    hold_out_fold: `[k, K]`: leave out the episodes whose index is k modulo K (cross-fitting, RECAP: a value model
        trained so, annotates that fold with `python -m hf_vla.recap annotate --value` given one model per fold,
        each episode judged by the model that never saw it; docs/recap.md).
    outlier_widths: the start-up scan refuses a state/action value farther than this many q01..q99 widths outside
        that range (per dim; the width is at least 1e-3 of the dim's magnitude, so a constant dim tolerates its own
        scale): bit rot in a parquet page body decodes to values like 1e38 that pass every format check. `null`
        turns the check off for data whose rare extremes are real.
    """

    repo_id: str | None = None
    root: str | None = None
    revision: str | None = None
    name: str | None = None
    weight: float = 1.0
    cameras: list[str | None] = field(default_factory=list)
    state_key: str = "observation.state"
    action_key: str = "action"
    robot_type: str | None = None
    control_mode: str | None = None
    fps: float | None = None
    task: str | None = None
    keep_ranges: str | dict | None = None
    keep_ranges_key: str = "{episode_index}"
    shuffle_tasks_seed: int | None = None
    quantile_stats: str = "exact"
    outlier_widths: float | None = 1e4
    target_text_key: str | None = None
    subtask_key: str | None = None
    action_chunk_key: str | None = None
    normalization: dict | None = None
    relative_actions: bool | list[bool] | None = None
    relative_exclude_joints: list[str] | None = None
    advantage: dict | None = None
    success: bool | None = None
    max_episode_steps: int | None = None
    hold_out_fold: list[int] | None = None

    def __post_init__(self):
        if self.quantile_stats not in ("exact", "metadata"):
            raise ConfigError(f"dataset {self.name or self.repo_id!r}: quantile_stats must be 'exact' or 'metadata', "
                              f"got {self.quantile_stats!r}")
        if self.repo_id is None and self.root is None:
            raise ConfigError("DatasetConfig needs repo_id or root")
        if self.outlier_widths is not None and not (isinstance(self.outlier_widths, int | float)
                                                    and self.outlier_widths > 0):
            raise ConfigError(f"dataset {self.name or self.repo_id!r}: outlier_widths must be a positive number or "
                              f"null, got {self.outlier_widths!r}")
        if self.name is None:
            self.name = self.repo_id or Path(self.root).name
        if not self.weight > 0:
            raise ConfigError(f"dataset {self.name!r}: weight must be > 0, got {self.weight}")
        if not isinstance(self.cameras, list) or not self.cameras or not any(self.cameras):
            raise ConfigError(f"dataset {self.name!r}: `cameras` must map at least one model camera slot to a camera key")
        from hf_vla.models.common.normalization import parse_mapping

        try:
            self.normalization = parse_mapping(self.normalization, f"dataset {self.name!r}: normalization") or None
        except ValueError as error:
            raise ConfigError(str(error)) from None
        relative = self.relative_actions
        if isinstance(relative, list):
            if not relative or not all(isinstance(m, bool) or m in (0, 1) for m in relative):
                raise ConfigError(f"dataset {self.name!r}: relative_actions as a mask is a non-empty list of true/false "
                                  f"(openpi's make_bool_mask), got {relative!r}")
            self.relative_actions = [bool(m) for m in relative]
        elif relative is not None and not isinstance(relative, bool):
            raise ConfigError(f"dataset {self.name!r}: relative_actions must be true/false or a list of true/false "
                              f"(a mask), got {relative!r}")
        if self.success is not None and not isinstance(self.success, bool):
            raise ConfigError(f"dataset {self.name!r}: success must be true or false (every episode's outcome), got "
                              f"{self.success!r}")
        if self.max_episode_steps is not None and (isinstance(self.max_episode_steps, bool) or not isinstance(
                self.max_episode_steps, int) or self.max_episode_steps < 1):
            raise ConfigError(f"dataset {self.name!r}: max_episode_steps must be a positive integer, got "
                              f"{self.max_episode_steps!r}")
        if self.hold_out_fold is not None:
            fold = self.hold_out_fold
            if (not isinstance(fold, list | tuple) or len(fold) != 2 or not all(isinstance(v, int) and not isinstance(
                    v, bool) for v in fold) or not (fold[1] >= 2 and 0 <= fold[0] < fold[1])):
                raise ConfigError(f"dataset {self.name!r}: hold_out_fold must be [k, K] with K >= 2 and 0 <= k < K "
                                  f"(leave out the episodes whose index is k modulo K), got {fold!r}")
            self.hold_out_fold = [int(fold[0]), int(fold[1])]
        if self.advantage is not None:
            self.advantage = _advantage_settings(self.advantage, f"dataset {self.name!r}: advantage")
        if self.relative_exclude_joints is not None:
            if self.relative_actions is not True:
                raise ConfigError(f"dataset {self.name!r}: relative_exclude_joints names action dims kept absolute "
                                  "with relative_actions: true (an explicit mask says it itself)")
            if not isinstance(self.relative_exclude_joints, list) or not all(
                    isinstance(n, str) for n in self.relative_exclude_joints):
                raise ConfigError(f"dataset {self.name!r}: relative_exclude_joints must be a list of action names, got "
                                  f"{self.relative_exclude_joints!r}")


def _advantage_settings(value, where: str) -> dict:
    """`{"key": COLUMN}` or `{"value": BOOL}`, with `dropout` in [0, 1) (default 0.3), or one line naming the key."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected {{\"key\": COLUMN, \"dropout\": 0.3}} or {{\"value\": true}}, got "
                          f"{value!r}")
    unknown = sorted(set(value) - {"key", "value", "dropout"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; it takes key or value, and dropout")
    if ("key" in value) == ("value" in value):
        raise ConfigError(f"{where}: give one of key (a bool column per frame) or value (true/false for every frame)")
    if "key" in value and not (isinstance(value["key"], str) and value["key"]):
        raise ConfigError(f"{where}.key: a column name, got {value['key']!r}")
    if "value" in value and not isinstance(value["value"], bool):
        raise ConfigError(f"{where}.value: true or false, got {value['value']!r}")
    dropout = value.get("dropout", 0.3)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ConfigError(f"{where}.dropout: a probability in [0, 1), got {dropout!r}")
    return {**value, "dropout": float(dropout)}


def field_docs() -> dict[str, str]:
    """Each field's text in `DatasetConfig`'s docstring (an entry `name: text`, or `a / b: text` for two fields)."""
    import dataclasses
    import inspect

    names = {f.name for f in dataclasses.fields(DatasetConfig)}
    docs, current = {}, []
    for line in inspect.cleandoc(DatasetConfig.__doc__).splitlines()[1:]:
        head = line.split(":", 1)[0]
        keys = [k.strip() for k in head.split("/")] if not line.startswith(" ") and ":" in line else []
        if keys and all(k in names for k in keys):
            current = keys
            for key in keys:
                docs[key] = line.split(":", 1)[1].strip()
        elif current and line.startswith(" "):
            for key in current:
                docs[key] += " " + line.strip()
        elif line.strip():  # each entry's sentence may hold colons; an unindented line that names no field ends it
            current = []
    return docs


def fields_markdown() -> str:
    """docs/dataset_fields.md: every field of a `datasets` entry with its type, default and docstring text (a test
    keeps the file equal to this)."""
    import dataclasses
    import json

    docs = field_docs()
    lines = ["# Dataset fields", "",
             "Every field of an entry of a config's `datasets` list (`hf_vla.data.DatasetConfig`), generated from its",
             "docstring (`python -c \"from hf_vla.data.dataset_config import fields_markdown; print(fields_markdown())\"",
             "> docs/dataset_fields.md`). Only `root` or `repo_id`, and `cameras`, are needed; the rest has defaults.",
             "", "| field | type | default | what it is |", "|---|---|---|---|"]
    for item in dataclasses.fields(DatasetConfig):
        if item.default is not dataclasses.MISSING:
            default = item.default
        else:
            default = item.default_factory()
        kind = str(item.type).replace("|", "or")
        text = docs.get(item.name, "").replace("|", "\\|")
        lines.append(f"| `{item.name}` | {kind} | `{json.dumps(default)}` | {text} |")
    return "\n".join(lines) + "\n"


__all__ = ["NUMERIC_DTYPES", "DatasetConfig", "field_docs", "fields_markdown"]
