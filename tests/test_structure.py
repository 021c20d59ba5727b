"""The trainer as TRL builds one, one path per rule, and a wheel that works outside the repository:

- `optim` / `optim_args` reach the optimizer through the Trainer's own mechanism, with and without fp32 masters;
  an optimizer that cannot run over masters is refused;
- evaluation's `eval_loss` is `losses.aggregate` over the whole pass, for every mode;
- the collator's batch is the processor's, for the same inputs (pi0.5 and transformers' pi0);
- freeze modes and LoRA targets come from the model;
- per-head training MSE in the logs;
- the built wheel, installed in a fresh environment away from the repository, renders a model card and runs the demo's
  `--help`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import _trainer, two_datasets  # noqa: F401  (session fixture)

from hf_vla import PI05ForConditionalGeneration, PI05Processor, VLATrainer, VLATrainingArguments
from hf_vla.data import PI0Collator, PI05Collator, WeightedDatasetMixture
from hf_vla.data.stream import StreamSettings
from hf_vla.errors import ConfigError
from hf_vla.tiny import build_tiny_tokenizer, tiny_pi0_config, tiny_pi05_config
from hf_vla.training.losses import GROUP_KEYS, PerSampleLoss, aggregate
from hf_vla.training.optim import MasterWeightOptimizer

REPO = Path(__file__).resolve().parents[1]
CAM = "observation.images.cam"


def _innermost(optimizer):
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return optimizer.inner if isinstance(optimizer, MasterWeightOptimizer) else optimizer


@pytest.mark.parametrize("optim,optim_args,cls,check", [
    ("adamw_torch", None, "AdamW", lambda g: g["betas"] == (0.9, 0.95)),
    ("adafactor", None, "Adafactor", lambda g: g["relative_step"] is False),
    ("sgd", "momentum=0.5", "SGD", lambda g: g["momentum"] == 0.5),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optim_reaches_the_optimizer_with_and_without_master_weights(two_datasets, tmp_path, optim, optim_args, cls,  # noqa: F811
                                                                     check, dtype):
    trainer = _trainer(two_datasets, tmp_path, max_steps=1, optim=optim, optim_args=optim_args, weight_decay=0.1)
    trainer.model.to(dtype)
    optimizer = trainer.create_optimizer()
    inner = _innermost(optimizer)
    assert type(inner).__name__ == cls
    assert isinstance(optimizer, MasterWeightOptimizer) == (dtype == torch.bfloat16)
    if dtype == torch.bfloat16:  # the masters are fp32 and the inner optimizer steps them
        assert all(p.dtype == torch.float32 for g in inner.param_groups for p in g["params"])
    assert all(check(group) for group in inner.param_groups)
    # the Trainer's decay rule, plus no decay on token embeddings
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decayed = {names[id(p)] for p in optimizer.param_groups[0]["params"]}
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and optimizer.param_groups[1]["weight_decay"] == 0.0
    assert not any("norm" in n or n.endswith(".bias") or "embed_tokens" in n for n in decayed)
    assert any(n.endswith("q_proj.weight") for n in decayed)
    trainer.train()  # and it trains


def test_an_optimizer_that_cannot_run_over_masters_is_refused(two_datasets, tmp_path):  # noqa: F811
    class NotAnOptimizer:
        def __init__(self, params, **kwargs):
            self.params = params

    trainer = _trainer(two_datasets, tmp_path, max_steps=1)
    trainer.optimizer_cls_and_kwargs = (NotAnOptimizer, {"lr": 1e-3})  # as given to Trainer(optimizer_cls_and_kwargs=)
    trainer.model.to(torch.bfloat16)
    with pytest.raises(ConfigError, match="cannot run over fp32 master weights: NotAnOptimizer is not a torch"):
        trainer.create_optimizer()


@pytest.mark.parametrize("mode,divisor", [("sample_mean", None), ("token_mean", None), ("group_mean", None),
                                          ("constant", 3.0)])
def test_eval_loss_is_the_training_aggregation(two_datasets, tmp_path, mode, divisor):  # noqa: F811
    trainer = _trainer(two_datasets, tmp_path, max_steps=1, loss_aggregation=mode, loss_divisor=divisor)
    metrics = trainer.evaluate()
    sums, counts, groups = [], [], []
    trainer.model.eval()
    for batch in trainer.get_eval_dataloader():
        with torch.no_grad():
            per_sample, _ = trainer.per_sample_loss(trainer.model, batch, -1)
        sums.append(per_sample.sum.double())
        counts.append(per_sample.count.double())
        groups.append(batch[GROUP_KEYS["episode"]])
    expected = aggregate(mode, PerSampleLoss(torch.cat(sums), torch.cat(counts)), torch.cat(groups), divisor)
    assert metrics["eval_loss"] == pytest.approx(float(expected), rel=1e-9)


def _samples(mixture, count=12, image_size=32, chunk=5):
    stream = mixture.train_stream(StreamSettings(image_size=image_size, chunk_size=chunk, open_blocks=3, seed=4))
    return [sample for sample, _ in zip(stream, range(count))]


def _expected_from_processor(processor, samples):
    return processor(images=torch.stack([s["images"] for s in samples]), text=[s["task"] for s in samples],
                     state=[s["state"] for s in samples], actions=[s["actions"] for s in samples],
                     head=[int(s["dataset_index"]) for s in samples],
                     camera_mask=torch.stack([s["camera_mask"] for s in samples]))


def test_the_collator_batch_is_the_processor_batch(two_datasets):  # noqa: F811
    mixture = WeightedDatasetMixture([dict(root=str(two_datasets / "a"), name="a", cameras=[CAM], control_mode="joint"),
                                      dict(root=str(two_datasets / "b"), name="b", cameras=["front"], control_mode="eef")])
    samples = _samples(mixture)
    assert len({int(s["dataset_index"]) for s in samples}) == 2  # two heads, of different widths, in one batch
    from hf_vla.models.pi0_adapter import PI0HeadProcessor

    tokenizer = build_tiny_tokenizer()
    stats = dict(norm_stats=mixture.norm_stats, head_names=mixture.head_names)
    pi05 = PI05Processor.from_config(tiny_pi05_config(chunk_size=5), tokenizer, **stats)
    pi0 = PI0HeadProcessor.from_config(tiny_pi0_config(chunk_size=5), tokenizer, **stats)
    for processor, collator in ((pi05, PI05Collator(pi05)), (pi0, PI0Collator(pi0))):
        batch = collator(samples)
        expected = _expected_from_processor(processor, samples)
        for key, value in expected.items():
            if key == "actions":  # the collator zeroes the chunk steps past an episode's end, nothing else
                value = value.clone()
                value[batch["action_is_pad"]] = 0.0
            assert torch.equal(batch[key], value), (type(processor).__name__, key)
        assert set(batch) - set(expected) == {"action_is_pad", "dataset_index", "source_index", "episode_index",
                                              "frame_index"}
        for i, sample in enumerate(samples):  # each row normalized by its own head, then padded
            head = mixture.head_names[int(sample["dataset_index"])]
            width = len(mixture.norm_stats[head]["actions"]["q01"])
            assert batch["action_dim_mask"][i].sum() == width and batch["actions"][i, :, width:].abs().sum() == 0


def test_freeze_modes_and_lora_targets_come_from_the_policy_structure(two_datasets, tmp_path, monkeypatch):  # noqa: F811
    from transformers import PI0ForConditionalGeneration

    from hf_vla.lora import lora_config
    from hf_vla.training.structure import PI05Structure, policy_structure

    model = PI05ForConditionalGeneration(tiny_pi05_config())
    targets = policy_structure(model).lora_target_modules("all_linear")
    assert "model.expert.layers.0.input_layernorm.dense" in targets  # adaRMS modulation
    assert "model.vlm.language_model.layers.0.self_attn.q_proj" in targets
    last = len(model.model.vlm.language_model.layers) - 1
    assert f"model.vlm.language_model.layers.{last}.self_attn.k_proj" in targets
    assert f"model.vlm.language_model.layers.{last}.self_attn.q_proj" not in targets  # never run by pi0.5
    assert not any("vision_tower" in t for t in targets)
    assert set(policy_structure(model).lora_target_modules("expert")) == {t for t in targets
                                                                          if t.startswith("model.expert.")}
    # lora_config and the trainer ask the policy's structure
    monkeypatch.setattr(PI05Structure, "lora_target_modules", lambda self, preset: ["action_in_proj"])
    monkeypatch.setattr(PI05Structure, "trained_heads", lambda self: ["time_mlp_in"])
    config = lora_config("expert", r=2, model=model)
    assert config.target_modules == {"action_in_proj"} and config.modules_to_save == ["time_mlp_in"]
    calls = []
    monkeypatch.setattr(PI05Structure, "freeze", lambda self, mode: calls.append(mode))
    _trainer(two_datasets, tmp_path, max_steps=1, freeze="vlm")
    assert calls == ["vlm"]
    # transformers' pi0 through its adapter: same presets over its expert (`dit`)
    pi0 = PI0ForConditionalGeneration(tiny_pi0_config())
    structure = policy_structure(pi0)
    assert all(t.startswith("model.dit.layers.") for t in structure.lora_target_modules("expert"))
    structure.freeze("expert_only")
    assert {n.split(".")[1] for n, p in pi0.named_parameters() if p.requires_grad} == {"dit"}


def test_per_head_training_mse_in_the_logs(two_datasets, tmp_path):  # noqa: F811
    recorded = []

    class Recording(VLATrainer):
        def per_sample_loss(self, model, inputs, step):
            per_sample, outputs = super().per_sample_loss(model, inputs, step)
            if model.training:
                recorded.append((self.state.global_step, per_sample, inputs["dataset_index"].clone()))
            return per_sample, outputs

    trainer = _trainer(two_datasets, tmp_path, max_steps=4, logging_steps=2)
    trainer.__class__ = Recording
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for entry, window in zip(logs, ((0, 1), (2, 3))):
        for head, name in enumerate(["arm_a::joint", "arm_b::eef"]):
            total = sum(float(p.sum[h == head].detach().sum()) for step, p, h in recorded if step in window)
            count = sum(float(p.count[h == head].sum()) for step, p, h in recorded if step in window)
            assert entry[f"{name}/mse"] == pytest.approx(total / count, rel=1e-6), (entry, name)


def test_trainer_takes_datasets_like_trl(two_datasets, tmp_path):  # noqa: F811
    """No mixture inside: datasets, collator, processor and peft config come from outside (peft wraps in the trainer)."""
    import inspect

    from hf_vla.lora import lora_config

    parameters = inspect.signature(VLATrainer.__init__).parameters
    assert {"train_dataset", "eval_dataset", "data_collator", "processing_class", "peft_config"} <= set(parameters)
    assert "mixture" not in parameters
    source = (REPO / "hf_vla" / "training" / "trainer.py").read_text()
    assert "WeightedDatasetMixture" not in source and "mixture import" not in source
    mixture = WeightedDatasetMixture([dict(root=str(two_datasets / "a"), name="a", cameras=[CAM], control_mode="joint")])
    model = PI05ForConditionalGeneration(tiny_pi05_config(chunk_size=6))
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats=mixture.norm_stats,
                                          head_names=mixture.head_names)
    args = VLATrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                                use_cpu=True, disable_tqdm=True, save_strategy="no", stream_open_blocks=3)
    train, validation = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=6)
    assert validation is None and train.provenance.names == ["a"]
    trainer = VLATrainer(model, args, train_dataset=train, data_collator=PI05Collator(processor),
                         processing_class=processor, peft_config=lora_config("expert", r=2, model=model))
    assert hasattr(trainer.model, "peft_config")
    trainer.train()
    with pytest.raises(ConfigError, match="no eval_dataset"):
        VLATrainer(PI05ForConditionalGeneration(tiny_pi05_config(chunk_size=6)), VLATrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                               eval_strategy="steps", eval_steps=1), train_dataset=train,
                   processing_class=processor)


def test_no_product_module_imports_test_helpers():
    for path in (REPO / "hf_vla").rglob("*.py"):
        text = path.read_text()
        assert "hf_vla.testing" not in text and "from tests" not in text and "import tests" not in text, path
    for path in (REPO / "benchmarks").rglob("*.py"):
        assert '/ "tests"' not in path.read_text() and "sys.path.insert" not in path.read_text(), path


@pytest.mark.slow
def test_the_wheel_works_outside_the_repository(tmp_path):
    """Build the wheel, install it (no editable install) into a fresh environment whose dependencies come from this
    one, and there render a model card and run `python -m hf_vla.demo --help`, away from the repository."""
    import site
    import venv

    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(REPO)], check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("hf_vla-*.whl"))
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert {"hf_vla/templates/vla_model_card.md", "hf_vla/configs/demo.json", "hf_vla/py.typed"} <= set(names)
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    env_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies: this environment's site-packages as a plain path (its .pth files, among them the editable
    # hf_vla, are not processed), the package itself unpacked from the wheel
    (env_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    zipfile.ZipFile(wheel).extractall(env_site)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    script = tmp_path / "render.py"
    script.write_text(f"""
