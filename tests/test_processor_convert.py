"""PI05Processor (prompt, images, quantiles, round trip) and checkpoint conversion (function and CLI)."""

import json
import os
import subprocess
import sys
import textwrap
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModel, AutoModelForImageTextToText, AutoProcessor

import hf_vla.convert as convert
from hf_vla import PI05ForConditionalGeneration, PI05Processor
from hf_vla.models.common.images import resize_with_pad
from hf_vla.models.reference import (
    EXPERT,
    IMAGE_SIZE,
    TEXT,
    VISION,
    build_lerobot_pi0,
    build_lerobot_pi05,
    sample_inputs,
)
from hf_vla.tiny import tiny_pi05_config

STATS = {
    "arm::joint": {
        "state": {"q01": [0.0, 1.0, -2.0], "q99": [1.0, 1.0, 2.0]},  # dim 1 is degenerate
        "actions": {"q01": [0.0, -1.0], "q99": [2.0, 1.0]},
    }
}


@pytest.fixture
def processor(tiny_tokenizer):
    return PI05Processor.from_config(tiny_pi05_config(), tiny_tokenizer, norm_stats=STATS)


def test_quantile_normalization_and_degenerate_dims(processor):
    state = torch.tensor([[0.5, 1.0, 2.0], [0.0, 1.3, -2.0]])
    normalized = processor.normalize(state, "state")
    torch.testing.assert_close(normalized, torch.tensor([[0.0, 0.0, 1.0], [-1.0, 0.0, -1.0]]))
    assert normalized.abs().max() < 10  # a constant dim never explodes, even off its constant
    actions = torch.tensor([[[1.0, 0.5]]])
    roundtrip = processor.unnormalize_actions(processor.normalize(actions, "actions"))
    torch.testing.assert_close(roundtrip, actions)


def test_prompt_holds_task_and_discretized_state(processor):
    out = processor(text="pick_up the cube\n", state=[[0.5, 1.0, 2.0]])
    text = processor.tokenizer.decode(out["input_ids"][0][out["attention_mask"][0]])
    # normalized state [0, 0, 1] -> bins of linspace(-1, 1, 257)[:-1]: 128, 128, 255
    assert text == "Task: pick up the cube , State: 128 128 255;\nAction: ".replace(" ,", ",")
    assert out["input_ids"].shape == (1, processor.prompt_max_length)
    assert out["state"].shape == (1, processor.max_state_dim) and out["state"][0, 3:].abs().sum() == 0


def test_discretization_matches_openpi(processor):
    values = torch.linspace(-0.999, 0.999, 101)
    ours = processor.discretize_state(values)
    openpi = np.digitize(values.numpy(), bins=np.linspace(-1, 1, 257)[:-1]) - 1
    np.testing.assert_array_equal(ours, openpi)
    # out of range as openpi and lerobot have it: below -1 is bin -1, above 1 the last bin
    assert processor.discretize_state(torch.tensor([-5.0, 5.0])).tolist() == [-1, 255]


def test_images_resized_with_aspect_preserving_padding():
    image = torch.full((1, 3, 48, 96), 255, dtype=torch.uint8)  # 2:1 -> 32x16 content, 8 rows of padding each side
    out = resize_with_pad(image, 32)
    assert out.shape == (1, 3, 32, 32)
    assert torch.all(out[:, :, :8] == -1) and torch.all(out[:, :, -8:] == -1)
    assert torch.allclose(out[:, :, 8:24], torch.ones(1)) and out.min() == -1


def test_call_builds_the_batch_contract(processor):
    images = torch.randint(0, 256, (2, 2, 3, 48, 64), dtype=torch.uint8)
    out = processor(images=images, text=["a", "b"], state=torch.zeros(2, 3), actions=torch.zeros(2, 5, 2),
                    camera_mask=[[True, False], [True, True]])
    assert out["pixel_values"].shape == (2, 2, 3, 32, 32)
    assert out["pixel_attention_mask"].tolist() == [[True, False], [True, True]]
    assert out["actions"].shape == (2, 5, 6) and out["action_dim_mask"][0].tolist() == [True] * 2 + [False] * 4


