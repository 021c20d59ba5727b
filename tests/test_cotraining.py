"""pi0.5's token objective (docs/cotraining.md): the FAST action tokenizer, and the model's target tokens under
knowledge insulation (masks as KI Appendix B, the expert reading stop-gradient backbone keys/values)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.fft import dct, idct

from hf_vla.models.pi05.fast_tokenizer import FASTActionTokenizer, FASTError, dct_matrix


def recorded_chunks(root, chunk_size: int = 50, stride: int = 10) -> np.ndarray:
    """Normalised action chunks of a real recording: q01/q99 per dimension to [-1, 1] (the processor's pi0.5
    normalisation), windows that stay inside one episode."""
    tables = [pq.read_table(path, columns=["actions", "episode_index"]) for path in sorted(root.glob("data/*/*.parquet"))]
    actions = np.concatenate([np.stack(t["actions"].to_numpy(zero_copy_only=False)) for t in tables]).astype(np.float64)
    episodes = np.concatenate([t["episode_index"].to_numpy() for t in tables])
    q01, q99 = np.quantile(actions, [0.01, 0.99], axis=0)
    normalised = 2 * (actions - q01) / np.maximum(q99 - q01, 1e-8) - 1
    starts = [i for i in range(0, len(actions) - chunk_size, stride) if episodes[i] == episodes[i + chunk_size - 1]]
    return np.stack([normalised[i:i + chunk_size] for i in starts])


@pytest.fixture(scope="module")
def chunks(humanoid):
    return recorded_chunks(humanoid)


@pytest.fixture(scope="module")
def fitted(chunks):
    return FASTActionTokenizer.fit(chunks[::2], vocab_size=1024, source="humanoid_teleop_24")


def test_dct_is_scipys_orthonormal_dct():
    x = np.random.default_rng(0).normal(size=(50, 7))
    np.testing.assert_allclose(dct_matrix(50) @ x, dct(x, axis=0, norm="ortho"), atol=1e-12)
    np.testing.assert_allclose(dct_matrix(50).T @ x, idct(x, axis=0, norm="ortho"), atol=1e-12)


def test_round_trip_is_within_the_quantisation_bound_on_recorded_chunks(fitted, chunks):
    """Every value of every held-out chunk (the odd ones; the fit saw the even ones) comes back within 0.5 * sqrt(T) /
    scale (each coefficient is off by at most 0.5 / scale; a unit column of the DCT sums to at most sqrt(T)), and far
    fewer tokens than values are needed."""
    bound = 0.5 * np.sqrt(fitted.chunk_size) / fitted.scale
    held_out = chunks[1::2]
    worst, lengths = 0.0, []
    for chunk in held_out:
        try:
            ids = fitted.encode(chunk)
        except ValueError:  # a coefficient the fit never saw: refused, not silently clipped
            continue
        lengths.append(len(ids))
        assert max(ids) < fitted.vocab_size
        worst = max(worst, float(np.abs(fitted.decode(ids) - chunk).max()))
    assert len(lengths) >= 0.9 * len(held_out)
    assert worst <= bound, (worst, bound)
    assert np.mean(lengths) < 0.5 * fitted.chunk_size * fitted.action_dim  # BPE compresses the coefficients
    assert fitted.malformed == 0
    stats = fitted.stats
    assert len(stats["round_trip_max_error"]) == 34 and max(stats["round_trip_max_error"]) <= bound
    assert stats["tokens_per_chunk_mean"] > 0 and stats["chunks"] == len(chunks[::2])


def test_fit_is_deterministic_and_survives_saving(fitted, chunks, tmp_path):
    again = FASTActionTokenizer.fit(chunks[::2], vocab_size=1024)
    assert again.to_dict() == fitted.to_dict()
    fitted.save_pretrained(tmp_path)
    loaded = FASTActionTokenizer.from_pretrained(tmp_path)
    assert loaded.to_dict() == fitted.to_dict()
    assert loaded.encode(chunks[3]) == fitted.encode(chunks[3])


def test_malformed_sequences_decode_to_zeros_and_are_counted(fitted, chunks):
    tokenizer = FASTActionTokenizer.from_dict(fitted.to_dict())
    ids = tokenizer.encode(chunks[1])
    for broken in (ids[:-1], [], ids + ids[:1]):
        assert not tokenizer.decode(broken).any()
    assert tokenizer.malformed == 3
    assert np.abs(tokenizer.decode(ids) - chunks[1]).max() < 0.5 * np.sqrt(tokenizer.chunk_size) / tokenizer.scale


def test_bad_fits_are_refused_in_one_line(chunks, tmp_path):
    with pytest.raises(FASTError, match=r"FAST fit on humanoid: the quantised coefficients span -?\d+\.\.\d+ "
                                          r"\(\d+ values\), more than vocab_size=64"):
        FASTActionTokenizer.fit(chunks, vocab_size=64, source="humanoid")
    with pytest.raises(FASTError, match="FAST fit on tiny: 2 chunk\\(s\\) are too few"):
        FASTActionTokenizer.fit(chunks[:2], source="tiny")
    bad = chunks[:10].copy()
    bad[3, 4, 5] = np.nan
    with pytest.raises(FASTError, match="NaN or inf"):
        FASTActionTokenizer.fit(bad)
    (tmp_path / "fast_tokenizer.json").write_text('{"chunk_size": 4}')
    with pytest.raises(FASTError, match="not a FAST tokenizer"):
        FASTActionTokenizer.from_pretrained(tmp_path)
    tokenizer = FASTActionTokenizer.fit(chunks[:40] * 0.1)  # fitted on small actions: a large chunk is refused
    with pytest.raises(ValueError, match="outside the fitted range"):
        tokenizer.encode(chunks[0] * 0 + 1.0)


# ---- the model: target tokens behind knowledge insulation -----------------------------------------------------------
def token_model(seed: int = 1, **overrides):
    import torch
    from conftest import randomize_

    from hf_vla import PI05ForConditionalGeneration
    from hf_vla.tiny import tiny_pi05_config

    torch.manual_seed(0)
    return randomize_(PI05ForConditionalGeneration(tiny_pi05_config(token_loss=True, **overrides)), seed=seed)


def token_inputs(config, batch=3, seq=9, targets=6, seed=0):
    """Ragged prompts, a missing camera, ragged targets (-100 after each sample's last one)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    size = config.image_size
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 2:] = False
    cams = torch.ones(batch, 2, dtype=torch.bool)
    cams[0, 1] = False
    labels = torch.randint(4, 400, (batch, targets), generator=g)
    labels[1, 4:] = -100
    labels[2, 1:] = -100
    return dict(input_ids=torch.randint(4, 400, (batch, seq), generator=g), attention_mask=mask,
                pixel_values=torch.rand(batch, 2, 3, size, size, generator=g) * 2 - 1, pixel_attention_mask=cams,
                noise=torch.randn(batch, config.chunk_size, config.max_action_dim, generator=g),
                timestep=torch.rand(batch, generator=g), labels=labels)


