"""Bad input and faults through `python -m hf_vla.train`: every case exits non-zero with one line naming the culprit,
and leaves no partial or NaN output behind. Plus kill -9 during checkpoint saves and seeded builds."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file
from test_data import CAM, make_dataset

from hf_vla.tiny import tiny_dit_config, tiny_vlm_config
from hf_vla.train import cli, main
from hf_vla.training import checkpoints
from hf_vla.training.arguments import parse_config

TESTS = Path(__file__).parent
LENGTHS = [12 + e for e in range(6)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("failures") / "toy", 6)


@pytest.fixture
def data(pristine, tmp_path):
    """A private copy of the dataset, free to corrupt."""
    root = tmp_path / "toy"
    shutil.copytree(pristine, root)
    return root


def base_config(root, out, **overrides):
    config = {
        "tokenizer": "tiny", "policy": "pi05",
        "model_config": {"vlm_config": tiny_vlm_config(), "dit_config": tiny_dit_config(), "chunk_size": 4,
                         "max_state_dim": 4, "max_action_dim": 2},
        "datasets": [{"root": str(root), "name": "toy", "cameras": [CAM], "control_mode": "joint"}],
        "output_dir": str(out), "max_steps": 2, "per_device_train_batch_size": 4, "report_to": [], "use_cpu": True,
        "save_strategy": "no", "disable_tqdm": True, "stream_open_blocks": 2, "seed": 0, "learning_rate": 1e-3,
        "warmup_steps": 0, "logging_steps": 1,
    }
    config.update(overrides)
    return config


def write_config(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def run_fails(capsys, path, *overrides, code=None):
    """Run the CLI expecting failure; returns (exit code, the one-line message)."""
    with pytest.raises(SystemExit) as exited:
        cli([str(path), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    message = next(line for line in reversed(err) if line.startswith("hf_vla.train: error: "))
    assert exited.value.code != 0
    if code is not None:
        assert exited.value.code == code, message
    return exited.value.code, message


def assert_no_output(out: Path):
    if not out.exists():
        return
    left = sorted(p.name for p in out.iterdir())
    assert not any(name.startswith("checkpoint-") or name in ("model.safetensors", "config.json") for name in left), left


def assert_finite_outputs(out: Path):
    for weights in out.rglob("model.safetensors"):
        for name, tensor in load_file(weights).items():
            assert torch.isfinite(tensor).all(), (weights, name)


# ---- configuration: exit 2, nothing loaded or created --------------------------------------------------------------
CONFIG_FAULTS = [
    ({"max_steps": "abc"}, [], "max_steps: expected an integer, got 'abc'"),
    ({}, ["--max_steps"], "--max_steps needs a value"),
    ({}, ["--model_config.chunk_sise", "4"], "model_config: unknown key(s) ['chunk_sise'] for PI05Config"),
    ({"per_device_train_batch_size": 0}, [], "per_device_train_batch_size=0: must be positive"),
    ({"stream_open_blocks": 0}, [], "stream_open_blocks=0: must be positive"),
    ({"attn_implementation": "fast"}, [], "attn_implementation='fast'"),
    ({"eval_strategy": "steps", "eval_steps": 1}, [], "needs a validation split"),
    ({"bf16": "maybe"}, [], "bf16: expected a boolean, got 'maybe'"),
    ({"lora_r": 1.5}, [], "lora_r: expected an integer, got 1.5"),
    ({"decoder_threads": 0}, [], "decoder_threads=0"),
    ({"report_to": 5}, [], "report_to: expected"),
    ({"learning_rate": -1}, [], "learning_rate=-1"),
    ({"on_nonfinite": "ignore"}, [], "on_nonfinite='ignore'"),
    ({"policy": "pi0", "model_config": {"chunk_size": 4, "state_bins": 8}}, [],
     "model_config: unknown key(s) ['state_bins'] for PI0Config"),
    ({"rtc_max_delay": 99}, [], "rtc_max_delay=99: must be in [0, chunk_size="),
    ({"policy": "pi0", "model_config": {"chunk_size": 4}, "rtc_max_delay": 1}, [],
     "rtc_max_delay=1: training-time RTC needs policy 'pi05'"),
    ({"rtc_prefix_noise": -0.5, "rtc_max_delay": 2}, [], "rtc_prefix_noise=-0.5: must be a finite number >= 0"),
    ({"rtc_prefix_noise": 0.2}, [], "rtc_prefix_noise=0.2: only used with training-time RTC; set rtc_max_delay"),
]


@pytest.mark.parametrize("overrides,flags,culprit", CONFIG_FAULTS, ids=lambda v: str(v)[:40])
def test_bad_configuration_exits_2_naming_the_key(pristine, tmp_path, capsys, overrides, flags, culprit):
    out = tmp_path / "out"
    path = write_config(tmp_path, base_config(pristine, out, **overrides))
    _, message = run_fails(capsys, path, *flags, code=2)
    assert culprit in message
    assert not out.exists()


def test_bad_values_inside_datasets_and_nested_model_config(pristine, tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        ({"datasets": [{"root": str(pristine), "cameras": [CAM], "weight": "heavy"}]}, "datasets[0].weight: expected a number"),
        ({"datasets": [{"root": str(pristine), "cameras": CAM}]}, "datasets[0].cameras: expected a list"),
        ({"model_config": {"vlm_config": {**tiny_vlm_config(), "text_config": {
            **tiny_vlm_config()["text_config"], "num_hidden_layer": 2}}, "dit_config": tiny_dit_config()}},
         "model_config.vlm_config.text_config: unknown key(s) ['num_hidden_layer'] for GemmaConfig"),
        ({"model_config": {"vlm_config": tiny_vlm_config(), "dit_config": {**tiny_dit_config(), "num_hidden_layers": 3}}},
         "dit_config.num_hidden_layers=3; the expert attends"),
    ]
    for overrides, culprit in cases:
        _, message = run_fails(capsys, write_config(tmp_path, base_config(pristine, out, **overrides)), code=2)
        assert culprit in message, message
    assert not out.exists()


def test_output_dir_must_be_writable(pristine, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    _, message = run_fails(capsys, write_config(tmp_path, base_config(pristine, blocker / "out")), code=2)
    assert f"output_dir='{blocker / 'out'}'" in message and "is a file, not a directory" in message
    # a directory that the permission probe allows and mkdir still refuses (a pseudo file system): one line at the run
    # lock, not two chained tracebacks
    _, message = run_fails(capsys, write_config(tmp_path, base_config(pristine, "/proc/hf_vla_out")), code=2)
    assert "output_dir '/proc/hf_vla_out' cannot be created" in message, message


def test_strings_are_decoded_like_the_command_line(pristine, tmp_path):
    """A number given as a JSON string means what `--learning_rate 1e-3` means: coerced, not refused."""
    path = write_config(tmp_path, base_config(pristine, tmp_path / "out", learning_rate="1e-3", max_steps="7",
                                               bf16="false"))
    _, _, args = parse_config(path)
    assert (args.learning_rate, args.max_steps, args.bf16) == (1e-3, 7, False)
    _, _, args = parse_config(path, ["--learning_rate", "2e-4", "--bf16"])  # a bare flag sets a boolean
    assert args.learning_rate == 2e-4 and args.bf16 is True


def test_missing_inputs_are_named(pristine, tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        ({"tokenizer": str(tmp_path / "no_tokenizer")}, "tokenizer="),
        ({"model_name_or_path": str(tmp_path / "no_model"), "model_config": None}, "model_name_or_path="),
        ({"resume_from_checkpoint": str(tmp_path / "no_ckpt")}, "no such directory"),
        ({"datasets": [{"root": str(tmp_path / "nowhere"), "cameras": [CAM]}]}, "meta/info.json not found"),
    ]
    for overrides, culprit in cases:
        _, message = run_fails(capsys, write_config(tmp_path, base_config(pristine, out, **overrides)))
        assert culprit in message, message
    assert_no_output(out)


# ---- data faults: found at start-up, before the model is built ------------------------------------------------------
def _data_file(root: Path) -> Path:
    return next((root / "data").glob("*/*.parquet"))


def _set_vector(root: Path, column: str, cells: list[tuple[int, int, int]], value: float):
    """Write `value` at (episode, frame, dim) cells of a vector column."""
    path = _data_file(root)
    table = pq.read_table(path)
    array = table[column].combine_chunks()
    dim = array.type.list_size
    values = array.flatten().to_numpy().reshape(-1, dim).copy()
    for episode, frame, d in cells:
        values[sum(LENGTHS[:episode]) + frame, d] = value
    new = pa.FixedSizeListArray.from_arrays(pa.array(values.ravel(), array.type.value_type), dim)
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, new), path)


def _expect_data_error(capsys, root, tmp_path, *culprits, **overrides):
    out = tmp_path / "out"
    code, message = run_fails(capsys, write_config(tmp_path, base_config(root, out, **overrides)))
    for culprit in culprits:
        assert culprit in message, message
    assert_no_output(out)
    return code, message


def test_nan_in_actions_named_with_file_episode_frame_column(data, tmp_path, capsys):
    _set_vector(data, "action", [(2, 3, 1), (2, 5, 0)], float("nan"))
    _expect_data_error(capsys, data, tmp_path, "2 non-finite value(s) in column 'action'", str(_data_file(data)),
                       "episode 2, frame 3, dim 1", "dataset 'toy'")


def test_inf_in_first_frames_of_state(data, tmp_path, capsys):
    _set_vector(data, "observation.state", [(0, 0, 0), (1, 0, 2), (3, 0, 1)], float("inf"))
    _expect_data_error(capsys, data, tmp_path, "3 non-finite value(s) in column 'observation.state'",
                       "episode 0, frame 0", "episodes affected: [0, 1, 3]")


def test_parquet_shorter_than_its_metadata(data, tmp_path, capsys):
    path = _data_file(data)
    table = pq.read_table(path)
    pq.write_table(table.slice(0, table.num_rows - 3), path)
    _expect_data_error(capsys, data, tmp_path, f"{path} has {table.num_rows - 3} rows", "meta/episodes places")


def test_task_index_missing_from_tasks_parquet(data, tmp_path, capsys):
    path = _data_file(data)
    table = pq.read_table(path)
    tasks = table["task_index"].to_numpy().copy()
    tasks[sum(LENGTHS[:4]) + 2] = 99
    pq.write_table(table.set_column(table.schema.get_field_index("task_index"), "task_index", pa.array(tasks)), path)
    _expect_data_error(capsys, data, tmp_path, "episode 4 frame 2 has task_index 99", "tasks.parquet")


def test_corrupt_parquet_pages_and_non_parquet_file(data, tmp_path, capsys):
    path = _data_file(data)
    raw = bytearray(path.read_bytes())
    raw[200:1200] = os.urandom(1000)  # data pages; the footer stays readable
    path.write_bytes(bytes(raw))
    _expect_data_error(capsys, data, tmp_path, str(path), "dataset 'toy'")
    path.write_bytes(b"not a parquet file at all")
    _expect_data_error(capsys, data, tmp_path, str(path), "not a readable parquet file")


def test_local_root_without_episode_metadata(data, tmp_path, capsys):
    shutil.rmtree(data / "meta" / "episodes")
    _expect_data_error(capsys, data, tmp_path, str(data / "meta" / "episodes"), "not a complete LeRobot v3.0 dataset")


@pytest.mark.parametrize("name", ["info.json", "stats.json"])
def test_metadata_that_is_a_json_list_is_one_line(data, tmp_path, capsys, name):
    """meta/info.json or meta/stats.json holding a JSON list (was an AttributeError traceback)."""
    path = data / "meta" / name
    path.write_text(json.dumps([json.loads(path.read_text())]))
    _expect_data_error(capsys, data, tmp_path, f"{path} is a JSON list, not an object", "dataset 'toy'")


def test_state_key_naming_a_scalar_column(data, tmp_path, capsys):
    datasets = [{"root": str(data), "name": "toy", "cameras": [CAM], "control_mode": "joint", "state_key": "timestamp"}]
    _expect_data_error(capsys, data, tmp_path, "'timestamp' is a scalar column", datasets=datasets)


def test_truncated_video(data, tmp_path, capsys):
    video = next((data / "videos").rglob("*.mp4"))
    video.write_bytes(video.read_bytes()[: int(video.stat().st_size * 0.6)])
    _expect_data_error(capsys, data, tmp_path, f"video {video}", "truncated or too short", "episode 5")


def test_decode_error_at_training_time_names_file_and_episode(pristine, tmp_path):
    """A video that breaks after start-up (replaced mid-run) fails naming file and episode, not a bare PyAV error."""
    from hf_vla.data.sources import DatasetConfig, LeRobotSource, VideoReader
    from hf_vla.errors import DataError

    source = LeRobotSource(DatasetConfig(root=str(pristine), name="toy", cameras=[CAM]), 0)
    path, start = source.video_path(5, CAM)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(path.read_bytes()[: int(path.stat().st_size * 0.6)])
    reader = VideoReader(broken, start, source.fps, 16, episode=5)
    with pytest.raises(DataError, match=rf"{broken} \(episode 5\).*truncated"):
        for index in range(LENGTHS[5]):
            reader.frame(index)


def test_inconsistent_video_timestamps_in_metadata(data, tmp_path, capsys):
    path = next((data / "meta" / "episodes").glob("*/*.parquet"))
    table = pq.read_table(path)
    column = f"videos/{CAM}/to_timestamp"
    values = table[column].to_numpy().copy()
    values[1] += 3.0
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, pa.array(values)), path)
    _expect_data_error(capsys, data, tmp_path, "episode 1 spans", "meta/episodes is inconsistent")


def test_keep_ranges_faults(data, tmp_path, capsys, caplog):
    def spec(ranges):
        return [{"root": str(data), "name": "toy", "cameras": [CAM], "control_mode": "joint", "keep_ranges": ranges}]

    # every range invalid: told apart from a key mismatch
    _, message = _expect_data_error(capsys, data, tmp_path, "keeps no frame", "2 reversed", "1 outside their episode",
                                    datasets=spec({"0": [[8, 2], [5, 1]], "1": [[40, 50]]}))
    assert "matches no episode" not in message
    _expect_data_error(capsys, data, tmp_path, "matches no episode", "check keep_ranges_key",
                       datasets=spec({"episode-0": [[0, 5]]}))
    _expect_data_error(capsys, data, tmp_path, "keys match 2 episodes", "2 malformed entries", "0: [0, 'x']",
                       datasets=spec({"0": [[0, "x"]], "1": [3]}))
    empty_file = tmp_path / "empty_keep.json"
    empty_file.write_text("{}")  # the DROID config's placeholder
    _expect_data_error(capsys, data, tmp_path, f"the keep_ranges filter ({empty_file}) is empty",
                       datasets=spec(str(empty_file)))
    bad_file = tmp_path / "keep.json"
    bad_file.write_text("{not json")
    _expect_data_error(capsys, data, tmp_path, f"keep_ranges file {bad_file} is not valid JSON",
                       datasets=spec(str(bad_file)))
    # some ranges survive: a warning with counts and examples, and the run goes on
    from hf_vla.data import WeightedDatasetMixture

    with caplog.at_level("WARNING", logger="hf_vla.data"):
        mixture = WeightedDatasetMixture(spec({"0": [[0, 5], [9, 3]], "2": [[10, 99]], "7": [[0, 2]]}))
    assert [(b.episode, b.start, b.end) for b in mixture.train_blocks[0]] == [(0, 0, 5), (2, 10, 14)]
    assert "2 of 3 ranges kept" in caplog.text and "1 reversed" in caplog.text and "1 clipped" in caplog.text
    assert "1 filter keys match no episode" in caplog.text


def test_dataset_mapping_faults(data, tmp_path, capsys):
    def spec(**kw):
        return [{"root": str(data), "name": "toy", "cameras": [CAM], "control_mode": "joint", **kw}]

    _expect_data_error(capsys, data, tmp_path, "config fps=30", datasets=spec(fps=30))
    _expect_data_error(capsys, data, tmp_path, "cameras 'observation.images.top' is not a feature",
                       datasets=spec(cameras=["observation.images.top"]))
    model_config = base_config(data, tmp_path)["model_config"] | {"max_state_dim": 2}
    _expect_data_error(capsys, data, tmp_path, "state has 3 dims, more than the model's max_state_dim=2; build it "
                       "wider: --model_config.max_state_dim 3", model_config=model_config)
    video = next((data / "videos").rglob("*.mp4"))
    video.unlink()
    _expect_data_error(capsys, data, tmp_path, "data/video files are missing", video.name)


# ---- training faults -------------------------------------------------------------------------------------------------
def test_diverging_learning_rate_stops_with_step_and_provenance(pristine, tmp_path, capsys):
    out = tmp_path / "out"
    config = base_config(pristine, out, learning_rate=1e6, max_steps=30, save_strategy="steps", save_steps=1,
                         max_grad_norm=0.0)
    _, message = run_fails(capsys, write_config(tmp_path, config), code=1)
    assert "non-finite" in message and "at step" in message
    assert "dataset 'toy': episode" in message or "the loss was finite" in message
    assert not (out / "model.safetensors").exists()
    assert_finite_outputs(out)  # checkpoints written before the divergence hold finite weights only


def test_skip_mode_drops_the_step_counts_it_and_keeps_the_loss_honest(pristine, tmp_path):
    from test_trainer import StopAt  # noqa: F401  (shared helpers live there)
    from transformers import TrainerCallback

    from hf_vla import PI05ForConditionalGeneration, PI05Processor, VLATrainer, VLATrainingArguments
    from hf_vla.data import WeightedDatasetMixture
    from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config

    class Poisoned(VLATrainer):
        def per_sample_loss(self, model, inputs, step):
            per_sample, outputs = super().per_sample_loss(model, inputs, step)
            if model.training and self.state.global_step == 1:  # the second optimizer step sees a NaN
                per_sample.sum = per_sample.sum.clone()
                per_sample.sum[1] = float("nan")
            return per_sample, outputs

    snapshots = {}

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    mixture = WeightedDatasetMixture([dict(root=str(pristine), name="toy", cameras=[CAM], control_mode="joint")])
    torch.manual_seed(0)
    config = tiny_pi05_config(chunk_size=4)
    model = PI05ForConditionalGeneration(config)
    processor = PI05Processor.from_config(config, build_tiny_tokenizer(), norm_stats=mixture.norm_stats,
                                          head_names=mixture.head_names)
    args = VLATrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                                report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, learning_rate=1e-3,
                                warmup_steps=0, stream_open_blocks=2, on_nonfinite="skip")
    train, _ = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=config.chunk_size)
    trainer = Poisoned(model, args, train_dataset=train, processing_class=processor, callbacks=[Snapshot()])
    trainer.train()
    for name, param in snapshots[2].items():  # step 2 was dropped: the weights are those after step 1
        assert torch.equal(param, snapshots[1][name]), name
    assert any(not torch.equal(p, snapshots[2][n]) for n, p in snapshots[3].items())  # training went on
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["nonfinite_skipped"] for h in logs] == [1, 1]
    assert all(np.isfinite(h["loss"]) and h["loss"] > 0 for h in logs)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_disk_full_during_a_save_names_path_and_cause_and_keeps_the_previous(pristine, tmp_path, capsys, monkeypatch):
    import errno

    out = tmp_path / "out"
    original = torch.save
    calls = {"optimizer": 0}

    def save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            calls["optimizer"] += 1
            if calls["optimizer"] == 2:  # the second checkpoint's optimizer: the disk fills up half way
                with open(f, "wb") as handle:
                    handle.write(b"\0" * 100)
                raise OSError(errno.ENOSPC, "No space left on device")
        return original(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    config = base_config(pristine, out, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=1)
    _, message = run_fails(capsys, write_config(tmp_path, config), code=1)
    assert f"saving checkpoint {out / 'checkpoint-4'} failed: no space left on the device" in message
    assert f"the previous checkpoint {out / 'checkpoint-2'} is intact (free space, then --resume_from_checkpoint" \
        in message
    assert not (out / "checkpoint-4").exists()
    assert checkpoints.incomplete_reason(out / "checkpoint-2") is None


# ---- resume faults ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(pristine, tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (fp32)."""
    base = tmp_path_factory.mktemp("trained")
    config = base_config(pristine, base / "out", max_steps=4, save_strategy="steps", save_steps=2)
    main([str(write_config(base, config))])
    return base / "out", config


