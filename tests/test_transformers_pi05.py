"""hf_vla's pi0.5 beside transformers' own (5.25+, model type "pi05"): no silent wrong load either way.

Oracle: transformers 5.25 itself, installed apart by `../shared/oracles/transformers-5.25/install.sh` (it cannot share
the project's environment: it needs huggingface-hub >= 2.4, lerobot pins < 2) and run in a subprocess with it first on
PYTHONPATH (`tests/transformers_overlay.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SHARED, randomize_, require_shared
from safetensors.torch import load_file

from hf_vla.hub.resolve import load_pretrained
from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config

INSTALL = SHARED / "oracles" / "transformers-5.25" / "install.sh"
OVERLAY_SCRIPT = Path(__file__).with_name("transformers_overlay.py")
STATS = {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}, "actions": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}}


@pytest.fixture(scope="module")
def overlay() -> Path:
    """transformers 5.25 installed apart (reused once complete); skips with one line where it cannot be installed."""
    require_shared(INSTALL, "the transformers 5.25 oracle installer")
    target = Path(os.environ.get("HF_VLA_TRANSFORMERS_ORACLE",
                                 Path.home() / ".cache" / "hf_vla-oracles" / "transformers-5.25"))
    done = subprocess.run(["bash", str(INSTALL), str(target)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHON=sys.executable))
    if done.returncode != 0 or not (target / ".complete").exists():
        pytest.skip(f"transformers 5.25 could not be installed into {target}: {done.stderr.strip()[-300:]}")
    return target


def _run_overlay(overlay: Path, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{overlay}{os.pathsep}{REPO / 'tests'}", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, str(OVERLAY_SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.rsplit("\nRESULT ", 1)[-1])


def _bos_tokenizer():
    """The tiny tokenizer, starting every text with BOS as PaliGemma's does (lerobot's and hf_vla's prompts get it from
    the tokenizer; transformers' processor writes it into the prompt and turns the tokenizer's off)."""
    from tokenizers import processors

    tokenizer = build_tiny_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.convert_tokens_to_ids("<bos>"))])
    return tokenizer


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """A tiny hf_vla pi0.5 with its processor, and the same files as hf_vla wrote them before its own model type."""
    root = tmp_path_factory.mktemp("pi05_types")
    model = randomize_(PI05ForConditionalGeneration(tiny_pi05_config(chunk_size=4, max_state_dim=2,
                                                                     max_action_dim=2)), seed=1).eval()
    processor = PI05Processor.from_config(model.config, _bos_tokenizer(), norm_stats={"h": STATS}, head_names=["h"])
    model.save_pretrained(root / "hf_vla")
    processor.save_pretrained(root / "hf_vla")
    shutil.copytree(root / "hf_vla", root / "legacy")
    config = json.loads((root / "legacy" / "config.json").read_text())
    (root / "legacy" / "config.json").write_text(json.dumps({**config, "model_type": "pi05"}))
    return {"root": root, "hf_vla": root / "hf_vla", "legacy": root / "legacy", "model": model}


def _inputs(config, seed=0):
    generator = torch.Generator().manual_seed(seed)
    size = config.image_size
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    return dict(input_ids=torch.randint(4, 400, (2, 7), generator=generator), attention_mask=mask,
                pixel_values=torch.rand(2, 2, 3, size, size, generator=generator) * 2 - 1,
                pixel_attention_mask=torch.tensor([[True, True], [True, False]]),
                noise=torch.randn(2, config.chunk_size, config.max_action_dim, generator=generator),
                timestep=torch.rand(2, generator=generator))


def test_hf_vla_writes_a_model_type_of_its_own(checkpoints):
    config = json.loads((checkpoints["hf_vla"] / "config.json").read_text())
    assert config["model_type"] == "hf_vla_pi05"
    assert config["auto_map"]["AutoModel"] == "modeling_pi05.PI05ForConditionalGeneration"


def test_a_former_checkpoint_loads_and_converts_to_the_new_type(checkpoints, tmp_path):
    from transformers import AutoModel

    from hf_vla.convert import cli

    inputs = _inputs(checkpoints["model"].config)
    with torch.no_grad():
        expected = checkpoints["model"](**inputs).logits
        for loaded in (load_pretrained(checkpoints["legacy"])[0], AutoModel.from_pretrained(checkpoints["legacy"])):
            assert loaded.config.model_type == "hf_vla_pi05"
            torch.testing.assert_close(loaded.eval()(**inputs).logits, expected, rtol=0, atol=0)
    out = tmp_path / "converted"
    assert cli(["--input", str(checkpoints["legacy"]), "--output", str(out)]) == out
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "hf_vla_pi05"
    assert "model_type = MODEL_TYPE" in (out / "configuration_pi05.py").read_text()  # the current remote code
    before, after = load_file(checkpoints["legacy"] / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) and before[key].dtype == after[key].dtype for key in before)
    for name in ("processor_config.json", "tokenizer.json"):  # the processor (its statistics, tokenizer) kept
        assert (out / name).is_file()
    assert PI05Processor.from_pretrained(out).norm_stats["h"]["actions"]["q99"] == [1.0, 1.0]


def test_transformers_own_pi05_format_is_refused_in_one_line(checkpoints, tmp_path, capsys):
    """A config of model type "pi05" without hf_vla's fields is transformers' own pi0.5: its weights have other names,
    so hf_vla's loaders refuse it naming the file instead of loading random tensors."""
    from hf_vla.convert import cli

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    config = json.loads((checkpoints["hf_vla"] / "config.json").read_text())
    for name in ("discrete_state_input", "state_bins", "tokenizer_max_length", "auto_map"):
        config.pop(name, None)
    (theirs / "config.json").write_text(json.dumps({**config, "model_type": "pi05"}))
    shutil.copy(checkpoints["hf_vla"] / "model.safetensors", theirs)
    with pytest.raises(ValueError, match=r"theirs/config.json: transformers' own pi0.5 \(model_type 'pi05' without "):
        load_pretrained(theirs)
    with pytest.raises(SystemExit) as exited:  # convert imports it, with the processor saved beside it
        cli(["--input", str(theirs), "--output", str(tmp_path / "x")])
    line = capsys.readouterr().err.strip()
    assert exited.value.code != 0 and "processor_config.json" in line and len(line.splitlines()) == 1, line