def reference_token_logits(model, inputs):
    """float64 oracle: each sample alone, its real prompt tokens and real targets as one contiguous sequence through
    the VLM's plain `GemmaDecoderLayer.forward`, with an explicit mask written from big_vision's rule (prefix ar=0,
    each target ar=1), then the tied LM head; row k predicts target k from the position before it."""
    import copy

    import torch
    from transformers.models.gemma.modeling_gemma import GemmaDecoderLayer

    model = copy.deepcopy(model).double()
    model.set_attn_implementation("eager")
    text = model.model.text_model
    out = []
    for row in range(inputs["input_ids"].shape[0]):
        cams = inputs["pixel_attention_mask"][row]
        images = model.model.embed_prefix(inputs["input_ids"][row:row + 1], inputs["pixel_values"][row:row + 1].double(),
                                          cams[None])[:, : cams.numel() * model.config.num_image_tokens]
        images = images.reshape(cams.numel(), model.config.num_image_tokens, -1)[cams].reshape(1, -1, images.shape[-1])
        prompt = inputs["input_ids"][row][inputs["attention_mask"][row]]
        labels = inputs["labels"][row][inputs["labels"][row] != -100]
        embed = model.model.get_input_embeddings()
        sequence = torch.cat([images, embed(prompt[None]), embed(labels[None])], dim=1)
        length, prefix = sequence.shape[1], sequence.shape[1] - len(labels)
        blocks = torch.tensor([0] * prefix + list(range(1, len(labels) + 1)))
        allowed = blocks[None, :] <= blocks[:, None]
        mask = torch.zeros(1, 1, length, length, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
        positions = torch.arange(length)[None]
        cos_sin = text.rotary_emb(sequence, position_ids=positions)
        hidden = sequence
        for layer in text.layers:
            hidden = GemmaDecoderLayer.forward(layer, hidden, attention_mask=mask, position_embeddings=cos_sin)
        hidden = text.norm(hidden)[0, prefix - 1: length - 1]
        out.append(hidden @ embed.weight.T)
    return out


def test_target_tokens_equal_a_float64_causal_reference_and_leave_the_velocity_alone():
    """Target logits equal the float64 oracle (ragged prompts and targets, a missing camera, both CPU backends); the
    velocity is the one computed without targets (the expert never sees them, the prefix never sees them); a later
    target changes no earlier logit."""
    import torch

    model = token_model().eval()
    inputs = token_inputs(model.config)
    expected = reference_token_logits(model, inputs)
    without = {k: v for k, v in inputs.items() if k != "labels"}
    for backend in ("eager", "sdpa"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            out = model(**inputs, output_token_logits=True)
            plain = model(**without)
        torch.testing.assert_close(out.logits, plain.logits, atol=1e-5, rtol=1e-5)
        assert out.token_logits.shape == (3, 6, model.config.vlm_config.text_config.vocab_size)
        for row, reference in enumerate(expected):
            got = out.token_logits[row, : len(reference)].double()
            torch.testing.assert_close(got, reference, atol=2e-4, rtol=2e-4)
    changed = dict(inputs, labels=inputs["labels"].clone())
    changed["labels"][0, 3] = 7
    with torch.no_grad():
        again = model(**changed, output_token_logits=True).token_logits
    torch.testing.assert_close(again[0, :4], out.token_logits[0, :4], atol=1e-6, rtol=1e-6)  # 0..3 read targets < 3
    assert (again[0, 4] - out.token_logits[0, 4]).abs().max() > 1e-4  # target 4 reads target 3


@pytest.mark.parametrize("chunk", [1, 4, 0])
def test_the_cross_entropy_in_pieces_equals_the_whole_logits(chunk):
    """`token_losses` go through the LM head `token_loss_chunk` targets at a time (recomputed in backward), so a
    257k vocabulary never holds every target's logits: losses and gradients equal the cross-entropy of the whole
    `[B, L_t, vocab]` logits."""
    import torch
    import torch.nn.functional as F

    model = token_model().train()
    model.config.token_loss_chunk = chunk
    inputs = token_inputs(model.config)
    valid = inputs["labels"] != -100
    out = model(**inputs, output_token_logits=True)
    whole = F.cross_entropy(out.token_logits.float().flatten(0, 1), inputs["labels"].masked_fill(~valid, 0).flatten(),
                            reduction="none").view(valid.shape) * valid
    torch.testing.assert_close(out.token_losses, whole, atol=1e-5, rtol=1e-5)
    assert (out.token_losses[~valid] == 0).all() and valid.sum() > 4  # more targets than one piece of 4
    vlm_pieces, _ = _gradients(model, out.token_losses.sum())
    vlm_pieces = {n: g.clone() for n, g in vlm_pieces.items() if g is not None}
    out = model(**inputs, output_token_logits=True)
    whole = F.cross_entropy(out.token_logits.float()[valid], inputs["labels"][valid], reduction="sum")
    vlm_whole, _ = _gradients(model, whole)
    assert vlm_pieces.keys() == {n for n, g in vlm_whole.items() if g is not None}
    for name, grad in vlm_pieces.items():
        torch.testing.assert_close(grad, vlm_whole[name], atol=1e-5, rtol=1e-4, msg=name)


def _gradients(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    vlm = {n: p.grad for n, p in model.named_parameters() if n.startswith("model.vlm.") and p.requires_grad}
    expert = {n: p.grad for n, p in model.named_parameters() if not n.startswith("model.vlm.") and p.requires_grad}
    return vlm, expert


def _moved(grads):
    return [n for n, g in grads.items() if g is not None and g.abs().max() > 0]


@pytest.mark.parametrize("insulated", [True, False])
def test_knowledge_insulation_keeps_the_flow_loss_out_of_the_backbone(insulated):
    """KI: the flow loss's gradient reaches the expert, the action/time heads and nothing of the VLM (vision tower
    included); the token loss reaches the VLM and nothing of the expert. Without insulation the flow loss reaches the
    VLM too. The VLM's last layer and final norm train under the token objective."""

    model = token_model(knowledge_insulation=insulated).train()
    assert all(p.requires_grad for p in model.model.vlm.language_model.norm.parameters())
    inputs = token_inputs(model.config)
    out = model(**inputs)
    vlm, expert = _gradients(model, out.logits.pow(2).mean())
    if insulated:
        assert not _moved(vlm), _moved(vlm)[:5]
    else:
        assert any("vision_tower" in n for n in _moved(vlm)) and any("language_model.layers.0." in n
                                                                      for n in _moved(vlm))
    assert any("expert.layers" in n for n in _moved(expert)) and "action_in_proj.weight" in _moved(expert)
    out = model(**inputs)
    valid = inputs["labels"] != -100
    ce = out.token_losses[valid].mean()  # the cross-entropy as trained: in pieces through the LM head
    vlm, expert = _gradients(model, ce)
    assert not _moved(expert), _moved(expert)[:5]
    moved = _moved(vlm)
    assert any("vision_tower" in n for n in moved) and "model.vlm.language_model.norm.weight" in moved
    last = len(model.model.vlm.language_model.layers) - 1
    assert f"model.vlm.language_model.layers.{last}.mlp.down_proj.weight" in moved


def test_token_objective_refusals_and_a_flow_only_model_unchanged():
    import torch

    from hf_vla import PI05ForConditionalGeneration
    from hf_vla.tiny import tiny_pi05_config

    flow_only = PI05ForConditionalGeneration(tiny_pi05_config())
    inputs = token_inputs(flow_only.config)
    with pytest.raises(ValueError, match="labels \\(target tokens\\) need config.token_loss=True"):
        flow_only(**inputs)
    assert not flow_only.model.vlm.language_model.norm.weight.requires_grad  # frozen: nothing reads it flow-only
    model = token_model().eval()
    with torch.no_grad():
        cache = model.prefix_cache(inputs["input_ids"], inputs["pixel_values"], inputs["pixel_attention_mask"],
                                   inputs["attention_mask"])
        with pytest.raises(ValueError, match="labels need the prefix"):
            model(**{**inputs, "pixel_values": None}, past_key_values=cache)


# ---- training with the token objective ------------------------------------------------------------------------------
def test_training_with_the_token_objective(tmp_path):
    """`token_loss` end to end on a small LeRobot dataset: FAST fitted at start-up on the training chunks, `labels` in
    every batch that decode back to the chunk, the loss = alpha * flow + CE (each sample_mean over its own elements;
    checked against a one-batch computation), CE logged per component and head in training and evaluation, the FAST
    tokenizer saved with the processor and loaded back through AutoProcessor."""
    import json

    import torch
    from test_data import make_dataset
    from test_failures import base_config, write_config
    from transformers import AutoProcessor

    from hf_vla.train import main

    data = make_dataset(tmp_path / "toy", 6)
    out = tmp_path / "out"
    config = base_config(data, out, max_steps=3, token_loss=True, fast_vocab_size=256, flow_loss_weight=2.0,
                         validation_ratio=0.34, eval_strategy="steps", eval_steps=3, save_strategy="steps",
                         save_steps=3)
    trainer = main([str(write_config(tmp_path, config))])
    processor = trainer.processing_class
    fast = processor.fast
    assert fast.chunk_size == 4 and fast.action_dim == 2 and processor.fast_token_range == (475, 475 + 256)
    assert trainer.model.config.token_loss and trainer.model.config.knowledge_insulation
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"ce", "fast_ce", "arm_a::joint/ce", "eval_ce", "eval_fast_ce", "eval_arm_a::joint/fast_ce",
            "eval_by_dataset/toy/fast_ce", "eval_mse"} <= logged, sorted(logged)
    assert "text_ce" not in logged  # no text targets in this data
    saved = json.loads((out / "processor_config.json").read_text())
    assert saved["fast_config"]["vocab_size"] == 256 and saved["fast_token_offset"] == 475
    card = (out / "README.md").read_text()
    assert "| dataset | flow-matching MSE | action MSE (un-normalized) | FAST-token CE | text CE |" in card
    assert "pi0.5's token objective" in card and "knowledge insulation" in card
    assert (out / "fast_tokenizer.py").is_file()  # with processing_pi05.py: loads where hf_vla is not installed
    loaded = AutoProcessor.from_pretrained(out)
    assert loaded.fast.to_dict() == fast.to_dict()

    batch = next(iter(trainer.get_train_dataloader()))
    labels = batch["labels"]
    assert ((labels == -100) | ((labels >= 475) & (labels < 475 + 256))).all()
    bound = 0.5 * 2 / fast.scale  # 0.5 * sqrt(chunk 4) / scale
    for row in range(len(labels)):
        ids = (labels[row][labels[row] != -100] - 475).tolist()
        real = (~batch["action_is_pad"][row]).nonzero().flatten()
        decoded = torch.from_numpy(fast.decode(ids)).float()[real]
        assert (decoded - batch["actions"][row, real]).abs().max() <= bound + 1e-5
    model = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        per_sample, outputs = trainer.per_sample_loss(model, batch, trainer.state.global_step)
        valid = labels != -100
        ce = torch.stack([outputs.token_losses[i][valid[i]].mean() for i in range(len(labels))])
    expected = 2.0 * (per_sample.sum / per_sample.count).mean() + ce.mean()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_token_objective_refusals(tmp_path, capsys):
    from test_data import make_dataset
    from test_failures import base_config, run_fails, write_config

    data = make_dataset(tmp_path / "toy", 6)
    cases = [
        (dict(token_loss=True), "fast_vocab_size=1024: FAST ids 475..1498 do not fit the language model's vocabulary "
                                "of 1024 (475 tokenizer tokens); a FAST vocabulary of at most 549 fits"),
        (dict(token_loss=True, fast_vocab_size=8), "token_loss: FAST fit on the training mixture ['toy']: the "
                                                   "quantised coefficients span"),
        (dict(token_loss=True, fast_tokenizer=str(tmp_path / "none")), "token_loss: FAST tokenizer"),
        (dict(policy="pi0", token_loss=True), "token_loss=True: the token objective needs policy 'pi05'"),
        (dict(flow_loss_weight=-1), "flow_loss_weight=-1"),
        (dict(token_loss=True, lora_preset="expert"), "token_loss with lora_preset='expert' (LoRA on the expert only): "
                                                      "its cross-entropy trains the VLM backbone"),
        (dict(token_loss=True, freeze="vlm"), "token_loss with freeze='vlm'"),
    ]
    for overrides, culprit in cases:
        _, message = run_fails(capsys, write_config(tmp_path, base_config(data, tmp_path / "out", **overrides)))
        assert culprit in message, message


@pytest.mark.slow  # exact resume is the trainer's (default suite); the FAST fit's determinism is tested above
def test_a_resumed_token_objective_run_equals_the_uninterrupted_one(tmp_path):
    """The FAST fit is deterministic, so a run resumed from a checkpoint rebuilds the same targets: its final weights
    are bitwise those of the run that was not interrupted."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from test_data import make_dataset
    from test_failures import base_config, write_config

    from hf_vla.train import main

    data = make_dataset(tmp_path / "toy", 6)
    config = base_config(data, tmp_path / "full", max_steps=4, token_loss=True, fast_vocab_size=256,
                         save_strategy="steps", save_steps=2)
    main([str(write_config(tmp_path, config))])
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", resumed / "checkpoint-2")
    main([str(write_config(tmp_path, config | {"output_dir": str(resumed), "resume_from_checkpoint": True},
                           "resume.json"))])
    expected = load_file(tmp_path / "full" / "model.safetensors")
    for name, tensor in load_file(resumed / "model.safetensors").items():
        assert torch.equal(tensor, expected[name]), name


def _with_subtasks(root, missing_episode=None, as_int=False):
    """Add a per-frame string column `subtask` (first half of an episode "approach", then "retreat") to a toy dataset
    and its info.json; `missing_episode`'s last frame gets none (a null), `as_int` writes integers instead."""
    import json

    import pyarrow as pa

    for path in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        episodes, frames = table["episode_index"].to_numpy(), table["frame_index"].to_numpy()
        lengths = {e: int((episodes == e).sum()) for e in set(episodes.tolist())}
        values = [("approach" if f < lengths[e] // 2 else "retreat") for e, f in zip(episodes, frames)]
        if missing_episode is not None:
            last = int(np.flatnonzero(episodes == missing_episode)[-1])
            values[last] = None
        column = pa.array([len(v or "") for v in values]) if as_int else pa.array(values, type=pa.string())
        pq.write_table(table.append_column("subtask", column), path)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["subtask"] = {"dtype": "int64" if as_int else "string", "shape": [1], "names": None}
    info_path.write_text(json.dumps(info, indent=2))
    return root


def test_text_targets_follow_the_fast_tokens(tmp_path):
    """A dataset's `target_text_key` column (a subtask annotation) becomes text targets after each chunk's FAST tokens
    (then EOS), `text_ce` is logged beside `fast_ce`, and a mixture with a dataset without text trains both (that
    dataset's rows carry FAST targets only)."""
    from test_data import make_dataset
    from test_failures import base_config, write_config

    from hf_vla.train import main

    annotated = _with_subtasks(make_dataset(tmp_path / "toy", 6))
    plain = make_dataset(tmp_path / "plain", 4, robot_type="arm_b")
    config = base_config(annotated, tmp_path / "out", max_steps=2, token_loss=True, fast_vocab_size=256,
                         validation_ratio=0.3, eval_strategy="steps", eval_steps=2)
    config["datasets"] = [config["datasets"][0] | {"target_text_key": "subtask"},
                          {"root": str(plain), "name": "plain", "cameras": config["datasets"][0]["cameras"],
                           "control_mode": "joint"}]
    trainer = main([str(write_config(tmp_path, config))])
    processor = trainer.processing_class
    tokenizer = processor.tokenizer
    eos = tokenizer.eos_token_id
    approach = tokenizer("approach", add_special_tokens=False)["input_ids"]
    retreat = tokenizer("retreat", add_special_tokens=False)["input_ids"]
    first, end = processor.fast_token_range
    seen = {"toy": 0, "plain": 0}
    loader = iter(trainer.get_train_dataloader())
    for _ in range(3):
        batch = next(loader)
        for row, labels in enumerate(batch["labels"].tolist()):
            labels = [t for t in labels if t != -100]
            fast = [t for t in labels if first <= t < end]
            text = labels[len(fast):]
            assert labels[: len(fast)] == fast and fast  # FAST first
            if int(batch["source_index"][row]) == 0:
                assert text in (approach + [eos], retreat + [eos]), text
                seen["toy"] += 1
            else:
                assert text == []
                seen["plain"] += 1
    assert seen["toy"] and seen["plain"]
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"fast_ce", "text_ce", "eval_text_ce", "eval_by_dataset/toy/text_ce", "eval_fast_ce"} <= logged
    assert "eval_by_dataset/plain/text_ce" not in logged


def test_bad_text_targets_are_one_line_at_start_up(tmp_path, capsys):
    from test_data import make_dataset
    from test_failures import base_config, run_fails, write_config

    def fails(root, extra, culprit, code=2, **overrides):  # exit 2: configuration; 1: a fault of the data
        config = base_config(root, tmp_path / "out", fast_vocab_size=256, **overrides)
        config["datasets"][0] |= extra
        _, message = run_fails(capsys, write_config(tmp_path, config), code=code)
        assert culprit in message, message

    missing = _with_subtasks(make_dataset(tmp_path / "missing", 4), missing_episode=2)
    fails(missing, {"target_text_key": "subtask"}, "episode 2 frame 13 has no target text in 'subtask' (1 used row(s)",
          code=1, token_loss=True)
    fails(missing, {"target_text_key": "subtitle"}, "target_text_key 'subtitle' is not a feature", token_loss=True)
    numbers = _with_subtasks(make_dataset(tmp_path / "numbers", 4), as_int=True)
    fails(numbers, {"target_text_key": "subtask"}, "target_text_key 'subtask' is int64; target text must be a string",
          token_loss=True)
    fails(missing, {"target_text_key": "subtask"}, "target_text_key is a target of the token objective; set "
                                                   "token_loss true")


def test_fast_ids_avoid_location_and_text_tokens():
    """With `<loc>` tokens in the vocabulary (the tiny_loc tokenizer, as PaliGemma's), FAST takes the ids just below
    `<loc0000>`: no FAST id is a location token or one of the tokenizer's text tokens, and a location target is one
    token per coordinate. Without them FAST takes the ids after the tokenizer's own; too large a FAST vocabulary is
    refused with how many ids are free."""
    from hf_vla import PI05Processor
    from hf_vla.models.pi05.fast_tokenizer import FASTActionTokenizer
    from hf_vla.tiny import TINY_LOC_VOCAB_SIZE, build_tiny_tokenizer, tiny_pi05_config

    chunks = np.random.default_rng(0).uniform(-1, 1, (64, 5, 6))
    fast = FASTActionTokenizer.fit(chunks, vocab_size=1024)
    located = build_tiny_tokenizer(locations=True)
    processor = PI05Processor.from_config(tiny_pi05_config(), located)
    processor.set_fast_tokenizer(fast, TINY_LOC_VOCAB_SIZE)
    first, end = processor.fast_token_range
    locations = set(located.convert_tokens_to_ids([f"<loc{i:04d}>" for i in range(1024)]))
    text = {i for token, i in located.get_vocab().items() if not token.startswith(("<loc", "<unused"))}
    fast_ids = set(range(first, end))
    assert end == min(locations) and not fast_ids & locations and not fast_ids & text
    assert len(located("<loc0512><loc0300> gripper", add_special_tokens=False)["input_ids"]) == 2 + len(
        located(" gripper", add_special_tokens=False)["input_ids"])
    plain = PI05Processor.from_config(tiny_pi05_config(), build_tiny_tokenizer())
    with pytest.raises(ValueError, match="a FAST vocabulary of at most 549 fits"):
        plain.set_fast_tokenizer(fast, 1024)
    small = FASTActionTokenizer.fit(chunks, vocab_size=512)
    plain.set_fast_tokenizer(small, 1024)
    assert plain.fast_token_range == (475, 987)


@pytest.mark.slow  # LoRA, bf16 masters and EMA each have their own tests; this is their combination with the CE
def test_token_objective_with_lora_bf16_and_ema(tmp_path):
    """LoRA (all_linear: the VLM's layers, last one included, and the expert), a bf16 model with fp32 masters and an
    EMA train with the token loss: the VLM's adapters move (the CE reaches them through knowledge insulation), the
    merged output keeps token_loss and its FAST tokenizer."""
    import json

    import torch
    from test_data import make_dataset
    from test_failures import base_config, write_config

    from hf_vla.train import main

    data = make_dataset(tmp_path / "toy", 6)
    out = tmp_path / "out"
    config = base_config(data, out, max_steps=2, token_loss=True, fast_vocab_size=256, lora_preset="all_linear",
                         lora_r=4, dtype="bfloat16", ema_decay=0.5)
    trainer = main([str(write_config(tmp_path, config))])
    model = trainer.model
    last = len(model.get_base_model().model.vlm.language_model.layers) - 1
    adapters = {n: p for n, p in model.named_parameters() if "lora_B" in n and "language_model" in n}
    assert any(f"layers.{last}.mlp" in n for n in adapters)  # the last VLM layer runs, so it is adapted
    assert any(p.float().abs().max() > 0 for p in adapters.values())  # lora_B starts at 0: the CE moved them
    assert json.loads((out / "config.json").read_text())["token_loss"] is True
    assert json.loads((out / "processor_config.json").read_text())["fast_config"]["vocab_size"] == 256
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


def test_zero3_gathers_the_tied_head_with_the_model():
    """Under ZeRO-3 the LM head (the input embedding's weight, read in the model's forward outside the embedding
    module) is registered as the model's external parameter, so DeepSpeed gathers it for the model's forward and
    backward (tests/test_engines.py runs it with every parameter partitioned); not under ZeRO-2 nor flow-only."""
    from types import SimpleNamespace

    pytest.importorskip("deepspeed")
    from hf_vla.training.engines import _register_zero3_token_head

    def args(stage):
        return SimpleNamespace(deepspeed={"zero_optimization": {"stage": stage,
                                                               "stage3_param_persistence_threshold": 0}})

    def external(model):
        return [p for _, p in model.ds_external_parameters()] if hasattr(model, "_external_params") else []

    model = token_model()
    _register_zero3_token_head(model, args(2))
    assert external(model) == []
    _register_zero3_token_head(model, args(3))
    assert len(external(model)) == 1 and external(model)[0] is model.get_input_embeddings().weight
    flow = token_model()
    flow.config.token_loss = False
    _register_zero3_token_head(flow, args(3))
    assert external(flow) == []
