"""VLATrainer: exact loss aggregation under GA x DP, master weights, checkpoints and resume, validation, eval."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_step import MODES, TOKEN_MODES
from test_data import CAM, make_dataset
from transformers import TrainerCallback, get_scheduler

from hf_vla import MasterWeightOptimizer, PI05ForConditionalGeneration, PI05Processor, VLATrainer, VLATrainingArguments
from hf_vla.data import PI05Collator, WeightedDatasetMixture
from hf_vla.tiny import build_tiny_tokenizer, tiny_pi05_config
from hf_vla.training.losses import (
    GROUP_KEYS,
    RTC_NOISE_SALT,
    StepTotals,
    _sample_seed,
    aggregate,
    committed_steps,
    per_sample_flow_loss,
    policy_per_sample_loss,
    sample_noise_and_time,
    sample_weights,
)

TESTS = Path(__file__).parent


@pytest.fixture(scope="session")
def two_datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("trainer_data")
    make_dataset(base / "a", 10, lengths=[7 + (e % 4) for e in range(10)])
    make_dataset(base / "b", 8, state_dim=4, action_dim=3, robot_type="arm_b", cameras={"front": (48, 64)},
                 lengths=[5 + e for e in range(8)])
    return base


# ---- loss aggregation ---------------------------------------------------------------------------------------------
def test_aggregation_modes_on_one_batch():
    count = torch.tensor([4.0, 2.0, 0.0, 2.0])
    total = torch.tensor([8.0, 2.0, 0.0, 6.0])
    per_sample = type("P", (), {"sum": total, "count": count})
    groups = torch.tensor([1, 1, 2, 3])
    assert aggregate("token_mean", per_sample, groups) == pytest.approx(16 / 8)
    assert aggregate("sample_mean", per_sample, groups) == pytest.approx((2 + 1 + 3) / 3)  # padded sample counts zero
    assert aggregate("group_mean", per_sample, groups) == pytest.approx((10 / 6 + 6 / 2) / 2)
    assert aggregate("constant", per_sample, groups, divisor=5.0) == pytest.approx(16 / (5 * 3))


def _synthetic_batch(model, size=24, seed=0):
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    chunk, dims = config.chunk_size, config.max_action_dim
    lengths = torch.randint(2, chunk + 1, (size,), generator=generator)
    return {
        "input_ids": torch.randint(3, 200, (size, 12), generator=generator),
        "attention_mask": torch.ones(size, 12, dtype=torch.bool),
        "pixel_values": torch.randn(size, 2, 3, config.image_size, config.image_size, generator=generator),
        "pixel_attention_mask": torch.ones(size, 2, dtype=torch.bool),
        "actions": torch.randn(size, chunk, dims, generator=generator),
        "action_is_pad": torch.arange(chunk)[None, :] >= lengths[:, None],
        "action_dim_mask": torch.arange(dims)[None, :] < torch.randint(2, dims + 1, (size, 1), generator=generator),
        "source_index": torch.zeros(size, dtype=torch.long),
        "episode_index": torch.arange(size),
        "frame_index": torch.randint(0, 100, (size,), generator=generator),
    }


def test_training_time_rtc_objective(monkeypatch):
    """rtc_max_delay: per sample d ~ U{0..max} committed actions, keyed by the sample's identity; x_t holds them at
    time 0, clean up to one per-sample offset of std rtc_prefix_noise, and the loss leaves them out (oracle: the
    computation written out; the flow noise drawn for committed actions has no effect at all)."""
    from distributed_step import RTC_PREFIX_NOISE, make_model

    model = make_model(rtc_max_delay=3).train()
    assert model.config.rtc_prefix_noise == RTC_PREFIX_NOISE > 0
    batch = _synthetic_batch(model)
    delay = committed_steps(batch, seed=3, step=0, max_delay=3)
    assert set(delay.tolist()) == {0, 1, 2, 3}
    order = torch.randperm(len(delay), generator=torch.Generator().manual_seed(1))
    assert torch.equal(committed_steps({k: v[order] for k, v in batch.items()}, 3, 0, 3), delay[order])
    assert not torch.equal(committed_steps(batch, 3, 1, 3), delay)  # redrawn every step

    per_sample, _ = policy_per_sample_loss(model, batch, seed=3, step=0)
    noise, t = sample_noise_and_time(batch, batch["actions"].shape[1:], 3, 0, model.config)
    steps = torch.arange(model.config.chunk_size)
    committed = steps[None, :] < delay[:, None]
    time = torch.where(committed, 0.0, t[:, None])
    offsets = []
    for source, episode, frame in zip(batch["source_index"], batch["episode_index"], batch["frame_index"]):
        key = _sample_seed(3, 0, int(source), int(episode), int(frame), RTC_NOISE_SALT)
        offsets.append(RTC_PREFIX_NOISE * torch.randn(model.config.max_action_dim,
                                                      generator=torch.Generator().manual_seed(key)))
    shift = committed[..., None] * batch["action_dim_mask"][:, None, :] * torch.stack(offsets)[:, None, :]
    x_t = time[..., None] * noise + (1 - time[..., None]) * batch["actions"] + shift
    off = x_t - batch["actions"]  # on committed actions: the sample's offset on its real dims, 0 on padded dims
    real = committed[..., None] & batch["action_dim_mask"][:, None, :]
    assert off[real].abs().max() > 0.05 and (off[committed[..., None] & ~real] == 0).all()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}
    velocity = model(noise=x_t, timestep=time, **inputs).logits
    mask = (~batch["action_is_pad"] & ~committed)[..., None] & batch["action_dim_mask"][:, None, :]
    expected = ((noise - batch["actions"] - velocity) ** 2 * mask).sum(dim=(1, 2))
    torch.testing.assert_close(per_sample.sum, expected, rtol=1e-5, atol=1e-6)
    assert per_sample.count.tolist() == mask.sum(dim=(1, 2)).float().tolist()

    # other noise on the committed actions: the same loss to the bit (they are clean and unsupervised)
    import hf_vla.training.losses as losses

    def other_committed_noise(*args, **kwargs):
        drawn, times = sample_noise_and_time(*args, **kwargs)
        return torch.where(committed[..., None], torch.randn_like(drawn), drawn), times

    monkeypatch.setattr(losses, "sample_noise_and_time", other_committed_noise)
    again, _ = policy_per_sample_loss(model, batch, seed=3, step=0)
    assert torch.equal(again.sum, per_sample.sum)
    # without rtc_max_delay every step of a sample counts and the time is one per sample
    plain, _ = policy_per_sample_loss(make_model(), batch, seed=3, step=0)
    assert (plain.count >= per_sample.count).all() and (plain.count > per_sample.count).sum() > 5


def test_per_sample_flow_loss_masks_padding():
    velocity = torch.zeros(2, 3, 4)
    noise = torch.ones(2, 3, 4)
    actions = torch.zeros(2, 3, 4)
    is_pad = torch.tensor([[False, False, True], [True, True, True]])
    dims = torch.tensor([[True, True, False, False], [True] * 4])
    loss = per_sample_flow_loss(velocity, noise, actions, is_pad, dims)
    assert loss.count.tolist() == [4.0, 0.0] and loss.sum.tolist() == [4.0, 0.0]


@pytest.fixture(scope="module")
def distributed_run(two_datasets, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "grads.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT="29517")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
         str(TESTS / "distributed_step.py"), str(two_datasets / "a"), str(two_datasets / "b"), str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("mode,divisor,rtc_max_delay", MODES)  # the modes distributed_step.py ran
def test_ga4_x_dp2_gradient_equals_one_batch_of_16(distributed_run, mode, divisor, rtc_max_delay):
    from distributed_step import make_model, run_key

    run = distributed_run[run_key(mode, rtc_max_delay)]
    assert run["world_size"] == 2 and len(run["batches"]) == 8
    batch = {k: torch.cat([b[k] for b in run["batches"]]) for k in run["batches"][0]}
    assert batch["actions"].shape[0] == 16
    counts = per_sample_flow_loss(torch.zeros_like(batch["actions"]), batch["actions"], batch["actions"],
                                  batch["action_is_pad"], batch["action_dim_mask"]).count
    assert len(set(counts.tolist())) > 2  # heterogeneous lengths and dims: the modes really differ
    model = make_model(rtc_max_delay)
    model.train()
    per_sample, _ = policy_per_sample_loss(model, batch, seed=3, step=0)
    if rtc_max_delay:  # some samples really have a committed prefix, which the loss leaves out
        assert (per_sample.count < counts).any() and (per_sample.count == counts).any()
    groups = batch[GROUP_KEYS["episode"]]
    loss = aggregate(mode, per_sample, groups, divisor)
    loss.backward()
    reference = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert reference.keys() == run["grads"].keys()
    for name, grad in reference.items():
        torch.testing.assert_close(run["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("mode,alpha", TOKEN_MODES)
def test_token_objective_ga4_x_dp2_gradient_equals_one_batch_of_16(distributed_run, mode, alpha):
    """pi0.5's objective under DDP and gradient accumulation: CE over the target tokens and alpha x the flow MSE,
    each aggregated over its own elements of the whole step, give the gradient of one batch of all 16 samples."""
    from distributed_step import make_model, run_key

    from hf_vla.training.cotraining import token_per_sample_loss

    run = distributed_run[run_key(mode, token=True)]
    batch = {k: torch.cat([b[k] for b in run["batches"]]) if k != "labels" else None for k in run["batches"][0]}
    width = max(b["labels"].shape[1] for b in run["batches"])  # each micro-batch pads its targets to its own max
    batch["labels"] = torch.cat([torch.nn.functional.pad(b["labels"], (0, width - b["labels"].shape[1]), value=-100)
                                 for b in run["batches"]])
    token_counts = (batch["labels"] != -100).sum(-1)
    assert batch["actions"].shape[0] == 16 and len(set(token_counts.tolist())) > 1  # ragged targets
    model = make_model(token_loss=True).train()
    per_sample, outputs = policy_per_sample_loss(model, batch, seed=3, step=0)
    tokens = token_per_sample_loss(outputs.token_losses, batch["labels"], run["fast_range"])
    groups = batch[GROUP_KEYS["episode"]]
    loss = alpha * aggregate(mode, per_sample, groups) + aggregate(mode, tokens["ce"], groups)
    loss.backward()
    reference = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert reference.keys() == run["grads"].keys()
    assert any("language_model.norm" in n for n in reference)  # the backbone's last layer trains (CE only: KI)
    for name, grad in reference.items():
        torch.testing.assert_close(run["grads"][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_evaluation_identical_with_1_and_2_processes(distributed_run, two_datasets, tmp_path):
    from distributed_step import evaluate_split

    single = evaluate_split(str(two_datasets / "a"), str(two_datasets / "b"), str(tmp_path))
    double = distributed_run["eval"]
    keys = [k for k in single if k.startswith("eval_") and "runtime" not in k and "per_second" not in k]
    assert {"eval_loss", "eval_mse", "eval_by_dataset/a/mse", "eval_arm_b::eef/mse", "eval_mixture_mse"} <= set(keys)
    for key in keys:
        assert double[key] == pytest.approx(single[key], rel=1e-6, abs=1e-9), key


def test_gradient_checkpointing_through_training_arguments(two_datasets, tmp_path):
    trainer = _trainer(two_datasets, tmp_path / "gc", max_steps=2, gradient_checkpointing=True)
    trainer.train()
    assert trainer.model.model.gradient_checkpointing and trainer.model.is_gradient_checkpointing
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_step_totals_span_micro_batches():
    totals = StepTotals.from_counts([4, 0, 2, 6], [1, 1, 2, 2])
    assert (totals.num_samples, totals.num_elements, totals.group_counts) == (3, 12.0, {1: 4.0, 2: 8.0})
    part = type("P", (), {"sum": torch.tensor([1.0, 1.0]), "count": torch.tensor([2.0, 6.0])})
    weights = sample_weights("group_mean", part, totals, torch.tensor([2, 2]))
    assert weights.tolist() == pytest.approx([1 / 16, 1 / 16])


# ---- argument validation -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    ({"loss_aggregation": "median"}, "choose one of"),
    ({"loss_aggregation": "constant"}, "finite positive loss_divisor"),
    ({"loss_aggregation": "constant", "loss_divisor": float("inf")}, "finite positive"),
    ({"loss_aggregation": "constant", "loss_divisor": -1.0}, "finite positive"),
    ({"loss_divisor": 2.0}, "only used by loss_aggregation='constant'"),
    ({"loss_group_key": "robot"}, "loss_group_key"),
    ({"freeze": "everything"}, "freeze"),
])
def test_training_arguments_are_validated(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        VLATrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def test_published_defaults(tmp_path):
    args = VLATrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (2.5e-5, 0.9, 0.95, 1e-8)
    assert (args.weight_decay, args.max_grad_norm, args.warmup_steps) == (0.01, 1.0, 1000)
    assert args.lr_scheduler_type == "cosine_with_min_lr" and args.lr_scheduler_kwargs == {"min_lr": 2.5e-6}


# ---- master weights ----------------------------------------------------------------------------------------------
def _bf16_linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4).to(torch.bfloat16)


def test_master_weights_fp32_state_and_bitwise_writeback():
    layer = _bf16_linear()
    optimizer = MasterWeightOptimizer(layer.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    assert isinstance(optimizer, torch.optim.Optimizer)
    for _ in range(3):
        optimizer.zero_grad()
        layer(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
        for param, master in optimizer._pairs():
            assert master.dtype == torch.float32
            assert torch.equal(param, master.to(torch.bfloat16))  # bf16 param == rounded master, bitwise
    for state in optimizer.inner.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_master_weights_clip_on_fp32_and_scheduler_drives_it():
    layer = _bf16_linear()
    optimizer = MasterWeightOptimizer(layer.parameters(), lr=1.0)
    layer(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).sum().mul(100).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in layer.parameters()]))
    norm = optimizer.clip_master_grads(0.5)
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    masters = [m for _, m in optimizer._pairs()]
    assert all(m.grad.dtype == torch.float32 for m in masters)
    assert torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in masters])) == pytest.approx(0.5, rel=1e-5)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=4)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.75)
    layer(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    assert optimizer.inner.param_groups[0]["lr"] == pytest.approx(0.75)  # the inner optimizer follows the scheduler


def test_master_weights_state_dict_restores_masters_exactly():
    layer = _bf16_linear()
    optimizer = MasterWeightOptimizer(layer.parameters(), lr=1e-4)
    for _ in range(5):
        optimizer.zero_grad()
        layer(torch.randn(16, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optimizer.step()
    masters = [m.clone() for _, m in optimizer._pairs()]
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)  # below bf16 resolution
    state = optimizer.state_dict()
    fresh_layer = _bf16_linear(seed=1)
    fresh = MasterWeightOptimizer(fresh_layer.parameters(), lr=1e-4)
    fresh.load_state_dict(state)
    for (param, master), saved in zip(fresh._pairs(), masters):
        assert torch.equal(master, saved)
        assert torch.equal(param, saved.to(torch.bfloat16))


def test_master_weights_are_taken_after_wrapping_and_never_overwrite_parameters():
    """What DDP + accelerate do: the optimizer is built, DDP broadcasts rank 0's weights into the parameters, then
    accelerate round-trips the optimizer through state_dict/load_state_dict. The masters must follow the broadcast
    weights, not overwrite them with the values snapshotted at construction."""
    import copy

    layer = _bf16_linear(seed=0)
    optimizer = MasterWeightOptimizer(layer.parameters(), lr=1e-2)
    broadcast = _bf16_linear(seed=5)
    with torch.no_grad():  # the "broadcast"
        for param, source in zip(layer.parameters(), broadcast.parameters()):
            param.copy_(source)
    optimizer.load_state_dict(optimizer.state_dict())  # accelerate's device-placement round trip
    for param, source in zip(layer.parameters(), broadcast.parameters()):
        assert torch.equal(param, source)
    reference = copy.deepcopy(broadcast)
    reference_optimizer = MasterWeightOptimizer(reference.parameters(), lr=1e-2)  # built after the broadcast
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for module, opt in ((layer, optimizer), (reference, reference_optimizer)):
        module(x).float().sum().backward()
        opt.step()
    for (param, master), (ref_param, ref_master) in zip(optimizer._pairs(), reference_optimizer._pairs()):
        assert torch.equal(param, ref_param) and torch.equal(master, ref_master)
    assert all(p.grad is None for p in layer.parameters())  # the bf16 gradients are freed once upcast


def test_master_weights_converge_where_bf16_adamw_stalls():
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    target_w = torch.randn(16, 1)
    target_w = target_w + 2.5 * target_w.sign()  # |w| >= 2.5: bf16's half-ulp (0.0078) dwarfs a 1e-3 Adam update
    y = x @ target_w

    def run(optimizer_factory):
        torch.manual_seed(1)
        weight = torch.nn.Parameter((target_w + 0.05 * torch.randn(16, 1)).to(torch.bfloat16))
        optimizer = optimizer_factory([weight])
        for _ in range(300):
            optimizer.zero_grad()
            ((x.to(torch.bfloat16) @ weight).float() - y).pow(2).mean().backward()
            optimizer.step()
        return ((x @ weight.float()) - y).pow(2).mean().item()

    start = run(lambda p: torch.optim.SGD(p, lr=0.0))
    plain = run(lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0))
    master = run(lambda p: MasterWeightOptimizer(p, lr=1e-3, weight_decay=0.0))
    assert plain > 0.5 * start  # bf16 state: updates vanish below bf16 resolution
    assert master < 0.1 * start


# ---- trainer end to end ------------------------------------------------------------------------------------------
def _trainer(root, out, max_steps=6, callbacks=(), **kwargs):
    mixture = WeightedDatasetMixture([dict(root=str(root / "a"), name="a", cameras=[CAM], control_mode="joint"),
                                      dict(root=str(root / "b"), name="b", cameras=["front"], control_mode="eef")],
                                     validation_ratio=0.25)
    torch.manual_seed(0)
    config = tiny_pi05_config(chunk_size=6)
    model = PI05ForConditionalGeneration(config)
    processor = PI05Processor.from_config(config, build_tiny_tokenizer(), norm_stats=mixture.norm_stats,
                                          head_names=mixture.head_names)
    defaults = dict(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
                    per_device_eval_batch_size=8, gradient_accumulation_steps=2, logging_steps=1, save_steps=3,
                    report_to=[], learning_rate=1e-3, warmup_steps=1, use_cpu=True, seed=7, disable_tqdm=True,
                    stream_open_blocks=3)
    defaults.update(kwargs)
    args = VLATrainingArguments(**defaults)
    train, validation = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=config.chunk_size)
    return VLATrainer(model, args, train_dataset=train, eval_dataset=validation, data_collator=PI05Collator(processor),
                      processing_class=processor, callbacks=list(callbacks))


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_kill_and_resume_equals_uninterrupted_run_bitwise(two_datasets, tmp_path):
    full = _trainer(two_datasets, tmp_path / "full")
    full.train()
    expected = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    expected_losses = [(h["step"], h["loss"]) for h in full.state.log_history if "loss" in h]

    first = _trainer(two_datasets, tmp_path / "killed", callbacks=[StopAt(3)])
    first.train()
    checkpoint = tmp_path / "killed" / "checkpoint-3"
    saved = json.loads((checkpoint / "stream_state.json").read_text())
    assert saved["batches_consumed"] == 6
    assert (checkpoint / "processor_config.json").exists() and (checkpoint / "optimizer.pt").exists()
    resumed = _trainer(two_datasets, tmp_path / "killed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, expected[name]), name
    losses = [(h["step"], h["loss"]) for h in resumed.state.log_history if "loss" in h]
    assert losses[-3:] == expected_losses[-3:]


def test_master_weights_checkpoint_resume_bf16(two_datasets, tmp_path):
    def bf16_trainer(out, callbacks=()):
        trainer = _trainer(two_datasets, out, callbacks=callbacks)
        trainer.model.to(torch.bfloat16)
        return trainer

    full = bf16_trainer(tmp_path / "full")
    full.train()
    assert isinstance(full._master_optimizer(), MasterWeightOptimizer)
    expected = {n: p.detach().clone() for n, p in full.model.named_parameters()}
    bf16_trainer(tmp_path / "killed", callbacks=[StopAt(3)]).train()
    resumed = bf16_trainer(tmp_path / "killed")
    resumed.train(resume_from_checkpoint=True)
    for name, param in resumed.model.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_evaluation_metrics_by_provenance(two_datasets, tmp_path):
    trainer = _trainer(two_datasets, tmp_path / "eval", max_steps=1, action_metrics_batches=1)
    metrics = trainer.evaluate()
    for key in ("eval_loss", "eval_mse", "eval_arm_a::joint/mse", "eval_arm_b::eef/mse", "eval_by_dataset/a/mse",
                "eval_by_dataset/b/mse", "eval_mixture_mse", "eval_by_dataset/a/action_mse"):
        assert key in metrics and metrics[key] > 0, key
    # Σsum/Σcount, not a mean of means: recompute from the validation stream
    sums, counts = {}, {}
    for batch in trainer.get_eval_dataloader():
        with torch.no_grad():
            trainer.model.eval()
            per_sample, _ = trainer.per_sample_loss(trainer.model, batch, -1)
        for s, total, count in zip(batch["source_index"].tolist(), per_sample.sum, per_sample.count):
            sums[s] = sums.get(s, 0.0) + total.item()
            counts[s] = counts.get(s, 0.0) + count.item()
    assert metrics["eval_by_dataset/a/mse"] == pytest.approx(sums[0] / counts[0], rel=1e-5)
    assert metrics["eval_mse"] == pytest.approx(sum(sums.values()) / sum(counts.values()), rel=1e-5)
    assert metrics["eval_mixture_mse"] == pytest.approx((sums[0] / counts[0] + sums[1] / counts[1]) / 2, rel=1e-5)


def test_freezing(two_datasets, tmp_path):
    trainer = _trainer(two_datasets, tmp_path / "f", max_steps=1, freeze="vlm")
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and not any(".vlm." in n for n in trainable) and any("action_in_proj" in n for n in trainable)
    trainer = _trainer(two_datasets, tmp_path / "g", max_steps=1, freeze="expert_only")
    assert all(n.startswith("model.expert.") for n, p in trainer.model.named_parameters() if p.requires_grad)


def test_wandb_offline_logging(two_datasets, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer = _trainer(two_datasets, tmp_path / "w", max_steps=2, report_to=["wandb"], run_name="hf-vla-test")
    trainer.train()
    import wandb

    wandb.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())


def test_trainer_trains_transformers_pi0_unchanged(two_datasets, tmp_path):
    """The same trainer and objective drive transformers' PI0ForConditionalGeneration (state projected, not prompted)."""
    from transformers import PI0ForConditionalGeneration

    from hf_vla.data import PI0Collator
    from hf_vla.tiny import tiny_pi0_config

    mixture = WeightedDatasetMixture([dict(root=str(two_datasets / "a"), name="a", cameras=[CAM], control_mode="joint"),
                                      dict(root=str(two_datasets / "b"), name="b", cameras=["front", None],
                                           control_mode="eef")], validation_ratio=0.25)
    torch.manual_seed(0)
    config = tiny_pi0_config(chunk_size=6)
    model = PI0ForConditionalGeneration(config)
    from hf_vla.models.pi0_adapter import PI0HeadProcessor

    processor = PI0HeadProcessor.from_config(config, build_tiny_tokenizer(), norm_stats=mixture.norm_stats,
                                             head_names=mixture.head_names)
    collator = PI0Collator(processor)
    args = VLATrainingArguments(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=8,
                                learning_rate=5e-4, warmup_steps=0, logging_steps=5, report_to=[], use_cpu=True,
                                disable_tqdm=True, save_strategy="no", stream_open_blocks=3)
    train, validation = mixture.training_datasets(args, image_size=processor.image_size, chunk_size=config.chunk_size)
    trainer = VLATrainer(model, args, train_dataset=train, eval_dataset=validation, processing_class=processor,
                         data_collator=collator)
    batch = next(iter(trainer.get_train_dataloader()))
    images = (batch["input_ids"] == config.vlm_config.image_token_id).sum(1)
    assert images.tolist() == (batch["pixel_attention_mask"].sum(1) * 16).tolist()  # absent cameras are dropped
    # the trainer's own objective on a fixed batch: pi0 fits it (the objective, collator and model agree)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(40):
        loss = trainer.compute_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0]
    trainer.train()  # and the full training loop runs it, with evaluation by provenance
    metrics = trainer.evaluate()
    assert metrics["eval_by_dataset/a/mse"] > 0 and metrics["eval_by_dataset/b/mse"] > 0