def _resume_fails(capsys, tmp_path, config, resume, culprits, **overrides):
    out = Path(config["output_dir"])
    before = sorted(p.name for p in out.iterdir()) if out.exists() else []
    path = write_config(tmp_path, config | overrides | {"resume_from_checkpoint": resume}, "resume.json")
    _, message = run_fails(capsys, path, code=1)
    for culprit in culprits:
        assert culprit in message, message
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else []) == before


def test_resume_faults_say_what_is_wrong(trained, tmp_path, capsys):
    out, config = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    _resume_fails(capsys, tmp_path, config, str(empty), [f"resume_from_checkpoint='{empty}'", "not a checkpoint"])
    _resume_fails(capsys, tmp_path, config, str(out), ["not a checkpoint", "it holds checkpoints, e.g.",
                                                       "checkpoint-4"])
    # another model: a different chunk size
    other = config | {"model_config": config["model_config"] | {"chunk_size": 5}}
    _resume_fails(capsys, tmp_path, other, str(out / "checkpoint-2"), ["another model configuration",
                                                                       "chunk_size: checkpoint 4, this run 5"])
    # a float32 checkpoint resumed into a bfloat16 run
    _resume_fails(capsys, tmp_path, config, str(out / "checkpoint-2"), ["parameter dtype is 'float32' in the "
                                                                        "checkpoint but 'bfloat16'"], dtype="bfloat16")
    # nothing complete to resume from
    fresh = config | {"output_dir": str(tmp_path / "fresh")}
    _resume_fails(capsys, tmp_path, fresh, True, ["no complete checkpoint in output_dir"])