def test_plain_transformers_never_reads_an_hf_vla_checkpoint_as_its_own(overlay, checkpoints, tmp_path):
    """transformers 5.25 without hf_vla: every Auto class refuses the checkpoint (it has custom code) instead of
    building transformers' pi0.5 with random tensors; with `trust_remote_code` it runs hf_vla's own code, with the
    same logits as hf_vla."""
    model = checkpoints["model"]
    inputs = _inputs(model.config)
    torch.save(inputs, tmp_path / "inputs.pt")
    found = _run_overlay(overlay, "plain", str(checkpoints["hf_vla"]), str(tmp_path / "inputs.pt"),
                         str(tmp_path / "logits"))
    assert found["transformers"] == "5.25.0" and not found["hf_vla_imported"]
    for name in ("AutoConfig", "AutoModel", "AutoModelForImageTextToText"):
        assert found[name]["error"] == "ValueError" and "contains custom code" in found[name]["line"], found[name]
        assert found[f"{name}+remote_code"]["class"].startswith("transformers_modules."), found
    assert "error" in found["AutoProcessor"], found["AutoProcessor"]  # never transformers' PI05Processor
    assert found["AutoProcessor+remote_code"]["class"].endswith("processing_pi05.PI05Processor")
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt")["logits"], expected, rtol=0, atol=1e-6)