def test_processor_errors_name_the_problem(processor):
    with pytest.raises(ValueError, match="state has 2 dims"):
        processor(text="x", state=[[0.0, 1.0]])
    with pytest.raises(KeyError, match="unknown normalization head 'nope'"):
        processor(text="x", state=[[0.0, 1.0, 2.0]], head="nope")


def test_processor_round_trip(tmp_path, processor):
    processor.save_pretrained(tmp_path)
    tiny_pi05_config().save_pretrained(tmp_path)
    for loaded in (PI05Processor.from_pretrained(tmp_path), AutoProcessor.from_pretrained(tmp_path)):
        assert isinstance(loaded, PI05Processor)
        assert loaded.norm_stats == STATS and loaded.head_names == ["arm::joint"]
        a = processor(text="go", state=[[0.2, 1.0, 0.0]])
        b = loaded(text="go", state=[[0.2, 1.0, 0.0]])
        assert torch.equal(a["input_ids"], b["input_ids"])


def _write_lerobot_checkpoint(path, model, policy_type, tokenizer_dir):
    path.mkdir()
    # PI05Policy / PI0Policy hold the core model under `model.`; lm_head is stored, tied to embed_tokens.
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    embed = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
    state["model.paligemma_with_expert.paligemma.lm_head.weight"] = state.pop(embed)
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    config = {"type": policy_type, "chunk_size": 5, "n_action_steps": 4, "max_state_dim": 8, "max_action_dim": 6,
              "image_resolution": [IMAGE_SIZE, IMAGE_SIZE], "paligemma_variant": "gemma_2b",
              "action_expert_variant": "gemma_300m",
              # as lerobot writes them: the features the policy was trained on and how each is normalised
              "input_features": {"observation.images.base_0_rgb": {"type": "VISUAL", "shape": [3, 224, 224]},
                                 "observation.images.left_wrist_0_rgb": {"type": "VISUAL", "shape": [3, 224, 224]},
                                 "observation.state": {"type": "STATE", "shape": [3]}},
              "output_features": {"action": {"type": "ACTION", "shape": [2]}},
              # lerobot's defaults: quantiles for pi0.5, mean/std for pi0
              "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"} if
              policy_type == "pi05" else {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}}
    (path / "config.json").write_text(json.dumps(config))
    stats = {"observation.state.q01": torch.zeros(3), "observation.state.q99": torch.ones(3),
             "action.q01": torch.zeros(2), "action.q99": torch.ones(2),
             "observation.state.mean": torch.zeros(3), "observation.state.std": torch.ones(3),
             "action.mean": torch.zeros(2), "action.std": torch.ones(2)}
    save_file(stats, path / "policy_preprocessor_step_3_normalizer_processor.safetensors")


def _tiny_variants():
    def dims(d):
        return dict(hidden_size=d["width"], num_hidden_layers=d["depth"], intermediate_size=d["mlp_dim"],
                    num_attention_heads=d["num_heads"], num_key_value_heads=d["num_kv_heads"], head_dim=d["head_dim"])

    vision = {**VISION, "image_size": IMAGE_SIZE}
    from hf_vla.hub import convert as conversion  # the conversion library (hf_vla.convert is its command)

    return mock.patch.multiple(conversion, _GEMMA_VARIANTS={"gemma_2b": dims(TEXT), "gemma_300m": dims(EXPERT)},
                               _VISION_DIMS=vision)


