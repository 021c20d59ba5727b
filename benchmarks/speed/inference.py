"""`sample_actions` latency: hf_vla's pi0.5 against lerobot's, same inputs, eager and `torch.compile`.

    python -m benchmarks.speed.inference [--sizes demo mid] [--device cpu] [--repeats 20]
    python -m benchmarks.speed.inference --sizes full --device cuda          # on a GPU: the published dims, bf16

Sizes: `demo` is the built-in demo's model (hf_vla only: its dims are not ones lerobot's constructor can build),
`mid` a mid-size pi0.5 (Gemma 256-wide x 4 layers, expert 128 x 4, SigLIP 128 x 2, 224 px), `full` pi0.5 at the
published dims (PaliGemma 3B + Gemma 300M expert; random weights), run in bf16 on a GPU. Every size: batch 1,
10 flow steps, chunk 50, the cameras of its config (full: 3 at 224 px), a prompt padded to the model's length.
lerobot runs `PI05Pytorch.sample_actions` (what `PI05Policy.predict_action_chunk` calls after its preprocessing) on
the same tensors and noise. Compiled variants use `torch.compile(model.sample_actions, mode=...)`; the first call's
time (compilation) is reported apart.

`policy_level` (mid size, CPU): a whole observation -> chunk call, hf_vla's processor (tokenizer, resize, quantile
normalisation) + `sample_actions` + un-normalisation against lerobot's `PI05Policy.predict_action_chunk` (image
preprocessing + sampling; lerobot tokenizes in its separate processor pipeline, not timed here).
`serve_overhead` (`--server`): the round trip through `python -m hf_vla.serve` with the real `openpi-client` against
the same `PolicyRunner` call in-process, on the demo model, for a 1-camera 32 px and a DROID-like 3-camera 224 px
observation, with and without real-time chunking.
Prints JSON: median and p95 in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_vla.models.reference import Dims

MID = Dims(
    text=dict(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=32),
    expert=dict(width=128, depth=4, mlp_dim=512, num_heads=8, num_kv_heads=1, head_dim=32),
    vision=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, patch_size=16),
    image_size=224, chunk=50, max_state=32, max_action=32,
)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _summary(times: list[float]) -> dict:
    times = sorted(times)
    return {"median_ms": round(1000 * statistics.median(times), 2),
            "p95_ms": round(1000 * times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))], 2),
            "repeats": len(times)}


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
    return {**_summary(times), "first_call_s": round(first, 2)}


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
        from hf_vla.models.reference import build_lerobot_pi05, hf_pi05_config

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
    out["hf_vla"].update(rtc_latency(ours, x, repeats, warmup, device))
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


def rtc_latency(model, x: dict, repeats: int, warmup: int, device) -> dict:
    """`sample_actions` with real-time chunking, eager: inference-time guidance (lerobot's weighted error, and the
    paper's vector-Jacobian product: a backward pass per flow step) and training-time RTC (the committed prefix held
    at time 0; the model's `rtc_max_delay` is set for the call). Delay: a tenth of the chunk, at least 2."""
    from hf_vla.models.common.rtc import RTCConfig

    chunk = model.config.chunk_size
    delay = max(2, chunk // 10)
    left_over = torch.randn(1, chunk - delay, model.config.max_action_dim, generator=torch.Generator().manual_seed(2))
    left_over = left_over.to(device)
    trained = model.config.rtc_max_delay
    out = {}
    for name, config in (("eager_rtc_guidance", RTCConfig(method="guidance")),
                         ("eager_rtc_guidance_jacobian", RTCConfig(method="guidance", jacobian=True)),
                         ("eager_rtc_prefix", RTCConfig(method="prefix"))):
        model.config.rtc_max_delay = delay
        try:
            with torch.no_grad():  # not inference_mode: the Jacobian variant back-propagates through the expert
                out[name] = timed(lambda config=config: model.sample_actions(
                    x["input_ids"], x["pixel_values"], x["pixel_attention_mask"], x["attention_mask"], noise=x["noise"],
                    prev_chunk_left_over=left_over, inference_delay=delay, rtc_config=config), repeats, warmup, device)
        finally:
            model.config.rtc_max_delay = trained
        out[name]["inference_delay"] = delay
    return out


def policy_level(repeats: int, warmup: int) -> dict:
    """Observation -> chunk at mid size: hf_vla processor + sample_actions + un-normalisation vs lerobot's
    PI05Policy.predict_action_chunk, 3 cameras at 224 px, batch 1, CPU float32."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config as LeConfig
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy

    from hf_vla import PI05ForConditionalGeneration, PI05Processor
    from hf_vla.models.reference import _tiny_lerobot, hf_pi05_config
    from hf_vla.tiny import build_tiny_tokenizer

    cams = [f"observation.images.cam{i}" for i in range(3)]
    features = {key: PolicyFeature(FeatureType.VISUAL, (3, 224, 224)) for key in cams}
    features["observation.state"] = PolicyFeature(FeatureType.STATE, (8,))
    le_config = LeConfig(chunk_size=MID.chunk, n_action_steps=MID.chunk, max_state_dim=MID.max_state,
                         max_action_dim=MID.max_action, dtype="float32", device="cpu", input_features=features,
                         output_features={"action": PolicyFeature(FeatureType.ACTION, (7,))})
    import lerobot.policies.pi05.modeling_pi05 as module

    with _tiny_lerobot(module, MID):
        lerobot = PI05Policy(le_config).eval()
    ours = PI05ForConditionalGeneration(hf_pi05_config(MID)).eval()
    ours.set_attn_implementation("sdpa")
    stats = {"robot::joint": {"state": {"q01": [-1.0] * 8, "q99": [1.0] * 8},
                              "actions": {"q01": [-1.0] * 7, "q99": [1.0] * 7}}}
    processor = PI05Processor.from_config(ours.config, build_tiny_tokenizer(), norm_stats=stats)
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (1, 3, 3, 224, 224), dtype=torch.uint8, generator=generator)
    state = torch.rand(1, 8, generator=generator) * 2 - 1
    noise = torch.randn(1, MID.chunk, MID.max_action, generator=generator)
    length = ours.config.tokenizer_max_length
    batch = {key: images[:, i].float() / 255 for i, key in enumerate(cams)}
    batch["observation.language.tokens"] = torch.randint(2, 1000, (1, length), generator=generator)
    batch["observation.language.attention_mask"] = torch.arange(length)[None] < 40

    def hf_vla_call():
        inputs = processor(images=images, text=["pick up the red cube and place it in the bowl"], state=state)
        chunk = ours.sample_actions(inputs["input_ids"], inputs["pixel_values"], inputs["pixel_attention_mask"],
                                    inputs["attention_mask"], noise=noise)
        return processor.unnormalize_actions(chunk)

    with torch.inference_mode():
        out = {"hf_vla_processor_sample_unnormalize": timed(hf_vla_call, repeats, warmup, torch.device("cpu")),
               "lerobot_predict_action_chunk": timed(lambda: lerobot.predict_action_chunk(batch, noise=noise), repeats,
                                                     warmup, torch.device("cpu"))}
    out["ratio_to_lerobot"] = round(out["hf_vla_processor_sample_unnormalize"]["median_ms"]
                                    / out["lerobot_predict_action_chunk"]["median_ms"], 3)
    return out


def _round_trips(runner, client, observation: dict, repeats: int, warmup: int) -> dict:
    """The four calls interleaved call by call, so CPU frequency and load drift hit them alike."""
    rtc = {"inference_delay": 2, "executed_steps": 4}
    calls = {
        "in_process": lambda: runner(observation),
        "server_round_trip": lambda: client.infer(observation),
        "in_process_rtc": lambda: runner(observation, **rtc),
        "server_round_trip_rtc": lambda: client.infer({**observation, "rtc/inference_delay": 2,
                                                       "rtc/executed_steps": 4}),
    }
    times = {name: [] for name in calls}
    for round_ in range(warmup + repeats):
        for name, call in calls.items():
            begin = time.perf_counter()
            call()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - begin)
    out = {name: _summary(values) for name, values in times.items()}
    out["overhead_ms"] = round(out["server_round_trip"]["median_ms"] - out["in_process"]["median_ms"], 2)
    out["overhead_rtc_ms"] = round(out["server_round_trip_rtc"]["median_ms"] - out["in_process_rtc"]["median_ms"], 2)
    return out


def serve_overhead(repeats: int, warmup: int) -> dict:
    """In-process PolicyRunner vs the same call through hf_vla.serve + openpi-client, demo model, localhost."""
    import subprocess
    import sys
    import tempfile
    from importlib import resources
    from pathlib import Path

    import numpy as np
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from hf_vla import PI05Config, PI05ForConditionalGeneration, PI05Processor
    from hf_vla.serving.policy import PolicyRunner
    from hf_vla.tiny import build_tiny_tokenizer

    demo = json.loads(resources.files("hf_vla").joinpath("configs/demo.json").read_text())
    model = PI05ForConditionalGeneration(PI05Config(**demo["model_config"])).eval()
    stats = {"demo::xy": {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]},
                          "actions": {"q01": [-0.1, -0.1], "q99": [0.1, 0.1]}}}
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats=stats)
    rng = np.random.default_rng(0)
    payloads = {
        "1cam_32px": {"observation/image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)},
        "3cam_224px": {f"observation/cam{i}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for i in range(3)},
    }
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        server = subprocess.Popen([sys.executable, "-m", "hf_vla.serve", "--checkpoint", tmp, "--host", "127.0.0.1",
                                   "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  cwd=Path(__file__).resolve().parents[2])
        try:
            uri = None
            for line in server.stdout:
                if "listening on ws://" in line:
                    uri = line.strip().rsplit(" ", 1)[-1]
                    break
            if uri is None:
                raise RuntimeError("the server did not start")
            client = WebsocketClientPolicy(uri)
            for name, cameras in payloads.items():
                observation = {**cameras, "observation/state": np.zeros(2, np.float32), "prompt": "move to the red target"}
                out[name] = _round_trips(PolicyRunner(model, processor), client, observation, repeats, warmup)
                out[name]["image_bytes"] = int(sum(v.nbytes for v in cameras.values()))
        finally:
            server.terminate()
            server.wait(timeout=30)
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
    parser.add_argument("--policy_level", action="store_true", help="also time observation -> chunk vs lerobot's "
                        "PI05Policy.predict_action_chunk (mid size, CPU)")
    parser.add_argument("--server", action="store_true", help="also time the policy server round trip")
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
    if args.policy_level:
        report["policy_level_mid"] = policy_level(args.repeats, args.warmup)
        save(None)
    if args.server:
        report["serve_overhead"] = serve_overhead(args.repeats, args.warmup)
        save(None)
    report["goal"] = {"full_size_compiled_median_ms": 40.0}
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


if __name__ == "__main__":
    main()