def test_hf_vla_imported_leaves_transformers_pi05_in_place(overlay, checkpoints, tmp_path):
    """transformers 5.25 with hf_vla imported: "pi05" stays transformers' (its checkpoints load into its classes,
    hf_vla's loader refuses them in one line); hf_vla's checkpoints, new and former, load as hf_vla's model through
    hf_vla's loader, and the new ones through the Auto classes too."""
    found = _run_overlay(overlay, "with_hf_vla", str(checkpoints["hf_vla"]), str(checkpoints["legacy"]),
                         str(tmp_path))
    assert found["config_mapping_pi05"] == "transformers.models.pi05.configuration_pi05.PI05Config", found
    assert found["model_mapping_pi05"] == "transformers.models.pi05.modeling_pi05"
    assert found["config_mapping_hf_vla_pi05"] == "hf_vla.models.pi05.configuration_pi05"
    assert found["transformers:AutoModelForImageTextToText"]["class"] == \
        "transformers.models.pi05.modeling_pi05.PI05ForConditionalGeneration", found
    assert found["transformers:AutoConfig"]["class"].startswith("transformers.models.pi05."), found
    refused = found["transformers:load_pretrained"]
    assert refused["error"] == "ValueError" and refused["lines"] == 1 and "transformers' own pi0.5" in refused[
        "line"], refused
    ours = "hf_vla.models.pi05.modeling_pi05.PI05ForConditionalGeneration"
    for key in ("hf_vla:AutoModel", "hf_vla:AutoModelForImageTextToText", "hf_vla:load_pretrained",
                "legacy:load_pretrained"):
        assert found[key] == {"class": ours}, (key, found[key])


def test_an_export_runs_in_transformers_own_pi05_with_hf_vlas_actions(overlay, checkpoints, tmp_path):
    """`convert --to transformers`: transformers 5.25's own `PI05ForConditionalGeneration` loads it with no key
    missing or unexpected, and its `PI05Processor` + `sample_actions` on the same observations and noise give hf_vla's
    velocity, chunk and robot-unit actions; two cameras, one absent in one sample, prompts of different lengths."""
    import numpy as np

    from hf_vla.convert import cli

    exported = cli(["--input", str(checkpoints["hf_vla"]), "--to", "transformers", "--output", str(tmp_path / "tf")])
    model = checkpoints["model"]
    processor = PI05Processor.from_pretrained(checkpoints["hf_vla"])
    size, config = processor.image_size, model.config
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (2, 2, size, size, 3), dtype=np.uint8)
    present = torch.tensor([[True, True], [True, False]])
    tasks, state = ["pick up the red cube", "open it"], torch.tensor([[0.3, -0.7], [-0.2, 0.9]])
    noise = torch.randn(2, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(4))
    timestep = torch.tensor([0.7, 0.3])
    torch.save({"images": [[images[0, 0], images[0, 1]], [images[1, 0]]], "tasks": tasks, "state": state,
                "noise": noise, "timestep": timestep}, tmp_path / "observations.pt")
    found = _run_overlay(overlay, "parity", str(exported), str(tmp_path / "observations.pt"), str(tmp_path / "theirs"))
    assert found["loading"] == {}, found  # strict: every tensor has its place
    theirs = torch.load(tmp_path / "theirs.pt")
    ours = processor(images=torch.from_numpy(images).permute(0, 1, 4, 2, 3), text=tasks, state=state, head="h",
                     camera_mask=present)
    inputs = {key: ours[key] for key in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}
    with torch.no_grad():
        velocity = model(**inputs, noise=noise, timestep=timestep).logits
        chunk = model.sample_actions(**inputs, noise=noise)
    robot = processor.unnormalize_actions(chunk, "h")
    torch.testing.assert_close(theirs["velocity"], velocity, rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs["chunk"], chunk, rtol=0, atol=1e-5)
    torch.testing.assert_close(theirs["robot"], torch.as_tensor(robot)[..., :2], rtol=0, atol=1e-5)