def test_convert_cli_pi05(tmp_path, tiny_tokenizer_dir):
    reference = build_lerobot_pi05(seed=5)
    _write_lerobot_checkpoint(tmp_path / "lerobot", reference, "pi05", tiny_tokenizer_dir)
    with _tiny_variants():
        convert.main(["--input", str(tmp_path / "lerobot"), "--output", str(tmp_path / "hf"),
                      "--tokenizer", str(tiny_tokenizer_dir), "--head", "arm::joint"])
    model = AutoModel.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(model, PI05ForConditionalGeneration)
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    assert processor.norm_stats["arm::joint"]["state"]["q99"] == [1.0, 1.0, 1.0]
    # how to run it, from lerobot's config: its n_action_steps, cameras in order, keys, normalisation mode
    contract = processor.deployment
    assert contract == json.loads((tmp_path / "hf" / "deployment_config.json").read_text())
    assert contract["n_action_steps"] == 4 and contract["chunk_size"] == 5 and contract["default_head"] == "arm::joint"
    head = contract["heads"]["arm::joint"]
    assert [c["key"] for c in head["cameras"]] == ["observation.images.base_0_rgb", "observation.images.left_wrist_0_rgb"]
    assert head["cameras"][0]["height"] == 224 and head["state"] == {"key": "observation.state", "dim": 3}
    assert head["normalization_mapping"]["STATE"] == "QUANTILES" and contract["source"]["made_by"] == "hf_vla.convert"
    x = sample_inputs()
    cams = [x["images"][:, i] for i in range(2)]
    masks = [x["camera_mask"][:, i] for i in range(2)]
    with torch.no_grad():
        expected = reference.sample_actions(cams, masks, x["tokens"], x["token_mask"], noise=x["noise"].clone())
        ours = model.sample_actions(x["tokens"], x["images"], x["camera_mask"], x["token_mask"], noise=x["noise"].clone())
    assert ((ours - expected).abs().max() / expected.abs().max()) < 5e-3


def test_convert_cli_pi0(tmp_path, tiny_tokenizer_dir):
    from transformers import PI0ForConditionalGeneration

    _write_lerobot_checkpoint(tmp_path / "lerobot", build_lerobot_pi0(seed=6), "pi0", tiny_tokenizer_dir)
    _write_lerobot_checkpoint(tmp_path / "lerobot_05", build_lerobot_pi05(seed=6), "pi05", tiny_tokenizer_dir)
    with _tiny_variants():
        for src, dst in (("lerobot", "hf"), ("lerobot_05", "hf_05")):
            convert.main(["--input", str(tmp_path / src), "--output", str(tmp_path / dst),
                          "--tokenizer", str(tiny_tokenizer_dir)])
    # transformers maps pi0's policy class to AutoModelForImageTextToText (AutoModel is the headless PI0Model)
    assert isinstance(AutoModelForImageTextToText.from_pretrained(tmp_path / "hf"), PI0ForConditionalGeneration)
    assert isinstance(AutoModelForImageTextToText.from_pretrained(tmp_path / "hf_05"), PI05ForConditionalGeneration)
    # every command loads a converted pi0 with hf_vla's pi0 processor and the checkpoint's normalisation stats
    from hf_vla.hub.resolve import load_pretrained
    from hf_vla.models.pi0_adapter import PI0HeadProcessor

    model, processor = load_pretrained(tmp_path / "hf")
    assert isinstance(model, PI0ForConditionalGeneration) and isinstance(processor, PI0HeadProcessor)
    assert list(processor.norm_stats) == ["default"]
    assert processor.norm_stats["default"]["actions"]["std"] == [1.0, 1.0]  # the lerobot normalizer's, as written


