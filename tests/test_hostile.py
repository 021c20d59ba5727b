"""What a hostile-input run found getting through on the newer surfaces, each case as it was found:

- recordings never destroy or lose data: `--overwrite` never removes an input, a folder above it, or a folder of
  files hf_vla did not write; one writer per recording directory; one client's bad camera costs its episode only; a
  full disk at the join leaves nothing half-written and says how to join later; episodes of different shapes join into
  one dataset per shape; a recording stopped or killed before its first episode continues;
- a recording continues only with the same checkpoint, whatever its spelling, and not with other weights under its path;
- inputs of the new commands end in one line, never a traceback or a silent acceptance (`/proc/x` outputs, NaN
  thresholds, DAgger flags without DAgger, fractional fps, hand-edited FAST tokenizers, short per-frame chunks, NaN in
  `norm_stats_from`, a model vocabulary smaller than its tokenizer).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import shutil

import numpy as np
import pytest
from conftest import refused
from test_serve import HEAD, checkpoint, demo_policy  # noqa: F401  (module fixtures)

from hf_vla.errors import ConfigError, DataError


# ---- the recording of a served policy ---------------------------------------------------------------------------------
def _frame(size: int = 32, value: float = 0.0):
    from hf_vla.serving.recorder import Frame

    image = np.random.default_rng(int(value * 100) + size).integers(0, 255, (size, size, 3), dtype=np.uint8)
    action = np.full(2, value, np.float32)
    return Frame({"observation/image": image}, np.full(2, value, np.float32), "reach", action, action, False)


def _episodes(recorder, *sizes, frames: int = 2):
    for index, size in enumerate(sizes):
        episode = recorder.start_episode()
        for step in range(frames):
            recorder.add(episode, _frame(size, index + step / 10))
        recorder.end(episode, True, "episode_end")


def _total(root):
    return json.loads((root / "meta" / "info.json").read_text())["total_episodes"]


def test_one_clients_bad_camera_costs_its_episode_and_other_shapes_join_apart(tmp_path, caplog):
    """An odd-sized image (33 px: H.264 4:2:0 cannot take it) drops that episode only, the other clients' episodes are
    kept; episodes of another camera size (48 px) are joined into a dataset of their own, said in one line."""
    from hf_vla.serving.recorder import RUN_FILE, ServeRecorder

    root = tmp_path / "served"
    recorder = ServeRecorder(root, {"checkpoint": "x", "head": HEAD}, fps=10)
    with caplog.at_level(logging.WARNING, logger="hf_vla.serve"):
        _episodes(recorder, 32, 33, 32, 48)
        assert recorder.close() == root / "dataset"
    assert recorder.stopped is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("episode 1 not kept: camera observation/image is 33x33" in w for w in warnings), warnings
    assert any("dataset: episodes 0,2 (observation.image 32x32x3); dataset.2: episodes 3 (observation.image 48x48x3)"
               in w for w in warnings), warnings
    summary = json.loads((root / "meta" / RUN_FILE).read_text())
    assert [e["episode"] for e in summary["episodes"]] == [0, 2, 3]
    assert _total(root / "dataset") == 2 and _total(root / "dataset.2") == 1


def test_a_full_disk_at_the_join_leaves_nothing_half_written(tmp_path, monkeypatch):
    """A full disk while joining: one line saying how to join later, no `.dataset.joining`, the finished episodes and
    an earlier join intact; a full disk while an episode is saved leaves no `.partial` behind."""
    import lerobot.datasets.aggregate

    from hf_vla.serving.recorder import ServeRecorder, join_recording

    root = tmp_path / "served"
    recorder = ServeRecorder(root, {"checkpoint": "x", "head": HEAD}, fps=10)
    _episodes(recorder, 32, 32)
    recorder.close()
    assert _total(root / "dataset") == 2
    earlier = sorted(p.relative_to(root) for p in (root / "dataset").rglob("*"))

    def full(*args, aggr_root, **kwargs):
        (aggr_root / "meta").mkdir(parents=True)
        (aggr_root / "meta" / "info.json").write_text("{")  # half-written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lerobot.datasets.aggregate, "aggregate_datasets", full)
    with pytest.raises(DataError, match=r"joining the 2 finished episodes of .* failed \(No space left on device\); "
                                        r"they are intact in .*episodes; join them later with python -c"):
        join_recording(root)
    assert not (root / ".dataset.joining").exists()
    assert sorted(p.relative_to(root) for p in (root / "dataset").rglob("*")) == earlier
    assert sorted(p.name for p in (root / "episodes").iterdir()) == ["000000", "000001"]

    again = ServeRecorder(root, {"checkpoint": "x", "head": HEAD}, fps=10)
    create = again._create

    def saved_on_a_full_disk(index, frame):
        dataset = create(index, frame)

        def save_episode(**kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        dataset.save_episode = save_episode
        return dataset

    again._create = saved_on_a_full_disk
    _episodes(again, 32)
    again.close(join=False)
    assert again.stopped and "No space left" in again.stopped
    assert sorted(p.name for p in (root / "episodes").iterdir()) == ["000000", "000001"]  # no 000002.partial


def test_one_server_per_recording_directory(checkpoint, tmp_path, capsys):  # noqa: F811
    """A second writer of one recording directory is refused at start-up naming the holder, before its model loads
    (`serve --record`); once the first has stopped, the directory is taken again."""
    from hf_vla.serve import cli
    from hf_vla.serving.recorder import ServeRecorder

    root = tmp_path / "served"
    first = ServeRecorder(root, {"checkpoint": "x", "head": HEAD}, fps=10)
    with pytest.raises(ConfigError, match=rf"--record '{root}' is in use by another server recording there: pid "
                                          rf"{os.getpid()}"):
        ServeRecorder(root, {"checkpoint": "x", "head": HEAD}, fps=10)
    first.close()
    ServeRecorder(root, {"checkpoint": "x", "head": HEAD}, fps=10).close()

    busy = tmp_path / "busy"
    from hf_vla.serving.recorder import record_lock

    with record_lock(busy):
        line = refused(cli, ["--checkpoint", str(checkpoint), "--record", str(busy), "--port", "0"], capsys)
    assert f"--record '{busy}' is in use by another server recording there: pid {os.getpid()}" in line


def test_a_recording_stopped_before_its_first_episode_continues(checkpoint, tmp_path, caplog):  # noqa: F811
    """Stopped cleanly before any episode, or killed (-9) while the first was open: the same run continues there, the
    unfinished episode dropped with a warning."""
    from hf_vla.serving.recorder import ServeRecorder, check_record_dir

    run = {"checkpoint": "x", "head": HEAD}
    root = tmp_path / "stopped"
    ServeRecorder(root, run, fps=10).close()  # SIGTERM before any episode
    check_record_dir(root, run)
    ServeRecorder(root, run, fps=10).close()

    killed = tmp_path / "killed"  # what a server killed during its first episode leaves
    (killed / "episodes" / "000000.partial" / "meta").mkdir(parents=True)
    (killed / "meta").mkdir()
    check_record_dir(killed, run)
    with caplog.at_level(logging.WARNING, logger="hf_vla.serve"):
        recorder = ServeRecorder(killed, run, fps=10)
    _episodes(recorder, 32)
    recorder.close()
    assert "removing the unfinished episode 000000.partial" in caplog.text
    assert _total(killed / "dataset") == 1


def test_the_same_checkpoint_is_the_same_run_other_weights_are_not(checkpoint, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`base/`, a relative `base` and its absolute path continue one recording; the same path holding other weights is
    another run, refused naming the weights."""
    from hf_vla.serve import cli
    from hf_vla.serving.launch import record_run as _record_run
    from hf_vla.serving.recorder import ServeRecorder, check_record_dir

    base = tmp_path / "base"
    shutil.copytree(checkpoint, base)
    root = tmp_path / "served"
    args = argparse.Namespace(checkpoint=str(base), revision=None)
    ServeRecorder(root, _record_run(args) | {"head": HEAD}, fps=10).close()
    monkeypatch.chdir(tmp_path)
    for spelling in ("base/", "base", "./base", str(base)):
        check_record_dir(root, _record_run(argparse.Namespace(checkpoint=spelling, revision=None)))
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)  # other weights under the same path
    line = refused(cli, ["--checkpoint", "base", "--record", str(root), "--port", "0"], capsys)
    assert f"--record {root}: recorded by another run (weights: " in line, line


