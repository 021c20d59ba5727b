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
SHARED = REPO.parent / "shared"
HUMANOID = SHARED / "datasets" / "humanoid_teleop_24"


def pytest_collection_modifyitems(config, items):
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


def randomize_(model, seed=0, scale=0.1):
    """Random weights everywhere, so zero-initialised adaRMS gates do not hide the expert."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model
