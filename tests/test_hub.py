"""Hub ids in, offline, through huggingface_hub's real cache resolution (hf_vla.hub.resolve): a lerobot-layout pi0.5
checkpoint under a Hub id is converted on load (bit for bit what `hf_vla.convert` writes) and cached, so the second
run does not convert again; a `repo_id` dataset in lerobot's cache trains with no root; only the used episodes' and
cameras' files are requested from the Hub; keep_ranges by hf:// reference; missing ids and revisions are one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, refused
from safetensors.torch import load_file
from test_processor_convert import _write_lerobot_checkpoint

from hf_vla.errors import ConfigError

COMMIT = "c0ffee" + "0" * 34
TOKENIZER_ID = "google/paligemma-3b-pt-224"


def add_to_hub_cache(cache: Path, repo_id: str, source: Path, repo_type: str = "model", commit: str = COMMIT,
                     revision: str = "main") -> Path:
    """A repository in huggingface_hub's cache layout (refs/<revision> -> snapshots/<commit>/<files>)."""
    folder = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / revision).write_text(commit)
    snapshot = folder / "snapshots" / commit
    shutil.copytree(source, snapshot, dirs_exist_ok=True)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_tokenizer_dir):
    """A Hub cache with lerobot's pi0.5 layout under `lerobot/pi05_tiny` and the tokenizer its pre-processor names."""
    from hf_vla.models.reference import build_lerobot_pi05

    root = tmp_path_factory.mktemp("hub")
    checkpoint = root / "lerobot_pi05"
    _write_lerobot_checkpoint(checkpoint, build_lerobot_pi05(seed=7), "pi05", tiny_tokenizer_dir)
    (checkpoint / "policy_preprocessor.json").write_text(json.dumps({"name": "policy_preprocessor", "steps": [
        {"registry_name": "tokenizer_processor", "config": {"tokenizer_name": TOKENIZER_ID, "max_length": 48}}]}))
    cache = root / "hub_cache"
    snapshot = add_to_hub_cache(cache, "lerobot/pi05_tiny", checkpoint)
    tokenizer = root / "tokenizer"  # the real repo has a config.json beside the tokenizer files; AutoTokenizer reads it
    shutil.copytree(tiny_tokenizer_dir, tokenizer)
    (tokenizer / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    add_to_hub_cache(cache, TOKENIZER_ID, tokenizer)
    return {"cache": cache, "snapshot": snapshot, "root": root}


@pytest.fixture
def hub_cache(hub, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    monkeypatch.setenv("HF_VLA_CACHE", str(tmp_path / "hf_vla_cache"))
    return hub


def test_train_from_hub_ids_converts_once_and_equals_hf_vla_convert(hub, tmp_path, tiny_tokenizer_dir):
    from hf_vla.convert import convert_checkpoint
    from hf_vla.envs.generate import ensure_demo_dataset

    home = tmp_path / "lerobot_home"
    ensure_demo_dataset(home / "hf-vla-test" / "color_reach", episodes=4, seed=2)  # a dataset in lerobot's cache
    env = dict(os.environ, HF_HUB_CACHE=str(hub["cache"]), HF_LEROBOT_HOME=str(home), HF_HUB_OFFLINE="1",
               HF_VLA_CACHE=str(tmp_path / "hf_vla_cache"), OMP_NUM_THREADS="1")
    config = {"policy": "pi05", "model_name_or_path": "lerobot/pi05_tiny", "tokenizer": TOKENIZER_ID,
              "datasets": [{"repo_id": "hf-vla-test/color_reach", "cameras": ["observation.image"],
                            "state_key": "observation.state", "action_key": "action"}],
              "validation_ratio": 0, "max_steps": 2, "per_device_train_batch_size": 2, "stream_open_blocks": 2,
              "warmup_steps": 0, "save_strategy": "no", "report_to": [], "use_cpu": True, "disable_tqdm": True,
              "dataloader_num_workers": 0}

    def train(name, **extra):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config | {"output_dir": str(tmp_path / name)} | extra))
        result = subprocess.run([sys.executable, "-m", "hf_vla.train", str(path)], capture_output=True, text=True,
                                env=env, cwd=REPO, timeout=900)
        assert result.returncode == 0, result.stderr[-4000:]
        return result.stderr

    first = train("first")
    converted = tmp_path / "hf_vla_cache" / "converted" / f"lerobot--pi05_tiny--{COMMIT}--v1"
    assert "converting it once" in first and converted.is_dir()
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    second = train("second", token_loss=True, fast_vocab_size=256)  # the lerobot checkpoint trains with the token loss
    assert "converting it once" not in second and "using its converted copy" in second
    assert "token_loss: FAST ids are language-model ids 475..730; the LM head is the VLM's input embedding" in second
    assert json.loads((tmp_path / "second" / "config.json").read_text())["token_loss"] is True
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    # bit for bit what `python -m hf_vla.convert` writes from the same files
    convert_checkpoint(hub["snapshot"], tmp_path / "reference", tokenizer=str(tiny_tokenizer_dir))
    ours, reference = load_file(converted / "model.safetensors"), load_file(tmp_path / "reference" / "model.safetensors")
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    assert json.loads((converted / "config.json").read_text()) == json.loads(
        (tmp_path / "reference" / "config.json").read_text())
    # the dims came from the weights (the config names the 2B / 300M variants; these towers are tiny)
    saved = json.loads((converted / "config.json").read_text())
    assert saved["vlm_config"]["text_config"]["hidden_size"] == 64 and saved["dit_config"]["hidden_size"] == 32
    card = (tmp_path / "second" / "README.md").read_text()
    assert "base_model: lerobot/pi05_tiny" in card  # the card names the Hub id, not the cache path


