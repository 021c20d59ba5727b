"""Preemption (hf_vla.training.preemption): SIGTERM at a random step, or during a checkpoint save, writes a complete
checkpoint of that step and exits 75; resuming from it ends bitwise equal to the uninterrupted run, in one process
and under a 2-process DDP launch where only one rank got the signal; a second signal exits at once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from test_failures import base_config, make_dataset, write_config

from hf_vla.errors import Preempted
from hf_vla.training import checkpoints
from hf_vla.training.preemption import SIGNALS

STEPS = 30


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("preemption")
    data = make_dataset(base / "toy", 6)
    config = base_config(data, base / "unused", max_steps=STEPS, save_strategy="steps", save_steps=1000)
    reference = base / "reference"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    subprocess.run([sys.executable, "-m", "hf_vla.train", str(write_config(base, config | {"output_dir":
                    str(reference)}, "reference.json"))], env=env, check=True, capture_output=True, timeout=600)
    return base, config, env, load_file(reference / "model.safetensors")


def assert_equal(got: dict, expected: dict):
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def start_and_signal(command, env, after_steps: int, signals=1, pid_of=None):
    """Start `command`, wait until it has logged `after_steps` losses, then send SIGTERM (to `pid_of(process)` if
    given, else the process itself) `signals` times."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    seen = 0
    for line in process.stdout:
        seen += "'loss'" in line
        if seen >= after_steps:
            break
    target = pid_of(process) if pid_of else process.pid
    for _ in range(signals):
        os.kill(target, signal.SIGTERM)
        time.sleep(0.05)
    out, err = process.communicate(timeout=600)
    return process.returncode, err


