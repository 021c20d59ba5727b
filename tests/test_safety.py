"""Every command fails as safely as train does: one line naming the culprit, exit 2 for a bad argument (1 for a data,
connection or run fault), the input untouched and no partial output.

convert never destroys its input; one run per output_dir; corrupt parquet pages are caught at start-up; evaluate and
serve check their arguments before loading anything; a resume with another gradient_accumulation_steps keeps the stream
position exact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO
from test_failures import _data_file, _set_vector, assert_no_output, base_config, run_fails, write_config
from test_processor_convert import _tiny_variants, _write_lerobot_checkpoint, build_lerobot_pi05

from hf_vla import convert
from hf_vla.train import main
from hf_vla.training.run_lock import LOCK_NAME, RunLock


def tree_hash(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def fails(capsys, command, argv, code=2) -> str:
    """Run a command's `cli` expecting exit `code`; returns its one stderr line."""
    with pytest.raises(SystemExit) as exited:
        command(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]  # progress bars of a loaded model may precede it
    assert exited.value.code == code, lines
    assert [line for line in lines if ": error: " in line] == lines[-1:] and "Traceback" not in err, lines
    return lines[-1]


# ---- convert ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lerobot_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    path = tmp_path_factory.mktemp("convert") / "lerobot"
    _write_lerobot_checkpoint(path, build_lerobot_pi05(seed=5), "pi05", tiny_tokenizer_dir)
    return path


@pytest.fixture
def source(lerobot_checkpoint, tmp_path):
    """A private copy of the lerobot checkpoint, and its files' hashes."""
    copy = tmp_path / "lerobot"
    shutil.copytree(lerobot_checkpoint, copy)
    return copy, tree_hash(copy)


def test_convert_never_writes_into_or_around_its_input(source, tmp_path, capsys, tiny_tokenizer_dir):
    path, before = source
    tok = ["--tokenizer", str(tiny_tokenizer_dir)]
    cases = [
        (path, "is --input"),
        (path / "converted", "is inside --input"),
        (tmp_path, "contains --input"),
    ]
    with _tiny_variants():
        for output, culprit in cases:
            line = fails(capsys, convert.cli, ["--input", str(path), "--output", str(output), *tok])
            assert line.startswith("hf_vla.convert: error: --output") and culprit in line, line
            assert tree_hash(path) == before  # not one byte of the input changed
        assert not (path / "converted").exists()


def test_convert_failure_leaves_nothing(source, tmp_path, capsys):
    """The default tokenizer cannot load offline: found before anything is written; no output, no staging dir."""
    path, before = source
    with _tiny_variants():
        line = fails(capsys, convert.cli, ["--input", str(path), "--output", str(tmp_path / "out")])
    assert "--tokenizer 'google/paligemma-3b-pt-224' could not be loaded" in line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.converting-*"))
    assert tree_hash(path) == before


