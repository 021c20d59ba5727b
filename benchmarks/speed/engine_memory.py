"""Bytes per parameter each rank holds under DDP, FSDP2, ZeRO-2 and ZeRO-3, and what they make for the full pi0.5 on 8 GPUs.

    python -m benchmarks.speed.engine_memory [--dataset ../shared/datasets/humanoid_teleop_24] [--engines ddp fsdp2 zero2 zero3]

For each engine it runs `accelerate launch --config_file configs/accelerate/<engine>.yaml --num_processes 2` on CPU
(gloo; `hf_vla.training.engines.allow_sharding_on_cpu`), training a tiny pi0.5 held in bfloat16 with fp32 master weights (the
production setting) through `VLATrainer` on a real dataset. Right after the first optimizer step it measures, on each
rank, the tensors the run holds: the model's parameters (the local shard), gradients, fp32 masters (the optimizer's
own parameters when they are not the model's), optimizer state and the EMA of the weights (`ema_decay` 0.999,
`hf_vla.training.ema`). Parameters are divided by the model's parameter count, the rest by its trainable count. The full-size figures apply them to pi0.5 at the published dims (counted on the
meta device) on 8 GPUs, with each engine's sharded parts divided by 8 instead of 2. Activations, communication buckets
and the allocator's slack are not included. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARDED = {"ddp": set(), "fsdp2": {"params", "grads", "masters", "optimizer_state", "ema"},
           "zero2": {"grads", "masters", "optimizer_state"},
           "zero3": {"params", "grads", "masters", "optimizer_state", "ema"}}
PARTS = ("grads", "masters", "optimizer_state", "ema")


def _tensor_bytes(tensor) -> int:
    if tensor is None:
        return 0
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def _innermost(optimizer):
    while True:
        if hasattr(optimizer, "inner"):  # MasterWeightOptimizer
            optimizer = optimizer.inner
        elif hasattr(optimizer, "optimizer") and optimizer.optimizer is not optimizer:  # accelerate / DeepSpeed wrappers
            optimizer = optimizer.optimizer
        else:
            return optimizer


def worker(engine: str, dataset: str, out: str):
    from hf_vla.training.engines import allow_sharding_on_cpu

    allow_sharding_on_cpu()
    import torch
    from transformers import TrainerCallback

    from hf_vla import PI05ForConditionalGeneration, PI05Processor, VLATrainer, VLATrainingArguments
    from hf_vla.data import WeightedDatasetMixture
    from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config

    mixture = WeightedDatasetMixture([dict(root=dataset, name="bench", cameras=["image"], state_key="state",
                                           action_key="actions", control_mode="joint")])
    torch.manual_seed(0)
    config = tiny_pi05_config(chunk_size=4, max_state_dim=34, max_action_dim=34)
    model = PI05ForConditionalGeneration(config).to(torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    processor = PI05Processor.from_config(config, build_tiny_tokenizer(), norm_stats=mixture.norm_stats,
                                          head_names=mixture.head_names)
    args = VLATrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                                ddp_backend="gloo", save_strategy="no", disable_tqdm=True, stream_open_blocks=2,
                                warmup_steps=0, learning_rate=1e-4, bf16=engine.startswith("zero"), ema_decay=0.999)
    train, _ = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=config.chunk_size)
    trainer = VLATrainer(model, args, train_dataset=train, processing_class=processor)
    measured = {}

    class Measure(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            inner = _innermost(trainer.optimizer)
            original = inner.step

            seen = {"masters": {}, "master_grads": {}, "state": {}, "model_grads": 0}

            def step(*a, **k):
                # DeepSpeed steps its inner optimizer once per parameter group (param_groups swapped to that group):
                # accumulate over the calls, keyed by tensor
                model_params = list(trainer.model_wrapped.parameters())
                model_storage = {(p.to_local() if hasattr(p, "to_local") else p).data_ptr() for p in model_params}
                seen["model_grads"] = max(seen["model_grads"], sum(_tensor_bytes(p.grad) for p in model_params))
                result = original(*a, **k)
                for group in inner.param_groups:
                    for param in group["params"]:
                        local = param.to_local() if hasattr(param, "to_local") else param
                        if local.data_ptr() not in model_storage:
                            seen["masters"][id(param)] = _tensor_bytes(param)
                            seen["master_grads"][id(param)] = _tensor_bytes(param.grad)
                        seen["state"][id(param)] = sum(_tensor_bytes(v) for v in inner.state.get(param, {}).values()
                                                       if torch.is_tensor(v))
                measured.update({
                    "params": sum(_tensor_bytes(getattr(p, "ds_tensor", p)) for p in model_params),
                    "grads": seen["model_grads"] + sum(seen["master_grads"].values()),
                    "masters": sum(seen["masters"].values()),
                    "optimizer_state": sum(seen["state"].values()),
                    "optimizer": type(inner).__name__, "masters_are_params": not seen["masters"],
                })
                return result

            inner.step = step

        def on_step_end(self, args, state, control, **kwargs):  # after the EMA's own update of this step
            measured["ema"] = sum(_tensor_bytes(t) for t in trainer._ema.shadow)

    trainer.add_callback(Measure())
    trainer.train()
    from accelerate.utils import gather_object

    ranks = gather_object([measured])
    if trainer.args.process_index == 0:
        Path(out, "measured.json").write_text(json.dumps({"ranks": ranks, "total": total, "trainable": trainable,
                                                          "engine": str(trainer.accelerator.distributed_type)}))
    # Results are written: leave without interpreter teardown, where native threads have been seen to abort a
    # multi-process CPU run that had succeeded (about 1 run in 8; the cause was not found).
    import torch.distributed as dist

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


def full_size_counts() -> tuple[int, int]:
    import torch

    from hf_vla import PI05Config, PI05ForConditionalGeneration

    with torch.device("meta"):
        model = PI05ForConditionalGeneration(PI05Config())
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default=str(REPO.parent / "shared/datasets/humanoid_teleop_24"))
    parser.add_argument("--engines", nargs="*", default=["ddp", "fsdp2", "zero2", "zero3"])
    parser.add_argument("--gpus", type=int, default=8, help="GPUs of the full-size estimate")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.dataset, args.out)
    full_total, full_trainable = full_size_counts()
    report = {"model": "tiny pi0.5 in bfloat16 with fp32 master weights, 2 processes (gloo, CPU)",
              "full_size": {"params": full_total, "trainable": full_trainable, "gpus": args.gpus}, "engines": {}}
    for engine in args.engines:
        with tempfile.TemporaryDirectory() as out:
            command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                       str(REPO / "configs" / "accelerate" / f"{engine}.yaml"), "--num_processes", "2",
                       __file__, "--worker", engine, "--dataset", args.dataset, "--out", out]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
            if result.returncode != 0:
                raise SystemExit(f"{engine}: the run failed:\n{result.stderr[-4000:]}")
            data = json.loads(Path(out, "measured.json").read_text())
        rank = max(data["ranks"], key=lambda r: r["params"] + sum(r[k] for k in PARTS))
        per_param = {"params": rank["params"] / data["total"]}
        per_param.update({k: rank[k] / data["trainable"] for k in PARTS})
        shrink = 2 / args.gpus
        full = {"params": per_param["params"] * full_total}
        full.update({k: per_param[k] * full_trainable for k in PARTS})
        full = {k: v * (shrink if k in SHARDED[engine] else 1.0) for k, v in full.items()}
        report["engines"][engine] = {
            "accelerate_engine": data["engine"], "optimizer": rank["optimizer"],
            "masters_are_the_sharded_params": rank["masters_are_params"],
            "bytes_per_param_per_rank_2_processes": {k: round(v, 3) for k, v in per_param.items()},
            "bytes_per_param_per_rank_total_without_ema": round(sum(v for k, v in per_param.items() if k != "ema"), 3),
            "bytes_per_param_per_rank_total": round(sum(per_param.values()), 3),
            f"full_pi05_per_gpu_GiB_{args.gpus}_gpus": {k: round(v / 2**30, 2) for k, v in full.items()},
            f"full_pi05_per_gpu_GiB_{args.gpus}_gpus_total_without_ema": round(
                sum(v for k, v in full.items() if k != "ema") / 2**30, 2),
            f"full_pi05_per_gpu_GiB_{args.gpus}_gpus_total": round(sum(full.values()) / 2**30, 2),
        }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
