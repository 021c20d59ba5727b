"""Closed-loop evaluation of a checkpoint in a gymnasium env with LeRobot-style observations.

    python -m hf_vla.evaluate --checkpoint outputs/demo --env hf_vla/ColorReach-v0 --episodes 50

    python -m hf_vla.evaluate --server ws://localhost:8000 --inference_delay 2 --rtc

Loads the policy with `AutoModel` (pi0.5) and its `PI05Processor` (or connects to a policy server with openpi-client),
runs episodes with receding-horizon action chunks (`--n_action_steps` of each predicted chunk are executed), with an
optional simulated inference delay and real-time chunking, reports the success rate (`info["is_success"]`) and the
smoothness at chunk switches with a progress bar, and saves the first few rollouts as animated GIFs.
"""

from __future__ import annotations

import json
import os

from hf_vla.cli import run
from hf_vla.deployment.contract import head_spec
from hf_vla.evaluation.arguments import EvaluateArguments
from hf_vla.hub.resolve import resolve_contract
from hf_vla.parser import CommandParser
from hf_vla.serving.arguments import RTCArguments


def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    # every argument is checked before a model is loaded or an env built
    args, rtc = CommandParser("python -m hf_vla.evaluate", (EvaluateArguments, RTCArguments), __doc__,
                              exclusive=(("checkpoint", "server"),), required_one=True).parse(argv)
    env = args.env
    if env is None and args.checkpoint is not None:
        env = (head_spec(resolve_contract(args.checkpoint, args.revision), args.head) or {}).get("benchmark", {}) or {}
        env = env.get("env") if isinstance(env, dict) else None
    import torch

    from hf_vla.evaluation.runner import BenchmarkResult, evaluate_checkpoint, printed_result
    from hf_vla.registry import task_env

    if "OMP_NUM_THREADS" not in os.environ and (task_env(env) is not None or (args.num_envs or 1) > 1):
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # leave a core to the env workers
    from hf_vla.cli import setup_logging

    setup_logging()
    result = evaluate_checkpoint(args, rtc.rtc_config())
    if isinstance(result, BenchmarkResult):
        print(result.table())
    print(json.dumps(printed_result(result), indent=2))
    return result


def cli(argv=None):
    return run("hf_vla.evaluate", main, argv)


if __name__ == "__main__":
    cli()