def test_what_transformers_pi05_cannot_express_is_refused_in_one_line(checkpoints, tmp_path, capsys):
    from hf_vla.convert import cli

    root = tmp_path / "memory"
    shutil.copytree(checkpoints["hf_vla"], root)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, "advantage_indicator": "text"}))
    with pytest.raises(SystemExit) as exited:
        cli(["--input", str(root), "--to", "transformers", "--output", str(tmp_path / "x")])
    line = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(line.splitlines()) == 1, line
    assert "transformers' pi0.5 cannot express RECAP's advantage indicator (advantage_indicator='text')" in line


@pytest.fixture(scope="module")
def theirs(overlay, tmp_path_factory) -> Path:
    """A tiny pi0.5 saved by transformers 5.25's own `PI05ForConditionalGeneration` and `PI05Processor`."""
    root = tmp_path_factory.mktemp("theirs")
    _bos_tokenizer().save_pretrained(root / "tokenizer")
    _run_overlay(overlay, "save_theirs", str(root / "tokenizer"), str(root / "pi05"))
    return root / "pi05"


def _observations(size: int, chunk: int, dims: int, path: Path):
    import numpy as np

    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (2, 2, size, size, 3), dtype=np.uint8)
    given = {"images": [[images[0, 0], images[0, 1]], [images[1, 0]]], "tasks": ["pick up the red cube", "open it"],
             "state": torch.tensor([[0.3, -0.7], [-0.2, 1.9]]), "timestep": torch.tensor([0.7, 0.3]),
             "noise": torch.randn(2, chunk, dims, generator=torch.Generator().manual_seed(4))}
    torch.save(given, path)
    return given, images


def _ours(checkpoint: Path, given: dict, images):
    model, processor = load_pretrained(checkpoint)
    head = processor.head_names[0]
    ours = processor(images=torch.from_numpy(images).permute(0, 1, 4, 2, 3), text=given["tasks"],
                     state=given["state"], head=head, camera_mask=torch.tensor([[True, True], [True, False]]))
    inputs = {key: ours[key] for key in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}
    with torch.no_grad():
        velocity = model.eval()(**inputs, noise=given["noise"], timestep=given["timestep"]).logits
        chunk = model.sample_actions(**inputs, noise=given["noise"])
    return velocity, chunk, torch.as_tensor(processor.unnormalize_actions(chunk, head))[..., :2]


def test_transformers_own_checkpoint_converts_into_hf_vla_with_its_actions(overlay, theirs, tmp_path):
    """A checkpoint transformers' own classes saved converts (`hf_vla.convert --input`) into one hf_vla acts with as
    transformers does: its velocity, chunk and robot-unit actions on the same observations and noise."""
    from hf_vla.convert import cli

    imported = cli(["--input", str(theirs), "--output", str(tmp_path / "imported"), "--head", "arm"])
    assert json.loads((imported / "config.json").read_text())["model_type"] == "hf_vla_pi05"
    model, _ = load_pretrained(imported)
    given, images = _observations(model.config.image_size, model.config.chunk_size, model.config.max_action_dim,
                                  tmp_path / "observations.pt")
    found = _run_overlay(overlay, "parity", str(theirs), str(tmp_path / "observations.pt"), str(tmp_path / "theirs"))
    assert found["loading"] == {}, found
    expected = torch.load(tmp_path / "theirs.pt")
    velocity, chunk, robot = _ours(imported, given, images)
    torch.testing.assert_close(velocity, expected["velocity"], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunk, expected["chunk"], rtol=0, atol=1e-5)
    torch.testing.assert_close(robot, expected["robot"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_an_imported_transformers_checkpoint_trains(theirs, tmp_path, lora):
    from conftest import colorreach_run

    from hf_vla.convert import cli

    imported = cli(["--input", str(theirs), "--output", str(tmp_path / "imported")])
    flags = ["--lora_preset", "expert", "--lora_r", "4"] if lora else []
    run, _ = colorreach_run(tmp_path, 40, "--model_name_or_path", str(imported), "--model_config", "null", *flags)
    trained, _ = load_pretrained(run)
    assert trained.config.model_type == "hf_vla_pi05"
    assert json.loads((run / "all_results.json").read_text())["train_loss"] > 0
