"""Best-of-N's cost: `sample_actions` with N candidates from one prefix (`num_candidates`) against one chunk and against
N separate calls, one torch thread, CPU, and the memory each N adds.

    python -m benchmarks.speed.best_of_n [--sizes demo mid] [--candidates 1 2 4 8 16] [--repeats 10]

Sizes as `benchmarks.speed.inference` (`demo`: the built-in demo's model; `mid`: Gemma 256 x 4, expert 128 x 4,
SigLIP 128 x 2, 224 px, three cameras, chunk 50): random weights, batch 1, 10 flow steps, a prompt padded to the
model's length. Each N runs in a fresh process: `peak_extra_mib` is its peak resident memory while sampling less the
peak before (the model and inputs built, nothing sampled), so it counts what sampling N candidates allocates.
Prints JSON: per size, per N, `ms_per_call` (median), `ms_per_call_separate` (N calls of one chunk, for comparison),
`ratio_to_one`, `peak_extra_mib`, and `ms_critic`: a chunk critic of the same backbone scoring the N candidates
(`PI05ChunkCritic.chunk_values`; selector `critic` costs `ms_per_call` + `ms_critic`).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def _one(size: str, candidates: int, repeats: int) -> dict:
    from benchmarks.speed.inference import build

    torch.set_num_threads(1)
    model, _, x = build(size, torch.device("cpu"), torch.float32)
    inputs = {k: x[k] for k in ("input_ids", "pixel_values", "pixel_attention_mask", "attention_mask")}
    generator = torch.Generator().manual_seed(2)
    config = model.config
    noise = torch.randn(1, candidates, config.chunk_size, config.max_action_dim, generator=generator)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        def batched():
            return model.sample_actions(**inputs, noise=noise if candidates > 1 else noise[:, 0],
                                        num_candidates=candidates)

        def separate():
            return [model.sample_actions(**inputs, noise=noise[:, j]) for j in range(candidates)]

        batched()  # warm-up, and the peak memory of sampling N from one prefix
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        times, apart = [], []
        for _ in range(repeats):
            begin = time.perf_counter()
            batched()
            times.append(time.perf_counter() - begin)
        for _ in range(max(1, repeats // 2)):
            begin = time.perf_counter()
            separate()
            apart.append(time.perf_counter() - begin)
        critic = _critic(model.config)
        candidates_ = batched().reshape(1, candidates, config.chunk_size, config.max_action_dim)
        critic.chunk_values(candidates_, **inputs)  # warm-up
        scoring = []
        for _ in range(repeats):
            begin = time.perf_counter()
            critic.chunk_values(candidates_, **inputs)
            scoring.append(time.perf_counter() - begin)
    return {"ms_per_call": round(1000 * statistics.median(times), 2),
            "ms_per_call_separate": round(1000 * statistics.median(apart), 2),
            "peak_extra_mib": round((peak - before) / 1024, 1), "ms_critic": round(1000 * statistics.median(scoring), 2),
            "repeats": repeats}


def _critic(config):
    """A chunk critic (random weights) with the policy's backbone, chunk and action width."""
    from hf_vla.models.value import PI05ChunkCritic, PI05ChunkCriticConfig

    fields = {k: v for k, v in config.to_dict().items() if k in PI05ChunkCriticConfig.__dataclass_fields__
              and k not in ("model_type", "transformers_version", "architectures", "auto_map")}
    return PI05ChunkCritic(PI05ChunkCriticConfig(**fields)).eval()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["demo", "mid"])
    parser.add_argument("--candidates", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--_one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one:
        print(json.dumps(_one(args._one[0], int(args._one[1]), args.repeats)))
        return
    results = {"machine": "CPU, one torch thread, float32, batch 1, 10 flow steps", "sizes": {}}
    for size in args.sizes:
        rows = {}
        for n in args.candidates:
            out = subprocess.run([sys.executable, "-m", "benchmarks.speed.best_of_n", "--_one", size, str(n),
                                  "--repeats", str(args.repeats)], capture_output=True, text=True, check=True,
                                 env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
            rows[n] = json.loads(out.stdout.strip().splitlines()[-1])
            print(size, n, rows[n], file=sys.stderr, flush=True)
        one = rows.get(1, {}).get("ms_per_call")
        for row in rows.values():
            row["ratio_to_one"] = round(row["ms_per_call"] / one, 2) if one else None
        results["sizes"][size] = rows
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
