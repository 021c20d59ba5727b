"""pi0.5's token objective on the five-task Meta-World benchmark: flow only vs FAST CE + knowledge insulation.

    python -m benchmarks.closed_loop.metaworld_benchmark --stage record
    python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min 20 --tag cotrain \\
        --config configs/pi05_metaworld_cotrain.json --output data_cache/metaworld_bench/cotrain.json
    python -m benchmarks.closed_loop.metaworld_benchmark --stage evaluate --tag cotrain --which hf_vla --checkpoint_episodes 0 \\
        --episodes 50 --output data_cache/metaworld_bench/cotrain.json
    # the third arm, FAST + KI + object locations, on a recording that carries them:
    python -m benchmarks.closed_loop.metaworld_benchmark --stage record --work data_cache/metaworld_loc
    python -m benchmarks.closed_loop.metaworld_benchmark --stage hf_vla --budget_min 20 --tag locations \
        --work data_cache/metaworld_loc --config configs/pi05_metaworld_cotrain_locations.json
    python -m benchmarks.closed_loop.metaworld_benchmark --stage evaluate --tag locations --which hf_vla --checkpoint_episodes 0 \
        --episodes 50 --work data_cache/metaworld_loc
    python -m benchmarks.closed_loop.metaworld_cotraining          # -> benchmarks/results/metaworld_cotraining_cpu.json
    # the four object-centred tasks, the same three arms at equal minutes (MT50 recipe, 128 px):
    python -m hf_vla.record --env metaworld --task basketball,peg-insert-side,push,pick-place --episodes 50 \
        --output data_cache/mt50_4loc --image_size 160
    python -m benchmarks.closed_loop.metaworld_mt50_ablation --data data_cache/mt50_4loc --work data_cache/object_centred \
        --output benchmarks/results/metaworld_object_centred_cpu.json --budget_min 15 \
        --settings flow_only,fast_ki,fast_ki_locations --probe_only        # the step rates, measured alone
    python -m benchmarks.closed_loop.metaworld_mt50_ablation ... (the same without --probe_only)
    python -m benchmarks.closed_loop.metaworld_cotraining --object_centred benchmarks/results/metaworld_object_centred_cpu.json
    # MT50 with the best token arm at the 45-minute budget (benchmarks/closed_loop/metaworld_mt50.py's docstring):
    python -m benchmarks.closed_loop.metaworld_cotraining --mt50 benchmarks/results/metaworld_mt50_cpu.json

The arms share the recorded data (5 tasks x 50 expert episodes at 96 px), the 20-minute budget (steps from each
arm's own probe of 200 steps, so the token objective's cost per step shows as fewer steps) and the evaluation (50
held-out episodes per task, seeds from 10,000). `flow_only` is `configs/pi05_metaworld.json`, whose figures are
benchmarks/results/metaworld_cpu.json (the committed run); `fast_ki` is `configs/pi05_metaworld_cotrain.json`. This
script collects both into the issue's schema and measures the policy call's latency of the token-objective
checkpoint, and of its weights in a flow-only model of the same dims (inference runs the same code path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _arm(run: dict, name: str) -> dict:
    final = run["closed_loop"][name]
    return {"mean_success": round(final["success_rate"], 4),
            "tasks": {task: r["success_rate"] for task, r in final["tasks"].items()},
            "minutes": run["budget_min"], "max_steps": run["max_steps"],
            "steps_per_s": run["probe_steps_per_s"], "peak_rss_gb": run.get("peak_rss_gb"),
            "train_seconds": run["train_seconds"]}


def latency_ms(checkpoint: Path, token_loss: bool, repeats: int = 30, image: int = 96) -> float:
    """Median `PolicyRunner` call (prompt, images, `sample_actions`, un-normalisation) on one thread: the checkpoint as
    saved, or its weights in a model built with `token_loss` off (a flow-only model of the same dims)."""
    import numpy as np
    import torch

    from hf_vla import PI05ForConditionalGeneration
    from hf_vla.hub.resolve import load_pretrained
    from hf_vla.serving.policy import PolicyRunner

    model, processor = load_pretrained(str(checkpoint))
    if not token_loss:
        config = model.config
        config.token_loss = False
        flow_only = PI05ForConditionalGeneration(config)
        flow_only.load_state_dict(model.state_dict())
        model = flow_only
    runner = PolicyRunner(model.eval(), processor)
    observation = {"observation.image": np.zeros((image, image, 3), np.uint8),
                   "observation.state": np.zeros(4, np.float32), "task": "reach the goal"}
    torch.set_num_threads(1)
    times = []
    for index in range(repeats + 3):
        started = time.perf_counter()
        runner(observation, "reach the goal")
        if index >= 3:
            times.append(1000 * (time.perf_counter() - started))
    return round(statistics.median(times), 2)


def object_centred(ablation: dict, work: Path) -> dict:
    """The issue's schema for the four object-centred tasks, from the ablation script's arms at equal minutes."""
    out = {"tasks": ablation["tasks"], "episodes_per_task": None, "data": ablation["data"],
           "episodes_in_training": ablation["episodes_in_training"]}
    for arm in ("flow_only", "fast_ki", "fast_ki_locations"):
        run = ablation["settings"].get(arm)
        if run is None:
            continue
        out["episodes_per_task"] = run["episodes_per_task"]
        checkpoint = work / arm
        out[arm] = {"mean_success": run["mean_success"], "tasks": run["tasks"], "minutes": run["budget_min"],
                    "steps": run["steps"], "steps_per_s": run["probe_steps_per_s"],
                    "peak_rss_gb": run.get("peak_rss_gb"), "train_seconds": run["train_seconds"],
                    "eval_seconds": run["eval_seconds"],
                    **({"policy_call_ms": latency_ms(checkpoint, arm != "flow_only", image=160)}
                       if (checkpoint / "config.json").is_file() else {})}
    return out


def mt50(benchmark: dict, work: Path) -> dict:
    """The issue's schema for MT50 (`average` = mean of the four group means, the published figure), from
    benchmarks/closed_loop/metaworld_mt50.py's results: `flow_only` its `hf_vla` run, each token arm its `hf_vla_<arm>` run."""
    out = {}
    for arm, key in (("flow_only", "hf_vla"), ("fast_ki", "hf_vla_fast_ki"),
                     ("fast_ki_locations", "hf_vla_fast_ki_locations")):
        run = benchmark.get(key)
        if run is None:
            continue
        budget, checkpoint = run["budget"], work / key
        out[arm] = {"average": round(run["average"], 4), "groups": run["groups"], "tasks": run["tasks"],
                    "minutes": budget["budget_min"], "steps": budget["max_steps"],
                    "steps_per_s": budget["probe_steps_per_s"], "peak_rss_gb": budget.get("peak_rss_gb"),
                    "train_seconds": budget["train_seconds"], "eval_seconds": budget.get("eval_seconds"),
                    "episodes_per_task": run["episodes_per_task"],
                    **({"policy_call_ms": latency_ms(checkpoint, arm != "flow_only", image=160)}
                       if (checkpoint / "config.json").is_file() else {})}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=str(REPO / "data_cache" / "metaworld_bench"))
    parser.add_argument("--flow_only", default=str(REPO / "benchmarks" / "results" / "metaworld_cpu.json"))
    parser.add_argument("--locations_work", default=str(REPO / "data_cache" / "metaworld_loc"),
                        help="the locations arm's --work (recorded again: its recordings carry the locations column)")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "metaworld_cotraining_cpu.json"))
    parser.add_argument("--object_centred", default=None,
                        help="the four object-centred tasks' arms (benchmarks/closed_loop/metaworld_mt50_ablation.py --budget_min "
                             "--settings flow_only,fast_ki,fast_ki_locations --output PATH): put into the output's "
                             "object_centred entry, the five-task entries kept as they are")
    parser.add_argument("--object_centred_work", default=str(REPO / "data_cache" / "object_centred"),
                        help="that run's --work (its checkpoints, for the policy call's latency)")
    parser.add_argument("--mt50", default=None,
                        help="benchmarks/closed_loop/metaworld_mt50.py's results (its --output): put into the output's mt50 "
                             "entry, the other entries kept as they are")
    parser.add_argument("--mt50_work", default=str(REPO / "data_cache" / "mt50_bench"),
                        help="that run's --work (its checkpoints, for the policy call's latency)")
    args = parser.parse_args(argv)
    if args.mt50:
        results = json.loads(Path(args.output).read_text())
        results["mt50"] = mt50(json.loads(Path(args.mt50).read_text()), Path(args.mt50_work))
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps({arm: {k: v for k, v in r.items() if k != "tasks"} for arm, r in results["mt50"].items()},
                         indent=2))
        return
    if args.object_centred:
        results = json.loads(Path(args.output).read_text())
        results["object_centred"] = object_centred(json.loads(Path(args.object_centred).read_text()),
                                                   Path(args.object_centred_work))
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results["object_centred"], indent=2))
        return
    work = Path(args.work)
    flow = json.loads(Path(args.flow_only).read_text())["hf_vla"]
    five_task = {"flow_only": _arm(flow, "checkpoint-5700_50_episodes") | {
        "source": "benchmarks/results/metaworld_cpu.json"}}
    for arm, folder, tag in (("fast_ki", work, "cotrain"), ("fast_ki_locations", Path(args.locations_work),
                                                               "locations")):
        if not (folder / "results.json").is_file() or tag not in json.loads((folder / "results.json").read_text()):
            continue
        run = json.loads((folder / "results.json").read_text())[tag]
        if "closed_loop" not in run:
            continue
        final = sorted(run["closed_loop"], key=lambda n: int(n.split("-")[1]) if "-" in n else 10**9)[-1]
        checkpoint = folder / tag if final == "final" else folder / tag / final
        offline = run["offline"][str(max(int(k) for k in run["offline"]))]
        five_task[arm] = _arm(run, final) | {
            "config": run.get("config"), "evaluated": final,
            **{key: offline.get(f"eval_{key}") for key in ("fast_ce", "text_ce", "mse")},
            "policy_call_ms": {"this_checkpoint": latency_ms(checkpoint, True),
                               "its_weights_flow_only_model": latency_ms(checkpoint, False)}}
    # the five-task arms are collected again; the object-centred and MT50 entries (their own flags) are kept
    previous = json.loads(Path(args.output).read_text()) if Path(args.output).is_file() else {}
    results = {
        "five_task": five_task,
        "object_centred": previous.get("object_centred", {"not_measured": "run with --object_centred"}),
        "mt50": previous.get("mt50", {"not_measured": "run with --mt50"}),
        "episodes_per_task": 50,
    }
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
