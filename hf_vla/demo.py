"""The README's main job: `python -m hf_vla.demo` (what `make demo` runs).

Generates the ColorReach demo dataset if missing, trains a tiny pi0.5 on CPU with `configs/demo.json`, evaluates it
closed-loop, checks the checkpoint loads with `AutoModel.from_pretrained`, and writes `outputs/demo/summary.json`.
`--blind` also trains the language-blind control (same run, instructions shuffled across episodes).
Extra arguments are passed to the trainer as config overrides (e.g. `--max_steps 300`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

CONFIG = Path(__file__).resolve().parent / "configs" / "demo.json"  # inside the package (configs/demo.json links here)


def run(config: Path, overrides: list[str], episodes: int, tag: str, n_action_steps: int | None = None) -> dict:
    from transformers import AutoModel

    import hf_vla.models.auto  # noqa: F401  (registers pi05 with AutoModel)
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint
    from hf_vla.train import main as train_main

    start = time.perf_counter()
    if n_action_steps is not None:  # trained into the checkpoint's deployment contract, which evaluation reads
        overrides = [*overrides, "--n_action_steps", str(n_action_steps)]
    trainer = train_main([str(config), *overrides])
    train_seconds = time.perf_counter() - start
    output_dir = Path(trainer.args.output_dir)
    model = AutoModel.from_pretrained(output_dir)  # the saved checkpoint is a plain transformers model
    assert type(model).__name__ == "PI05ForConditionalGeneration"
    result = evaluate_checkpoint(EvaluateArguments(checkpoint=str(output_dir), episodes=episodes, device="cpu",
                                                   output_dir=str(output_dir / "rollouts")))
    summary = {"run": tag, "checkpoint": str(output_dir), "success_rate": result.success_rate,
               "episodes": result.episodes, "train_seconds": round(train_seconds, 1),
               "total_seconds": round(time.perf_counter() - start, 1), "videos": result.videos}
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@dataclass
class DemoArguments:
    """The demo's own options; every other `--key value` is a trainer override of the config."""

    config: str = field(default=str(CONFIG), metadata={"help": "the training config (the demo's by default)"})
    episodes: int = field(default=50, metadata={"help": "closed-loop evaluation episodes", "min": 1})
    blind: bool = field(default=False, metadata={"help": "also train the language-blind control"})
    n_action_steps: int | None = field(default=None, metadata={"help": "actions executed per chunk (default: half)",
                                                               "min": 1})


def main(argv=None):
    from hf_vla.parser import CommandParser

    args, overrides = CommandParser("python -m hf_vla.demo", (DemoArguments,), __doc__,
                                    config_file="none").parse_known(argv)
    if args is None:  # --help
        return []
    summaries = [run(Path(args.config), overrides, args.episodes, "demo", args.n_action_steps)]
    if args.blind:
        datasets = json.loads(Path(args.config).read_text())["datasets"]
        datasets[0]["shuffle_tasks_seed"] = 0
        blind = ["--datasets", json.dumps(datasets), "--output_dir", "outputs/demo_blind", *overrides]
        summaries.append(run(Path(args.config), blind, args.episodes, "language_blind", args.n_action_steps))
    print(json.dumps(summaries, indent=2))
    return summaries


def cli(argv=None):
    from hf_vla.cli import run as run_command

    return run_command("hf_vla.demo", main, argv)


if __name__ == "__main__":
    cli()