def test_convert_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert.convert_checkpoint(tmp_path, tmp_path / "out")
    config = tiny_pi05_config()
    with pytest.raises(ValueError, match="no mapping"):
        convert.convert_lerobot_state_dict({"something.else": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match="adaRMS"):
        convert.convert_lerobot_state_dict(
            {"paligemma_with_expert.gemma_expert.model.norm.weight": torch.zeros(1)}, config)


def test_numpy_uint8_images_read_as_pixels(processor):
    """uint8 images given as numpy arrays are 0..255 pixels, as uint8 tensors are (they were once read as floats)."""
    images = np.random.default_rng(0).integers(0, 256, size=(1, 2, 3, 40, 30), dtype=np.uint8)
    from_numpy = processor(images=images, text=["reach"], state=np.zeros((1, 3)), head=0)["pixel_values"]
    from_torch = processor(images=torch.from_numpy(images), text=["reach"], state=np.zeros((1, 3)), head=0)["pixel_values"]
    torch.testing.assert_close(from_numpy, from_torch, rtol=0, atol=0)
    assert from_numpy.min() >= -1 and from_numpy.max() <= 1


def _processor(tiny_tokenizer):
    from test_serve import NORM_STATS, demo_config

    from hf_vla.models.pi05 import PI05Processor

    return PI05Processor.from_config(demo_config(), tiny_tokenizer, norm_stats=NORM_STATS)


def test_processor_takes_frames_as_cameras_and_envs_give_them(tiny_tokenizer):
    """HxWx3 uint8 (env, server), PIL, CHW uint8 and float in [0, 1] give the same pixels; float 0..255, other dtypes
    and non-RGB shapes are refused in one line naming the problem."""
    from PIL import Image

    processor = _processor(tiny_tokenizer)
    head = processor.head_names[0]
    dims = len(processor.norm_stats[head]["state"]["q01"])
    rng = np.random.default_rng(0)
    hwc = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)

    def pixels(images, text="pick", state=None):
        state = np.zeros(dims, np.float32) if state is None else state
        return processor(images=images, text=text, state=state, head=head)["pixel_values"]

    expected = pixels(torch.from_numpy(hwc).permute(2, 0, 1)[None])  # the documented [n_cams, 3, H, W]
    assert expected.shape == (1, 1, 3, processor.image_size, processor.image_size)
    for given in (hwc, hwc[None], hwc[None, None], torch.from_numpy(hwc), Image.fromarray(hwc), [Image.fromarray(hwc)],
                  [[Image.fromarray(hwc)]], torch.from_numpy(hwc).permute(2, 0, 1),
                  torch.from_numpy(hwc).permute(2, 0, 1).float() / 255, hwc.astype(np.float32) / 255):
        torch.testing.assert_close(pixels(given), expected, atol=1e-5, rtol=0)
    batch = processor(images=np.stack([hwc, hwc[::-1]]), text=["a", "b"], state=np.zeros((2, dims), np.float32),
                      head=head)["pixel_values"]
    assert batch.shape[:2] == (2, 1)  # [B, H, W, 3] with B prompts: one camera per sample
    for given, message in ((hwc.astype(np.float32), r"float pixels must be in \[0, 1\], got values in \[0, 255\]"),
                           (hwc.astype(np.int64), "dtype torch.int64 is not accepted"),
                           (hwc[..., :2], r"expected RGB images"),
                           (hwc[0], r"expected \[3, H, W\]")):
        with pytest.raises(ValueError, match=message):
            pixels(given)


