"""Every command answers `--help`, the command list and an unknown key before importing torch (issue #92): the
options are importable without torch, and train's and rl's (transformers' `TrainingArguments` among them) come from
their cached text, which must equal the live parser's."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from hf_vla import parser as parser_module

HEAVY = ("torch", "transformers", "lerobot")


def _imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess]:
    """The top-level modules a `python -X importtime ...` run imported, and the run."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=120)
    modules = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()
               if line.startswith("import time:")}
    return modules, done


@pytest.mark.parametrize("command", ["train", "rl", "evaluate", "serve", "record", "recap", "demo"])
def test_help_imports_no_torch(command):
    modules, done = _imported("-m", f"hf_vla.{command}", "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower() or "--" in done.stdout
    assert not modules & set(HEAVY), f"hf_vla.{command} --help imported {sorted(modules & set(HEAVY))}"


def test_command_list_and_unknown_key_import_no_torch(tmp_path):
    modules, done = _imported("-m", "hf_vla")
    assert done.returncode == 0 and "hf_vla.train" in done.stdout
    assert not modules & set(HEAVY)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"max_stepz": 3}))
    modules, done = _imported("-m", "hf_vla.train", str(config))
    assert done.returncode == 2 and "unknown key(s) ['max_stepz']" in done.stderr and "max_steps" in done.stderr
    assert not modules & set(HEAVY)
    modules, done = _imported("-m", "hf_vla.train", str(REPO / "configs" / "demo.json"), "--learning_rat", "1")
    assert done.returncode == 2 and "--learning_rat: unknown argument" in done.stderr
    assert not modules & set(HEAVY)


def test_import_hf_vla_still_registers_the_auto_classes():
    code = ("import hf_vla; from transformers import AutoConfig; "
            "print(type(AutoConfig.for_model('hf_vla_pi05')).__name__, type(AutoConfig.for_model('pi05_value')).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["PI05Config", "PI05ValueConfig"], done.stderr[-2000:]


@pytest.mark.parametrize("command", ["train", "rl"])
def test_cached_help_and_keys_equal_the_live_parser(command):
    """A field added, renamed or re-documented without re-writing the cache fails here; re-write it with
    `python -m hf_vla --write-command-cache` (hf_vla/templates/commands/)."""
    if command == "train":
        import hf_vla.train

        live = hf_vla.train.parser()
    else:
        from hf_vla.rl.__main__ import rl_parser

        live = rl_parser()
    cached = json.loads((parser_module.CACHE_DIR / f"{command}.json").read_text())
    assert cached == parser_module.command_cache_of(command, live), "stale cache: run python -m hf_vla --write-command-cache"


def test_cache_of_another_transformers_version_is_not_used(monkeypatch, capsys):
    monkeypatch.setattr(parser_module, "_transformers_version", lambda: "0.0.0")
    assert parser_module.answer_early("train", ["--help"]) is False
    assert capsys.readouterr().out == ""
    monkeypatch.undo()
    assert parser_module.answer_early("train", ["--help"]) is True
    assert "usage: python -m hf_vla.train" in capsys.readouterr().out


def test_a_long_phase_writes_a_line_every_30_seconds_to_a_log(monkeypatch, caplog):
    """Off a terminal, a phase's progress is a log line every PROGRESS_EVERY_S (done/total, rate, time left) and, unless
    the caller logs the end itself (the dataset scan), one when it ends."""
    import logging

    from hf_vla import cli

    clock = iter(float(t) for t in range(0, 1000, 10))
    monkeypatch.setattr(cli.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: False, raising=False)
    with caplog.at_level(logging.INFO, logger="hf_vla"):
        for final in (True, False):
            bar = cli.progress_bar(9, "scanning x", "files", final_line=final)
            for _ in range(9):
                bar.update(1)
            bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("scanning x: 3/9 files" in line for line in lines) == 2  # 30 s in: 3 files done, both bars
    assert sum(" in " in line and "9/9" in line for line in lines) == 1  # the end line: the first bar only


# A wrong type, choice or bound, a missing required key, a bad `datasets` entry: the same line from the cache
# (before torch is imported) as from the live parser, whose checks run after it.
BAD = [
    ({"max_steps": "abc"}, []),
    ({}, ["--max_steps", "2.5"]),
    ({}, ["--log_level", "loud"]),
    ({}, ["--per_device_train_batch_size", "true"]),
    ({}, ["--datasets.0.weight", "x"]),
    ({"datasets": [{"root": "x", "cameras": ["a"], "wieght": 2}]}, []),
    ({"datasets": [{"root": "x", "cameras": "a"}]}, []),
    ({"datasets": ["x"]}, []),
    ({"model_config": 3}, []),
    ({"lora_target_modules": [1, 2]}, []),
]


@pytest.mark.parametrize("extra,overrides", BAD)
def test_a_wrong_type_or_value_is_refused_from_the_cache_as_the_live_parser_refuses_it(tmp_path, extra, overrides):
    from hf_vla.errors import ConfigError
    from hf_vla.training.arguments import parse_config

    config = json.loads((REPO / "configs" / "demo.json").read_text()) | extra
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as early:
        parser_module.answer_early("train", [str(path), *overrides])
    with pytest.raises(ConfigError) as live:
        parse_config(path, overrides)
    assert str(early.value) == str(live.value)


def test_every_shipped_config_passes_the_early_checks():
    """The cache refuses nothing the live parser takes (its enums, unions and lists decoded as they were)."""
    for path in sorted((REPO / "configs").rglob("*.json")):
        if path.parent.name == "accelerate":
            continue
        command = "rl" if path.parent.name == "rl" else "train"
        assert parser_module.answer_early(command, [str(path), "--max_steps", "3"]) is False, path


def test_a_wrong_type_imports_no_torch(tmp_path):
    modules, done = _imported("-m", "hf_vla.train", str(REPO / "configs" / "demo.json"), "--max_steps", "abc")
    assert done.returncode == 2 and "max_steps: expected an integer, got 'abc'" in done.stderr
    assert not modules & set(HEAVY)
