"""One output rule for every route of `python -m hf_vla.convert` (#91): the output is never an input, above one or in
one; `--overwrite` replaces only an output of the same kind that hf_vla wrote (`.hf_vla_output.json`); the victim of a
refused command is byte-identical afterwards.

Each case gets its own tmp folder; the inputs are tiny checkpoints written by the tests' own builders."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
from test_lerobot_export import hf_vla_checkpoint
from test_processor_convert import _tiny_variants, _write_lerobot_checkpoint, build_lerobot_pi05
from test_safety import fails, tree_hash

from hf_vla import convert
from hf_vla.storage import OUTPUT_MARKER, marker_kind

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_tokenizer, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("output_rule")
    hf = hf_vla_checkpoint(root / "hf_vla", tiny_tokenizer)
    lerobot = root / "lerobot"
    _write_lerobot_checkpoint(lerobot, build_lerobot_pi05(seed=7), "pi05", tiny_tokenizer_dir)
    return {"hf_vla": hf, "lerobot": lerobot}


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def _lerobot_dataset(path: Path) -> Path:
    """A folder hf_vla did not write: the shape of a LeRobot dataset."""
    (path / "meta").mkdir(parents=True)
    (path / "meta" / "info.json").write_text(json.dumps({"codebase_version": "v3.0", "fps": 30}))
    (path / "data").mkdir()
    (path / "data" / "file-000.parquet").write_bytes(b"PAR1 not really")
    return path


def _adapters(run: Path) -> Path:
    """A LoRA run's layout: RUN/checkpoint-4 holds adapters (on a base beside the run), RUN holds other files."""
    checkpoint = run / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(run.parent / "base"),
                                                               "peft_type": "LORA"}))
    (checkpoint / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    (checkpoint / "optimizer.pt").write_bytes(b"state")
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / "adapter_model.safetensors").write_bytes(b"\1" * 16)
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}")
    return checkpoint


ROUTES = {"plugin": ["--to", "lerobot_plugin"], "export": ["--to", "lerobot"], "import": []}


def _route_input(route: str, built: dict, where: Path) -> Path:
    return _copy(built["lerobot" if route == "import" else "hf_vla"], where)


def _variants(route: str):
    """The import builds lerobot's tiny variants; the export checks against lerobot at the checkpoint's own dims."""
    return _tiny_variants() if route == "import" else contextlib.nullcontext()


@pytest.mark.parametrize("route", ["plugin", "export", "import"])
def test_an_output_holding_the_input_is_refused_and_nothing_moves(route, built, tmp_path, capsys, tiny_tokenizer_dir):
    """`--input P/run --output P --overwrite`: P (the input and what lies beside it) stays byte-identical."""
    parent = tmp_path / "P"
    source = _route_input(route, built, parent / "run")
    (parent / "notes.txt").write_text("beside the checkpoint")
    before = tree_hash(parent)
    tok = ["--tokenizer", str(tiny_tokenizer_dir)] if route == "import" else []
    for output, where in ((parent, "contains --input"), (source, "is --input"), (source / "sub", "is inside --input")):
        with _variants(route):
            line = fails(capsys, convert.cli, ["--input", str(source), *ROUTES[route], "--output", str(output), *tok,
                                               "--overwrite", "true"])
        assert line.startswith("hf_vla.convert: error: --output") and where in line, line
        assert tree_hash(parent) == before


@pytest.mark.parametrize("route", ["plugin", "export", "import"])
def test_overwrite_never_replaces_a_folder_hf_vla_did_not_write(route, built, tmp_path, capsys, tiny_tokenizer_dir):
    source = _route_input(route, built, tmp_path / "in")
    victim = _lerobot_dataset(tmp_path / "dataset")
    before = tree_hash(victim)
    tok = ["--tokenizer", str(tiny_tokenizer_dir)] if route == "import" else []
    with _variants(route):
        line = fails(capsys, convert.cli, ["--input", str(source), *ROUTES[route], "--output", str(victim), *tok,
                                           "--overwrite", "true"])
    assert "files hf_vla did not write (data, meta" in line and OUTPUT_MARKER in line, line
    assert tree_hash(victim) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset", "in"]  # no staging left behind