def test_only_the_used_episodes_and_cameras_are_downloaded(hub_cache, tmp_path, monkeypatch):
    import huggingface_hub
    from lerobot.utils import constants

    from hf_vla.data.sources import DatasetConfig, LeRobotSource
    from hf_vla.data.synthetic import DROID_CAMERAS, DroidLike, write_droid_like

    remote = write_droid_like(tmp_path / "remote", DroidLike(episodes=12, mean_length=40, frames_per_data_file=100,
                                                             episodes_per_video=3), progress=False)
    home = tmp_path / "lerobot_home"
    shutil.copytree(remote / "meta", home / "hf-vla-test" / "droid_tiny" / "meta")  # as lerobot fetches it first
    monkeypatch.setattr(constants, "HF_LEROBOT_HOME", home)
    asked = []

    def snapshot_download(repo_id, repo_type=None, revision=None, local_dir=None, allow_patterns=None, **kwargs):
        asked.append((repo_id, repo_type, revision, list(allow_patterns)))
        for pattern in allow_patterns:  # exact paths: the Hub would send just these
            target = Path(local_dir) / pattern
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(remote / pattern, target)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    # keep_ranges by hf:// reference, from a dataset repo in the Hub cache: episodes 0 and 1 only
    ranges = tmp_path / "ranges"
    ranges.mkdir()
    (ranges / "keep.json").write_text(json.dumps({"0": [[0, 20]], "1": [[5, 30]]}))
    add_to_hub_cache(Path(hub_cache["cache"]), "hf-vla-test/droid_ranges", ranges, repo_type="dataset")
    config = DatasetConfig(repo_id="hf-vla-test/droid_tiny", cameras=[DROID_CAMERAS[0]], revision="v3.0",
                           keep_ranges="hf://datasets/hf-vla-test/droid_ranges/keep.json")
    source = LeRobotSource(config, 0)
    assert source.usable_episodes() == [0, 1]
    [(repo_id, repo_type, revision, files)] = asked
    assert (repo_id, repo_type, revision) == ("hf-vla-test/droid_tiny", "dataset", "v3.0")
    expected = sorted(str(p.relative_to(source.root)) for p in [*source.data_files(), *source.video_files(DROID_CAMERAS[0])])
    assert files == expected and len(files) == 2  # one data file and one video file hold episodes 0-1
    assert all(DROID_CAMERAS[1] not in f and DROID_CAMERAS[2] not in f for f in files)
    all_data = list((remote / "data").rglob("*.parquet"))
    assert len(all_data) > 1  # the dataset has more, never asked for
    LeRobotSource(config, 0)  # everything is there now: nothing more is asked
    assert len(asked) == 1


def test_missing_hub_ids_and_revisions_are_one_line(hub_cache, tmp_path, capsys):
    from hf_vla.evaluate import cli
    from hf_vla.hub.resolve import fetch_file, resolve_pretrained

    with pytest.raises(ConfigError, match=r"Hub checkpoint 'nobody/nothing' is not in the local Hub cache"):
        resolve_pretrained("nobody/nothing")
    with pytest.raises(ConfigError, match=r"'lerobot/pi05_tiny' at revision 'v9' is not in the local Hub cache"):
        resolve_pretrained("lerobot/pi05_tiny", revision="v9")
    with pytest.raises(ConfigError, match="not a Hub id"):
        resolve_pretrained("./nowhere/at/all")
    with pytest.raises(ConfigError, match="hf://datasets/nobody/x/keep.json"):
        fetch_file("hf://datasets/nobody/x/keep.json", "keep_ranges")
    # the command says it in one line too (in this process, with the fixture's Hub cache: python -m's own path is
    # tested in tests/test_failures.py and tests/test_cli.py)
    last = refused(cli, ["--checkpoint", "nobody/nothing", "--episodes", "1"], capsys)
    assert "Hub checkpoint 'nobody/nothing' is not in the local Hub cache" in last, last
    from hf_vla.data.sources import DatasetConfig, LeRobotSource

    with pytest.raises(ConfigError, match="dataset 'nobody/nothing'"):
        LeRobotSource(DatasetConfig(repo_id="nobody/nothing", cameras=["observation.image"]), 0)


def test_resolve_pretrained_passes_other_checkpoints_through_and_loads_lerobot_ones(hub_cache, tmp_path):
    from transformers import AutoModel, AutoProcessor

    import hf_vla

    path = hf_vla.resolve_pretrained("lerobot/pi05_tiny")  # the documented helper for AutoModel users
    model = AutoModel.from_pretrained(path)
    assert type(model).__name__ == "PI05ForConditionalGeneration"
    assert AutoProcessor.from_pretrained(path).norm_stats["default"]["state"]["q99"] == [1.0, 1.0, 1.0]
    assert hf_vla.resolve_pretrained(path) == path  # a converted (hf_vla) directory passes through
    local = hf_vla.resolve_pretrained(hub_cache["snapshot"])  # a lerobot directory converts too, cached by content
    assert local != path and Path(local).is_dir() and hf_vla.resolve_pretrained(hub_cache["snapshot"]) == local
