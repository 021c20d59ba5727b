"""Run under `torchrun --nproc_per_node 2`: one optimizer step (per-device batch 2 x GA 4) per loss mode.

Rank 0 writes, per mode, the gradient right before the optimizer step (after DDP's all-reduce) and every micro-batch
of every rank, so the test can recompute the same 16 samples as one batch in one process.
"""

import os
import sys

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from hf_vla import PI05ForConditionalGeneration, PI05Processor, VLATrainer, VLATrainingArguments
from hf_vla.data import WeightedDatasetMixture
from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config

# (loss mode, divisor, rtc_max_delay): the last two train with committed prefixes (training-time RTC, with prefix
# noise), whose element counts the step-wide totals must see exactly as the loss does.
MODES = [("sample_mean", None, 0), ("token_mean", None, 0), ("group_mean", None, 0), ("constant", 7.0, 0),
         ("token_mean", None, 2), ("sample_mean", None, 2)]


# pi0.5's token objective (CE + alpha x flow MSE, each aggregated over its own elements across the step)
TOKEN_MODES = [("sample_mean", 2.0), ("token_mean", 0.5)]
FAST_VOCAB = 128


def run_key(mode, rtc_max_delay=0, token=False):
    return (mode if not rtc_max_delay else f"{mode}+rtc{rtc_max_delay}") + ("+tokens" if token else "")


RTC_PREFIX_NOISE = 0.2  # a model trained with committed prefixes also gets their per-sample offsets


def make_model(rtc_max_delay=0, token_loss=False):
    torch.manual_seed(0)
    noise = RTC_PREFIX_NOISE if rtc_max_delay else 0.0
    model = PI05ForConditionalGeneration(tiny_pi05_config(chunk_size=6, rtc_max_delay=rtc_max_delay,
                                                          rtc_prefix_noise=noise, token_loss=token_loss))
    with torch.no_grad():  # random adaRMS too, so every parameter gets a gradient
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.05)
    return model


def add_lora(model):
    """peft LoRA (the `expert` preset, r 4), seeded, with random B (it starts at zero) so the adapters matter."""
    from peft import get_peft_model

    from hf_vla.lora import lora_config

    torch.manual_seed(11)
    model = get_peft_model(model, lora_config("expert", r=4, model=model))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model


def build(root_a, root_b, rtc_max_delay=0, token_loss=False):
    mixture = WeightedDatasetMixture([
        dict(root=root_a, name="a", cameras=["observation.images.cam"], control_mode="joint"),
        dict(root=root_b, name="b", cameras=["front", None], control_mode="eef", weight=2.0),
    ])
    model = make_model(rtc_max_delay, token_loss)
    config = model.config
    processor = PI05Processor.from_config(config, build_tiny_tokenizer(), norm_stats=mixture.norm_stats,
                                          head_names=mixture.head_names)
    if token_loss:
        from hf_vla.training.cotraining import fit_fast

        fit_fast(mixture, processor, config, vocab_size=FAST_VOCAB)
    return mixture, model, processor


class Capture(TrainerCallback):
    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


class Recording(VLATrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append({k: v.detach().cpu() for k, v in inputs.items()})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def evaluate_split(root_a, root_b, out_dir, **extra):
    """Evaluation metrics of a fixed model on a split mixture (run with any number of processes)."""
    mixture = WeightedDatasetMixture([
        dict(root=root_a, name="a", cameras=["observation.images.cam"], control_mode="joint"),
        dict(root=root_b, name="b", cameras=["front", None], control_mode="eef", weight=2.0),
    ], validation_ratio=0.3, split_seed=2)
    model = make_model()
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats=mixture.norm_stats,
                                          head_names=mixture.head_names)
    distributed = "WORLD_SIZE" in os.environ  # under torchrun; the test calls this in one plain process too
    args = VLATrainingArguments(output_dir=out_dir, max_steps=1, per_device_eval_batch_size=3, report_to=[],
                                use_cpu=True, ddp_backend="gloo" if distributed else None, save_strategy="no", seed=3,
                                disable_tqdm=True, **extra)
    _, validation = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=model.config.chunk_size)
    trainer = VLATrainer(model, args, eval_dataset=validation, processing_class=processor)
    return trainer.evaluate()


def main(root_a, root_b, out):
    results = {"eval": evaluate_split(root_a, root_b, f"{out}.eval")}
    runs = [(mode, divisor, rtc, False, 1.0) for mode, divisor, rtc in MODES]
    runs += [(mode, None, 0, True, alpha) for mode, alpha in TOKEN_MODES]
    for mode, divisor, rtc_max_delay, token_loss, alpha in runs:
        mixture, model, processor = build(root_a, root_b, rtc_max_delay, token_loss)
        key = run_key(mode, rtc_max_delay, token_loss)
        args = VLATrainingArguments(output_dir=f"{out}.{key}", max_steps=1, per_device_train_batch_size=2,
                                    gradient_accumulation_steps=4, loss_aggregation=mode, loss_divisor=divisor,
                                    max_grad_norm=0.0, report_to=[], use_cpu=True, ddp_backend="gloo",
                                    save_strategy="no", warmup_steps=0, seed=3, stream_open_blocks=2,
                                    disable_tqdm=True, flow_loss_weight=alpha)
        capture = Capture(model)
        train, _ = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=model.config.chunk_size)
        trainer = Recording(model, args, train_dataset=train, processing_class=processor, callbacks=[capture])
        trainer.seen = []
        trainer.train()
        batches = gather_object([trainer.seen])
        results[key] = {"grads": capture.grads, "batches": [b for rank in batches for b in rank],
                        "world_size": trainer.accelerator.num_processes, "fast_range": processor.fast_token_range}
    if torch.distributed.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    from engines import leave

    leave()