def test_processor_loads_with_remote_code_where_hf_vla_is_absent(tmp_path, tiny_tokenizer):
    processor = _processor(tiny_tokenizer)
    processor.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "processor_config.json").read_text())
    assert config["auto_map"] == {"AutoProcessor": "processing_pi05.PI05Processor"}
    head = processor.head_names[0]
    dims = len(processor.norm_stats[head]["state"]["q01"])
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hf_vla"] = None  # hf_vla is not installed here
        import numpy as np
        from transformers import AutoProcessor
        processor = AutoProcessor.from_pretrained({str(tmp_path / "ckpt")!r}, trust_remote_code=True)
        assert type(processor).__name__ == "PI05Processor", type(processor)
        assert type(processor).__module__.startswith("transformers_modules"), type(processor).__module__
        out = processor(images=np.zeros((32, 32, 3), np.uint8), text="pick", state=np.zeros({dims}, np.float32),
                        head={head!r})
        print("REMOTE_OK", tuple(out["pixel_values"].shape), processor.head_names)
        """)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "REMOTE_OK" in result.stdout, result.stderr[-3000:]
    assert repr(processor.head_names) in result.stdout
    # where Pillow is not installed either: the processor loads and takes arrays (PIL images need Pillow, by nature)
    no_pillow = script.replace('sys.modules["hf_vla"] = None', 'sys.modules["hf_vla"] = None; sys.modules["PIL"] = None')
    result = subprocess.run([sys.executable, "-c", no_pillow], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "REMOTE_OK" in result.stdout, result.stderr[-3000:]


def test_pil_images_go_in_without_a_warning(tiny_tokenizer):
    """A PIL image is read-only as an array; the processor copies it rather than hand torch a read-only buffer (which
    printed "The given NumPy array is not writable")."""
    import warnings

    from PIL import Image

    processor = _processor(tiny_tokenizer)
    head = processor.head_names[0]
    dims = len(processor.norm_stats[head]["state"]["q01"])
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pixels = processor(images=image, text="pick", state=np.zeros(dims, np.float32), head=head)["pixel_values"]
    assert pixels.shape[:2] == (1, 1)


def test_a_prompt_without_the_state_is_openpis(tiny_tokenizer, tmp_path):
    """`discrete_state_input=False` (openpi's pi05_libero): the prompt is the cleaned task with BOS, then "\n"
    tokenized on its own, as openpi's `PaligemmaTokenizer.tokenize(prompt, state=None)`; the state leaves it unchanged,
    and the setting is saved with the processor."""
    from hf_vla.tiny import tiny_pi05_config

    config = tiny_pi05_config()
    config.discrete_state_input = False
    processor = PI05Processor.from_config(config, tiny_tokenizer, norm_stats={"h": {
        "state": {"q01": [0.0, 0.0], "q99": [1.0, 1.0]}, "actions": {"q01": [0.0], "q99": [1.0]}}})
    a = processor(text="pick_up the\nbowl ", state=[0.1, 0.9])
    b = processor(text="pick_up the\nbowl ", state=[0.7, 0.2])
    expected = tiny_tokenizer("pick up the bowl")["input_ids"] + tiny_tokenizer("\n", add_special_tokens=False)[
        "input_ids"]
    assert a["input_ids"][0, : len(expected)].tolist() == expected and torch.equal(a["input_ids"], b["input_ids"])
    assert a["attention_mask"][0].sum() == len(expected)
    with_state = PI05Processor.from_config(tiny_pi05_config(), tiny_tokenizer, norm_stats=processor.norm_stats)
    assert not torch.equal(with_state(text="pick up the bowl", state=[0.1, 0.9])["input_ids"],
                           with_state(text="pick up the bowl", state=[0.7, 0.2])["input_ids"])
    processor.save_pretrained(tmp_path)
    assert PI05Processor.from_pretrained(tmp_path).discrete_state_input is False


def test_a_read_only_state_is_taken_without_a_warning(tiny_tokenizer):
    """A state read with pandas (a read-only NumPy view) made PyTorch warn "The given NumPy array is not writable"
    from inside the processor."""
    import warnings

    import numpy as np

    from hf_vla.models.pi05 import PI05Processor
    from hf_vla.tiny import tiny_pi05_config

    config = tiny_pi05_config()
    processor = PI05Processor.from_config(config, tiny_tokenizer, norm_stats={"arm": {
        "state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}, "actions": {"q01": [-1.0] * 2, "q99": [1.0] * 2}}})
    state = np.array([[0.25, -0.5]], dtype=np.float32)
    state.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inputs = processor(images=np.zeros((1, 1, 32, 32, 3), np.uint8), text=["reach"], state=state)
    assert inputs["state"][0, :2].tolist() == pytest.approx([0.25, -0.5])