def test_convert_a_truncated_weights_file_is_one_line(source, tmp_path, capsys, tiny_tokenizer_dir):
    """A model.safetensors cut off by a download or copy: one line naming the file, exit 1, nothing written."""
    path, _ = source
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    tok = ["--tokenizer", str(tiny_tokenizer_dir)]
    for size in (len(data) // 2, 40):  # tensors cut off; the header itself cut off
        weights.write_bytes(data[:size])
        with _tiny_variants():
            line = fails(capsys, convert.cli, ["--input", str(path), "--output", str(tmp_path / "out"), *tok], code=1)
        assert line.startswith(f"hf_vla.convert: error: {weights}: not a complete safetensors file ("), line
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.converting-*"))


def test_convert_replaces_an_existing_output_only_when_asked(source, tmp_path, capsys, tiny_tokenizer_dir):
    from transformers import AutoModel

    path, before = source
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    tok = ["--tokenizer", str(tiny_tokenizer_dir)]
    with _tiny_variants():
        line = fails(capsys, convert.cli, ["--input", str(path), "--output", str(out), *tok])
        assert "exists and is not empty" in line and "--overwrite" in line
        assert (out / "keep.txt").read_text() == "mine"
        line = fails(capsys, convert.cli, ["--input", str(path), "--output", str(out), *tok, "--overwrite"])
        assert "holds files hf_vla did not write (keep.txt" in line  # a folder convert did not write: never replaced
        assert (out / "keep.txt").read_text() == "mine"
        (out / "keep.txt").unlink()
        convert.cli(["--input", str(path), "--output", str(out), *tok])
        assert capsys.readouterr().out.strip().endswith(f"wrote {out}")  # success says where, in one line
        (out / "keep.txt").write_text("stale")
        convert.cli(["--input", str(path), "--output", str(out), *tok, "--overwrite"])  # its own output: replaced
    assert not (out / "keep.txt").exists() and AutoModel.from_pretrained(out) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lerobot", "out"]  # no staging left
    assert tree_hash(path) == before


def test_convert_argument_errors(tmp_path, capsys):
    line = fails(capsys, convert.cli, ["--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
    assert f"--input '{tmp_path / 'nope'}': no such directory" in line
    line = fails(capsys, convert.cli, ["--input", str(tmp_path), "--output", str(tmp_path / "o")])
    assert "not a lerobot checkpoint directory (no config.json or model.safetensors)" in line
    line = fails(capsys, convert.cli, ["--output", "x"])
    assert "the following arguments are required: --input" in line


# ---- one run per output_dir --------------------------------------------------------------------------------------
HOLDER = """
import sys, time
from hf_vla.training.run_lock import RunLock
with RunLock(sys.argv[1]):
    print("holding", flush=True)
    time.sleep(120)
"""


def test_a_second_run_into_a_live_output_dir_stops_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "holding"
        path = write_config(tmp_path, base_config(tmp_path / "unused", out))
        _, message = run_fails(capsys, path, code=2)
        assert f"is in use by another run: pid {holder.pid} on host '{socket.gethostname()}'" in message, message
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing of the holder's was touched
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_lock_is_taken_over(tmp_path, caplog):
    """A lock of a dead pid on this host is taken over at once; one from another host only once its heartbeat is
    older than the stale limit; the lock is released (and an empty output_dir removed) at exit."""
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "started": "x",
                                             "command": "old"}))
    with caplog.at_level("WARNING", logger="hf_vla.train"), RunLock(out) as lock:
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"pid {int(dead.stdout)} on this host is gone" in caplog.text and not (out / LOCK_NAME).exists()
    other = {"host": "node-17", "pid": 1, "started": "x", "command": "old"}
    (out / LOCK_NAME).write_text(json.dumps(other))
    with pytest.raises(ValueError, match="in use by another run: pid 1 on host 'node-17'"):
        RunLock(out, stale_after_s=60).acquire()
    old = time.time() - 120
    os.utime(out / LOCK_NAME, (old, old))
    with RunLock(out, stale_after_s=60) as lock:
        assert lock.path.exists()
    assert "no heartbeat for 120 s" in caplog.text
    fresh = tmp_path / "fresh"
    with RunLock(fresh):
        assert (fresh / LOCK_NAME).exists()
    assert not fresh.exists()  # created by the lock, left empty: removed


def test_the_lock_heartbeat_keeps_a_long_run_alive(tmp_path):
    with RunLock(tmp_path / "out", heartbeat_s=0.05) as lock:
        old = time.time() - 1000
        os.utime(lock.path, (old, old))
        time.sleep(0.3)
        assert time.time() - lock.path.stat().st_mtime < 5


# ---- corrupt parquet pages ---------------------------------------------------------------------------------------
def test_page_checksums_are_verified(data, tmp_path, capsys):
    """A data file written with page CRCs (pyarrow's write_page_checksum) and damaged inside a page body: refused at
    start-up naming the file (the same damage without CRCs decodes to wrong values silently)."""
    path = _data_file(data)
    pq.write_table(pq.read_table(path), path, write_page_checksum=True, compression="NONE", use_dictionary=False)
    metadata = pq.ParquetFile(path).metadata
    names = [metadata.schema.column(i).path for i in range(metadata.num_columns)]
    column = metadata.row_group(0).column(next(i for i, name in enumerate(names) if name.startswith("observation.state")))
    raw = bytearray(path.read_bytes())
    end = column.data_page_offset + column.total_compressed_size
    raw[end - 40 : end - 8] = os.urandom(32)  # inside the last page's values, its header intact
    path.write_bytes(bytes(raw))
    _, message = run_fails(capsys, write_config(tmp_path, base_config(data, tmp_path / "out")), code=1)
    assert str(path) in message and "CRC" in message, message
    assert_no_output(tmp_path / "out")


