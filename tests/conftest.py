import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

# No test may reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The statistics/check cache of every test session starts empty (and never touches the user's cache).
os.environ.setdefault("HF_VLA_CACHE", tempfile.mkdtemp(prefix="hf_vla_test_cache_"))

sys.path.insert(0, str(Path(__file__).parent))

REPO = Path(__file__).resolve().parents[1]
# The project's shared folder beside the repository (CI lays it there); HF_VLA_SHARED points elsewhere.
SHARED = Path(os.environ.get("HF_VLA_SHARED") or REPO.parent / "shared")
HUMANOID = SHARED / "datasets" / "humanoid_teleop_24"


def require_shared(path: Path, what: str) -> Path:
    """`path` under the shared folder; without it a test skips with one line saying what is missing and where it comes
    from, except under CI (`CI=true`), where a missing dataset is a failure, so CI keeps running these tests."""
    if path.exists():
        return path
    message = (f"{what} is missing: {path} (the project's shared folder, laid beside the repository as ../shared; "
               f"set HF_VLA_SHARED to its location)")
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{message}; CI=true needs it", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def humanoid() -> Path:
    """The real LeRobot v3.0 teleoperation dataset (24 episodes, 640x480 video, 34-dim state/actions)."""
    return require_shared(HUMANOID, "the real teleop dataset humanoid_teleop_24")


# `make test` hands whole files to two pytest-xdist workers in collection order (--dist loadfile
# --no-loadscope-reorder): the longest files go first so the workers end together. Seconds per file of the default
# suite (not `slow`), both workers busy on the 2-core CI-like machine (2026-11-28, --durations=0, 940 s wall): test_rl
# 311, test_metaworld 237, test_readme 229, test_serve 131, test_failures 126, test_trainer 121, test_engines 76,
# test_cli 76, test_deployment 74, test_preemption 72; every other file under 55. test_lerobot_plugin (lerobot-eval's
# 500 Meta-World steps, 2026-12-02): ~190. test_engines goes second for the
# `slow` tier (`make test TEST_MARKS=slow`), where its other engines' launches make it the longest (~540 s).
LONGEST_FIRST = ("test_rl.py", "test_engines.py", "test_metaworld.py", "test_readme.py", "test_lerobot_plugin.py",
                 "test_serve.py", "test_metaworld_cameras.py",
                 "test_failures.py", "test_trainer.py", "test_cli.py", "test_deployment.py", "test_preemption.py", "test_cotraining.py",
                 "test_elastic.py", "test_ema.py", "test_hub.py", "test_rollouts.py", "test_pi05_model.py",
                 "test_notebooks.py", "test_structure.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from hf_vla.tiny import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from hf_vla.tiny import build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer_dir")
    build_tiny_tokenizer(path)
    return path


def refused(cli, argv, capsys) -> str:
    """A command's `cli(argv)` run in this process (a command's interpreter start-up is ~15 s on the CI machine;
    `python -m` itself is tested in tests/test_failures.py and tests/test_cli.py): it must exit 2 with no traceback;
    its last stderr line is returned. Restores torch's thread count (evaluate sets it for its env workers)."""
    import torch

    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exited:
            cli(argv)
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


def randomize_(model, seed=0, scale=0.1):
    """Random weights everywhere, so zero-initialised adaRMS gates do not hide the expert."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def colorreach_run(base, max_episode_steps: int, *train_flags: str, config: Path = REPO / "configs/demo.json"):
    """A ColorReach recording at 24 px (4 episodes, seeds 0..) under `base / "data"` and a 2-step run of the demo config
    (or `config`) on it in `base / "run"` (more flags appended): a small checkpoint with a deployment contract.
    -> (run, datasets)"""
    from hf_vla.envs.recording import RecordArguments, record
    from hf_vla.train import main as train_main

    record(RecordArguments(env="color_reach", output=base / "data", episodes=4, image_size=24,
                           max_episode_steps=max_episode_steps), progress=False)
    datasets = json.loads(Path(config).read_text())["datasets"]
    datasets[0]["root"] = str(base / "data")
    out = base / "run"
    train_main([str(config), "--datasets", json.dumps(datasets), "--output_dir", str(out),
                "--generate_demo_data", "false", "--validation_ratio", "0", "--per_device_train_batch_size", "4",
                "--stream_open_blocks", "2", "--max_steps", "2", "--warmup_steps", "0", "--disable_tqdm", "true",
                *train_flags])
    return out, datasets
