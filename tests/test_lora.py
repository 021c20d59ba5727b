"""LoRA through peft: both presets train, save an adapter, reload and merge to the same function."""

import json

import pytest
import torch
from conftest import randomize_
from peft import PeftModel, get_peft_model
from test_pi05_model import tiny_inputs

from hf_vla import PI05ForConditionalGeneration
from hf_vla.lora import lora_config
from hf_vla.tiny import tiny_pi05_config


@pytest.mark.parametrize("preset", ["expert", "all_linear"])
def test_lora_trains_saves_reloads_merges(tmp_path, preset):
    torch.manual_seed(0)
    base = randomize_(PI05ForConditionalGeneration(tiny_pi05_config()), seed=0)
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, lora_config(preset, r=4, model=base))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_" in n and ".expert." in n for n in trainable)
    assert any("lora_" in n and "language_model" in n for n in trainable) == (preset == "all_linear")
    assert not any("vision_tower" in n for n in trainable)
    assert not any(("language_model" in n or ".expert." in n) and "lora_" not in n for n in trainable)

    inputs = tiny_inputs(base.config)
    target = torch.randn_like(inputs["noise"])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(15):
        loss = ((model(**inputs).logits - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]

    model.eval()
    with torch.no_grad():
        expected = model(**inputs).logits
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()

    fresh = PI05ForConditionalGeneration.from_pretrained(tmp_path / "base")
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, atol=1e-5, rtol=1e-5)
        merged = reloaded.merge_and_unload()
        assert isinstance(merged, PI05ForConditionalGeneration)
        assert not any("lora_" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(**inputs).logits, expected, atol=1e-5, rtol=1e-5)


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="unknown LoRA preset"):
        lora_config("everything")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A base trained in full for 2 steps, then LoRA (expert preset) from it for 3 steps with a checkpoint at step 2."""
    from test_data import make_dataset
    from test_failures import base_config, write_config

    from hf_vla.train import main

    root = tmp_path_factory.mktemp("lora_run")
    data = make_dataset(root / "toy", 6)
    main([str(write_config(root, base_config(data, root / "base", max_steps=2), "base.json"))])
    config = base_config(data, root / "lora", max_steps=3, lora_preset="expert", lora_r=4,
                         model_name_or_path=str(root / "base"), save_strategy="steps", save_steps=2,
                         learning_rate=5e-2)
    trainer = main([str(write_config(root, config, "lora.json"))])
    return root, trainer


def _actions(model, processor):
    """One chunk of un-normalised actions from fixed inputs and fixed noise (what a robot would execute)."""
    import numpy as np

    rng = np.random.default_rng(0)
    size = processor.image_size
    inputs = processor(images=torch.from_numpy(rng.integers(0, 255, (1, 3, size, size), dtype=np.uint8)),
                       text="pick the cube", state=torch.zeros(1, len(processor.norm_stats[processor.head_names[0]]["state"]["q01"])),
                       head=processor.head_names[0])
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")
    noise = torch.randn(1, model.config.chunk_size, model.config.max_action_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        chunk = model.sample_actions(noise=noise, **{k: inputs[k] for k in keys if k in inputs})
    return processor.unnormalize_actions(chunk, processor.head_names[0])


def test_lora_output_loads_as_the_trained_model(lora_run):
    """The card's line (`AutoModel.from_pretrained(<output>)`) gives the in-training model's actions, trained heads
    included; the adapters alone are in adapter/ and load onto the base with peft."""
    from transformers import AutoModel, AutoProcessor

    import hf_vla  # noqa: F401

    root, trainer = lora_run
    out = root / "lora"
    processor = AutoProcessor.from_pretrained(out)
    live = trainer.accelerator.unwrap_model(trainer.model).eval()
    expected = _actions(live, processor)
    base_actions = _actions(AutoModel.from_pretrained(root / "base").eval(), processor)
    assert (expected - base_actions).abs().max() > 1e-3  # the adapters and heads did change the policy

    loaded = AutoModel.from_pretrained(out).eval()
    torch.testing.assert_close(_actions(loaded, processor), expected, atol=1e-5, rtol=1e-5)
    assert not (out / "adapter_config.json").exists() and (out / "adapter" / "adapter_config.json").exists()
    reloaded = PeftModel.from_pretrained(AutoModel.from_pretrained(root / "base"), out / "adapter").eval()
    torch.testing.assert_close(_actions(reloaded, processor), expected, atol=1e-5, rtol=1e-5)
    card = (out / "README.md").read_text()
    assert 'subfolder="adapter"' in card and "merged" in card
    # not pushed: the snippets name the output directory (a bare folder name is no Hub id and would not resolve)
    assert f'AutoModel.from_pretrained("{out}")' in card and f'"{out}", subfolder="adapter"' in card
    # arguments as written: the scheduler's name, integers as integers
    assert "SchedulerType" not in card and "- `lr_scheduler_type`: cosine_with_min_lr" in card
    assert "- `warmup_steps`: 0\n" in card and "- `max_steps`: 3\n" in card


def test_a_lora_checkpoint_is_evaluated_and_served_as_its_merged_model(lora_run, tmp_path, monkeypatch):
    """checkpoint-N of a LoRA run holds adapters only (the Trainer's layout, to resume from): evaluate / serve /
    load_policy merge it with its base (the base's heads would be wrong) and name the problem when the base is gone."""
    from transformers import AutoModel, AutoProcessor

    from hf_vla.cli import model_source
    from hf_vla.errors import ConfigError
    from hf_vla.hub.resolve import resolve_pretrained
    from hf_vla.serving.policy import load_policy

    monkeypatch.setenv("HF_VLA_CACHE", str(tmp_path / "cache"))
    root, _ = lora_run
    checkpoint = root / "lora" / "checkpoint-2"
    assert (checkpoint / "adapter_config.json").exists() and not (checkpoint / "config.json").exists()
    assert model_source("--checkpoint", str(checkpoint)) == str(checkpoint)
    merged = resolve_pretrained(checkpoint)
    assert merged != str(checkpoint) and resolve_pretrained(checkpoint) == merged  # merged once, then cached
    base = PeftModel.from_pretrained(AutoModel.from_pretrained(root / "base"), checkpoint).eval()
    processor = AutoProcessor.from_pretrained(merged)
    torch.testing.assert_close(_actions(AutoModel.from_pretrained(merged).eval(), processor),
                               _actions(base, processor), atol=1e-5, rtol=1e-5)
    runner = load_policy(checkpoint)
    assert runner.processor.head_names == processor.head_names

    # the base is gone (a run from a freshly built model has none): one line that says so
    import shutil

    orphan = tmp_path / "orphan"
    shutil.copytree(checkpoint, orphan)
    config = json.loads((orphan / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (orphan / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="no longer exists: a run trained from a freshly built model"):
        resolve_pretrained(orphan)


def test_convert_merges_adapters_and_explains_what_needs_no_conversion(lora_run, tmp_path, monkeypatch, capsys):
    from transformers import AutoModel, AutoProcessor

    from hf_vla.convert import cli

    monkeypatch.setenv("HF_VLA_CACHE", str(tmp_path / "cache"))
    root, _ = lora_run
    cli(["--input", str(root / "lora" / "checkpoint-2"), "--output", str(tmp_path / "merged")])
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    base = PeftModel.from_pretrained(AutoModel.from_pretrained(root / "base"), root / "lora" / "checkpoint-2").eval()
    torch.testing.assert_close(_actions(AutoModel.from_pretrained(tmp_path / "merged").eval(), processor),
                               _actions(base, processor), atol=1e-5, rtol=1e-5)
    for given, expected in ((str(root / "base"), "already a transformers checkpoint (model_type 'hf_vla_pi05'), nothing to "
                                                 "convert"),
                            ("lerobot/pi05_base", "a Hub id needs no conversion step")):
        with pytest.raises(SystemExit) as exited:
            cli(["--input", given, "--output", str(tmp_path / "x")])
        assert exited.value.code == 2 and expected in capsys.readouterr().err
