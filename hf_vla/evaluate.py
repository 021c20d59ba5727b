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

import torch

from hf_vla.cli import ArgumentParser, model_source, output_dir, positive, run, websocket_uri
from hf_vla.evaluation.envs import BENCHMARKS, check_cameras, check_env, env_camera_keys
from hf_vla.evaluation.runner import MAX_ENVS_AT_ONCE, BenchmarkResult, _summary, evaluate_checkpoint
from hf_vla.evaluation.settings import DEFAULT_ENV, DEFAULT_SEED, OVERRIDABLE, head_spec
from hf_vla.hub.resolve import resolve_contract
from hf_vla.serving.policy import add_rtc_arguments, rtc_config_from_args


def main(argv=None):
    """The command; raises `hf_vla.errors.VLAError` for bad arguments (`cli` prints them as one line)."""
    parser = ArgumentParser(prog="python -m hf_vla.evaluate", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="model + processor directory or Hub id (a lerobot pi0.5 checkpoint is "
                        "converted on load), run in-process")
    parser.add_argument("--revision", default=None, help="Hub revision of --checkpoint")
    source.add_argument("--server", help="ws://HOST:PORT of a policy server (python -m hf_vla.serve)")
    contract = parser.add_argument_group(
        "settings the checkpoint's deployment contract (deployment_config.json) provides; a flag that contradicts it "
        "is refused unless --override names it")
    contract.add_argument("--env", default=None, help=f"gymnasium env id, or `metaworld` / `libero` (lerobot's env "
                          f"wrappers; with --task) (default: the env the data was recorded in, else {DEFAULT_ENV})")
    contract.add_argument("--task", default=None, help="Meta-World task names (comma-separated) or a difficulty group "
                          "(easy, medium, hard, very_hard); LIBERO suites (libero_spatial, ...) or suite/index "
                          "(default: the recorded tasks)")
    contract.add_argument("--image_size", type=int, default=None, help="the image side the env renders (default: the "
                          "size the data was recorded at; else the env's own)")
    contract.add_argument("--max_episode_steps", type=int, default=None, help="episode limit (default: the "
                          "checkpoint's, else the env's: 500 for Meta-World, the suite's for LIBERO)")
    contract.add_argument("--n_action_steps", type=int, default=None, help="actions executed per chunk (default: the "
                          "checkpoint's, else half the chunk)")
    contract.add_argument("--cameras", nargs="*", default=None, help="observation image keys in camera-slot order "
                          "(default: the checkpoint's)")
    contract.add_argument("--seed", type=int, default=None, help=f"first episode seed (default {DEFAULT_SEED}; seeds "
                          "the training data was recorded with are refused)")
    contract.add_argument("--override", nargs="+", default=[], choices=OVERRIDABLE, metavar="FIELD",
                          help=f"accept these flags against the checkpoint's contract ({', '.join(OVERRIDABLE)}); "
                          "recorded in eval_result.json")
    parser.add_argument("--episodes", type=int, default=50, help="episodes per task")
    parser.add_argument("--num_envs", type=int, default=None, help="envs run at once, each in a worker process, one "
                        "policy call per control step for all of them (default: 70%% of the cores, as lerobot-eval; "
                        "per-seed outcomes do not depend on it)")
    parser.add_argument("--tasks_at_once", type=int, default=None, help="benchmark tasks evaluated side by side, "
                        "their envs served by one policy call per control step (default: as many as keep "
                        f"{MAX_ENVS_AT_ONCE} env workers or fewer; per-seed outcomes do not depend on it)")
    parser.add_argument("--inference_delay", type=int, default=0,
                        help="simulated inference delay in control steps (actions of the old chunk run meanwhile)")
    parser.add_argument("--rtc", action="store_true", help="real-time chunking: continue the chunk being executed")
    parser.add_argument("--head", default=None, help="normalization head (default: the processor's only one)")
    parser.add_argument("--save_videos", type=int, default=3)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_rtc_arguments(parser, title="real-time chunking settings (in-process; a server uses its own)")
    args = parser.parse_args(argv)
    # every argument is checked before a model is loaded or an env built
    positive("--episodes", args.episodes)
    positive("--n_action_steps", args.n_action_steps)
    positive("--inference_delay", args.inference_delay, allow_zero=True)
    positive("--save_videos", args.save_videos, allow_zero=True)
    positive("--num_envs", args.num_envs)
    positive("--tasks_at_once", args.tasks_at_once)
    checkpoint = model_source("--checkpoint", args.checkpoint) if args.checkpoint else None
    if args.server:
        websocket_uri("--server", args.server)
    output_dir("--output_dir", args.output_dir)
    positive("--image_size", args.image_size)
    positive("--max_episode_steps", args.max_episode_steps)
    if args.env is not None:
        check_env(args.env, args.task, "--env ", "--task ")  # an unknown env or task stops here, by name
        check_cameras("--cameras", args.cameras, env_camera_keys(args.env))
    env = args.env
    if env is None and checkpoint is not None:
        env = (head_spec(resolve_contract(checkpoint, args.revision), args.head) or {}).get("benchmark", {}) or {}
        env = env.get("env") if isinstance(env, dict) else None
    if "OMP_NUM_THREADS" not in os.environ and (env in BENCHMARKS or (args.num_envs or 1) > 1):
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # leave a core to the env workers
    env_kwargs = {k: v for k, v in (("image_size", args.image_size), ("max_episode_steps", args.max_episode_steps))
                  if v is not None}
    from hf_vla.cli import setup_logging

    setup_logging()
    result = evaluate_checkpoint(checkpoint, args.env, args.episodes, args.n_action_steps, args.seed, args.head,
                                 args.cameras, args.save_videos, args.output_dir, args.device, server=args.server,
                                 inference_delay=args.inference_delay, rtc=args.rtc,
                                 rtc_config=rtc_config_from_args(args), task=args.task, env_kwargs=env_kwargs or None,
                                 revision=args.revision, num_envs=args.num_envs, overrides=args.override,
                                 tasks_at_once=args.tasks_at_once)
    if isinstance(result, BenchmarkResult):
        print(result.table())
    print(json.dumps(_summary(result), indent=2))
    return result


def cli(argv=None):
    return run("hf_vla.evaluate", main, argv)


if __name__ == "__main__":
    cli()
