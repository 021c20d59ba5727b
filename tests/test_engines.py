"""Every distributed engine, run with `accelerate launch` and the ready-made configs under configs/accelerate/, two
processes over gloo on CPU, `VLATrainer` unchanged (tests/engine_patch.py only lets accelerate's FSDP/DeepSpeed
plugins through on CPU, as it does on GPUs):

- the gradient of one optimizer step (per-device batch 2 x GA 2 x 2 processes) equals the one-batch gradient of the
  same 8 samples in one process, for DDP, FSDP2 (per layer), ZeRO-2 and ZeRO-3 (and with training-time RTC's
  committed prefixes under FSDP2 and ZeRO-3); sharding engines hold half the model; the token objective's gradient
  under DDP, FSDP2, ZeRO-2 and ZeRO-3 (also with every parameter partitioned: the tied LM head);
- kill-and-resume equals the uninterrupted run bitwise (weights, logged losses, epochs, train_loss) for DDP, FSDP2 and
  ZeRO-2 in fp32, and DDP / FSDP2 with a bfloat16 model and fp32 master weights;
- a bf16 run from scratch keeps every rank's parameters and masters identical at every step, with and without LoRA,
  also when the ranks start from different weights.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer import two_datasets  # noqa: F401  (session fixture: two small LeRobot datasets)

from hf_vla.errors import ConfigError
from hf_vla.training.losses import GROUP_KEYS, aggregate, policy_per_sample_loss

TESTS = Path(__file__).parent
REPO = TESTS.parent
pytest.importorskip("deepspeed")

LAUNCHES = {  # name: (accelerate config, engine, mixed precision override or None, scenarios)
    "ddp": ("ddp.yaml", "ddp", "no", ["grad", "resume", "grad_lora", "grad_tokens"]),
    "ddp_bf16": ("ddp.yaml", "ddp", None, ["resume_bf16", "same"]),
    "fsdp2": ("fsdp2.yaml", "fsdp2", "no", ["grad", "resume", "grad_pi0", "grad_rtc", "grad_lora", "grad_tokens"]),
    # a bfloat16 model with master_weights and mixed precision "no": the trainer switches FSDP2 to bf16 mixed precision
    "fsdp2_bf16": ("fsdp2.yaml", "fsdp2", "no", ["resume_bf16"]),
    "zero2": ("zero2.yaml", "zero2", "no", ["grad", "resume", "grad_lora", "grad_tokens"]),
    "zero3": ("zero3.yaml", "zero3", "no", ["grad", "grad_rtc", "grad_lora", "grad_tokens"]),
    # ZeRO-3 with every parameter partitioned (the tiny embedding is otherwise under the persistence threshold and
    # stays whole, as PaliGemma's 257,152 x 2,048 one never does): the tied LM head of the token objective
    "zero3_partitioned": ("zero3.yaml", "zero3", "no", ["grad_tokens"]),
}
DEEPSPEED_OVERRIDES = {"zero3_partitioned": {"stage3_param_persistence_threshold": 0}}

_results: dict = {}


def launched(name, two_datasets, tmp_path_factory):  # noqa: F811
    if name not in _results:
        config, engine, precision, scenarios = LAUNCHES[name]
        out = tmp_path_factory.mktemp(f"engine_{name}")
        port = str(29650 + list(LAUNCHES).index(name))
        config_file = REPO / "configs" / "accelerate" / config
        if name in DEEPSPEED_OVERRIDES:  # the shipped config with the ZeRO settings changed
            config_file = with_zero_settings(config_file, DEEPSPEED_OVERRIDES[name], out)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(config_file), "--num_processes", "2", "--main_process_port", port]
        if precision is not None:
            command += ["--mixed_precision", precision]
        command += [str(TESTS / "engines.py"), engine, str(two_datasets / "a"), str(two_datasets / "b"), str(out),
                    *scenarios]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(TESTS))
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
        assert result.returncode == 0, result.stderr[-5000:]
        _results[name] = {s: torch.load(out / f"{s}.pt", weights_only=False) for s in scenarios}
    return _results[name]


def with_zero_settings(config_file: Path, zero: dict, out: Path) -> Path:
    """A copy of an accelerate DeepSpeed config whose DeepSpeed JSON has `zero` merged into `zero_optimization`."""
    import json

    import yaml

    launch = yaml.safe_load(config_file.read_text())
    deepspeed = json.loads((REPO / launch["deepspeed_config"]["deepspeed_config_file"]).read_text())
    deepspeed["zero_optimization"].update(zero)
    (out / "deepspeed.json").write_text(json.dumps(deepspeed))
    launch["deepspeed_config"]["deepspeed_config_file"] = str(out / "deepspeed.json")
    (out / "accelerate.yaml").write_text(yaml.safe_dump(launch))
    return out / "accelerate.yaml"


def engine_cases(*cases):
    """FSDP2's launch (one ~60 s two-process run) is in the default suite as the sharding engine's representative (DDP's
    gradient is also tests/test_trainer.py's); the other engines' launches are `slow`."""
    return [case if case[0] == "fsdp2" else pytest.param(*case, marks=pytest.mark.slow) for case in cases]


@pytest.mark.parametrize("name,variant", engine_cases(
    ("ddp", "grad"), ("fsdp2", "grad"), ("zero2", "grad"), ("zero3", "grad"),
    ("fsdp2", "grad_rtc"), ("zero3", "grad_rtc"),  # training-time RTC (rtc_max_delay 2) on the sharding engines
    ("ddp", "grad_lora"), ("fsdp2", "grad_lora"), ("zero2", "grad_lora"), ("zero3", "grad_lora"),  # peft LoRA
))
def test_one_step_gradient_equals_one_batch(name, variant, two_datasets, tmp_path_factory):  # noqa: F811
    from distributed_step import add_lora, make_model

    run = launched(name, two_datasets, tmp_path_factory)[variant]
    assert run["world_size"] == 2 and len(run["batches"]) == 4
    expected_engine = {"ddp": "MULTI_CPU", "fsdp2": "FSDP", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}[name]
    assert run["engine"].endswith(expected_engine)
    batch = {k: torch.cat([b[k] for b in run["batches"]]) for k in run["batches"][0]}
    rtc_max_delay = 2 if variant == "grad_rtc" else 0
    model = make_model(rtc_max_delay)
    if variant == "grad_lora":
        model = add_lora(model)
    model.train()
    per_sample, _ = policy_per_sample_loss(model, batch, seed=3, step=0)
    if rtc_max_delay:  # some samples really have a committed prefix
        full = policy_per_sample_loss(make_model(), batch, seed=3, step=0)[0].count
        assert (per_sample.count < full).any()
    aggregate("sample_mean", per_sample, batch[GROUP_KEYS["episode"]]).backward()
    reference = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    grads = {n.removeprefix("module."): g for n, g in run["grads"].items()}
    assert grads.keys() == reference.keys()
    for key, grad in reference.items():
        torch.testing.assert_close(grads[key].float(), grad, atol=1e-6, rtol=1e-5, msg=key)
    share = run["share"]
    assert (0.45 < share < 0.55) if name in ("fsdp2", "zero3") else share == 1.0, share


@pytest.mark.parametrize("name", ["fsdp2", pytest.param("ddp", marks=pytest.mark.slow),
                                  pytest.param("zero2", marks=pytest.mark.slow),
                                  pytest.param("zero3", marks=pytest.mark.slow),
                                  pytest.param("zero3_partitioned", marks=pytest.mark.slow)])
def test_token_objective_gradient_under_sharding(name, two_datasets, tmp_path_factory):  # noqa: F811
    """pi0.5's token objective (CE over the FAST targets + the flow MSE, knowledge insulation) under DDP, FSDP2 and ZeRO:
    the one-step gradient equals one batch's, computed in one process."""
    from distributed_step import make_model

    from hf_vla.training.cotraining import token_per_sample_loss

    run = launched(name, two_datasets, tmp_path_factory)["grad_tokens"]
    assert run["world_size"] == 2 and len(run["batches"]) == 4
    width = max(b["labels"].shape[1] for b in run["batches"])  # each micro-batch pads its targets to its own max
    batch = {k: torch.cat([b[k] for b in run["batches"]]) for k in run["batches"][0] if k != "labels"}
    batch["labels"] = torch.cat([torch.nn.functional.pad(b["labels"], (0, width - b["labels"].shape[1]), value=-100)
                                 for b in run["batches"]])
    model = make_model(token_loss=True).train()
    per_sample, outputs = policy_per_sample_loss(model, batch, seed=3, step=0)
    tokens = token_per_sample_loss(outputs.token_losses, batch["labels"], run["fast_range"])
    groups = batch[GROUP_KEYS["episode"]]
    (aggregate("sample_mean", per_sample, groups) + aggregate("sample_mean", tokens["ce"], groups)).backward()
    reference = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads = {n.removeprefix("module."): g for n, g in run["grads"].items() if g is not None}
    assert any("language_model.norm" in n for n in reference)  # the backbone's last layer trains (CE only: KI)
    if name == "zero3_partitioned":  # every parameter partitioned, the tied head's embedding included
        assert 0.45 < run["share"] < 0.55, run["share"]
    assert {n for n in grads if grads[n].abs().sum() > 0} <= reference.keys()
    for key, grad in reference.items():
        torch.testing.assert_close(grads[key].float(), grad, atol=1e-6, rtol=1e-5, msg=key)


def test_transformers_pi0_per_layer_under_fsdp2(two_datasets, tmp_path_factory):  # noqa: F811
    """transformers' pi0, unchanged, per-layer FSDP2 units: the same one-batch gradient, half the model per rank."""
    from engines import make_pi0

    from hf_vla.models.pi0_adapter import prepare_pi0

    run = launched("fsdp2", two_datasets, tmp_path_factory)["grad_pi0"]
    assert run["engine"].endswith("FSDP") and 0.45 < run["share"] < 0.55
    batch = {k: torch.cat([b[k] for b in run["batches"]]) for k in run["batches"][0]}
    model = make_pi0()
    prepare_pi0(model, "ddp")  # the same frozen (never used) modules as in the run
    model.train()
    per_sample, _ = policy_per_sample_loss(model, batch, seed=3, step=0)
    aggregate("sample_mean", per_sample, batch[GROUP_KEYS["episode"]]).backward()
    reference = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert run["grads"].keys() == reference.keys()
    for key, grad in reference.items():
        torch.testing.assert_close(run["grads"][key], grad, atol=1e-6, rtol=1e-5, msg=key)


@pytest.mark.parametrize("name,scenario", engine_cases(("ddp", "resume"), ("fsdp2", "resume"), ("zero2", "resume"),
                                                       ("ddp_bf16", "resume_bf16"), ("fsdp2_bf16", "resume_bf16")))
def test_kill_and_resume_equals_the_uninterrupted_run(name, scenario, two_datasets, tmp_path_factory):  # noqa: F811
    run = launched(name, two_datasets, tmp_path_factory)[scenario]
    assert run["expected"].keys() == run["resumed"].keys()
    for key, value in run["expected"].items():
        assert torch.equal(run["resumed"][key], value), key
    assert run["losses"] == run["expected_losses"] and len(run["losses"]) == 4
    # the epoch is the passes over the training frames so far, from the step count: a resume continues it exactly
    assert run["epochs"] == run["expected_epochs"] and [step for step, _ in run["epochs"]] == [1, 2, 3, 4]
    first = run["epochs"][0][1]
    assert first > 0 and all(epoch == pytest.approx(first * step) for step, epoch in run["epochs"])
    mean = float(np.mean([loss for _, loss in run["expected_losses"]]))
    for which, value in run["train_loss"].items():  # also when the last steps were logged in no window
        assert value == pytest.approx(mean, rel=1e-6), which
    if name == "ddp_bf16":
        assert run["master_optimizer"] == "MasterWeightOptimizer"
    if name == "fsdp2_bf16":  # the sharded parameters are the fp32 masters; the layers compute in bf16
        assert run["mixed_precision"] == "bf16" and run["param_dtypes"] == ["torch.float32"]
        assert run["reduce_dtype"] == "torch.float32"  # gradients reach the fp32 masters unrounded
        assert run["master_optimizer"] == "NoneType"


@pytest.mark.slow
def test_bf16_ranks_hold_identical_parameters_and_masters_every_step(two_datasets, tmp_path_factory):  # noqa: F811
    runs = launched("ddp_bf16", two_datasets, tmp_path_factory)["same"]
    assert set(runs) == {f"lora={lora},diverge={diverge}" for lora in (False, True) for diverge in (False, True)}
    for case, (rank0, rank1) in runs.items():
        assert len(rank0) == len(rank1) == 3, case
        assert rank0 == rank1, case  # parameters and fp32 masters, after every step
        assert all(uses_masters for _, _, uses_masters in rank0), case
        assert len({params for params, _, _ in rank0}) == 3, case  # and training moved them


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2.yaml", "zero3.yaml", "fsdp2.yaml"])
def test_the_cli_with_a_launch_config_and_a_bf16_model(config, two_datasets, tmp_path):  # noqa: F811
    """What a user types, as is: the launch config, `-m hf_vla.train`, a bfloat16 model (on CPU processes)."""
    import json

    from test_failures import base_config

    out = tmp_path / "out"
    settings = base_config(two_datasets / "a", out, dtype="bfloat16", max_steps=2, per_device_train_batch_size=2)
    settings["datasets"][0]["cameras"] = ["observation.images.cam"]
    (tmp_path / "run.json").write_text(json.dumps(settings))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_VLA_CPU_SHARDING="1")

    def launch(path):
        result = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                 str(REPO / "configs" / "accelerate" / config), "--num_processes", "2",
                                 "--main_process_port", "29671", "-m", "hf_vla.train", str(path)],
                                capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
        assert result.returncode == 0, result.stderr[-5000:]

    launch(tmp_path / "run.json")
    from transformers import AutoModel

    model = AutoModel.from_pretrained(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # saved under the model's own class (FSDP2 swaps it for torch's FSDP subclass): the code that loads it remotely
    saved = json.loads((out / "config.json").read_text())["auto_map"]
    assert saved["AutoModel"] == "modeling_pi05.PI05ForConditionalGeneration", saved
    assert {"modeling_pi05.py", "rtc.py"} <= {p.name for p in out.glob("*.py")} and not list(out.glob("_fsdp*"))
    if config == "zero3.yaml":  # fine-tuning a checkpoint: loaded straight into ZeRO-3's partitions, config overridden
        settings.pop("model_config")
        settings.update(model_name_or_path=str(out), output_dir=str(tmp_path / "tuned"), rtc_max_delay=1)
        (tmp_path / "tune.json").write_text(json.dumps(settings))
        launch(tmp_path / "tune.json")
        tuned = AutoModel.from_pretrained(tmp_path / "tuned")
        assert tuned.config.rtc_max_delay == 1
        before = dict(model.named_parameters())
        changed = [n for n, p in tuned.named_parameters() if not torch.equal(p, before[n])]
        assert all(torch.isfinite(p).all() for p in tuned.parameters()) and len(changed) > len(before) // 2


def test_fsdp1_is_refused_with_the_reason(tmp_path):
    from distributed_step import make_model

    from hf_vla import VLATrainer, VLATrainingArguments

    args = VLATrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp="full_shard auto_wrap",
                                fsdp_config={"version": 1})
    with pytest.raises(ConfigError, match="FSDP version 1 is not supported: use fsdp_version 2"):
        VLATrainer(make_model(), args)


def test_a_bf16_model_under_deepspeed_needs_its_bf16_mode(tmp_path):
    from distributed_step import make_model

    from hf_vla import VLATrainer, VLATrainingArguments

    args = VLATrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                deepspeed=str(REPO / "configs" / "accelerate" / "ds_zero2.json"))
    with pytest.raises(ConfigError, match="needs DeepSpeed's bf16 mode"):
        VLATrainer(make_model().to(torch.bfloat16), args)
