"""The README's walkthrough runs top to bottom as written: every `<!-- walkthrough -->` block, in order, from a
fresh directory (the repository's configs beside it), offline. Training steps and episodes are cut with overrides
appended to the commands (what the README says its test does); everything else is the README's text."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
from conftest import REPO

BLOCK = re.compile(r"<!-- walkthrough -->\n```(bash|python)\n(.*?)\n```", re.S)
# appended to the README's commands so the walkthrough fits in CI: fewer steps, episodes and demo episodes
FAST = {
    ("hf_vla.demo",): ["--max_steps", "30", "--episodes", "2", "--demo_episodes", "24"],
    ("hf_vla.evaluate",): ["--episodes", "2"],
    ("hf_vla.train",): ["--max_steps", "3"],
    ("hf_vla.rl",): ["--max_steps", "1", "--eval_episodes", "2", "--group_size", "2", "--groups_per_update", "1",
                     "--num_envs", "1"],
}


def walkthrough() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    section = text[text.index("\n## Walkthrough\n"):]
    section = section[: section.index("\n## ", 1)]
    return BLOCK.findall(section)


def commands(script: str) -> list[str]:
    return [line.strip() for line in script.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_walkthrough_is_found_and_covers_the_newcomer_path():
    blocks = walkthrough()
    text = "\n".join(code for _, code in blocks)
    for step in ("make install", "python -m hf_vla.demo", "AutoModel.from_pretrained", "python -m hf_vla.evaluate",
                 "python -m hf_vla.serve", "WebsocketClientPolicy", "--lora_preset", "python -m hf_vla.rl",
                 "hf upload"):
        assert step in text, step


def _free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def test_readme_walkthrough_runs_as_written(tmp_path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    port = "8000" if _free(8000) else str(_free_port())  # the README's port, unless this machine has it taken
    background: list[subprocess.Popen] = []
    log = []

    def run(argv, **kwargs):
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, **kwargs)
        log.append((argv, result.returncode))
        assert result.returncode == 0, f"{argv}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        return result

    try:
        for kind, code in walkthrough():
            code = code.replace("8000", port)
            if kind == "python":
                run([sys.executable, "-c", code])
                continue
            for line in commands(code):
                if line.startswith("make install"):  # this suite runs inside the environment it creates
                    assert line == "make install && source .venv/bin/activate"
                    continue
                if line.startswith("until curl"):  # the README's wait for the server, through bash as written
                    run(["bash", "-c", f"for i in $(seq 120); do {line.split('; do ')[0].removeprefix('until ')} && "
                                       "exit 0; sleep 1; done; exit 1"])
                    continue
                if line == "kill %1":
                    background.pop().terminate()
                    continue
                argv = shlex.split(line.rstrip("&").strip())
                if argv[:2] == ["hf", "upload"]:  # up to the network: the command parses, the folder is the model
                    run([str(REPO / ".venv" / "bin" / "hf") if (REPO / ".venv/bin/hf").exists() else "hf", "upload",
                         "--help"])
                    folder = tmp_path / argv[3]
                    assert {"README.md", "config.json", "model.safetensors", "processor_config.json",
                            "deployment_config.json"} <= {p.name for p in folder.iterdir()}
                    run([sys.executable, "-c", f"import hf_vla; from transformers import AutoModel; "
                                               f"AutoModel.from_pretrained({str(folder)!r})"])
                    continue
                assert argv[0] == "python", line
                argv = [sys.executable, *argv[1:]]
                for prefix, extra in FAST.items():
                    if argv[2:2 + len(prefix)] == list(prefix):
                        argv += extra
                if line.endswith("&"):
                    background.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                                       stderr=subprocess.DEVNULL))
                    continue
                result = run(argv)
                if argv[2] == "hf_vla.demo":
                    assert "saved the trained model to outputs/demo" in result.stdout
    finally:
        for process in background:
            process.terminate()
            process.wait(timeout=30)
    ran = [argv[2] for argv, _ in log if len(argv) > 2 and argv[1] == "-m"]
    assert ran.count("hf_vla.evaluate") == 4 and {"hf_vla.demo", "hf_vla.train", "hf_vla.rl"} <= set(ran)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if not (REPO / "README.md").exists():  # pragma: no cover
    pytest.skip("no README", allow_module_level=True)


def test_your_own_data_on_cpu_runs_as_written_on_the_real_teleop_dataset(tmp_path, humanoid):
    """The README's "Your own data on CPU" command on a real 34-dim dataset (its keys put in): the model is built as
    wide as the data, the epoch counts passes over its frames, and the last line says to serve the model (the data
    comes from no simulator hf_vla runs)."""
    import json

    text = (REPO / "README.md").read_text()
    section = text[text.index("**Your own data on CPU**"):]
    script = section[section.index("```bash\n") + 8: section.index("\n```", section.index("```bash\n"))]
    (argv,) = commands(script)
    spec = {"root": str(humanoid), "cameras": ["image"], "state_key": "state", "action_key": "actions"}
    argv = shlex.split(argv.replace("path/to/dataset", str(humanoid)).replace("observation.images.top", "image")
                       .replace('"observation.state"', '"state"').replace('"action"}', '"actions"}'))
    assert argv[:3] == ["python", "-m", "hf_vla.train"] and json.loads(argv[-1]) == [spec], argv
    out = tmp_path / "own"
    argv = [sys.executable, *argv[1:], "--output_dir", str(out), "--max_steps", "4", "--logging_steps", "2"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(line.strip() for line in done.stdout.splitlines()[:4]), done.stdout[:300]  # no blank lines open the log
    assert "max_state_dim=34: the widest state of the data" in done.stderr
    assert "max_action_dim=34: the widest actions of the data" in done.stderr
    assert done.stdout.strip().splitlines()[-1].endswith(
        f"or serve it to your robot with python -m hf_vla.serve --checkpoint {out} (README: 'On a lerobot robot')")
    config = json.loads((out / "config.json").read_text())
    assert (config["max_state_dim"], config["max_action_dim"]) == (34, 34)
    # 2 steps x 16 samples over the 95% of 10,002 frames left for training: 0.0034 of a pass (the Trainer said 0.5)
    epochs = [float(e) for e in re.findall(r"'loss': '[^']+'.*?'epoch': '([^']+)'", done.stdout)]
    assert epochs and abs(epochs[0] - 32 / 9500) < 5e-4, epochs
