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