def test_values_far_outside_the_robust_range_are_refused(data, tmp_path, capsys):
    _set_vector(data, "observation.state", [(3, 4, 2)], 1.5e38)
    _, message = run_fails(capsys, write_config(tmp_path, base_config(data, tmp_path / "out")), code=1)
    for culprit in ("column 'observation.state'", str(_data_file(data)), "episode 3, frame 4, dim 2: 1.5e+38",
                    "widths outside the column's q01..q99 range", "outlier_widths"):
        assert culprit in message, message
    assert_no_output(tmp_path / "out")
    config = base_config(data, tmp_path / "out2")
    config["datasets"][0]["outlier_widths"] = None  # the documented override: trains
    main([str(write_config(tmp_path, config, "override.json"))])
    _, message = run_fails(capsys, write_config(tmp_path, {**config, "datasets": [
        {**config["datasets"][0], "outlier_widths": -1}]}, "bad.json"), code=2)
    assert "outlier_widths must be a positive number or null, got -1" in message


@pytest.fixture
def data(tmp_path):
    from test_data import make_dataset

    return make_dataset(tmp_path / "toy", 6)


# ---- evaluate and serve: arguments checked up front --------------------------------------------------------------
@pytest.fixture(scope="module")
def served_checkpoint(tmp_path_factory, tiny_tokenizer):
    from test_serve import NORM_STATS, demo_config

    from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor

    path = tmp_path_factory.mktemp("safety_ckpt")
    model = PI05ForConditionalGeneration(demo_config())
    model.save_pretrained(path)
    PI05Processor.from_config(model.config, tiny_tokenizer, norm_stats=NORM_STATS).save_pretrained(path)
    return path


def test_evaluate_argument_errors(served_checkpoint, tmp_path, capsys):
    from hf_vla.evaluate import cli

    ckpt = ["--checkpoint", str(served_checkpoint)]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (ckpt + ["--n_action_steps", "-100"], "--n_action_steps=-100: must be positive"),
        (ckpt + ["--episodes", "0"], "--episodes=0: must be positive"),
        (ckpt + ["--inference_delay", "-1"], "--inference_delay=-1: must be >= 0"),
        (["--checkpoint", str(tmp_path / "missing" / "run")], f"--checkpoint '{tmp_path / 'missing' / 'run'}': no such"),
        (["--checkpoint", str(a_file)], "is a file, not a checkpoint directory"),
        (["--server", "http://127.0.0.1:8000"], "--server 'http://127.0.0.1:8000': expected ws://HOST:PORT"),
        (ckpt + ["--env", "NoSuchEnv-v9"], "--env 'NoSuchEnv-v9': "),
        (ckpt + ["--output_dir", str(a_file / "out")], f"{a_file} is a file, not a directory"),
        (ckpt + ["--head", "nope::x", "--episodes", "1"], "head: unknown normalization head 'nope::x'"),
        (ckpt + ["--n_action_steps", "9", "--episodes", "1"], "n_action_steps=9: must be 1..8"),
        (["--checkpoint", "some-org/not-cached"], "Hub checkpoint 'some-org/not-cached' is not in the local Hub cache"),
        (ckpt + ["--cameras", "observation.nope"], "--cameras: ['observation.nope'] is not an image of the env's "
                                                   "observations; it has ['observation.image']"),
        (ckpt + ["--cameras", "observation.image", "observation.image"], "--cameras: ['observation.image'] given more "
                                                                         "than once"),
        (ckpt + ["--env", "metaworld", "--task", "reach-v3", "--cameras", "top"], "--cameras: ['top'] is not an image"),
    ]
    import transformers

    loads = []
    original = transformers.AutoModel.from_pretrained
    transformers.AutoModel.from_pretrained = lambda *a, **k: loads.append(a) or original(*a, **k)
    try:
        for argv, _ in cases[-3:]:  # refused before the model loads
            fails(capsys, cli, argv)
        assert loads == []
    finally:
        transformers.AutoModel.from_pretrained = original
    for argv, culprit in cases:
        line = fails(capsys, cli, argv)
        assert line.startswith("hf_vla.evaluate: error: ") and culprit in line, line
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    line = fails(capsys, cli, ["--server", f"ws://127.0.0.1:{port}", "--episodes", "1"], code=1)
    assert f"cannot connect to the policy server ws://127.0.0.1:{port}" in line
    assert not (served_checkpoint / "rollouts").exists()


def test_serve_argument_errors(served_checkpoint, tmp_path, capsys):
    from hf_vla.serve import cli

    cases = [
        (["--checkpoint", str(tmp_path / "nowhere" / "x")], "no such directory"),
        (["--checkpoint", str(served_checkpoint), "--port", "70000"], "--port 70000: must be 0..65535"),
        (["--checkpoint", str(served_checkpoint), "--max_batch", "0"], "--max_batch: must be positive"),
        (["--checkpoint", str(served_checkpoint), "--obs_map", str(tmp_path / "map.json")], "--obs_map: observation map"),
    ]
    for argv, culprit in cases:
        line = fails(capsys, cli, argv)
        assert line.startswith("hf_vla.serve: error: ") and culprit in line, line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = fails(capsys, cli, ["--checkpoint", str(served_checkpoint), "--host", "127.0.0.1", "--port", str(port)],
                     code=1)
    assert f"cannot listen on 127.0.0.1:{port}" in line


