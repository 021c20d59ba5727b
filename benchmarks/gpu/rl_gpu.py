"""RL fine-tuning throughput of full-size pi0.5 on one GPU: rollout episodes per hour through `RLTrainer`.

    python -m benchmarks.gpu.rl_gpu [--out benchmarks/results/rl_gpu_h100.json] [--variants lora full] [--updates 4]
    python -m benchmarks.gpu.rl_gpu --tiny --updates 2 --num_envs 1 --group_size 2   # CPU smoke test at tiny dims

The model is pi0.5 at the published dims (PaliGemma 3B's SigLIP So400m/14 + Gemma 2B, Gemma 300M action expert, chunk
50; random weights: nothing can be downloaded here), bf16 on the GPU. It runs the real thing: `RLTrainer` (the class
`python -m hf_vla.rl` runs) on the Meta-World benchmark's five tasks through lerobot's wrapper in worker processes
(one per env, `num_envs` per task), one batched policy call per control step across live envs, the stochastic Flow-SDE
sampler storing each decision's chain, then GRPO updates on the stored chains (the VLM prefix once, the action expert
K = 10 times per decision).

Random weights never succeed, so every episode runs the whole 200-step limit: the figures are the worst case for a
step budget of 200 (a policy that succeeds ends its episodes sooner). Variants, each in its own process (an
out-of-memory one does not take the others down):

- `lora`: LoRA rank 8 on the action expert (`lora_preset expert`, pi_RL's rank), the VLM frozen: its prefix is computed
  without a graph, and the start policy for the KL is the base with the adapters off (no copy).
- `full`: every parameter, fp32 master weights and AdamW state (18 bytes a parameter, 60 GB for 3.35B), gradient
  checkpointing; `log_kl` off (the frozen start copy would add 6.7 GB).

Per update: the rollout's wall time (envs stepping and policy calls), the update's (the optimizer step: forward and
backward over every kept decision), episodes, decisions, and the peak GPU memory. Episodes per hour = episodes per
update / (rollout + update seconds), the first update left out (CUDA start-up). Prints JSON and writes it to `--out`
after every variant, so a cut-off run keeps what it measured, and with `--progress_dir` appends each phase's time
(imports, model, trainer, every rollout and update) to a file as it ends. On a lent GPU machine without network,
`benchmarks/gpu/gpu_site.py` packs the packages it lacks (its docstring has the commands).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TASKS = "reach-v3,push-v3,button-press-topdown-v3,drawer-open-v3,door-open-v3"  # the Meta-World benchmark's five
HEAD = "metaworld::delta_xyz_gripper"


def _build(tiny: bool, device: str):
    import torch

    from hf_vla import PI05Config, PI05ForConditionalGeneration, PI05Processor
    from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config

    torch.manual_seed(0)
    config = tiny_pi05_config(chunk_size=16, num_inference_steps=10) if tiny else PI05Config()
    with torch.device(device):
        model = PI05ForConditionalGeneration(config)
    if device == "cuda":
        model = model.to(torch.bfloat16)
    # Meta-World's 4-dim state and actions; q01/q99 of [-1, 1] (the env's action range)
    stats = {HEAD: {"state": {"q01": [-1.0] * 4, "q99": [1.0] * 4}, "actions": {"q01": [-1.0] * 4, "q99": [1.0] * 4}}}
    processor = PI05Processor.from_config(config, build_tiny_tokenizer(), norm_stats=stats, head_names=[HEAD])
    return model, processor


def run_variant(spec: dict) -> dict:
    """One variant in this process: build the model, run `updates` RL updates, return the timings. With
    `spec["progress"]`, each phase's time is appended to that file as it ends (a run cut off keeps them)."""
    origin = time.perf_counter()

    def mark(event: str) -> None:
        if spec.get("progress"):
            with open(spec["progress"], "a") as handle:
                handle.write(f"{time.perf_counter() - origin:8.1f} s  {spec['variant']}: {event}\n")

    import torch
    from transformers import TrainerCallback

    from hf_vla.lora import lora_config
    from hf_vla.rl import RLConfig, RLTrainer

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    started = time.perf_counter()
    mark("imports done")
    model, processor = _build(spec["tiny"], device)
    build_seconds = time.perf_counter() - started
    mark(f"model built ({build_seconds:.1f} s)")
    variant = spec["variant"]
    peft_config = lora_config("expert", r=8, model=model) if variant == "lora" else None
    steps = int(spec["max_episode_steps"])
    decisions = -(-steps // spec["n_action_steps"])
    episodes = 5 * spec["group_size"]
    args = RLConfig(
        output_dir=spec["output_dir"], env="metaworld", task=TASKS, num_envs=spec["num_envs"],
        group_size=spec["group_size"], groups_per_update=1, max_steps=spec["updates"], reward="success",
        n_action_steps=spec["n_action_steps"], max_episode_steps=steps,
        env_kwargs={"image_size": spec["image_size"]}, noise_level=0.5, learning_rate=1e-5,
        # micro-batches of about `micro_batch` decisions (a random policy runs every episode to the limit)
        gradient_accumulation_steps=max(1, -(-episodes * decisions // spec["micro_batch"])),
        dynamic_sampling=False,  # random weights never succeed: keep every group, so each update does its full work
        gradient_checkpointing=variant == "full", log_kl=variant != "full",
        eval_strategy="no", eval_on_start=False, save_strategy="no", load_best_model_at_end=False,
        bf16=cuda, use_cpu=not cuda, report_to=[], disable_tqdm=True, logging_steps=1, seed=0,
        dataloader_pin_memory=False)
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())
            mark(f"update {state.global_step} done ({marks[-1] - (marks[-2] if len(marks) > 1 else begin):.1f} s)")

    trainer = RLTrainer(model, args, processing_class=processor, peft_config=peft_config, callbacks=[Clock()])
    mark("trainer built")
    rollout_seconds: list[float] = []
    generate = trainer._generate

    def timed_generate(generation):
        begin = time.perf_counter()
        out = generate(generation)
        rollout_seconds.append(time.perf_counter() - begin)
        mark(f"rollout {generation} done ({rollout_seconds[-1]:.1f} s, {sum(len(b['chain']) for b in out)} "
             "decisions in the update)")
        return out

    trainer._generate = timed_generate
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    begin = time.perf_counter()
    try:
        trainer.train()
    finally:
        trainer.engine.close()
    logs = [e for e in trainer.state.log_history if "rollout/decisions" in e]
    starts = [begin] + marks[:-1]
    updates = []
    for i, (start, end) in enumerate(zip(starts, marks)):
        rollout = rollout_seconds[i] if i < len(rollout_seconds) else 0.0
        entry = logs[i] if i < len(logs) else {}
        updates.append({"seconds": round(end - start, 2), "rollout_seconds": round(rollout, 2),
                        "update_seconds": round(end - start - rollout, 2),
                        "decisions": entry.get("rollout/decisions"),
                        "decisions_used": entry.get("rollout/decisions_used"),
                        "episode_length": entry.get("rollout/episode_length")})
    steady = updates[1:] or updates
    per_update = statistics.mean(u["seconds"] for u in steady)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {
        "variant": variant, "parameters": sum(p.numel() for p in model.parameters()), "trainable": trainable,
        "episodes_per_update": episodes, "updates": updates,
        "seconds_per_update": round(per_update, 2),
        "rollout_seconds": round(statistics.mean(u["rollout_seconds"] for u in steady), 2),
        "update_seconds": round(statistics.mean(u["update_seconds"] for u in steady), 2),
        "episodes_per_hour": round(episodes * 3600 / per_update),
        "decisions_per_s_in_rollouts": round(statistics.mean(
            (u["decisions"] or 0) / max(u["rollout_seconds"], 1e-9) for u in steady), 1),
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
        "build_seconds": round(build_seconds, 1),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def _launch(spec: dict, timeout: float) -> dict:
    command = [sys.executable, __file__, "--worker", json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"variant": spec["variant"], "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
        return {"variant": spec["variant"], "error": f"exit {done.returncode}", "log": tail}
    return json.loads(lines[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--num_envs", type=int, default=3, help="envs per task (5 tasks), each a worker process")
    parser.add_argument("--group_size", type=int, default=6, help="episodes per task per update (one env seed)")
    parser.add_argument("--n_action_steps", type=int, default=10)
    parser.add_argument("--max_episode_steps", type=int, default=200)
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--micro_batch", type=int, default=32, help="decisions per forward/backward in the update")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    parser.add_argument("--progress_dir", default=None, help="append each phase's time to a file per variant here")
    parser.add_argument("--tiny", action="store_true", help="tiny dims on the CPU: a smoke test of this script")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(run_variant(spec)), flush=True)
        return
    os.environ.setdefault("MUJOCO_GL", "egl")
    report = {"model": "pi0.5 at the published dims (3.35B parameters, random weights), bf16, chunk 50, 10 denoising "
                       "steps" if not args.tiny else "tiny pi0.5 (smoke test)",
              "env": f"Meta-World {TASKS} through lerobot's wrapper, {args.image_size} px, "
                     f"{args.max_episode_steps}-step "
                     f"limit (random weights: every episode runs it whole), {args.n_action_steps} actions per decision",
              "method": "GRPO on Flow-SDE likelihoods (noise level 0.5), one env seed per task per update",
              "num_envs_per_task": args.num_envs, "group_size": args.group_size, "variants": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for variant in args.variants:
            spec = {"variant": variant, "tiny": args.tiny, "updates": args.updates, "num_envs": args.num_envs,
                    "group_size": args.group_size, "n_action_steps": args.n_action_steps,
                    "max_episode_steps": args.max_episode_steps, "image_size": args.image_size,
                    "micro_batch": args.micro_batch, "output_dir": str(Path(scratch) / variant),
                    "progress": str(Path(args.progress_dir) / f"progress_{variant}.txt") if args.progress_dir else None}
            print(f"[rl_gpu] {variant} ...", file=sys.stderr, flush=True)
            report["variants"][variant] = _launch(spec, args.timeout)
            print(json.dumps(report["variants"][variant]), file=sys.stderr, flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
