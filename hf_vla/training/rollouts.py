"""Closed-loop rollouts during training: the policy's success rate in a simulator every `rollout_steps` steps.

    python -m hf_vla.train configs/pi05_metaworld.json --rollout_env metaworld --rollout_tasks reach,push \
        --rollout_episodes 10 --rollout_steps 1000 --rollout_env_kwargs '{"image_size": 96}'

Every `rollout_steps` optimizer steps, all ranks write the current weights and processor to
`<output_dir>/_rollouts/step-<N>` together (`Trainer.save_model`, which gathers FSDP2 / ZeRO-3 shards; seconds), then
the main process evaluates that snapshot in a separate process (`python -m hf_vla.training.rollouts SPEC`, which runs
`hf_vla.evaluation.runner.evaluate_checkpoint`) while every rank trains on. When the evaluation ends, its figures are logged at
the step training has reached: `rollout/<task>/success` per task, `rollout/success` (the mean) and `rollout/step`
(the step whose weights were evaluated), and appended to `<output_dir>/rollout_results.jsonl`; the snapshot's weights
are deleted, its `eval_result.json` and GIFs kept. A rollout still running when the next one is due makes that one
wait (it is skipped, and says so); the last one is awaited at the end of training, and the model card lists the last
figures as model-index results. `rollout_wait=True` evaluates synchronously instead (every rank waits at a barrier).

The `_` keeps the snapshots out of the Trainer's Hub uploads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from transformers import TrainerCallback

from hf_vla.errors import ConfigError

logger = logging.getLogger("hf_vla.training.rollouts")
SNAPSHOTS = "_rollouts"
RESULTS = "rollout_results.jsonl"


def check_rollout_args(args) -> None:
    """Validate the `rollout_*` training arguments (an unknown env or task is refused before training starts)."""
    if args.rollout_env is None:
        return
    if not args.rollout_steps or args.rollout_steps <= 0:
        raise ConfigError(f"rollout_steps={args.rollout_steps}: rollout_env is set, so it must be a positive number of "
                          "optimizer steps")
    if args.rollout_episodes <= 0:
        raise ConfigError(f"rollout_episodes={args.rollout_episodes}: must be positive")
    if isinstance(args.rollout_env_kwargs, str):
        try:
            args.rollout_env_kwargs = json.loads(args.rollout_env_kwargs)
        except json.JSONDecodeError as error:
            raise ConfigError(f"rollout_env_kwargs={args.rollout_env_kwargs!r}: not a JSON object ({error})") from error
    if args.rollout_env_kwargs is not None and not isinstance(args.rollout_env_kwargs, dict):
        raise ConfigError(f"rollout_env_kwargs={args.rollout_env_kwargs!r}: must be an object of env arguments")
    limit = (args.rollout_env_kwargs or {}).get("max_episode_steps")
    if limit is not None and args.max_episode_steps is not None and limit != args.max_episode_steps:
        # the snapshot's deployment contract holds max_episode_steps: a rollout with another limit would be refused
        raise ConfigError(f"rollout_env_kwargs max_episode_steps={limit} contradicts max_episode_steps="
                          f"{args.max_episode_steps} (the episode limit saved in the checkpoint's deployment contract); "
                          "set one of them")
    from hf_vla.evaluation.envs import check_env

    check_env(args.rollout_env, args.rollout_tasks, "rollout_env=", "rollout_tasks=")


def rollout_metrics(result: dict, env: str) -> dict[str, float]:
    """`rollout/<task>/success` per task and `rollout/success`, from an `EvalResult` / `BenchmarkResult` dict."""
    if "tasks" in result:
        metrics = {f"rollout/{task}/success": r["success_rate"] for task, r in result["tasks"].items()}
    else:
        metrics = {f"rollout/{env.rsplit('/', 1)[-1]}/success": result["success_rate"]}
    metrics["rollout/success"] = result["success_rate"]
    return metrics


class RolloutCallback(TrainerCallback):
    """Runs the rollouts described in the module docstring for `trainer` (a `VLATrainer` with `rollout_env` set)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.running: tuple[int, subprocess.Popen, Path] | None = None
        self.last: dict | None = None  # the last finished rollout's metrics

    @property
    def root(self) -> Path:
        return Path(self.trainer.args.output_dir) / SNAPSHOTS

    def on_step_end(self, args, state, control, **kwargs):
        self._collect(block=False)
        if state.global_step % args.rollout_steps == 0:
            self._start(state.global_step)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        preemption = getattr(self.trainer, "_preemption", None)
        if preemption is not None and preemption.preempted and self.running is not None:
            step, process, folder = self.running  # leave now: the rollout would hold up the exit
            process.terminate()
            self.running = None
            logger.warning("the rollout of step %d was stopped (training was preempted)", step)
            return control
        self._collect(block=True)
        return control

    def _start(self, step: int) -> None:
        trainer = self.trainer
        from accelerate.utils import broadcast_object_list

        busy = broadcast_object_list([self.running[0] if self.running else None], from_process=0)[0]
        if busy is not None:  # every rank takes the main process's word, so they all skip or all save
            if trainer.is_world_process_zero():
                logger.warning("step %d: the rollout of step %d is still running; this one is skipped (raise "
                               "rollout_steps or lower rollout_episodes)", step, busy)
            return
        folder = self.root / f"step-{step}"
        if trainer.is_world_process_zero() and folder.exists():  # left by an earlier, interrupted run
            shutil.rmtree(folder)
        ema = getattr(trainer, "_ema", None)
        with ema.swapped() if ema is not None else contextlib.nullcontext():  # rollouts measure the EMA when set
            trainer.save_model(str(folder), _internal_call=True)  # collective under FSDP2 / DeepSpeed
        if trainer.is_world_process_zero():
            args = trainer.args
            spec = {"checkpoint": str(folder), "env": args.rollout_env, "episodes": args.rollout_episodes,
                    "task": args.rollout_tasks, "env_kwargs": args.rollout_env_kwargs, "seed": args.rollout_seed,
                    "save_videos": args.rollout_videos, "output_dir": str(folder / "eval"),
                    "device": args.rollout_device or str(args.device)}
            (folder / "rollout_spec.json").write_text(json.dumps(spec, indent=2))
            # the evaluation is a process of its own: not a rank of the launched run, one torch thread by default
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
            env["OMP_NUM_THREADS"] = os.environ.get("HF_VLA_ROLLOUT_THREADS", "1")
            with open(folder / "rollout.log", "w") as log:
                process = subprocess.Popen([sys.executable, "-m", "hf_vla.training.rollouts", str(folder / "rollout_spec.json")],
                                           stdout=log, stderr=subprocess.STDOUT, env=env)
            self.running = (step, process, folder)
            logger.info("step %d: rollouts in %s started (%d episodes%s), log in %s", step, args.rollout_env,
                        args.rollout_episodes, f" of each of {args.rollout_tasks}" if args.rollout_tasks else "",
                        folder / "rollout.log")
        if trainer.args.rollout_wait:
            self._collect(block=True)
            trainer.accelerator.wait_for_everyone()

    def _collect(self, block: bool) -> None:
        """On the main process: log the running rollout's figures once it has ended (waiting for it with `block`)."""
        if self.running is None:
            return
        step, process, folder = self.running
        if not block and process.poll() is None:
            return
        started = time.monotonic()
        code = process.wait()
        self.running = None
        if block and time.monotonic() - started > 1:
            logger.info("waited %.0f s for the rollout of step %d", time.monotonic() - started, step)
        result_file = folder / "eval" / "eval_result.json"
        if code != 0 or not result_file.is_file():
            lines = (folder / "rollout.log").read_text(errors="replace").strip().splitlines() or ["no output"]
            logger.error("the rollout of step %d failed (exit %d): %s; full log in %s", step, code, lines[-1],
                         folder / "rollout.log")
            return
        result = json.loads(result_file.read_text())
        metrics = rollout_metrics(result, self.trainer.args.rollout_env) | {"rollout/step": step}
        self.last = metrics
        with open(Path(self.trainer.args.output_dir) / RESULTS, "a") as handle:
            handle.write(json.dumps({"step": step, "metrics": metrics, "result": result}) + "\n")
        for path in folder.iterdir():  # the weights go; the spec, figures, GIFs and log stay
            if path.is_file() and path.suffix in (".safetensors", ".bin", ".pt"):
                path.unlink()
        self.trainer.log(dict(metrics))


def _run(spec_path: str) -> None:
    """The rollout process: evaluate one snapshot as its spec says (written by `RolloutCallback`)."""
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    spec = json.loads(Path(spec_path).read_text())
    from hf_vla.cli import setup_logging

    setup_logging()
    result = evaluate_checkpoint(EvaluateArguments(
        checkpoint=spec["checkpoint"], env=spec["env"], episodes=spec["episodes"], task=spec["task"],
        save_videos=spec["save_videos"], seed=spec["seed"], device=spec["device"], output_dir=spec["output_dir"]),
        env_kwargs=spec["env_kwargs"], progress=False)
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    from hf_vla.cli import run

    run("hf_vla.training.rollouts", lambda argv: _run(argv[0]), sys.argv[1:])
