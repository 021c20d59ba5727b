"""CPU seconds a command takes to answer `--help`, the command list and a configuration error (issue #92's goal:
under 3 each), the best of `--repeats` runs (the first run of a fresh install also compiles bytecode).

    python -m benchmarks.speed.cli_startup                       # this checkout
    python -m benchmarks.speed.cli_startup --repo /path/to/other/checkout --tag before

JSON (`--output`, default benchmarks/results/cli_startup_cpu.json, under `--tag`): {case: CPU seconds}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("train", "evaluate", "serve", "record", "convert", "rl", "recap", "demo")


def cpu_seconds(args: list[str], cwd: Path) -> tuple[float, int]:
    """User + system CPU seconds of one child run, and its exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(cwd)))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.returncode


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose hf_vla is measured")
    parser.add_argument("--tag", default="after")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "cli_startup_cpu.json"))
    args = parser.parse_args()
    repo = Path(args.repo).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "bad.json"
        bad.write_text(json.dumps({"max_stepz": 3}))
        cases = {"python -m hf_vla": ["-m", "hf_vla"]}
        cases |= {f"{command} --help": ["-m", f"hf_vla.{command}", "--help"] for command in COMMANDS}
        cases["train: unknown config key"] = ["-m", "hf_vla.train", str(bad)]
        cases["train: unknown --flag"] = ["-m", "hf_vla.train", str(repo / "configs" / "demo.json"), "--max_stepz", "3"]
        demo = str(repo / "configs" / "demo.json")
        cases["train: wrong type"] = ["-m", "hf_vla.train", demo, "--max_steps", "abc"]
        cases["train: bad datasets entry"] = ["-m", "hf_vla.train", demo, "--datasets.0.weight", "x"]
        cases["train: bad value (post-init check)"] = ["-m", "hf_vla.train", demo, "--learning_rate", "-1"]
        cases["rl: wrong type"] = ["-m", "hf_vla.rl", str(repo / "configs" / "rl" / "demo.json"), "--max_steps", "x"]
        found = {}
        for name, case in cases.items():
            runs = [cpu_seconds(case, repo) for _ in range(args.repeats)]
            found[name] = {"cpu_seconds": round(min(seconds for seconds, _ in runs), 2), "exit": runs[0][1]}
    output = Path(args.output)
    results = json.loads(output.read_text()) if output.exists() else {}
    results[args.tag] = {"repo": str(repo), "repeats": args.repeats, "cases": found}
    output.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results[args.tag], indent=1))


if __name__ == "__main__":
    main()