def test_resume_true_skips_incomplete_checkpoints_and_an_explicit_one_is_refused(trained, tmp_path, capsys, caplog):
    out, config = trained
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / "checkpoint-4" / checkpoints.MARKER).unlink()  # as if killed before the marker
    config = config | {"output_dir": str(copy)}
    _resume_fails(capsys, tmp_path, config, str(copy / "checkpoint-4"),
                  ["is incomplete", "the newest complete one is", "checkpoint-2"])
    assert checkpoints.resolve_resume(copy) == copy / "checkpoint-2"
    with caplog.at_level("WARNING", logger="hf_vla.training.checkpoints"):
        trainer = main([str(write_config(tmp_path, config | {"resume_from_checkpoint": True}, "again.json"))])
    assert "skipping incomplete checkpoint" in caplog.text and "checkpoint-4" in caplog.text
    assert trainer.state.global_step == 4
    expected = load_file(out / "model.safetensors")
    for name, tensor in load_file(copy / "model.safetensors").items():
        assert torch.equal(tensor, expected[name]), name


def _rewrite_action(root: Path, row: int, value) -> None:
    """Set one action value (dim 0 of `row` of the first data file) by rewriting the parquet file, episodes unchanged;
    `value(column)` gives the new value from the column's dim-0 values."""
    path = sorted((root / "data").rglob("*.parquet"))[0]
    table = pq.read_table(path)
    actions = np.stack(table["action"].to_numpy(zero_copy_only=False)).astype(np.float32)
    actions[row, 0] = value(actions[:, 0])
    column = pa.array(list(actions), type=table.schema.field("action").type)
    pq.write_table(table.set_column(table.schema.get_field_index("action"), "action", column), path)


