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

from hf_vla.cli import resolve_device, run
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
    env_kwargs = {k: v for k, v in (("image_size", args.image_size), ("max_episode_steps", args.max_episode_steps))
                  if v is not None}
    from hf_vla.cli import setup_logging

    setup_logging()
    result = evaluate_checkpoint(args.checkpoint, args.env, args.episodes, args.n_action_steps, args.seed, args.head,
                                 args.cameras, args.save_videos, args.output_dir, resolve_device(args.device), server=args.server,
                                 inference_delay=args.inference_delay, rtc=args.rtc, rtc_config=rtc.rtc_config(),
                                 task=args.task, env_kwargs=env_kwargs or None, revision=args.revision,
                                 num_envs=args.num_envs, overrides=args.override, tasks_at_once=args.tasks_at_once,
                                 cfg_beta=args.cfg_beta)
    if isinstance(result, BenchmarkResult):
        print(result.table())
    print(json.dumps(printed_result(result), indent=2))
    return result


def cli(argv=None):
    return run("hf_vla.evaluate", main, argv)


if __name__ == "__main__":
    cli()
