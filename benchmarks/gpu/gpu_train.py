"""Full-size pi0.5 training on one GPU: hf_vla's `VLATrainer` against lerobot's pi0.5, same inputs, same run.

    python -m benchmarks.gpu.gpu_train [--out results.json] [--only hf_vla lerobot] [--episodes 300]

The model is pi0.5 at the published dims (PaliGemma 3B's SigLIP So400m/14 + Gemma 2B, Gemma 300M action expert;
random weights: nothing can be downloaded), 3 cameras at 224 px, chunk 50, prompts padded to 200 tokens.

- hf_vla: `python -m hf_vla.train`'s path — a DROID-shaped synthetic LeRobot v3.0 dataset (`hf_vla.data.synthetic`,
  3 cameras at DROID's 180x320, keep-ranges) through the mixture, the episode-shuffle stream in DataLoader workers,
  `PI05Collator`, and `VLATrainer` with the model in bf16 and fp32 master weights (the product's default), with
  gradient checkpointing on and off, for each attention implementation installed. Step time is the median interval
  between optimizer steps after warm-up: data loading, clipping, the optimizer and the scheduler included.
- lerobot: `PI05Pytorch` (the model inside `PI05Policy`) with `dtype="bfloat16"` (bf16 parameters and bf16 AdamW
  state, as lerobot trains it; its vision tower stays fp32), gradient checkpointing on and off, its preset AdamW with
  grad clip 1.0, on one batch taken from the same stream and reused every step (no data loading: favours lerobot).

Each configuration runs in its own process; batch sizes double until the GPU runs out of memory, so the largest batch
that fits is reported with its throughput. MFU counts the model's own FLOPs (forward + backward, measured once with
`torch.utils.flop_counter` at batch 1, without the recomputation of checkpointing) against the GPU's dense bf16 peak.
Prints JSON (and writes it to `--out` after every configuration, so a cut-off run keeps what it measured).
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
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}  # dense bf16 tensor-core peak, FLOP/s


DEVICE = "cuda"


def _sync():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _reset_memory():
    import torch

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _memory() -> dict:
    import torch

    if DEVICE != "cuda":
        return {}
    return {"peak_memory_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


def _peak(name: str) -> float | None:
    return next((value for key, value in PEAK_BF16.items() if key in name), None)


def _ensure_dataset(root: Path, episodes: int) -> dict:
    from hf_vla.data.synthetic import DroidLike, droid_dataset_config, write_droid_like

    if not (root / "meta" / "info.json").exists():
        write_droid_like(root, DroidLike(episodes=episodes, video_size=(180, 320)))
    return droid_dataset_config(root)


TINY = None  # set by --tiny: a CPU smoke test of this script at tiny dims


def _pipeline(root: Path, episodes: int):
    """The mixture, the full-size config and the processor, as `python -m hf_vla.train` builds them."""
    from hf_vla import PI05Config, PI05Processor
    from hf_vla.data import WeightedDatasetMixture
    from hf_vla.models.reference import hf_pi05_config
    from hf_vla.tiny import build_tiny_tokenizer

    mixture = WeightedDatasetMixture([_ensure_dataset(root, episodes)], validation_ratio=0.0)
    # published dims; chunk 50, 32 state/action dims, 200 prompt tokens
    config = hf_pi05_config(TINY) if TINY else PI05Config()
    processor = PI05Processor.from_config(config, build_tiny_tokenizer(), norm_stats=mixture.norm_stats,
                                          head_names=mixture.head_names)
    return mixture, config, processor


def _build_hf_vla(config, attn: str):
    import torch

    from hf_vla import PI05ForConditionalGeneration

    torch.manual_seed(0)
    config._attn_implementation = attn
    with torch.device(DEVICE):
        model = PI05ForConditionalGeneration(config)
    model.set_attn_implementation(attn)
    return model.to(torch.bfloat16)


def measure_flops(root: Path, episodes: int) -> dict:
    """Forward + backward FLOPs per sample of the full model (no checkpointing), counted on the GPU at batch 2."""
    from torch.utils.flop_counter import FlopCounterMode

    mixture, config, processor = _pipeline(root, episodes)
    model = _build_hf_vla(config, "sdpa")
    batch = _one_batch(mixture, processor, config, 2)
    counter = FlopCounterMode(display=False)
    with counter:
        loss = model(**{k: v.to(DEVICE) for k, v in batch.items() if k in MODEL_KEYS}).loss
        loss.backward()
    return {"train_flops_per_sample": counter.get_total_flops() / 2}


MODEL_KEYS = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "actions")


def _one_batch(mixture, processor, config, batch_size: int) -> dict:
    from hf_vla.data import PI05Collator
    from hf_vla.data.stream import StreamSettings

    stream = mixture.train_stream(StreamSettings(processor.image_size, config.chunk_size, batch_size=batch_size, seed=0,
                                  open_blocks=8, collate_fn=PI05Collator(processor)))
    return next(iter(stream))


def run_hf_vla(root: Path, episodes: int, batch: int, checkpointing: bool, attn: str, steps: int, warmup: int,
               workers: int, master_weights: bool) -> dict:
    from transformers import TrainerCallback

    from hf_vla import VLATrainer, VLATrainingArguments
    from hf_vla.data import PI05Collator

    mixture, config, processor = _pipeline(root, episodes)
    model = _build_hf_vla(config, attn)
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = VLATrainingArguments(
            output_dir=out, max_steps=warmup + steps, per_device_train_batch_size=batch, report_to=[],
            save_strategy="no", disable_tqdm=True, logging_steps=10_000, warmup_steps=10, learning_rate=2.5e-5,
            gradient_checkpointing=checkpointing, dataloader_num_workers=workers, stream_open_blocks=8,
            dataloader_prefetch_factor=4, master_weights=master_weights, seed=0, use_cpu=DEVICE == "cpu",
        )
        train, _ = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=config.chunk_size)
        trainer = VLATrainer(model, args, train_dataset=train, data_collator=PI05Collator(processor),
                             processing_class=processor, callbacks=[Clock()])
        _reset_memory()
        start = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - start
        optimizer = trainer.optimizer
        while hasattr(optimizer, "optimizer") and optimizer.optimizer is not optimizer:
            optimizer = optimizer.optimizer
    intervals = [b - a for a, b in zip(marks[warmup - 1:], marks[warmup:])]
    step = statistics.median(intervals)
    return {"step_s": step, "samples_per_s": batch / step, "steps_timed": len(intervals),
            "first_steps_s": round(marks[0] - start, 2), "wall_s": round(total, 1),
            **_memory(), "optimizer": type(optimizer).__name__,
            "params": sum(p.numel() for p in model.parameters())}


def run_lerobot(root: Path, episodes: int, batch: int, checkpointing: bool, steps: int, warmup: int) -> dict:
    import torch
    from lerobot.policies.pi05.configuration_pi05 import PI05Config as LeConfig
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

    mixture, config, processor = _pipeline(root, episodes)
    inputs = _one_batch(mixture, processor, config, batch)
    le_config = LeConfig(dtype="bfloat16", device=DEVICE, gradient_checkpointing=checkpointing)
    torch.manual_seed(0)
    if TINY:
        from hf_vla.models.reference import build_lerobot_pi05

        model = build_lerobot_pi05(0, TINY)
    else:
        with torch.device(DEVICE):
            model = PI05Pytorch(le_config)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    preset = le_config.get_optimizer_preset()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=preset.lr, betas=preset.betas, eps=preset.eps,
                                  weight_decay=preset.weight_decay)
    cams = inputs["pixel_values"].to(DEVICE)
    images = [cams[:, i] for i in range(cams.shape[1])]
    masks = [inputs["pixel_attention_mask"][:, i].to(DEVICE) for i in range(cams.shape[1])]
    tokens, token_mask = inputs["input_ids"].to(DEVICE), inputs["attention_mask"].to(DEVICE).bool()
    actions = inputs["actions"].to(DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(0)

    def step():
        noise = torch.randn(actions.shape, device=DEVICE, generator=generator)
        t = torch.rand(batch, device=DEVICE, generator=generator) * 0.999 + 0.001
        loss = model(images, masks, tokens, token_mask, actions, noise, t).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, preset.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _reset_memory()
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        _sync()
        begin = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - begin)
    median = statistics.median(times)
    return {"step_s": median, "samples_per_s": batch / median, "steps_timed": steps,
            **_memory(), "params": sum(p.numel() for p in model.parameters())}


def worker(spec: dict) -> dict:
    import torch

    global TINY, DEVICE
    if spec.get("tiny"):
        from hf_vla.models.reference import Dims

        TINY, DEVICE = Dims(chunk=50, max_state=32, max_action=32), "cpu"
    root, episodes = Path(spec["root"]), spec["episodes"]
    try:
        if spec["kind"] == "flops":
            result = measure_flops(root, episodes)
        elif spec["kind"] == "hf_vla":
            result = run_hf_vla(root, episodes, spec["batch"], spec["checkpointing"], spec["attn"], spec["steps"],
                                spec["warmup"], spec["workers"], spec.get("master_weights", True))
        else:
            result = run_lerobot(root, episodes, spec["batch"], spec["checkpointing"], spec["steps"], spec["warmup"])
    except torch.OutOfMemoryError:
        result = {"oom": True, **_memory()}
    return result


def _launch(spec: dict, timeout: float) -> dict:
    command = [sys.executable, __file__, "--worker", json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    if "OutOfMemoryError" in done.stderr or "CUDA out of memory" in done.stderr:
        return {"oom": True}
    return {"error": done.stderr[-2000:]}


def summarize(report: dict) -> dict:
    """The largest batch that fits per configuration, its throughput, and hf_vla's best over lerobot's best."""

    def best(section: str) -> dict:
        out = {}
        for key, runs in report[section].items():
            fitting = {int(b): r for b, r in runs.items() if "samples_per_s" in r}
            if fitting:
                batch = max(fitting)
                out[key] = {"largest_batch": batch, "samples_per_s": round(fitting[batch]["samples_per_s"], 2),
                            "best_samples_per_s": round(max(r["samples_per_s"] for r in fitting.values()), 2),
                            "mfu_at_best": round(max(r.get("mfu", 0) for r in fitting.values()), 3)}
        return out

    report["summary"] = {"hf_vla": best("hf_vla"), "lerobot": best("lerobot")}
    ours = max((v["best_samples_per_s"] for k, v in report["summary"]["hf_vla"].items() if "master_weights=off" not in k),
               default=None)
    theirs = max((v["best_samples_per_s"] for v in report["summary"]["lerobot"].values()), default=None)
    if ours and theirs:
        report["summary"]["ratio_hf_vla_over_lerobot"] = round(ours / theirs, 2)
    return report


def merge(paths: list[str]) -> dict:
    """One report from runs of `--only hf_vla` and `--only lerobot` on the same machine."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    devices = {r["device"] for r in reports}
    if len(devices) != 1:
        raise SystemExit(f"refusing to merge runs from different devices: {sorted(devices)}")
    merged = json.loads(json.dumps(reports[0]))
    for report in reports[1:]:
        for section in ("hf_vla", "lerobot"):
            for key, runs in report.get(section, {}).items():
                merged.setdefault(section, {}).setdefault(key, {}).update(runs)
    merged["runs_merged"] = len(reports)
    return summarize(merged)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=None, help="where the synthetic dataset is written (default: a temp dir)")
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--only", nargs="*", default=["hf_vla", "lerobot"])
    parser.add_argument("--batches_checkpointing", type=int, nargs="*", default=[16, 32, 64, 128])
    parser.add_argument("--batches_no_checkpointing", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--attn", nargs="*", default=None, help="default: sdpa, and flash_attention_2 if installed")
    parser.add_argument("--master_weights_off_batch", type=int, default=32,
                        help="also run hf_vla without master weights (bf16 AdamW like lerobot) at this batch")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per configuration")
    parser.add_argument("--out", default=None)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test of this script at tiny dims")
    parser.add_argument("--merge", nargs="*", default=None, help="merge the JSON of earlier runs (same device)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return None
    if args.merge:
        report = merge(args.merge)
        print(json.dumps(report, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
        return report

    import importlib.util

    import torch

    if not torch.cuda.is_available() and not args.tiny:
        raise SystemExit("gpu_train.py needs a CUDA GPU (--tiny runs a CPU smoke test of the script)")
    attns = args.attn or ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
    root = Path(args.root or tempfile.mkdtemp(prefix="droid_gpu_"))
    os.environ.setdefault("HF_VLA_CACHE", str(root.parent / (root.name + "_cache")))
    _ensure_dataset(root, args.episodes)
    device = torch.cuda.get_device_name() if not args.tiny else "cpu (--tiny smoke test)"
    import lerobot
    import transformers

    report = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
              "lerobot_version": lerobot.__version__, "dense_bf16_peak_flops": _peak(device),
              "model": "pi0.5 at published dims (random weights), 3 cameras 224 px, chunk 50, prompt 200 tokens",
              "attention": attns, "flash_attention_2_installed": importlib.util.find_spec("flash_attn") is not None,
              "hf_vla": {}, "lerobot": {}}
    common = {"root": str(root), "episodes": args.episodes, "steps": args.steps, "warmup": args.warmup,
              "tiny": args.tiny}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))

    flops = _launch(common | {"kind": "flops"}, args.timeout)
    report["train_flops_per_sample"] = flops.get("train_flops_per_sample")
    report["flops_error"] = flops.get("error")

    def record(section: str, key: str, spec: dict) -> dict:
        result = _launch(common | spec, args.timeout)
        if report["train_flops_per_sample"] and report["dense_bf16_peak_flops"] and "samples_per_s" in result:
            result["mfu"] = result["samples_per_s"] * report["train_flops_per_sample"] / report["dense_bf16_peak_flops"]
        report[section].setdefault(key, {})[str(spec["batch"])] = result
        print(json.dumps({section: {key: {spec["batch"]: result}}}), file=sys.stderr, flush=True)
        save()
        return result

    ladders = {True: args.batches_checkpointing, False: args.batches_no_checkpointing}
    for section in args.only:
        variants = [(a, c) for a in attns for c in (True, False)] if section == "hf_vla" else [(None, c) for c in
                                                                                                (True, False)]
        for attn, checkpointing in variants:
            key = f"{attn + ', ' if attn else ''}checkpointing={'on' if checkpointing else 'off'}"
            for batch in ladders[checkpointing]:
                spec = {"kind": section, "batch": batch, "checkpointing": checkpointing}
                if section == "hf_vla":
                    spec |= {"attn": attn, "workers": args.workers}
                if "samples_per_s" not in record(section, key, spec):
                    break
        if section == "hf_vla" and args.master_weights_off_batch:
            record(section, "sdpa, checkpointing=on, master_weights=off (bf16 AdamW state)",
                   {"kind": "hf_vla", "batch": args.master_weights_off_batch, "checkpointing": True, "attn": "sdpa",
                    "workers": args.workers, "master_weights": False})

    summarize(report)
    report["goal"] = {"samples_per_s_per_gpu": 25.0}
    save()
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