def test_a_changed_value_in_the_data_is_refused_at_resume(pristine, tmp_path, capsys, caplog):
    """One action value changed (episodes unchanged) is refused at resume like an appended episode: a value inside the
    range by the content hash, the largest value by the normalisation statistics it shifts; `--on_data_change
    restart_epoch` accepts both, saying so."""
    data = tmp_path / "toy"
    shutil.copytree(pristine, data)
    out = tmp_path / "out"
    config = base_config(data, out, max_steps=2, save_strategy="steps", save_steps=2)
    main([str(write_config(tmp_path, config))])
    resume = config | {"max_steps": 4, "resume_from_checkpoint": str(out / "checkpoint-2")}
    _rewrite_action(data, 5, lambda column: np.median(column))  # inside the range: the quantiles stay
    _resume_fails(capsys, tmp_path, resume, str(out / "checkpoint-2"),
                  ["values in the training data changed since the checkpoint", "--on_data_change restart_epoch"])
    _rewrite_action(data, 6, lambda column: column.max() + 1.0)  # a new maximum: q99 moves
    _resume_fails(capsys, tmp_path, resume, str(out / "checkpoint-2"),
                  ["the normalisation statistics of this run's data differ from the checkpoint's (head",
                   "actions q99[0] ", "--on_data_change restart_epoch"])
    with caplog.at_level("WARNING", logger="hf_vla"):
        trainer = main([str(write_config(tmp_path, resume | {"on_data_change": "restart_epoch"}, "accept.json"))])
    assert trainer.state.global_step == 4
    assert "resuming under new normalisation statistics (head" in caplog.text and "the data changed" in caplog.text