@pytest.mark.parametrize("route", ["plugin", "export", "import"])
def test_overwrite_replaces_its_own_output_of_the_same_kind_only(route, built, tmp_path, capsys, tiny_tokenizer_dir):
    source = _route_input(route, built, tmp_path / "in")
    tok = ["--tokenizer", str(tiny_tokenizer_dir)] if route == "import" else []
    out = tmp_path / "out"
    argv = ["--input", str(source), *ROUTES[route], "--output", str(out), *tok]
    kind = {"plugin": "lerobot_plugin", "export": "lerobot_export", "import": "hf_vla_checkpoint"}[route]
    with _variants(route):
        convert.main(argv)
        assert marker_kind(out) == kind
        line = fails(capsys, convert.cli, argv)  # without --overwrite: refused
        assert "exists and is not empty" in line
        (out / "stale.txt").write_text("from the first write")
        convert.main([*argv, "--overwrite", "true"])
    assert marker_kind(out) == kind and not (out / "stale.txt").exists()
    # an output of another kind is not this route's to replace
    other = _copy(out, tmp_path / "other")
    (other / OUTPUT_MARKER).write_text(json.dumps({"kind": "recording"}))
    before = tree_hash(other)
    with _variants(route):
        line = fails(capsys, convert.cli, ["--input", str(source), *ROUTES[route], "--output", str(other), *tok,
                                           "--overwrite", "true"])
    assert "holds an hf_vla recording output" in line, line
    assert tree_hash(other) == before


def test_a_plugin_directory_written_before_markers_may_be_replaced(built, tmp_path):
    out = tmp_path / "policy"
    convert.main(["--input", str(built["hf_vla"]), "--to", "lerobot_plugin", "--output", str(out)])
    (out / OUTPUT_MARKER).unlink()  # as an older hf_vla wrote it: config.json of type hf_vla
    convert.main(["--input", str(built["hf_vla"]), "--to", "lerobot_plugin", "--output", str(out), "--overwrite", "true"])
    assert marker_kind(out) == "lerobot_plugin"


def test_lora_merge_never_replaces_its_run_or_its_adapters(tmp_path, capsys):
    """`--input RUN/checkpoint-4 --output RUN --overwrite` replaced the whole run; `--output RUN/checkpoint-4` the
    adapters; a LeRobot dataset as output was deleted. Each is refused before anything is merged."""
    run = tmp_path / "RUN"
    checkpoint = _adapters(run)
    base = _copy(run / "adapter", tmp_path / "base")  # the adapters' base model directory
    victim = _lerobot_dataset(tmp_path / "dataset")
    before = {p: tree_hash(p) for p in (run, base, victim)}
    cases = [(run, "contains --input"), (checkpoint, "is --input"), (victim, "files hf_vla did not write"),
             (base, "is the adapters' base model")]
    for output, why in cases:
        line = fails(capsys, convert.cli, ["--input", str(checkpoint), "--output", str(output), "--overwrite", "true"])
        assert line.startswith("hf_vla.convert: error: --output") and why in line, line
        assert {p: tree_hash(p) for p in (run, base, victim)} == before


def test_a_config_that_is_not_json_is_one_line(built, tmp_path, capsys):
    source = _copy(built["hf_vla"], tmp_path / "in")
    (source / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    for route in (["--to", "lerobot_plugin"], ["--to", "lerobot"]):
        line = fails(capsys, convert.cli, ["--input", str(source), *route, "--output", str(tmp_path / "out")])
        assert f"{source / 'config.json'} is not valid JSON" in line, line
    assert not (tmp_path / "out").exists()


# ---- a checkpoint that would act otherwise is refused -------------------------------------------------------------
def _normaliser(path: Path) -> Path:
    return next(path.glob("*normalizer_processor*.safetensors"))


def _edit_stats(path: Path, **changes):
    from safetensors.torch import load_file, save_file

    file = _normaliser(path)
    tensors = load_file(file)
    for key, value in changes.items():
        tensors[key.replace("__", ".")] = value
    save_file(tensors, file)


@pytest.mark.parametrize("case", ["nan_action_mean", "inf_state_std", "wide_action_q99", "no_normaliser"])
def test_the_import_refuses_statistics_it_cannot_act_on(case, built, tmp_path, capsys, tiny_tokenizer_dir):
    import torch

    source = _copy(built["lerobot"], tmp_path / "in")
    if case == "nan_action_mean":
        _edit_stats(source, action__mean=torch.tensor([0.0, float("nan")]))
        expected = "non-finite action.mean ([0.0, nan])"
    elif case == "inf_state_std":
        _edit_stats(source, observation__state__std=torch.tensor([1.0, float("inf"), 1.0]))
        expected = "non-finite observation.state.std"
    elif case == "wide_action_q99":
        _edit_stats(source, action__q99=torch.ones(5))
        expected = "action.q99 5 wide, but the config's feature action has 2 dims"
    else:
        _normaliser(source).unlink()
        expected = "no normaliser statistics (no *normalizer_processor*.safetensors beside config.json)"
    before = tree_hash(source)
    with _tiny_variants():
        line = fails(capsys, convert.cli, ["--input", str(source), "--output", str(tmp_path / "out"),
                                           "--tokenizer", str(tiny_tokenizer_dir)])
    assert expected in line, line
    assert tree_hash(source) == before and sorted(p.name for p in tmp_path.iterdir()) == ["in"]


@pytest.mark.parametrize("steps", [50, 0, -3])
def test_the_import_refuses_n_action_steps_outside_the_chunk(steps, built, tmp_path, capsys, tiny_tokenizer_dir):
    """lerobot's config with n_action_steps 50 for chunk 5 was clamped to 5, 0 became 2, -3 was a traceback."""
    source = _copy(built["lerobot"], tmp_path / "in")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config | {"n_action_steps": steps}))
    with _tiny_variants():
        line = fails(capsys, convert.cli, ["--input", str(source), "--output", str(tmp_path / "out"),
                                           "--tokenizer", str(tiny_tokenizer_dir)])
    assert f"n_action_steps={steps} must be 1..5 (chunk_size" in line, line
    assert not (tmp_path / "out").exists()