def test_recording_arguments_refused_in_one_line(checkpoint, tmp_path, capsys):  # noqa: F811
    from hf_vla.serve import cli
    from hf_vla.serving.recorder import ServeRecorder

    line = refused(cli, ["--checkpoint", str(checkpoint), "--record", str(tmp_path / "r"), "--record_fps", "2.5"],
                   capsys)
    assert "--record_fps 2.5: a LeRobot dataset has a whole number of frames per second; give an integer" in line
    line = refused(cli, ["--checkpoint", str(checkpoint), "--record", "/proc/x", "--port", "0"], capsys)
    assert "--record '/proc/x' cannot be created" in line
    with pytest.raises(ConfigError, match="recording fps 2.5: must be a whole number"):
        ServeRecorder(tmp_path / "r", {"checkpoint": "x"}, fps=2.5)
    assert not (tmp_path / "r").exists()


def test_numpy_bools_and_a_repeated_seed_from_the_wire(demo_policy, tmp_path):  # noqa: F811
    """openpi's client sends numpy scalars: `np.bool_` episode_end / success are taken as Python bools. An
    `episode_seed` starts an episode, the same seed again too (the policy is reset; so is the recorded episode)."""
    from openpi_client import msgpack_numpy
    from test_serve import observations

    from hf_vla.serving.policy import PolicyRunner
    from hf_vla.serving.recorder import RUN_FILE, ServeRecorder
    from hf_vla.serving.server import PolicyServer, _Session

    model, processor = demo_policy
    root = tmp_path / "served"
    recorder = ServeRecorder(root, {"checkpoint": "x", "head": HEAD}, fps=10)
    server = PolicyServer(PolicyRunner(model, processor), recorder=recorder, max_connections=1)
    runner, session = server.connection_runner(), _Session()  # one connection
    observation, task = next(observations(1, seed=70))
    for _ in range(2):  # two client episodes, both seeded 3
        for step in range(3):
            request = {**observation, "prompt": task} | ({"episode_seed": np.int64(3)} if step == 0 else {})
            assert server.infer(runner, msgpack_numpy.packb(request), session)["actions"].shape == (8, 2)
    reply = server.infer(runner, msgpack_numpy.packb({"episode_end": np.bool_(True), "success": np.bool_(True)}),
                         session)
    assert reply == {"episode_end": True, "recorded_episode": 1}
    recorder.close()
    summary = json.loads((root / "meta" / RUN_FILE).read_text())
    assert [(e["frames"], e["success"], e["ended"]) for e in summary["episodes"]] == [
        (3, None, "a new episode_seed"), (3, True, "episode_end")]