def test_sigterm_to_the_whole_process_group_with_dataloader_workers(setup):
    """`timeout`, `kill -TERM -PGID` and batch systems signal every process of the job, DataLoader workers included.
    The workers ignore it; the main process finishes the step, writes that step's checkpoint and exits 75 with the
    resume command (not a failed save), no worker is left behind, and the resumed run is bitwise the uninterrupted
    one."""
    base, config, env, expected = setup
    out = base / "group"
    path = write_config(base, config | {"output_dir": str(out), "dataloader_num_workers": 1}, "group.json")
    process = subprocess.Popen([sys.executable, "-m", "hf_vla.train", str(path)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True)
    seen = 0
    for line in process.stdout:
        seen += "'loss'" in line
        if seen >= 4:
            break
    group = os.getpgid(process.pid)
    workers = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()
    assert len(workers) >= 2, "the DataLoader worker runs in the run's process group"
    os.killpg(group, signal.SIGTERM)
    _, err = process.communicate(timeout=600)
    last = err.strip().splitlines()[-1]
    assert process.returncode == 75, err[-3000:]
    assert "killed by signal" not in err and "failed" not in last and "free space" not in err
    assert last.startswith("hf_vla.train: stopped: stopped by SIGTERM at step ") and "--resume_from_checkpoint" in last
    step = int(last.split("at step ")[1].split(":")[0])
    assert checkpoints.last_complete_checkpoint(out)[0] == out / f"checkpoint-{step}" and 4 <= step < STEPS
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-g", str(group)], capture_output=True).returncode == 0:  # workers follow the main
        assert time.monotonic() < deadline, "a DataLoader worker outlived the run"
        time.sleep(0.5)
    resumed = subprocess.run([sys.executable, "-m", "hf_vla.train", str(path), "--resume_from_checkpoint", "true"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_equal(load_file(out / "model.safetensors"), expected)


@pytest.mark.slow
def test_sigterm_at_a_random_step_saves_that_step_and_resume_is_bitwise(setup):
    base, config, env, expected = setup
    out = base / "sigterm"
    path = write_config(base, config | {"output_dir": str(out)}, "sigterm.json")
    after = random.Random().randint(3, 15)
    code, err = start_and_signal([sys.executable, "-m", "hf_vla.train", str(path)], env, after)
    last = err.strip().splitlines()[-1]
    assert code == 75, err[-3000:]
    assert last.startswith("hf_vla.train: stopped: stopped by SIGTERM at step ") and "--resume_from_checkpoint" in last
    step = int(last.split("at step ")[1].split(":")[0])
    complete, skipped = checkpoints.last_complete_checkpoint(out)
    assert complete == out / f"checkpoint-{step}" and not skipped and after <= step < STEPS
    assert not (out / "model.safetensors").exists()  # no final save: the run is not finished
    resumed = subprocess.run([sys.executable, "-m", "hf_vla.train", str(path), "--resume_from_checkpoint", "true"],
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_equal(load_file(out / "model.safetensors"), expected)


def test_sigterm_during_a_save_lets_it_finish_and_stops_there(setup, monkeypatch, request):
    from hf_vla.train import main
    from hf_vla.training.trainer import VLATrainer

    base, config, env, expected = setup
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the reference ran (OMP_NUM_THREADS=1): the same reductions, bit for bit
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    out = base / "mid_save"
    original = checkpoints.write_json_atomic
    sent = []

    def write_json_atomic(path, data):  # the stream state: written in the middle of the checkpoint save
        if not sent and "checkpoint-4" in str(path):
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(path, data)

    monkeypatch.setattr(checkpoints, "write_json_atomic", write_json_atomic)
    path = write_config(base, config | {"output_dir": str(out), "save_steps": 2}, "mid_save.json")
    stopped = {}
    original_train = VLATrainer.train

    def train(self, *args, **kwargs):
        try:
            return original_train(self, *args, **kwargs)
        finally:
            stopped["step"] = self.state.global_step
            stopped["summary"] = next(e for e in reversed(self.state.log_history) if "train_runtime" in e)

    monkeypatch.setattr(VLATrainer, "train", train)
    before = {number: signal.getsignal(number) for number in SIGNALS}
    with pytest.raises(Preempted, match="stopped by SIGTERM at step 4"):
        main([str(path)])
    assert sent and stopped["step"] == 4  # no step after the interrupted save
    summary = stopped["summary"]  # the rate of the 4 steps that ran, not of max_steps over their runtime
    assert abs(summary["train_steps_per_second"] * summary["train_runtime"] - 4) < 0.1, summary
    complete, skipped = checkpoints.last_complete_checkpoint(out)
    assert complete == out / "checkpoint-4" and not skipped
    assert {number: signal.getsignal(number) for number in SIGNALS} == before  # the handlers are given back
    monkeypatch.undo()
    trainer = main([str(path), "--resume_from_checkpoint", "true"])
    assert trainer.state.global_step == STEPS
    summary = next(e for e in reversed(trainer.state.log_history) if "train_runtime" in e)
    assert abs(summary["train_steps_per_second"] * summary["train_runtime"] - (STEPS - 4)) < 0.1, summary
    assert_equal(load_file(out / "model.safetensors"), expected)


def test_a_training_that_raises_gives_the_signals_back(setup, tmp_path, monkeypatch):
    """In a long-lived process (a notebook, a service) a training that failed must not keep hf_vla's handlers: its next
    SIGTERM would only set a flag for a trainer that is gone."""
    from transformers import TrainerCallback

    from hf_vla.train import main
    from hf_vla.training.trainer import VLATrainer

    base, config, env, expected = setup

    class Fails(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]  # hf_vla's handler while it trains
            if state.global_step == 2:
                raise RuntimeError("a fault at step 2")

    original_init = VLATrainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(Fails())

    monkeypatch.setattr(VLATrainer, "__init__", init)
    path = write_config(base, config | {"output_dir": str(tmp_path / "fails"), "max_steps": 4}, "fails.json")
    before = {number: signal.getsignal(number) for number in SIGNALS}
    with pytest.raises(RuntimeError, match="a fault at step 2"):
        main([str(path)])
    assert {number: signal.getsignal(number) for number in SIGNALS} == before


@pytest.mark.slow
def test_a_second_signal_exits_at_once(setup):
    base, config, env, _ = setup
    out = base / "twice"
    path = write_config(base, config | {"output_dir": str(out), "max_steps": 2000}, "twice.json")
    code, err = start_and_signal([sys.executable, "-m", "hf_vla.train", str(path)], env, 3, signals=2)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    assert "second SIGTERM: exiting now" in err


@pytest.mark.slow
def test_sigterm_to_one_rank_of_a_ddp_launch_stops_both_at_one_step(setup):
    import psutil

    base, config, env, _ = setup
    config = config | {"per_device_train_batch_size": 2, "max_steps": 20}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29691", "-m",
              "hf_vla.train"]
    reference = base / "ddp_reference"
    subprocess.run([*launch, str(write_config(base, config | {"output_dir": str(reference)}, "ddp_ref.json"))],
                   env=env, check=True, capture_output=True, timeout=600)
    out = base / "ddp"
    path = write_config(base, config | {"output_dir": str(out)}, "ddp.json")

    def rank0(process):  # as if the signal reached one task only: the others learn it from the all-reduce
        deadline = time.time() + 60
        while time.time() < deadline:
            for child in psutil.Process(process.pid).children(recursive=True):
                if child.environ().get("RANK") == "0":
                    return child.pid
            time.sleep(0.1)
        raise AssertionError("no rank-0 worker")

    code, err = start_and_signal([*launch, str(path)], env, 3, pid_of=rank0)
    assert code != 0 and "stopped by SIGTERM at step" in err, err[-3000:]
    steps = {int(line.split("at step ")[1].split(":")[0]) for line in err.splitlines() if "stopped: stopped by" in line}
    assert len(steps) == 1  # every rank names the same step
    (step,) = steps
    complete, skipped = checkpoints.last_complete_checkpoint(out)
    assert complete == out / f"checkpoint-{step}" and not skipped
    resumed = subprocess.run([*launch, str(path), "--resume_from_checkpoint", "true"], env=env, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_equal(load_file(out / "model.safetensors"), load_file(reference / "model.safetensors"))
