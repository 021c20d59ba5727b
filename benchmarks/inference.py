"""`sample_actions` latency: hf_vla's pi0.5 against lerobot's, same inputs, eager and `torch.compile`.

    python benchmarks/inference.py [--sizes demo mid] [--device cpu] [--repeats 20]
    python benchmarks/inference.py --sizes full --device cuda          # on a GPU: the published dims, bf16

Sizes: `demo` is the built-in demo's model (hf_vla only: its dims are not ones lerobot's constructor can build),
`mid` a mid-size pi0.5 (Gemma 256-wide x 4 layers, expert 128 x 4, SigLIP 128 x 2, 224 px), `full` pi0.5 at the
published dims (PaliGemma 3B + Gemma 300M expert; random weights), run in bf16 on a GPU. Every size: batch 1,
10 flow steps, chunk 50, the cameras of its config (full: 3 at 224 px), a prompt padded to the model's length.
lerobot runs `PI05Pytorch.sample_actions` (what `PI05Policy.predict_action_chunk` calls after its preprocessing) on
the same tensors and noise. Compiled variants use `torch.compile(model.sample_actions, mode=...)`; the first call's
time (compilation) is reported apart. With `--server`, the round trip through `python -m hf_vla.serve` and the real
`openpi-client` is measured against the in-process call on the demo model (see `serve_overhead`).
Prints JSON: median and p95 in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_vla.reference import Dims

MID = Dims(
    text=dict(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
    expert=dict(width=128, depth=4, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32),
    vision=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, patch_size=16),
    image_size=224, chunk=50, max_state=32, max_action=32,
)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, repeats: int, warmup: int, device) -> dict:
    _sync(device)
    begin = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - begin
    for _ in range(max(0, warmup - 1)):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        begin = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - begin)
    times.sort()
    return {"median_ms": round(1000 * statistics.median(times), 2),
            "p95_ms": round(1000 * times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))], 2),
            "first_call_s": round(first, 2), "repeats": repeats}


def build(size: str, device, dtype):
    """(ours, lerobot or None, inputs) for one size."""
    from hf_vla import PI05Config, PI05ForConditionalGeneration

    torch.manual_seed(0)
    lerobot = None
    if size == "demo":
        from importlib import resources

        demo = json.loads(resources.files("hf_vla").joinpath("configs/demo.json").read_text())
        config = PI05Config(**demo["model_config"])
        cameras = len(demo["datasets"][0]["cameras"])
    elif size == "mid":
        from hf_vla.reference import build_lerobot_pi05, hf_pi05_config

        config, cameras = hf_pi05_config(MID), 3
        lerobot = build_lerobot_pi05(seed=0, d=MID).to(device)
    else:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config as LeConfig
        from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

        config, cameras = PI05Config(), 3
        with torch.device(device):
            lerobot = PI05Pytorch(LeConfig(dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                                           device=str(device)))
    with torch.device(device):
        ours = PI05ForConditionalGeneration(config)
    ours.set_attn_implementation("sdpa")
    ours = ours.to(dtype).eval()
    if lerobot is not None:
        lerobot.eval()
    generator = torch.Generator().manual_seed(1)
    length = config.tokenizer_max_length
    tokens = torch.randint(2, 1000, (1, length), generator=generator)
    token_mask = torch.zeros(1, length, dtype=torch.bool)
    token_mask[:, :40] = True  # a DROID-like prompt with its state tokens, padded to the model's length
    tokens[~token_mask] = 0
    size_px = config.image_size
    inputs = {
        "input_ids": tokens.to(device), "attention_mask": token_mask.to(device),
        "pixel_values": (torch.rand(1, cameras, 3, size_px, size_px, generator=generator) * 2 - 1).to(device),
        "pixel_attention_mask": torch.ones(1, cameras, dtype=torch.bool, device=device),
        "noise": torch.randn(1, config.chunk_size, config.max_action_dim, generator=generator).to(device),
    }
    return ours, lerobot, inputs


def measure_size(size: str, device, dtype, repeats: int, warmup: int, compile_modes, save=lambda out: None) -> dict:
    ours, lerobot, x = build(size, device, dtype)
    out = {"params": sum(p.numel() for p in ours.parameters()), "dtype": str(dtype).removeprefix("torch."),
           "cameras": x["pixel_values"].shape[1], "chunk": ours.config.chunk_size, "hf_vla": {}, "lerobot": {}}

    def ours_call(fn):
        return lambda: fn(x["input_ids"], x["pixel_values"], x["pixel_attention_mask"], x["attention_mask"],
                          noise=x["noise"])

    cams = [x["pixel_values"][:, i].to(dtype) for i in range(x["pixel_values"].shape[1])]
    masks = [x["pixel_attention_mask"][:, i] for i in range(len(cams))]

    def lerobot_call(fn):
        return lambda: fn(cams, masks, x["input_ids"], x["attention_mask"], noise=x["noise"])

    with torch.inference_mode():
        out["hf_vla"]["eager"] = timed(ours_call(ours.sample_actions), repeats, warmup, device)
        if lerobot is not None:
            out["lerobot"]["eager"] = timed(lerobot_call(lerobot.sample_actions), repeats, warmup, device)
            a = ours.sample_actions(x["input_ids"], x["pixel_values"], x["pixel_attention_mask"], x["attention_mask"],
                                    noise=x["noise"])
            out["same_shape"] = list(a.shape) == list(lerobot_call(lerobot.sample_actions)().shape)
    save(out)
    for mode in compile_modes:
        key = f"compile_{mode}"
        for name, model, call in (("hf_vla", ours, ours_call), ("lerobot", lerobot, lerobot_call)):
            if model is None:
                continue
            torch._dynamo.reset()
            try:
                compiled = torch.compile(model.sample_actions, mode=None if mode == "default" else mode)
                with torch.inference_mode():
                    out[name][key] = timed(call(compiled), repeats, warmup, device)
            except Exception as error:  # a compile failure is a result, not the end of the benchmark
                out[name][key] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            save(out)
    for variant, result in out["hf_vla"].items():
        theirs = out["lerobot"].get(variant, {})
        if "median_ms" in result and "median_ms" in theirs:
            result["ratio_to_lerobot"] = round(result["median_ms"] / theirs["median_ms"], 3)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", default=["demo", "mid"], choices=["demo", "mid", "full"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile_modes", nargs="*", default=["default"],
                        help="torch.compile modes to try (e.g. default reduce-overhead max-autotune)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({torch.get_num_threads()} "
                                                                                      "threads)",
              "torch": torch.__version__, "batch": 1, "flow_steps": 10, "sizes": {}}
    def save(out, size=None):
        if size:
            report["sizes"][size] = out
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(report, handle, indent=2)

    for size in args.sizes:
        measure_size(size, device, dtype, args.repeats, args.warmup, args.compile_modes,
                     save=lambda out, size=size: save(out, size))
    report["goal"] = {"full_size_compiled_median_ms": 40.0}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
