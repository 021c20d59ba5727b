"""Train-step and sample_actions latency: hf_vla pi0.5 vs lerobot's PI05Pytorch, same tiny config, CPU.

    python -m benchmarks.speed.model_step [--repeats 7] [--batch 8]

Prints JSON: medians (seconds) of forward+backward and of `sample_actions` for both, and the ratios hf_vla/lerobot.
hf_vla runs with sdpa (its default path); lerobot with its own eager joint attention, as it ships.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_vla import PI05ForConditionalGeneration
from hf_vla.convert import convert_lerobot_state_dict
from hf_vla.models.reference import Dims, build_lerobot_pi05, hf_pi05_config, sample_inputs

DIMS = Dims(
    text=dict(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
    expert=dict(width=128, depth=4, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32),
    vision=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, patch_size=16),
    image_size=224,
    chunk=50,
    max_state=32,
    max_action=32,
)


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    reference = build_lerobot_pi05(seed=0, d=DIMS).train()
    config = hf_pi05_config(DIMS)
    ours = PI05ForConditionalGeneration(config)
    ours.load_state_dict(convert_lerobot_state_dict(reference.state_dict(), config), strict=False)
    ours.set_attn_implementation("sdpa")
    ours.train()

    x = sample_inputs(batch_size=args.batch, num_cameras=2, seq_len=48, d=DIMS)
    cams = [x["images"][:, i] for i in range(2)]
    masks = [x["camera_mask"][:, i] for i in range(2)]
    t = x["time"][:, None, None]
    x_t = t * x["noise"] + (1 - t) * x["actions"]

    def lerobot_step():
        reference.zero_grad(set_to_none=True)
        reference(cams, masks, x["tokens"], x["token_mask"], x["actions"], x["noise"], x["time"]).mean().backward()

    def ours_step():
        ours.zero_grad(set_to_none=True)
        velocity = ours(noise=x_t, timestep=x["time"], input_ids=x["tokens"], attention_mask=x["token_mask"],
                        pixel_values=x["images"], pixel_attention_mask=x["camera_mask"]).logits
        ((x["noise"] - x["actions"] - velocity) ** 2).mean().backward()

    train = {"lerobot_s": median_time(lerobot_step, args.repeats), "hf_vla_s": median_time(ours_step, args.repeats)}
    reference.eval()
    ours.eval()
    infer = {
        "lerobot_s": median_time(
            lambda: reference.sample_actions(cams, masks, x["tokens"], x["token_mask"], noise=x["noise"]), args.repeats
        ),
        "hf_vla_s": median_time(
            lambda: ours.sample_actions(x["tokens"], x["images"], x["camera_mask"], x["token_mask"], noise=x["noise"]),
            args.repeats,
        ),
    }
    for entry in (train, infer):
        entry["ratio_hf_vla_over_lerobot"] = entry["hf_vla_s"] / entry["lerobot_s"]
    print(json.dumps({
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "batch": args.batch,
        "repeats": args.repeats,
        "params": sum(p.numel() for p in ours.parameters()),
        "train_step": train,
        "sample_actions": infer,
        "targets": {"train_step_ratio_max": 0.8, "sample_actions_ratio_max": 1.0},
    }, indent=2))


if __name__ == "__main__":
    main()