def test_a_value_changed_in_place_with_its_mtime_restored_is_refused_naming_file_and_episode(pristine, tmp_path,
                                                                                              capsys):
    """Four bytes of one state value changed inside the parquet file, its size kept and its mtime restored (bit rot,
    or `cp -p` / `rsync -t` over an edited file): the scan cache, keyed by size and times, must not stand in for the
    content. The resume is refused and the message names the file and the episode."""
    import os

    data = tmp_path / "toy"
    shutil.copytree(pristine, data)
    path = _data_file(data)
    # plain, uncompressed values, so that one value's four bytes are in the file as they are; the toy state repeats
    # one value over its dims, made distinct here
    table = pq.read_table(path)
    state = np.stack(table["observation.state"].to_numpy(zero_copy_only=False)).astype(np.float32)
    state += np.float32(1e-3) * np.arange(state.shape[1], dtype=np.float32)
    field = table.schema.get_field_index("observation.state")
    table = table.set_column(field, "observation.state", pa.array(list(state), type=table.schema.field(field).type))
    pq.write_table(table, path, compression="none", use_dictionary=False, write_statistics=False)
    out = tmp_path / "out"
    config = base_config(data, out, max_steps=2, save_strategy="steps", save_steps=2)
    main([str(write_config(tmp_path, config))])  # scans the dataset and caches the scan
    table = pq.read_table(path)
    state = np.stack(table["observation.state"].to_numpy(zero_copy_only=False)).astype(np.float32)
    episodes = table["episode_index"].to_numpy()
    blob = bytearray(path.read_bytes())
    order = np.argsort(state[:, 1])
    middle = [int(i) for i in order[len(order) // 4: 3 * len(order) // 4]]  # middle values: the quantiles stay
    row = next(i for i in middle if blob.count(state[i, 1].tobytes()) == 1)  # a value whose bytes occur once
    donor = next(i for i in middle if state[i, 1] != state[row, 1])
    old, new = state[row, 1].tobytes(), state[donor, 1].tobytes()
    at = blob.index(old)
    blob[at:at + 4] = new
    info = path.stat()
    path.write_bytes(bytes(blob))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert path.stat().st_size == info.st_size and path.stat().st_mtime_ns == info.st_mtime_ns
    changed = np.stack(pq.read_table(path)["observation.state"].to_numpy(zero_copy_only=False))
    assert changed[row, 1] == state[donor, 1] and (changed != state).sum() == 1  # exactly that value changed
    resume = config | {"max_steps": 4}
    _resume_fails(capsys, tmp_path, resume, str(out / "checkpoint-2"),
                  ["values in the training data changed since the checkpoint",
                   f"dataset 'toy', {data}/{path.relative_to(data)} episode {int(episodes[row])}",
                   "--on_data_change restart_epoch"])


def test_a_bf16_checkpoint_into_a_float32_run(pristine, tmp_path, capsys):
    out = tmp_path / "bf16"
    config = base_config(pristine, out, max_steps=2, save_strategy="steps", save_steps=2, dtype="bfloat16")
    main([str(write_config(tmp_path, config))])
    _resume_fails(capsys, tmp_path, config, str(out / "checkpoint-2"),
                  ["'bfloat16' in the checkpoint but 'float32'", "resume with --dtype bfloat16"], dtype="float32")


# ---- kill -9 during checkpoint saves -------------------------------------------------------------------------------
MOMENTS = ["after_weights", "mid_optimizer", "before_marker", "mid_rotation"]


@pytest.fixture(scope="module")
def kill_setup(pristine, tmp_path_factory):
    base = tmp_path_factory.mktemp("kill")
    config = base_config(pristine, base / "unused", max_steps=6, save_strategy="steps", save_steps=2,
                         save_total_limit=1)
    reference = base / "reference"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    path = write_config(base, config | {"output_dir": str(reference)})
    subprocess.run([sys.executable, "-m", "hf_vla.train", str(path)], env=env, check=True, capture_output=True,
                   timeout=600)
    return base, config, env, reference


# one moment in the default suite (each is a killed and a resumed command, ~45 s), the other three `slow`
@pytest.mark.parametrize("moment", [m if m == "mid_optimizer" else pytest.param(m, marks=pytest.mark.slow)
                                    for m in MOMENTS])
def test_kill_during_a_checkpoint_save_then_resume_is_bitwise_exact(kill_setup, moment):
    base, config, env, reference = kill_setup
    out = base / moment
    path = write_config(base, config | {"output_dir": str(out)}, f"{moment}.json")
    killed = subprocess.run([sys.executable, str(TESTS / "kill_during_save.py"), str(path), moment, "4"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    complete, skipped = checkpoints.last_complete_checkpoint(out)
    assert complete is not None and complete.name in ("checkpoint-2", "checkpoint-4"), (complete, skipped)
    if moment != "mid_rotation":
        assert complete.name == "checkpoint-2" and skipped and skipped[0][0].name == "checkpoint-4"
    resumed = subprocess.run([sys.executable, "-m", "hf_vla.train", str(path), "--resume_from_checkpoint", "true"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = load_file(reference / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    reference_state = json.loads((reference / "checkpoint-6" / "trainer_state.json").read_text())
    losses = [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]
    reference_losses = [(h["step"], h["loss"]) for h in reference_state["log_history"] if "loss" in h]
    assert losses[-2:] == reference_losses[-2:]
    assert [p.name for p in checkpoints.checkpoint_dirs(out)] == ["checkpoint-6"]  # rotation cleaned up
    assert not list(out.glob(".deleting-*"))


# ---- seeded builds -----------------------------------------------------------------------------------------------------
def test_same_seed_builds_the_same_model_bitwise(pristine, tmp_path):
    from hf_vla.training.arguments import ModelArguments
    from hf_vla.training.builders import build_model

    args = ModelArguments(tokenizer="tiny", model_config=base_config(pristine, tmp_path)["model_config"])
    first, second = build_model(args, seed=3), build_model(args, seed=3)
    other = build_model(args, seed=4)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))


def test_two_from_scratch_runs_with_the_same_seed_are_bitwise_equal(pristine, tmp_path):
    runs = []
    for name in ("a", "b"):
        config = base_config(pristine, tmp_path / name, max_steps=1, full_determinism=True, lora_preset=None)
        main([str(write_config(tmp_path, config, f"{name}.json"))])
        runs.append(load_file(tmp_path / name / "model.safetensors"))
    assert runs[0].keys() == runs[1].keys()
    for key in runs[0]:
        assert torch.equal(runs[0][key], runs[1][key]), key


def test_the_module_entry_point_exits_with_the_code_and_one_line(pristine, tmp_path):
    path = write_config(tmp_path, base_config(pristine, tmp_path / "out", max_steps="abc"))
    result = subprocess.run([sys.executable, "-m", "hf_vla.train", str(path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        "hf_vla.train: error: max_steps: expected an integer, got 'abc' (str)"
    assert "Traceback" not in result.stderr


# ---- services and start-up: checked before the data scan, one line each ---------------------------------------------
def test_hub_and_wandb_problems_stop_the_run_before_it_starts(tmp_path, capsys, monkeypatch):
    """push_to_hub offline / without a token / with the Hub unreachable, and report_to wandb without an API key, end
    the run in one line before any data is read (the dataset here does not exist: its error would come first
    otherwise) and leave no output directory behind."""
    import huggingface_hub
    from huggingface_hub import constants

    out = tmp_path / "never"
    path = write_config(tmp_path, base_config(tmp_path / "no_such_dataset", out, push_to_hub=True,
                                              hub_model_id="me/policy"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _, message = run_fails(capsys, path, code=2)
    assert "push_to_hub=true (to 'me/policy') but the Hub is offline (HF_HUB_OFFLINE=1)" in message
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    _, message = run_fails(capsys, path, code=2)
    assert "no Hugging Face token is set: log in with `hf auth login`" in message

    def unreachable(token=None):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_token")
    monkeypatch.setattr(huggingface_hub, "whoami", unreachable)
    _, message = run_fails(capsys, path, code=2)
    assert "the Hub cannot be reached (Name or service not known)" in message
    assert not out.exists()
    # a Hub that never answers (a compute node whose packets are dropped): the real whoami against a silent server
    import socket
    import time

    import huggingface_hub.hf_api as hf_api

    import hf_vla.training.preflight as preflight

    silent = socket.create_server(("127.0.0.1", 0))
    try:
        monkeypatch.setattr(huggingface_hub, "whoami", hf_api.whoami)
        monkeypatch.setattr(hf_api.api, "endpoint", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(preflight, "HUB_ANSWER_S", 1.0)
        started = time.monotonic()
        _, message = run_fails(capsys, path, code=2)
        assert time.monotonic() - started < 10
        assert "the Hub did not answer within 1 s (http://127.0.0.1:" in message and "`hf upload me/policy " in message
    finally:
        silent.close()
    assert not out.exists()

    path = write_config(tmp_path, base_config(tmp_path / "no_such_dataset", out, report_to=["wandb"]), "wandb.json")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    _, message = run_fails(capsys, path, code=2)
    assert "report_to includes 'wandb' but no wandb API key is set: run `wandb login`" in message
    assert not out.exists()


def test_scheduler_kwargs_typo_gated_tokenizer_and_no_empty_output(tmp_path, capsys, monkeypatch):
    path = write_config(tmp_path, base_config(tmp_path / "x", tmp_path / "out", lr_scheduler_type="warmup_stable_decay",
                                              lr_scheduler_kwargs={"num_decay_step": 10}))
    _, message = run_fails(capsys, path, code=2)
    assert ("lr_scheduler_kwargs: unknown key(s) ['num_decay_step'] for lr_scheduler_type 'warmup_stable_decay' "
            "(did you mean 'num_decay_step' -> 'num_decay_steps'?)") in message
    path = write_config(tmp_path, base_config(tmp_path / "x", tmp_path / "out", lr_scheduler_type="cosinee"),
                        "typo.json")
    _, message = run_fails(capsys, path, code=2)
    assert "lr_scheduler_type='cosinee': did you mean 'cosine'? one of ['linear', 'cosine'," in message, message
    # another schedule without kwargs: hf_vla's default min_lr (for its default schedule) does not break it
    assert parse_config(write_config(tmp_path, base_config(tmp_path / "x", tmp_path / "out", lr_scheduler_type="linear"),
                                     "linear.json"))[2].lr_scheduler_kwargs == {}

    from huggingface_hub.errors import GatedRepoError
    from transformers import AutoTokenizer

    def gated(*args, **kwargs):
        error = GatedRepoError.__new__(GatedRepoError)  # as huggingface_hub raises it (built from an HTTP response)
        Exception.__init__(error, "401 Client Error. Cannot access gated repo for url ...")
        raise OSError("You are trying to access a gated repo.") from error

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", gated)
    out = tmp_path / "fresh_output"
    path = write_config(tmp_path, base_config(tmp_path / "x", out, tokenizer="google/paligemma-3b-pt-224"), "gated.json")
    _, message = run_fails(capsys, path)
    assert ("'google/paligemma-3b-pt-224' is a gated repository: accept its license at "
            "https://huggingface.co/google/paligemma-3b-pt-224, then log in (`hf auth login`") in message
    assert not out.exists()  # the run failed before writing anything: no empty output directory


def test_a_run_into_another_runs_output_dir_says_so_once(tmp_path, caplog):
    """A rerun into an output_dir holding checkpoints or a saved model, without resuming, warns in one line naming
    what is there and how to continue it instead; a resume or an empty directory says nothing."""
    import logging

    from hf_vla.training.launch import warn_previous_run

    out = tmp_path / "run"
    out.mkdir()
    with caplog.at_level(logging.WARNING, logger="hf_vla"):
        warn_previous_run(out, None)
        assert not caplog.records
        for step in (500, 1500, 1000):
            (out / f"checkpoint-{step}").mkdir()
        (out / "model.safetensors").write_bytes(b"")
        warn_previous_run(out, "true")
        assert not caplog.records
        warn_previous_run(out, None)
    (record,) = caplog.records
    assert "holds a previous run (checkpoint-1500 and a saved model)" in record.getMessage()
    assert "--resume_from_checkpoint true" in record.getMessage()
