"""The trainer's CUDA-only paths: fused AdamW over fp32 masters, masters following the model's device, a bf16 step
close to fp32, sdpa in bf16 on the GPU against a float64 reference. Skipped without CUDA (see conftest)."""

import pytest
import torch
from test_pi05_model import rel_err, tiny_inputs
from test_trainer import _trainer, two_datasets  # noqa: F401

from hf_vla import MasterWeightOptimizer, PI05ForConditionalGeneration
from hf_vla.tiny import tiny_pi05_config

pytestmark = pytest.mark.gpu
GPU = dict(use_cpu=False, gradient_accumulation_steps=1, save_strategy="no", eval_strategy="no")


def _masters(trainer):
    inner = trainer._master_optimizer().inner
    return inner, [p for group in inner.param_groups for p in group["params"]]


def test_fused_adamw_over_fp32_masters_on_cuda(two_datasets, tmp_path):  # noqa: F811
    finals = {}
    for optim in ("adamw_torch", "adamw_torch_fused"):
        trainer = _trainer(two_datasets, tmp_path / optim, max_steps=3, optim=optim, **GPU)
        trainer.model.to(torch.bfloat16)
        trainer.train()
        inner, masters = _masters(trainer)
        assert bool(inner.defaults.get("fused")) == optim.endswith("fused")
        assert all(m.device.type == "cuda" and m.dtype == torch.float32 for m in masters)
        state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
        assert state and all(v.device.type == "cuda" and v.dtype == torch.float32 for v in state)
        assert all(torch.isfinite(m).all() for m in masters)
        finals[optim] = [m.detach().cpu() for m in masters]
    # the fused kernel computes the same AdamW update as the foreach one
    worst = max((a - b).abs().max().item() for a, b in zip(finals["adamw_torch"], finals["adamw_torch_fused"]))
    assert worst < 1e-4


@pytest.mark.parametrize("fused", [False, True])
def test_masters_follow_the_model_to_cuda(fused):
    torch.manual_seed(0)
    layers = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
        optimizer = MasterWeightOptimizer(layer.parameters(), lr=1e-2, fused=fused)  # built while the model is on CPU
        x = torch.randn(16, 8, dtype=torch.bfloat16)
        for step in range(3):
            if step == 1:
                layer.to(device)  # the Trainer moves the model after the user built it
                x = x.to(device)
            optimizer.zero_grad()
            layer(x).float().pow(2).mean().backward()
            optimizer.step()
        masters = [p for group in optimizer.inner.param_groups for p in group["params"]]
        assert all(m.device.type == device for m in masters)
        assert all(v.device.type == device for s in optimizer.inner.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim())
        # the bf16 parameters are the masters rounded
        for param, master in zip(layer.parameters(), masters):
            assert torch.equal(param, master.to(torch.bfloat16))
        layers[device] = [m.detach().cpu() for m in masters]
    for a, b in zip(layers["cpu"], layers["cuda"]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_bf16_step_is_finite_and_close_to_fp32(two_datasets, tmp_path):  # noqa: F811
    trainers = {}
    for dtype in (torch.float32, torch.bfloat16):
        trainer = _trainer(two_datasets, tmp_path / str(dtype), max_steps=2, logging_steps=1, **GPU)
        trainer.model.to(dtype)
        trainers[dtype] = trainer
    batch = next(iter(trainers[torch.float32].get_train_dataloader()))
    losses, grads = {}, {}
    for dtype, trainer in trainers.items():
        model = trainer.model
        model.zero_grad()
        inputs = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        losses[dtype] = loss.item()
        grads[dtype] = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    assert torch.isfinite(torch.tensor(list(losses.values()))).all()
    assert abs(losses[torch.bfloat16] - losses[torch.float32]) < 2e-2 * losses[torch.float32]
    cosine = torch.nn.functional.cosine_similarity(grads[torch.bfloat16], grads[torch.float32], dim=0).item()
    assert cosine > 0.99
    # and a whole bf16 training run with fp32 masters stays finite, its loss logged as a number
    trainer = trainers[torch.bfloat16]
    trainer.model.zero_grad()
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(torch.isfinite(torch.tensor(logged)))
    _, masters = _masters(trainer)
    assert all(torch.isfinite(m).all() and m.device.type == "cuda" for m in masters)


def test_sdpa_in_bf16_on_cuda_matches_a_float64_reference():
    torch.manual_seed(0)
    model = PI05ForConditionalGeneration(tiny_pi05_config()).eval()
    inputs = tiny_inputs(model.config)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        reference = model.to(torch.float64)(**{k: v.double() if v.is_floating_point() else v
                                               for k, v in inputs.items()}).logits
        model.set_attn_implementation("sdpa")
        gpu = model.to("cuda", torch.bfloat16)(**{k: v.cuda() for k, v in inputs.items()}).logits
    assert rel_err(gpu.double().cpu(), reference) < 3e-2