def test_model_card_and_pushed_folder(two_datasets, tmp_path, monkeypatch):
    trainer = _trainer(two_datasets, tmp_path / "card", max_steps=2, eval_strategy="steps", eval_steps=2,
                       action_metrics_batches=1, hub_model_id="org/pi05-toy")
    trainer.train()
    card = trainer.create_model_card(model_name="pi05-toy")
    text = (tmp_path / "card" / "README.md").read_text()
    assert text == str(card) and text.startswith("---\n")
    assert "library_name: transformers" in text and "robotics" in text and "pi05" in text
    for name in ("a", "b"):  # per-dataset eval table with numbers
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |") and "arm" not in line)
        assert any(ch.isdigit() for ch in row), row
    assert "`arm_a::joint`" in text and "loss_aggregation`: sample_mean" in text and "Intended use" in text
    assert "image_augmentation`: none" in text  # how the weights were trained, augmentation included
    assert 'AutoModel.from_pretrained("org/pi05-toy")' in text

    # the pushed folder: what push_to_hub would upload, captured offline
    uploaded = {}

    def fake_upload_folder(**kwargs):
        uploaded.update(kwargs)
        uploaded["files"] = sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())
        return None

    # transformers binds these names at import: replace them where the Trainer looks them up (no network)
    monkeypatch.setattr("transformers.trainer.create_repo", lambda *a, **k: type("R", (), {"repo_id": "org/pi05-toy"})())
    monkeypatch.setattr("transformers.trainer.upload_folder", fake_upload_folder)
    trainer.hub_model_id = "org/pi05-toy"
    trainer.push_to_hub(token="offline")
    files = set(uploaded["files"])
    assert {"README.md", "config.json", "model.safetensors", "processor_config.json", "modeling_pi05.py",
            "configuration_pi05.py"} <= files
    assert uploaded["repo_id"] == "org/pi05-toy"


