"""LoRA through peft: both presets train, save an adapter, reload and merge to the same function."""

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
