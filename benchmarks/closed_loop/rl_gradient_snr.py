"""How much of an RL update's gradient is signal: the RL gradient of independent rollout batches, compared.

    python -m benchmarks.closed_loop.rl_gradient_snr configs/rl/demo.json --model_name_or_path CHECKPOINT [--key value ...] \
        --batches 4 --output snr.json

Builds `hf_vla.rl.RLTrainer` from the config exactly as `python -m hf_vla.rl` does, then, with the start weights
fixed, rolls out `--batches` independent batches (the trainer's own `_generate`, generations 0..N-1: other env seeds,
other noise) and takes each batch's gradient of the loss `RLTrainer.compute_loss` computes for GRPO without a KL
term (`beta` 0; PPO's critic and the KL term are refused), split by denoising step k (the loss is a mean over the K
Gaussian steps of the chain; the trainer's own split, `RLTrainer._policy_gradient_loss(..., per_step=True)`). Two batches' gradients agree only in their signal: the
mean cosine between pairs estimates signal / (signal + noise) of one batch's gradient (0: the update is a random walk;
near 1: every batch points the same way). Printed as JSON: the pairwise cosines of the whole gradient, of each
module's part (`per_module`) and of each step's part, and each step's share of the gradient's squared
norm (a step whose share is large and whose cosine is near 0 drowns the others in noise). Nothing is trained or saved.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch


def _flat(grads) -> torch.Tensor:
    return torch.cat([g.reshape(-1).double() for g in grads if g is not None])


def _group(name: str) -> str:
    parts = [p for p in name.split(".") if not p.isdigit()]
    return ".".join(parts[:4]) if len(parts) > 4 else ".".join(parts[:-1]) or name


def measure(argv: list[str], batches: int) -> dict:
    from hf_vla.rl.__main__ import load_start, parse_rl_config
    from hf_vla.rl.trainer import RLTrainer

    args = parse_rl_config(argv[0], argv[1:])
    if args.algorithm != "grpo" or args.beta > 0:  # the per-step split below is GRPO's policy term alone
        raise SystemExit(f"rl_gradient_snr.py: algorithm={args.algorithm!r}, beta={args.beta}: this measures GRPO's "
                         "policy gradient (algorithm grpo, beta 0)")
    model, processor = load_start(args)
    trainer = RLTrainer(model, args, processing_class=processor)
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    # the parts of the flat gradient by module (the name's first components): where the noise and any signal sit
    groups: dict[str, list[int]] = {}
    offset = 0
    for name, p in named:
        groups.setdefault(_group(name), []).extend(range(offset, offset + p.numel()))
        offset += p.numel()
    K = trainer.sde.num_steps
    whole, per_step, decisions = [], [], []
    try:
        for generation in range(batches):
            started = time.perf_counter()
            parts = trainer._generate(generation)
            trainer.model.train()
            steps = [None] * K
            for inputs in parts:
                # the trainer's loss (sum over decisions of weight * mean over k), each k's part alone
                losses = trainer._policy_gradient_loss(trainer.model, inputs, per_step=True)
                for k in range(K):
                    loss_k = losses[k]
                    grads = torch.autograd.grad(loss_k, params, retain_graph=k < K - 1, allow_unused=True)
                    flat = _flat(grads)
                    steps[k] = flat if steps[k] is None else steps[k] + flat
            whole.append(sum(steps))
            per_step.append(steps)
            decisions.append(int(sum(int((p["weights"] > 0).sum()) for p in parts)))
            print(f"batch {generation}: {decisions[-1]} decisions, {time.perf_counter() - started:.1f} s", flush=True)
    finally:
        trainer.engine.close()

    def cosines(vectors):
        out = []
        for a, b in itertools.combinations(vectors, 2):
            denominator = a.norm() * b.norm()
            out.append(float(a @ b / denominator) if denominator > 0 else math.nan)
        return out

    pairs = cosines(whole)
    by_group = {}
    for group, index in groups.items():
        index = torch.tensor(index)
        parts = [g[index] for g in whole]
        share = sum(float(g.norm() ** 2 / w.norm() ** 2) for g, w in zip(parts, whole)) / len(whole)
        group_pairs = cosines(parts)
        by_group[group] = {"parameters": len(index), "share_of_squared_norm": round(share, 4),
                           "cosine_between_batches": round(sum(group_pairs) / len(group_pairs), 4)}
    step_pairs = [cosines([steps[k] for steps in per_step]) for k in range(K)]
    shares = [[float(steps[k].norm() ** 2 / sum(s.norm() ** 2 for s in steps)) for k in range(K)] for steps in per_step]
    return {
        "config": argv[0], "overrides": argv[1:], "batches": batches, "denoise_steps": K,
        "noise_level": args.noise_level, "algorithm": args.algorithm, "reward": args.reward,
        "episodes_per_batch": args.group_size * args.groups_per_update * len(trainer.rl_settings["tasks"]),
        "decisions_per_batch": decisions, "trainable_parameters": sum(p.numel() for p in params),
        "cosine_between_batches": {"pairs": [round(c, 4) for c in pairs],
                                   "mean": round(sum(pairs) / len(pairs), 4) if pairs else None},
        "per_module": dict(sorted(by_group.items(), key=lambda kv: -kv[1]["share_of_squared_norm"])),
        "per_denoising_step": [
            {"k": k, "t": round(trainer.sde.times()[k], 3), "std": round(trainer.sde.stds()[k], 4),
             "cosine_between_batches": round(sum(step_pairs[k]) / len(step_pairs[k]), 4) if step_pairs[k] else None,
             "share_of_squared_norm": round(sum(s[k] for s in shares) / len(shares), 4)}
            for k in range(K)],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=4, help="independent rollout batches (at least 2)")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    known, rest = parser.parse_known_args()
    if known.batches < 2:
        parser.error(f"--batches {known.batches}: at least 2 (cosines compare pairs)")
    if not rest:
        parser.error("give the RL config and its overrides, as to python -m hf_vla.rl")
    result = measure(rest, known.batches)
    text = json.dumps(result, indent=2)
    if known.output:
        Path(known.output).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