# ---- hf_vla.record and the location replay ----------------------------------------------------------------------------
def _fake_recording(root):
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "info.json").write_text(json.dumps({"features": {}, "fps": 30}))
    (root / "meta" / "hf_vla_record.json").write_text(json.dumps({"env": "metaworld"}))
    return root


def test_overwrite_never_removes_an_input_or_what_hf_vla_did_not_write(tmp_path, capsys):
    """`--add_locations SRC --output DIR --overwrite` with DIR above SRC (it destroyed SRC and its siblings), at SRC,
    inside it, or a folder of other files: refused, nothing removed; the same for `hf_vla.record --overwrite`."""
    from hf_vla.record import cli

    parent = tmp_path / "data"
    source = _fake_recording(parent / "mt50")
    (parent / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for output, where in ((parent, "contains"), (source, "is"), (source / "sub", "is inside")):
        line = refused(cli, ["--env", "metaworld", "--add_locations", str(source), "--output", str(output),
                             "--overwrite"], capsys)
        assert f"--output '{output}' {where} --add_locations '{source}'" in line, line
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("mine")
    line = refused(cli, ["--env", "metaworld", "--add_locations", str(source), "--output", str(foreign),
                         "--overwrite"], capsys)
    assert "holds files this command did not write (thesis.tex; no meta/hf_vla_record.json)" in line
    line = refused(cli, ["--env", "color_reach", "--episodes", "1", "--output", str(foreign), "--overwrite"], capsys)
    assert "holds files this command did not write (thesis.tex" in line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before + [
        foreign.relative_to(tmp_path), (foreign / "thesis.tex").relative_to(tmp_path)]


def test_record_arguments_refused_in_one_line(checkpoint, tmp_path, capsys):  # noqa: F811
    from hf_vla.envs.dagger import DaggerSettings
    from hf_vla.evaluate import cli as evaluate
    from hf_vla.record import cli

    line = refused(cli, ["--env", "color_reach", "--episodes", "1", "--output", "/proc/x"], capsys)
    assert "--output '/proc/.x.recording' cannot be created" in line, line
    line = refused(cli, ["--env", "color_reach", "--episodes", "1", "--output", str(tmp_path / "o"), "--beta", "0.5"],
                   capsys)
    assert "--beta: DAgger settings, taken with --strategy dagger only" in line
    with pytest.raises(ConfigError, match="--takeover_threshold nan: must be a positive finite number"):
        DaggerSettings(takeover_threshold=math.nan)
    with pytest.raises(ConfigError, match="--beta nan"):
        DaggerSettings(beta=math.nan)
    line = refused(evaluate, ["--checkpoint", str(checkpoint), "--env", "hf_vla/ColorReach-v0", "--episodes", "1",
                              "--output_dir", "/proc/x"], capsys)
    assert "--output_dir '/proc/x' cannot be created" in line, line
    assert not (tmp_path / "o").exists()


# ---- the training inputs of the token objective and norm_stats_from ---------------------------------------------------
def test_hand_edited_fast_tokenizers_are_refused_naming_the_field(tmp_path):
    from hf_vla.models.pi05.fast_tokenizer import FASTActionTokenizer, FASTError

    fast = FASTActionTokenizer.fit(np.random.default_rng(0).uniform(-1, 1, (64, 5, 2)), vocab_size=256)
    path = fast.save_pretrained(tmp_path / "good")
    assert FASTActionTokenizer.from_pretrained(path).vocab_size == 256
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(FASTError, match=rf"FAST tokenizer {garbage}: cannot be read \(UnicodeDecodeError"):
        FASTActionTokenizer.from_pretrained(garbage)
    for field, value, message in (("vocab_size", 100, "vocab_size=100 but its BPE vocabulary has"),
                                  ("scale", 0, "scale=0.0 must be a finite number > 0"),
                                  ("scale", math.nan, "scale=nan must be a finite number > 0"),
                                  ("chunk_size", 0, "chunk_size=0 must be an integer of at least 1")):
        edited = tmp_path / f"{field}_{value}.json"
        edited.write_text(json.dumps(json.loads(path.read_text()) | {field: value}))
        with pytest.raises(FASTError, match=message):
            FASTActionTokenizer.from_pretrained(edited)


def test_a_model_vocabulary_smaller_than_its_tokenizer_is_said_so():
    from hf_vla import PI05Processor
    from hf_vla.models.pi05.fast_tokenizer import FASTActionTokenizer
    from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config

    fast = FASTActionTokenizer.fit(np.random.default_rng(0).uniform(-1, 1, (64, 5, 2)), vocab_size=256)
    tokenizer = build_tiny_tokenizer(locations=True)
    processor = PI05Processor.from_config(tiny_pi05_config(), tokenizer)
    with pytest.raises(ValueError, match=rf"vocabulary of 1024 is smaller than its tokenizer's {len(tokenizer)} "
                                         "tokens, so no FAST vocabulary fits"):
        processor.set_fast_tokenizer(fast, 1024)


def _with_plans(root, steps: int, action_dim: int = 2):
    """A per-frame `plan` column of `steps` x `action_dim` values (zeros) in a toy dataset and its info.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        column = pa.array([[0.0] * (steps * action_dim)] * table.num_rows, type=pa.list_(pa.float32()))
        pq.write_table(table.append_column("plan", column), path)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["plan"] = {"dtype": "float32", "shape": [steps * action_dim], "names": None}
    info_path.write_text(json.dumps(info, indent=2))
    return root


def test_short_plans_and_nan_statistics_are_one_line_at_start_up(tmp_path, capsys):
    """Per-frame chunks (`action_chunk_key`) shorter than chunk_size with the token objective (its FAST fit read them
    first: a broadcast traceback), and a `norm_stats_from` file with a NaN: one line at start-up naming the culprit."""
    from test_data import make_dataset
    from test_failures import base_config, run_fails, write_config

    root = _with_plans(make_dataset(tmp_path / "toy", 4), steps=2)
    config = base_config(root, tmp_path / "out", token_loss=True, fast_vocab_size=256)
    config["datasets"][0]["action_chunk_key"] = "plan"
    _, message = run_fails(capsys, write_config(tmp_path, config), code=2)
    assert "dataset 'toy': action_chunk_key 'plan' holds 2 steps per frame, fewer than chunk_size 4" in message

    stats = {"arm_a::joint": {key: {name: [0.0] * 2 for name in ("q01", "q99", "mean", "std")}
                              for key in ("state", "actions")}}
    stats["arm_a::joint"]["actions"]["q01"] = [0.0, math.nan]
    saved = tmp_path / "norm_stats.json"
    saved.write_text(json.dumps({"norm_stats": stats}))
    plain = _with_plans(make_dataset(tmp_path / "plain", 4, state_dim=2), steps=4)
    config = base_config(plain, tmp_path / "out", norm_stats_from=str(saved))
    _, message = run_fails(capsys, write_config(tmp_path, config), code=2)
    assert f"norm_stats_from: {saved} head 'arm_a::joint' actions q01: NaN or inf at dims [1]" in message, message