# ---- resume with another gradient_accumulation_steps -------------------------------------------------------------
def _recorded_run(config_path, seen: list):
    """`main` with every training batch's provenance (episode and state, which tells the frame) recorded."""
    from hf_vla.training import trainer as trainer_module

    original = trainer_module.VLATrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        seen.append(list(zip(inputs["episode_index"].tolist(), inputs["state"].sum(-1).round(decimals=5).tolist())))
        return original(self, model, inputs, *args, **kwargs)

    trainer_module.VLATrainer.compute_loss = recording
    try:
        main([str(config_path)])
    finally:
        trainer_module.VLATrainer.compute_loss = original


def test_resume_with_other_gradient_accumulation_keeps_the_stream_position(tmp_path, caplog):
    """4 steps at GA 3 (12 batches), resumed at GA 2 for 2 more steps: the stream state says 12 + 4 = 16 batches drawn
    (it said 6 x 2 = 12 before), and the resumed run trains on exactly the batches 12..15 of an uninterrupted stream."""
    from test_data import make_dataset

    data = make_dataset(tmp_path / "toy", 6)
    config = base_config(data, tmp_path / "out", max_steps=4, gradient_accumulation_steps=3, save_strategy="steps",
                         save_steps=4, per_device_train_batch_size=2)
    main([str(write_config(tmp_path, config))])
    state = json.loads((tmp_path / "out" / "checkpoint-4" / "stream_state.json").read_text())
    assert state["batches_consumed"] == 12 and state["gradient_accumulation_steps"] == 3
    resumed, reference = [], []
    with caplog.at_level("WARNING"):
        _recorded_run(write_config(tmp_path, config | {"max_steps": 6, "gradient_accumulation_steps": 2, "save_steps": 6,
                                                       "resume_from_checkpoint": True}, "resume.json"), resumed)
    state = json.loads((tmp_path / "out" / "checkpoint-6" / "stream_state.json").read_text())
    assert state["batches_consumed"] == 16, state
    assert "gradient_accumulation_steps 2 (the checkpoint used 3)" in caplog.text
    _recorded_run(write_config(tmp_path, config | {"max_steps": 16, "gradient_accumulation_steps": 1,
                                                   "save_strategy": "no", "output_dir": str(tmp_path / "ref")},
                               "reference.json"), reference)
    assert len(resumed) == 4 and resumed == reference[12:16]


def test_record_argument_errors(tmp_path, capsys):
    from hf_vla.record import cli

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    cases = [
        (["--env", "color_reach", "--episodes", "0", "--output", str(tmp_path / "a")], "episodes=0: must be positive"),
        (["--env", "color_reach", "--episodes", "2", "--output", str(taken)],
         "exists and is not empty: choose a new directory"),
        (["--env", "color_reach", "--episodes", "2", "--task", "reach", "--output", str(tmp_path / "b")],
         "ColorReach draws its instruction per episode"),
        (["--env", "atari", "--episodes", "2", "--output", str(tmp_path / "c")], "argument --env: invalid choice"),
        (["--env", "metaworld", "--episodes", "2", "--cameras", "", "--output", str(tmp_path / "d")],
         "--cameras '': empty"),  # recorded the default camera in silence
    ]
    for argv, culprit in cases:
        line = fails(capsys, cli, argv)
        assert line.startswith("hf_vla.record: error: ") and culprit in line, line
    assert (taken / "x").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


@pytest.mark.parametrize("command", ["train", "evaluate", "serve", "record", "convert", "rl.__main__"])
def test_a_binary_config_file_is_one_line(command, tmp_path, capsys):
    """Each command reads its config file through the one parser: a binary file (an image, a checkpoint) given as the
    config is one line naming it (was a UnicodeDecodeError traceback)."""
    import importlib

    config = tmp_path / "config.json"
    config.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    line = fails(capsys, importlib.import_module(f"hf_vla.{command}").cli, [str(config)])
    assert f"{config}: not a JSON config file (not UTF-8 text" in line, line


def test_train_without_a_config_file_says_so(capsys):
    from hf_vla.train import cli

    line = fails(capsys, cli, ["--max_steps", "1"])
    assert "the first argument must be a config file (a .json path), got '--max_steps'" in line, line
