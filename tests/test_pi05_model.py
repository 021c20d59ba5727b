"""pi0.5 model: parity with lerobot, attention backends, KV cache, gradient checkpointing, bf16, Auto*, remote code."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import randomize_

import hf_vla
from hf_vla import PI05Config, PI05ForConditionalGeneration
from hf_vla.convert import convert_lerobot_state_dict
from hf_vla.models.reference import (
    build_lerobot_pi0,
    build_lerobot_pi05,
    hf_pi0_config,
    hf_pi05_config,
    sample_inputs,
)
from hf_vla.tiny import tiny_pi05_config

# flex_attention's first call on the CPU compiles for ~30 s (~90 s beside the rest of the suite): its cases are `slow`
CPU_BACKENDS = ["eager", "sdpa", pytest.param("flex_attention", marks=pytest.mark.slow)]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def velocity_inputs(x):
    t = x["time"][:, None, None]
    return dict(
        noise=t * x["noise"] + (1 - t) * x["actions"],
        timestep=x["time"],
        input_ids=x["tokens"],
        attention_mask=x["token_mask"],
        pixel_values=x["images"],
        pixel_attention_mask=x["camera_mask"],
    )


@pytest.fixture(scope="module")
def lerobot_pair():
    reference = build_lerobot_pi05(seed=0)
    config = hf_pi05_config()
    model = PI05ForConditionalGeneration(config).eval()
    missing, unexpected = model.load_state_dict(convert_lerobot_state_dict(reference.state_dict(), config), strict=False)
    assert not unexpected and all("sinusoid" in k for k in missing)
    return reference, model


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_flow_loss_matches_lerobot_pi05(lerobot_pair, backend):
    reference, model = lerobot_pair
    model.set_attn_implementation(backend)
    x = sample_inputs()  # padded tokens and a missing camera in the last sample
    cams = [x["images"][:, i] for i in range(x["images"].shape[1])]
    masks = [x["camera_mask"][:, i] for i in range(x["images"].shape[1])]
    with torch.no_grad():
        expected = reference(cams, masks, x["tokens"], x["token_mask"], x["actions"], x["noise"], x["time"])
        velocity = model(**velocity_inputs(x)).logits
    ours = (x["noise"] - x["actions"] - velocity) ** 2
    assert rel_err(ours, expected) <= 1e-4


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sample_actions_matches_lerobot_pi05(lerobot_pair, backend):
    reference, model = lerobot_pair
    model.set_attn_implementation(backend)
    x = sample_inputs()
    cams = [x["images"][:, i] for i in range(x["images"].shape[1])]
    masks = [x["camera_mask"][:, i] for i in range(x["images"].shape[1])]
    with torch.no_grad():
        expected = reference.sample_actions(cams, masks, x["tokens"], x["token_mask"], noise=x["noise"].clone())
        ours = model.sample_actions(x["tokens"], x["images"], x["camera_mask"], x["token_mask"], noise=x["noise"].clone())
    assert rel_err(ours, expected) <= 5e-3


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_transformers_pi0_matches_lerobot_pi0_after_conversion(backend):
    from transformers import PI0ForConditionalGeneration

    reference = build_lerobot_pi0(seed=3)
    config = hf_pi0_config()
    model = PI0ForConditionalGeneration(config).eval()
    missing, unexpected = model.load_state_dict(convert_lerobot_state_dict(reference.state_dict(), config), strict=False)
    assert not unexpected and all("sinusoid" in k for k in missing)
    model.set_attn_implementation(backend)
    x = sample_inputs()
    x["camera_mask"][:] = True  # transformers' pi0 drops absent cameras from the prompt instead of masking them
    n_image = x["images"].shape[1] * config.vlm_config.vision_config.image_size**2 // 64
    batch = x["tokens"].shape[0]
    input_ids = torch.cat([torch.full((batch, n_image), config.vlm_config.image_token_id), x["tokens"]], 1)
    attention = torch.cat([torch.ones(batch, n_image, dtype=torch.long), x["token_mask"].long()], 1)
    cams = [x["images"][:, i] for i in range(x["images"].shape[1])]
    masks = [x["camera_mask"][:, i] for i in range(x["images"].shape[1])]
    with torch.no_grad():
        expected = reference(cams, masks, x["tokens"], x["token_mask"], x["state"], x["actions"], x["noise"], x["time"])
        inputs = velocity_inputs(x) | {"input_ids": input_ids, "attention_mask": attention}
        velocity = model(state=x["state"], **inputs).logits
    assert rel_err((x["noise"] - x["actions"] - velocity) ** 2, expected) <= 1e-4


@pytest.fixture
def tiny_model():
    torch.manual_seed(0)
    return randomize_(PI05ForConditionalGeneration(tiny_pi05_config()), seed=1).eval()


def tiny_inputs(config, batch=3, seq=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    size = config.image_size
    mask = torch.ones(batch, seq, dtype=torch.bool)
    cams = torch.ones(batch, 2, dtype=torch.bool)
    if batch >= 3:  # ragged prompts and a missing camera
        mask[1, 5:] = False
        mask[2, 2:] = False
        cams[0, 1] = False
    return dict(
        input_ids=torch.randint(4, 400, (batch, seq), generator=g),
        attention_mask=mask,
        pixel_values=torch.rand(batch, 2, 3, size, size, generator=g) * 2 - 1,
        pixel_attention_mask=cams,
        noise=torch.randn(batch, config.chunk_size, config.max_action_dim, generator=g),
        timestep=torch.rand(batch, generator=g),
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS[1:])
def test_backends_agree_on_cpu(tiny_model, backend):
    inputs = tiny_inputs(tiny_model.config)
    outputs = {}
    for name in ("eager", backend):
        tiny_model.set_attn_implementation(name)
        with torch.no_grad():
            outputs[name] = tiny_model(**inputs).logits
    assert outputs["eager"].abs().max() > 0.05  # the expert is not an identity here
    torch.testing.assert_close(outputs[backend], outputs["eager"], atol=1e-5, rtol=1e-5)


def test_padding_does_not_leak(tiny_model):
    """Extra right padding (tokens and their content) must not change the prediction."""
    inputs = tiny_inputs(tiny_model.config, batch=1)
    inputs["attention_mask"][:] = True
    with torch.no_grad():
        base = tiny_model(**inputs).logits
        padded = dict(inputs)
        padded["input_ids"] = torch.cat([inputs["input_ids"], torch.randint(4, 400, (1, 4))], 1)
        padded["attention_mask"] = torch.cat([inputs["attention_mask"], torch.zeros(1, 4, dtype=torch.bool)], 1)
        torch.testing.assert_close(tiny_model(**padded).logits, base, atol=1e-5, rtol=1e-5)
        # a masked camera's pixels are ignored
        cams = dict(inputs)
        cams["pixel_attention_mask"] = torch.tensor([[True, False]])
        other = dict(cams)
        other["pixel_values"] = inputs["pixel_values"].clone()
        other["pixel_values"][:, 1] = -1
        torch.testing.assert_close(tiny_model(**cams).logits, tiny_model(**other).logits, atol=1e-6, rtol=1e-6)


def test_sample_actions_cache_equals_cache_free_integration(tiny_model):
    inputs = tiny_inputs(tiny_model.config)
    noise = inputs.pop("noise")
    inputs.pop("timestep")
    steps = tiny_model.config.num_inference_steps
    with torch.no_grad():
        cached = tiny_model.sample_actions(noise=noise.clone(), **inputs)
        x_t, dt = noise.clone(), -1.0 / steps
        for step in range(steps):
            t = torch.full((noise.shape[0],), 1.0 + step * dt)
            x_t = x_t + dt * tiny_model(noise=x_t, timestep=t, **inputs).logits  # full prefix recomputed each step
    torch.testing.assert_close(cached, x_t, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_matches(use_reentrant):
    torch.manual_seed(0)
    model = randomize_(PI05ForConditionalGeneration(tiny_pi05_config()), seed=2).train()
    inputs = tiny_inputs(model.config)
    target = torch.randn_like(inputs["noise"])

    def grads():
        model.zero_grad()
        loss = ((model(**inputs).logits - target) ** 2).mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.model.gradient_checkpointing
    checkpointed = grads()
    model.gradient_checkpointing_disable()
    assert plain.keys() == checkpointed.keys()
    assert any("model.vlm.language_model.layers" in n for n in plain) and any("model.expert" in n for n in plain)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-6, msg=name)


def test_bf16_keeps_sensitive_parts_in_fp32(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    model = PI05ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    fp32 = [n for n, d in dtypes.items() if d == torch.float32]
    assert all(dtypes[n] == torch.float32 for n in dtypes if "vision_tower" in n or "layernorm" in n or ".norm." in n)
    for head in ("action_in_proj.weight", "action_out_proj.weight", "time_mlp_in.weight", "time_mlp_out.weight"):
        assert dtypes[head] == torch.float32
    assert dtypes["model.vlm.language_model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["model.expert.layers.0.mlp.up_proj.weight"] == torch.bfloat16
    assert len(fp32) < len(dtypes)
    inputs = tiny_inputs(tiny_model.config)
    with torch.no_grad():
        low = model(**inputs).logits
        high = tiny_model(**inputs).logits
    assert low.dtype == torch.float32
    assert rel_err(low, high) < 0.05


def test_auto_classes_and_save_load(tmp_path, tiny_model):
    from transformers import AutoConfig, AutoModel

    tiny_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "hf_vla_pi05"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_pi05.PI05Config",
        "AutoModel": "modeling_pi05.PI05ForConditionalGeneration",
        "AutoModelForImageTextToText": "modeling_pi05.PI05ForConditionalGeneration",
    }
    assert isinstance(AutoConfig.from_pretrained(tmp_path), PI05Config)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, PI05ForConditionalGeneration)
    # the attention backend chosen at load time reaches both towers (and the vision tower)
    for backend in ("eager", "flex_attention"):
        chosen = AutoModel.from_pretrained(tmp_path, attn_implementation=backend)
        modules = (chosen.model.vlm.language_model.layers[0].self_attn, chosen.model.expert.layers[0].self_attn)
        assert {m.config._attn_implementation for m in modules} == {backend}
    inputs = tiny_inputs(tiny_model.config)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, tiny_model(**inputs).logits)


def test_remote_code_loads_without_hf_vla(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path / "ckpt")
    # the shared code the model folder imports by its absolute name is written beside it, imported relatively
    saved = {path.name: path.read_text() for path in (tmp_path / "ckpt").glob("*.py")}
    assert {"modeling_pi05.py", "rtc.py", "rtc_config.py", "remote_code.py"} <= set(saved)
    imports = [line for text in saved.values() for line in text.splitlines()
               if line.lstrip().startswith(("from ", "import ")) and "hf_vla" in line]
    assert not imports, imports
    inputs = tiny_inputs(tiny_model.config)
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        torch.save(tiny_model(**inputs).logits, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_vla"] = None  # hf_vla is not installed here
        import torch
        from transformers import AutoModel
        try:
            import hf_vla  # noqa
            raise SystemExit("hf_vla importable")
        except ImportError:
            pass
        model = AutoModel.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        with torch.no_grad():
            out = model(**inputs).logits
        torch.testing.assert_close(out, torch.load({str(tmp_path / "expected.pt")!r}))
        print("REMOTE_OK")
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "REMOTE_OK" in result.stdout, result.stderr[-3000:]


def test_unsupported_attention_backend_is_refused(tiny_model):
    tiny_model.config.dit_config._attn_implementation_internal = "paged|sdpa"
    with pytest.raises(ValueError, match="per-key padding mask"):
        tiny_model(**tiny_inputs(tiny_model.config))


def test_model_loss_agrees_with_velocity():
    torch.manual_seed(0)
    model = randomize_(PI05ForConditionalGeneration(tiny_pi05_config()), seed=4).eval()
    inputs = tiny_inputs(model.config)
    actions = torch.randn_like(inputs["noise"])
    with torch.no_grad():
        out = model(actions=actions, **inputs)
        t = inputs["timestep"][:, None, None]
        x_t = t * inputs["noise"] + (1 - t) * actions
        velocity = model(**(inputs | {"noise": x_t})).logits
    expected = ((inputs["noise"] - actions - velocity) ** 2).mean()
    torch.testing.assert_close(out.loss, expected)


def test_config_refuses_mismatched_towers():
    with pytest.raises(Exception, match="num_hidden_layers"):
        tiny_pi05_config(dit_config={**hf_vla.tiny.tiny_dit_config(), "num_hidden_layers": 3})


def test_default_config_has_published_shapes():
    config = PI05Config()
    assert config.vlm_config.text_config.hidden_size == 2048 and config.dit_config.hidden_size == 1024
    assert config.vlm_config.vision_config.hidden_size == 1152 and config.num_image_tokens == 256
    assert (config.chunk_size, config.max_action_dim, config.num_inference_steps) == (50, 32, 10)
    with torch.device("meta"):
        model = PI05ForConditionalGeneration(config)
    params = sum(p.numel() for p in model.parameters())
    assert 3.2e9 < params < 3.7e9  # pi0.5: PaliGemma 3B + 300M expert


@pytest.mark.gpu
def test_flash_attention_2_matches_sdpa_on_gpu(tiny_model):
    pytest.importorskip("flash_attn")
    model = tiny_model.to("cuda", torch.bfloat16)
    inputs = {k: v.cuda() for k, v in tiny_inputs(model.config).items()}
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        sdpa = model(**inputs).logits
        model.set_attn_implementation("flash_attention_2")
        flash = model(**inputs).logits
    assert rel_err(flash, sdpa) < 2e-2