def test_checkpoint_pushes_carry_code_and_card(two_datasets, tmp_path, monkeypatch):
    pushed = []

    def fake_upload_folder(**kwargs):
        if "path_in_repo" not in kwargs:  # the model folder (not the checkpoint-folder copy)
            pushed.append(sorted(p.name for p in Path(kwargs["folder_path"]).iterdir()))
        return type("Job", (), {"is_done": lambda self: True, "done": lambda self: True})()

    monkeypatch.setattr("transformers.trainer.create_repo", lambda *a, **k: type("R", (), {"repo_id": "org/x"})())
    monkeypatch.setattr("transformers.trainer.upload_folder", fake_upload_folder)
    trainer = _trainer(two_datasets, tmp_path / "hub", max_steps=3, save_steps=3, push_to_hub=True,
                       hub_model_id="org/x", hub_strategy="checkpoint", hub_token="offline")
    trainer.train()
    assert pushed, "no checkpoint push happened"
    assert {"README.md", "modeling_pi05.py", "configuration_pi05.py", "model.safetensors"} <= set(pushed[0])


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE") == "1", reason="needs the network (HF_HUB_OFFLINE=1)")
def test_push_to_hub_network(two_datasets, tmp_path):
    token = os.environ.get("HF_TOKEN")
    if not token:
        pytest.skip("needs HF_TOKEN")
    trainer = _trainer(two_datasets, tmp_path / "push", max_steps=1, push_to_hub=True, hub_private_repo=True)
    trainer.train()
    trainer.push_to_hub()