import json, hf_vla
from hf_vla.hub.card import RunFacts, model_card
from hf_vla.tiny import tiny_pi05_config
assert hf_vla.__file__.startswith({str(env_site)!r}), hf_vla.__file__
datasets = [dict(name="toy", source="org/toy", weight=1.0, head="arm::joint", cameras="cam",
                 example_task="pick up the cube")]
card = model_card(tiny_pi05_config(), datasets, RunFacts(eval_metrics={{"eval_loss": 0.5, "eval_by_dataset/toy/mse": 0.25}}),
                  model_name="toy-policy")
print(json.dumps({{"card": str(card)}}))
""")
    result = subprocess.run([str(python), str(script)], capture_output=True, text=True, cwd=outside,
                            env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    card = json.loads(result.stdout.strip().splitlines()[-1])["card"]
    assert "library_name: transformers" in card and "pick up the cube" in card and "| toy |" in card
    demo = subprocess.run([str(python), "-m", "hf_vla.demo", "--help"], capture_output=True, text=True, cwd=outside,
                          env=environment, timeout=300)
    assert demo.returncode == 0 and "usage: python -m hf_vla.demo" in demo.stdout, demo.stderr[-2000:]


@pytest.mark.slow
def test_shared_data_tests_skip_on_a_user_machine_and_fail_under_ci(tmp_path):
    """A fresh clone without ../shared (any user's machine): the tests that read the real teleop dataset skip with one
    line naming what is missing; with CI=true they fail instead, so CI never silently stops running them."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    tests = ["tests/test_data.py::test_decorrelated_batches_on_real_data",
             "tests/test_data.py::test_training_frames_match_the_processor_resize_at_inference"]
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"HF_VLA_SHARED": str(tmp_path / "no_shared")}
    user = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert user.returncode == 0 and "2 skipped" in user.stdout, user.stdout[-2000:]
    assert ("the real teleop dataset humanoid_teleop_24 is missing: " f"{tmp_path / 'no_shared'}") in user.stdout
    ci = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=REPO,
                        env=env | {"CI": "true"}, capture_output=True, text=True, timeout=600)
    assert ci.returncode == 1 and "2 errors" in ci.stdout and "CI=true needs it" in ci.stdout, ci.stdout[-2000:]
