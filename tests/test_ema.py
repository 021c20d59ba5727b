"""EMA of the weights (hf_vla.training.ema): after k steps it equals a float64 reference computed from the recorded weights
(1e-6), in one process and under DDP, FSDP2, ZeRO-2 and ZeRO-3 (2 gloo processes on CPU); the saved model holds the
average (or the raw weights with ema_save_raw); kill-and-resume with EMA is bitwise equal to the uninterrupted run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file
from test_data import make_dataset
from test_failures import base_config, write_config

from hf_vla.errors import ConfigError

TESTS = REPO / "tests"
DECAY, START, STEPS = 0.8, 2, 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("ema") / "toy", 6)


def reference(record: dict) -> dict[str, torch.Tensor]:
    """The float64 EMA: it follows the weights up to step START, then ema = d * ema + (1 - d) * w."""
    ema = None
    for step, weights in enumerate(record["steps"], start=1):
        ema = [w.clone() for w in weights] if step <= START else [DECAY * e + (1 - DECAY) * w for e, w in zip(ema, weights)]
    return dict(zip(record["names"], ema))


def saved_parameters(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path)
    return {name: p.detach().double() for name, p in model.named_parameters()}


def run(engine, data, tmp_path, port, **overrides):
    config = base_config(data, tmp_path / "out", max_steps=STEPS, ema_decay=DECAY, ema_start_step=START,
                         per_device_train_batch_size=2, **overrides)
    path = write_config(tmp_path, config)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS), HF_VLA_CPU_SHARDING="1")
    if engine == "single":
        command = [sys.executable, str(TESTS / "ema_run.py")]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(REPO / "configs" / "accelerate" / f"{engine}.yaml"), "--num_processes", "2",
                   "--main_process_port", str(port), "--mixed_precision", "no", str(TESTS / "ema_run.py")]
    result = subprocess.run([*command, str(tmp_path / "record.pt"), str(path)], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stderr[-5000:]
    return torch.load(tmp_path / "record.pt", weights_only=False), tmp_path / "out"


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["single", "ddp", "fsdp2", "zero2", "zero3"])
def test_ema_equals_the_float64_reference_and_is_the_saved_model(engine, data, tmp_path):
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    record, out = run(engine, data, tmp_path, 29740 + ["single", "ddp", "fsdp2", "zero2", "zero3"].index(engine))
    assert len(record["steps"]) == STEPS
    expected, saved = reference(record), saved_parameters(out)
    assert set(expected) <= set(saved)
    worst = max(float((saved[name] - value).abs().max()) for name, value in expected.items())
    assert worst < 1e-6, worst
    last = dict(zip(record["names"], record["steps"][-1]))  # and the average is not the last weights
    assert max(float((saved[n] - last[n]).abs().max()) for n in expected) > 1e-4
    card = (out / "README.md").read_text()
    assert "exponential moving average of the training weights (decay 0.8" in card


def test_ema_save_raw_keeps_the_raw_weights(data, tmp_path):
    record, out = run("single", data, tmp_path, 0, ema_save_raw=True)
    saved, last = saved_parameters(out), dict(zip(record["names"], record["steps"][-1]))
    assert all(torch.equal(saved[n], last[n]) for n in last)


def test_the_model_pushed_to_the_hub_is_the_average(data, tmp_path):
    """`Trainer.push_to_hub` saves the model into the output directory again before it uploads: that save keeps the
    average (it wrote the raw weights over it, and pushed them)."""
    from hf_vla.train import main

    config = base_config(data, tmp_path / "out", max_steps=STEPS, ema_decay=DECAY, ema_start_step=START,
                         per_device_train_batch_size=2)
    trainer = main([str(write_config(tmp_path, config))])
    average = saved_parameters(tmp_path / "out")
    trainer.save_model(_internal_call=True)  # what Trainer.push_to_hub does first
    pushed = saved_parameters(tmp_path / "out")
    assert all(torch.equal(pushed[name], average[name]) for name in average)
    raw = {name: p.detach().double() for name, p in trainer.model.named_parameters()}  # the average is not these
    assert max(float((raw[name] - average[name]).abs().max()) for name in average if name in raw) > 1e-4


def test_kill_and_resume_with_ema_is_bitwise(data, tmp_path):
    from hf_vla.train import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = base_config(data, tmp_path / "full", max_steps=STEPS, ema_decay=DECAY, ema_start_step=START,
                             save_strategy="steps", save_steps=3)
        main([str(write_config(tmp_path, config, "full.json"))])
        resumed = tmp_path / "resumed"
        resumed.mkdir()
        shutil.copytree(tmp_path / "full" / "checkpoint-3", resumed / "checkpoint-3")  # as if killed after step 3
        assert (resumed / "checkpoint-3" / "ema_rank0.pt").is_file()
        config = config | {"output_dir": str(resumed), "resume_from_checkpoint": True}
        main([str(write_config(tmp_path, config, "resumed.json"))])
    finally:
        torch.set_num_threads(threads)
    expected, got = load_file(tmp_path / "full" / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    a = torch.load(tmp_path / "full" / "checkpoint-6" / "ema_rank0.pt", weights_only=True)
    b = torch.load(resumed / "checkpoint-6" / "ema_rank0.pt", weights_only=True)
    assert all(torch.equal(x, y) for x, y in zip(a["shadow"], b["shadow"]))


def test_ema_arguments_are_checked():
    from hf_vla.training.arguments import parse_config

    with pytest.raises(ConfigError, match="ema_decay=1.5"):
        parse_config(REPO / "configs/demo.json", ["--ema_decay", "1.5"])


def test_evaluation_runs_on_the_average_and_lora_averages_only_what_trains(data, tmp_path):
    from hf_vla.train import main

    config = base_config(data, tmp_path / "lora", max_steps=4, ema_decay=DECAY, ema_eval_raw=True, lora_preset="expert",
                         validation_ratio=0.3, per_device_train_batch_size=2)
    trainer = main([str(write_config(tmp_path, config, "lora.json"))])
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainer._ema.names == trainable and len(trainable) < sum(1 for _ in trainer.model.parameters())
    assert all("lora_" in n or "action_" in n or "time_mlp" in n for n in trainable)
    final = next(entry for entry in reversed(trainer.state.log_history) if "eval_loss" in entry)
    assert "eval_raw_loss" in final and final["eval_loss"] != final["eval_raw_loss"]  # two passes, two weight sets
    loader = trainer.get_eval_dataloader()
    assert trainer._evaluation_pass(loader, "check").metrics["check_loss"] == final["eval_raw_loss"]
    with trainer._ema.swapped():  # eval_loss measured the average
        assert trainer._evaluation_pass(loader, "check").metrics["check_loss"] == final["eval_loss"]
