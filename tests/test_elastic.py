"""Elastic resume: a checkpoint of 2 processes continues in 1, and one of 1 in 2, under FSDP2 (both ways) and DDP
(2 -> 1) (gloo on CPU, `python -m hf_vla.train` unchanged, every training batch's provenance recorded by
tests/elastic_run.py).

Within the epoch under way no sample is repeated or skipped across the change: the samples consumed before the
checkpoint and the pieces the resumed stream re-shards cover every frame exactly once, and the resumed run consumes
every piece (the rest of what it draws is the next epoch, each frame once). The loss continues where it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
from conftest import REPO
from test_data import make_dataset
from test_failures import base_config, write_config

TESTS = REPO / "tests"
SAVE = 6  # the checkpoint the second run resumes from
LAUNCHERS = {"ddp": "ddp.yaml", "fsdp2": "fsdp2.yaml"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("elastic") / "toy", 6)  # 87 frames: episodes of 12..17


def launch(engine: str, processes: int, config_path, record, port: int, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS), HF_VLA_CPU_SHARDING="1")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / LAUNCHERS[engine]), "--num_processes", str(processes),
               "--main_process_port", str(port), "--mixed_precision", "no"]
    if processes == 1:
        command += ["--num_machines", "1"]
    result = subprocess.run([*command, str(TESTS / "elastic_run.py"), str(record), str(config_path), *overrides],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    return result.stderr


def recorded(prefix) -> list[dict]:
    lines = []
    for path in sorted(prefix.parent.glob(prefix.name + ".rank*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    return lines


def losses(output_dir) -> dict[int, float]:
    state = json.loads(max(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
                       .joinpath("trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.mark.slow
# FSDP2 both ways (a sharded checkpoint gathered into one process, a full one sharded over two); DDP one way: its
# checkpoint is the same on every rank, and the stream's re-sharding (what differs by direction) is engine-independent
@pytest.mark.parametrize("engine, before, after", [("fsdp2", 2, 1), ("fsdp2", 1, 2), ("ddp", 2, 1)])
def test_resume_on_another_number_of_processes_consumes_the_epoch_once(engine, before, after, data, tmp_path):
    port = 29700 + 10 * list(LAUNCHERS).index(engine) + before
    per_sample = 4  # samples per optimizer step in both runs: per-device batch 4 / processes
    steps = 30  # long enough to finish the epoch's remaining pieces
    # the first run goes on uninterrupted to `steps` (its loss curve is the reference); the second resumes at SAVE
    config = base_config(data, tmp_path / "first", max_steps=steps, save_strategy="steps", save_steps=SAVE,
                         per_device_train_batch_size=per_sample // before, validation_ratio=0, logging_steps=1)
    first = write_config(tmp_path, config, "first.json")
    launch(engine, before, first, tmp_path / "first_batches", port)
    checkpoint = tmp_path / "first" / f"checkpoint-{SAVE}"
    second = write_config(tmp_path, config | {"output_dir": str(tmp_path / "second"), "save_steps": steps,
                                              "per_device_train_batch_size": per_sample // after}, "second.json")
    log = launch(engine, after, second, tmp_path / "second_batches", port + 5, "--resume_from_checkpoint",
                 str(checkpoint))
    assert "the stream layout changed (world_size" in log and f"resuming at step {SAVE}" in log
    consumed = Counter(tuple(s) for line in recorded(tmp_path / "first_batches") for s in line["samples"]
                       if line["step"] <= SAVE)
    assert sum(consumed.values()) == SAVE * per_sample
    state = json.loads((tmp_path / "second" / f"checkpoint-{steps}" / "stream_state.json").read_text())
    assert state["world_size"] == after and state["segment"]["index"] == 1
    pieces = Counter((0, episode, frame) for episode, start, end in state["segment"]["pieces"][0]
                     for frame in range(start, end))
    frames = Counter((0, e, f) for e in range(6) for f in range(12 + e))
    assert consumed + pieces == frames  # before the change + what was left: every frame of the epoch once
    resumed = [tuple(s) for line in recorded(tmp_path / "second_batches") for s in line["samples"]]
    assert {line["step"] for line in recorded(tmp_path / "second_batches")} == set(range(SAVE + 1, steps + 1))
    assert len(resumed) == (steps - SAVE) * per_sample
    drawn = Counter(resumed)
    assert not pieces - drawn  # every remaining piece was drawn after the change
    rest = drawn - pieces  # and the rest is the next epoch: no frame twice
    assert max(rest.values(), default=1) == 1
    # the loss continues: after the change it is the uninterrupted run's, within that run's step-to-step noise
    import numpy as np

    window = range(SAVE + 1, steps + 1)
    reference, resumed_losses = losses(tmp_path / "first"), losses(tmp_path / "second")
    expected = np.array([reference[s] for s in window])
    got = np.array([resumed_losses[s] for s in window])
    noise = expected.std()
    assert abs(got.mean() - expected.mean()) < noise, (got.mean(), expected.mean(), noise)
    # the first steps after the change: within the range the uninterrupted run's losses span (they are heavy-tailed)
    assert got[:3].max() < 1.5 * expected.max(), (got[:3], expected.max())