def test_n_action_steps_is_checked_and_honoured_by_every_route(built, tmp_path, capsys, tiny_tokenizer_dir):
    checkpoint = built["hf_vla"]
    for route in (["--to", "lerobot_plugin"], ["--to", "lerobot"]):
        line = fails(capsys, convert.cli, ["--input", str(checkpoint), *route, "--output", str(tmp_path / "out"),
                                           "--n_action_steps", "999"])
        assert "--n_action_steps 999: must be 1..5 (the checkpoint's chunk_size" in line, line
        assert not (tmp_path / "out").exists()
    # the import and the merge keep their source's: the flag is refused, not ignored
    line = fails(capsys, convert.cli, ["--input", str(built["lerobot"]), "--output", str(tmp_path / "out"),
                                       "--n_action_steps", "2"])
    assert "--n_action_steps 2: taken with --to lerobot_plugin or --to lerobot" in line, line
    # the export writes the steps asked for (it wrote the contract's in silence)
    exported = convert.main(["--input", str(checkpoint), "--to", "lerobot", "--output", str(tmp_path / "exported"),
                             "--n_action_steps", "1"])
    assert json.loads((exported / "config.json").read_text())["n_action_steps"] == 1


def test_the_plugin_route_on_lora_adapters_says_what_to_pass(tmp_path, capsys):
    checkpoint = _adapters(tmp_path / "RUN")
    line = fails(capsys, convert.cli, ["--input", str(checkpoint), "--to", "lerobot_plugin", "--output",
                                       str(tmp_path / "out")])
    assert "LoRA adapters; pass the run's output directory (the merged model), or merge them first" in line, line


@pytest.mark.parametrize("case", ["no_weights", "truncated_weights", "contract_not_json", "proc_output"])
def test_the_export_of_a_damaged_checkpoint_is_one_line(case, built, tmp_path, capsys):
    source = _copy(built["hf_vla"], tmp_path / "in")
    output = tmp_path / "out"
    weights = source / "model.safetensors"
    if case == "no_weights":
        weights.unlink()
        expected, code = f"{source}: no model.safetensors (the weights)", 1
    elif case == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[:4000])
        expected, code = f"{weights}: not a complete safetensors file", 1
    elif case == "contract_not_json":
        (source / "deployment_config.json").write_bytes(b"{\"policy\": \xff")
        expected, code = f"{source / 'deployment_config.json'}: not a deployment contract", 1
    else:
        output = Path("/proc/hf_vla_x")
        expected, code = "--output '/proc/hf_vla_x' cannot be created", 2
    line = fails(capsys, convert.cli, ["--input", str(source), "--to", "lerobot", "--output", str(output)], code=code)
    assert expected in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_truncated_weights_through_the_runner_name_the_file(built, tmp_path):
    """What evaluate, serve and lerobot's loader (through the plugin) load with: one line naming the file."""
    from hf_vla.errors import ConfigError
    from hf_vla.serving.policy import load_policy

    source = _copy(built["hf_vla"], tmp_path / "in")
    (source / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes()[:-100])
    with pytest.raises(ConfigError, match=r"model.safetensors: not a complete safetensors file \(its tensors end at"):
        load_policy(source)


def test_a_flag_a_route_does_not_honour_is_refused(built, tmp_path, capsys, tiny_tokenizer_dir):
    for route in (["--to", "lerobot_plugin"], ["--to", "lerobot"]):
        line = fails(capsys, convert.cli, ["--input", str(built["hf_vla"]), *route, "--output", str(tmp_path / "o"),
                                           "--tokenizer", str(tiny_tokenizer_dir)])
        assert "--tokenizer" in line and "uses the checkpoint's own tokenizer" in line, line
    checkpoint = _adapters(tmp_path / "RUN")
    line = fails(capsys, convert.cli, ["--input", str(checkpoint), "--output", str(tmp_path / "o"), "--head", "x"])
    assert "--head: merging LoRA adapters keeps their base's heads" in line, line
    assert not (tmp_path / "o").exists()
