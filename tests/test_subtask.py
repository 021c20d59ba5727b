"""pi0.5's high-level inference (docs/subtasks.md): the subtask decoded with the VLM's cache equals a decode that
recomputes the whole prefix for every token (the training forward is that recomputation), under eager and sdpa
attention; acting on a decoded subtask equals acting on the same tokens given; the expert attends to the subtask; a
model without subtask training refuses to decode one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import randomize_

from hf_vla.models.pi05 import PI05ForConditionalGeneration
from hf_vla.tiny import tiny_pi05_config

EOS = 1
BACKENDS = ("eager", "sdpa")


def subtask_model(backend="eager", **overrides):
    torch.manual_seed(0)
    config = tiny_pi05_config(**({"subtask_layout": "joint", "subtask_eos_token_id": EOS, "subtask_max_tokens": 6}
                                 | overrides))
    model = randomize_(PI05ForConditionalGeneration(config), seed=1).eval()
    model.set_attn_implementation(backend)
    return model


def prompt_inputs(config, batch=3, seq=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[1, 6:] = False  # ragged prompts: the decode starts after each row's own last token
    mask[2, 3:] = False
    cams = torch.ones(batch, 2, dtype=torch.bool)
    cams[0, 1] = False
    size = config.image_size
    return dict(input_ids=torch.randint(4, 400, (batch, seq), generator=g), attention_mask=mask,
                pixel_values=torch.rand(batch, 2, 3, size, size, generator=g) * 2 - 1, pixel_attention_mask=cams)


def recomputed_decode(model, inputs, steps: int) -> tuple[list[list[int]], list[list[float]]]:
    """The oracle: each next token (and its log-probability) from a full forward over the prompt and the tokens so
    far, no cache."""
    rows, scores = [], []
    for row in range(inputs["input_ids"].shape[0]):
        one = {k: v[row:row + 1] for k, v in inputs.items()}
        tokens, logps = [], []
        for _ in range(steps):
            labels = torch.tensor([tokens + [0]])  # the slot after the tokens so far: its logits predict the next
            with torch.no_grad():
                out = model(**one, noise=torch.zeros(1, model.config.chunk_size, model.config.max_action_dim),
                            timestep=torch.ones(1), subtask_ids=labels, output_token_logits=True)
            logits = out.token_logits[0, len(tokens)].float().log_softmax(-1)
            tokens.append(int(logits.argmax()))
            logps.append(float(logits.max()))
            if tokens[-1] == EOS:
                break
        rows.append(tokens)
        scores.append(logps)
    return rows, scores


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decode_equals_the_recomputed_decode(backend):
    model = subtask_model(backend)
    inputs = prompt_inputs(model.config)
    decoded = model.generate_subtask(**inputs)
    cached = [row[mask].tolist() for row, mask in zip(decoded.ids, decoded.mask)]
    tokens, log_probs = recomputed_decode(model, inputs, model.config.subtask_max_tokens)
    assert cached == tokens
    assert all(1 <= len(row) <= model.config.subtask_max_tokens for row in cached)
    for row, (scores, mask) in enumerate(zip(decoded.log_probs, decoded.mask)):  # the same numbers, not just argmax
        torch.testing.assert_close(scores[mask], torch.tensor(log_probs[row]), rtol=0, atol=1e-5)


def test_decode_stops_at_eos_and_keeps_it():
    model = subtask_model()
    inputs = prompt_inputs(model.config)
    # make EOS the likeliest token after the second decoded one: rows stop there, EOS kept in their span
    first = model.generate_subtask(**inputs)
    embedding = model.model.get_input_embeddings().weight
    with torch.no_grad():
        embedding[EOS] = embedding[first.ids[:, 1]].mean(0) * 50
    decoded = model.generate_subtask(**inputs)
    for row, mask in zip(decoded.ids, decoded.mask):
        tokens = row[mask].tolist()
        assert tokens[-1] == EOS and EOS not in tokens[:-1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_acting_on_a_decoded_subtask_equals_acting_on_its_tokens_given(backend):
    model = subtask_model(backend)
    inputs = prompt_inputs(model.config)
    noise = torch.randn(3, model.config.chunk_size, model.config.max_action_dim, generator=torch.Generator().manual_seed(3))
    decoded = model.generate_subtask(**inputs)
    reused = model.sample_actions(**inputs, noise=noise, subtask=decoded)
    given = model.sample_actions(**inputs, noise=noise, subtask_ids=decoded.ids, subtask_mask=decoded.mask)
    auto = model.sample_actions(**inputs, noise=noise, subtask="auto")
    torch.testing.assert_close(reused, given, rtol=0, atol=1e-5)
    torch.testing.assert_close(auto, given, rtol=0, atol=1e-5)
    plain = model.sample_actions(**inputs, noise=noise)
    assert (plain - given).abs().max() > 1e-3  # the expert reads the subtask


def test_the_training_forward_conditions_the_velocity_on_the_subtask_and_predicts_it():
    model = subtask_model()
    inputs = prompt_inputs(model.config) | dict(
        noise=torch.randn(3, model.config.chunk_size, model.config.max_action_dim), timestep=torch.rand(3))
    ids = torch.tensor([[5, 6, EOS, 0], [7, EOS, 0, 0], [0, 0, 0, 0]])
    mask = ids != 0
    mask[2] = False  # the third row has no subtask (dropped): it acts on its prompt alone
    out = model(**inputs, subtask_ids=ids, subtask_mask=mask)
    assert out.token_losses.shape == (3, 4) and (out.token_losses[~mask] == 0).all()
    assert (out.token_losses[mask] > 0).all()
    other = model(**inputs, subtask_ids=torch.where(mask, ids + 10, ids), subtask_mask=mask)
    changed = (other.logits - out.logits).abs().amax(dim=(1, 2))
    assert changed[0] > 1e-4 and changed[1] > 1e-4 and changed[2] == 0
    plain = model(**inputs)  # a row without a subtask computes what it computes without the span
    torch.testing.assert_close(out.logits[2], plain.logits[2], rtol=0, atol=1e-5)


def test_a_model_without_subtask_training_refuses_to_decode():
    torch.manual_seed(0)
    model = PI05ForConditionalGeneration(tiny_pi05_config()).eval()
    inputs = prompt_inputs(model.config)
    with pytest.raises(ValueError, match="not trained to predict subtasks"):
        model.generate_subtask(**inputs)
    with pytest.raises(ValueError, match="not trained to predict subtasks"):
        model.sample_actions(**inputs, subtask="auto")


def subtask_processor(tokenizer, config, layout="joint"):
    from hf_vla.models.pi05 import PI05Processor

    stats = {"state": {"q01": [-1.0] * 3, "q99": [1.0] * 3}, "actions": {"q01": [-1.0] * 2, "q99": [1.0] * 2}}
    processor = PI05Processor.from_config(config, tokenizer, norm_stats={"arm": stats})
    processor.subtask_layout = layout
    return processor


def test_a_given_subtask_acts_as_the_prompt_built_by_hand(tiny_tokenizer):
    """The processor's prompt and subtask tokens are exactly the documented strings: `Task: {task}, State: {bins};\\n
    Subtask: ` then the subtask's tokens and EOS (docs/subtasks.md)."""
    model = subtask_model(subtask_eos_token_id=tiny_tokenizer.eos_token_id)
    processor = subtask_processor(tiny_tokenizer, model.config)
    images = torch.rand(2, 1, 3, 16, 16)
    state = torch.tensor([[0.1, -0.5, 0.9], [0.0, 0.2, -0.3]])
    inputs = processor(images=images, text=["stack the cups", "open the drawer"], state=state, head="arm",
                       subtask=["pick up the red cup", None])
    bins = [" ".join(map(str, processor.discretize_state(processor.normalize(s, "state", "arm")).tolist())) for s in state]
    by_hand = tiny_tokenizer([f"Task: stack the cups, State: {bins[0]};\nSubtask: ",
                              f"Task: open the drawer, State: {bins[1]};\nAction: "], padding="max_length",
                             truncation=True, max_length=processor.prompt_max_length, return_tensors="pt")
    assert torch.equal(inputs["input_ids"], by_hand["input_ids"])
    words = tiny_tokenizer("pick up the red cup", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert inputs["subtask_ids"][0, : len(words)].tolist() == words and inputs["subtask_mask"][0].sum() == len(words)
    assert not inputs["subtask_mask"][1].any()
    noise = torch.randn(2, model.config.chunk_size, model.config.max_action_dim)
    model_inputs = {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask",
                                           "subtask_ids", "subtask_mask")}
    acted = model.sample_actions(**model_inputs, noise=noise)
    hand = model.sample_actions(input_ids=by_hand["input_ids"], attention_mask=by_hand["attention_mask"].bool(),
                                pixel_values=inputs["pixel_values"], pixel_attention_mask=inputs["pixel_attention_mask"],
                                subtask_ids=torch.tensor([words, [0] * len(words)]),
                                subtask_mask=torch.tensor([[True] * len(words), [False] * len(words)]), noise=noise)
    torch.testing.assert_close(acted, hand, rtol=0, atol=1e-6)
    # "auto": the prompt asks for the subtask; the decoded tokens read back as text
    auto = processor(images=images, text=["stack the cups", "open the drawer"], state=state, head="arm", subtask="auto")
    assert "subtask_ids" not in auto
    decoded = model.generate_subtask(**{k: auto[k] for k in ("input_ids", "attention_mask", "pixel_values",
                                                             "pixel_attention_mask")})
    texts = processor.decode_subtask(decoded.ids, decoded.mask)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)


def test_the_processor_of_a_policy_without_subtasks_refuses_one(tiny_tokenizer):
    processor = subtask_processor(tiny_tokenizer, tiny_pi05_config(), layout=None)
    with pytest.raises(ValueError, match="not trained with subtasks"):
        processor(images=torch.rand(1, 1, 3, 16, 16), text="t", state=torch.zeros(1, 3), head="arm", subtask="auto")


def test_factorised_prompts_put_the_subtask_in_the_tasks_place(tiny_tokenizer):
    processor = subtask_processor(tiny_tokenizer, tiny_pi05_config(subtask_layout="factorised"), layout="factorised")
    state = torch.zeros(2, 3)
    low = processor(text=["stack the cups", "stack the cups"], state=state, head="arm", subtask=["grasp the cup", None])
    plain = processor(text=["grasp the cup", "stack the cups"], state=state, head="arm")
    assert torch.equal(low["input_ids"], plain["input_ids"]) and "subtask_ids" not in low
    high = processor(text=["stack the cups"], state=state[:1], head="arm", subtask="auto")
    assert tiny_tokenizer.decode(high["input_ids"][0][high["attention_mask"][0]]).rstrip().endswith("Subtask:")


def _with_language_persistent(root):
    """lerobot's `language_persistent` column (as `lerobot-annotate` writes it on its pi052 branch): every frame of an
    episode carries the episode's rows; the subtask row "approach" from t=0, "retreat" from half the episode."""
    import json

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    row_type = pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string()),
                          pa.field("style", pa.string()), pa.field("timestamp", pa.float32()),
                          pa.field("camera", pa.string())])
    for path in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        episodes, times = table["episode_index"].to_numpy(), table["timestamp"].to_numpy()
        rows = []
        for episode in episodes:
            span = times[episodes == episode]
            middle = float(span[len(span) // 2])
            rows.append([{"role": "assistant", "content": "approach", "style": "subtask", "timestamp": 0.0, "camera": None},
                         {"role": "assistant", "content": "retreat", "style": "subtask", "timestamp": middle, "camera": None},
                         {"role": "assistant", "content": "remember the cup", "style": "memory", "timestamp": 0.0,
                          "camera": None}])
        pq.write_table(table.append_column("language_persistent", pa.array(rows, type=pa.list_(row_type))), path)
        assert np.all(np.diff(times[episodes == episodes[0]]) > 0)
    info_path = root / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["features"]["language_persistent"] = {"dtype": "language", "shape": [1], "names": None}
    info_path.write_text(json.dumps(info, indent=2))
    return root


@pytest.mark.parametrize("annotation", ["column", "language_persistent"])
def test_training_on_annotated_subtasks_predicts_and_acts_on_them(tmp_path, annotation):
    """A dataset's `subtask_key` trains the subtask after the prompt (teacher forcing, dropout leaving some rows
    without); the evaluation reports its CE and the exact-match accuracy of the greedy decode per dataset; the saved
    checkpoint decodes one and records the layout in its contract."""
    from test_cotraining import _with_subtasks
    from test_data import make_dataset
    from test_failures import base_config, write_config

    from hf_vla.train import main

    data = make_dataset(tmp_path / "toy", 6)
    data = _with_subtasks(data) if annotation == "column" else _with_language_persistent(data)
    key = "subtask" if annotation == "column" else "language_persistent"
    config = base_config(data, tmp_path / "out", max_steps=3, subtask_layout="joint", subtask_dropout=0.3,
                         validation_ratio=0.3, eval_strategy="steps", eval_steps=3, save_strategy="no")
    config["datasets"][0] |= {"subtask_key": key}
    trainer = main([str(write_config(tmp_path, config))])
    processor, tokenizer = trainer.processing_class, trainer.processing_class.tokenizer
    words = {text: tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
             for text in ("approach", "retreat")}
    loader, dropped, kept = iter(trainer.get_train_dataloader()), 0, 0
    for _ in range(4):
        batch = next(loader)
        for ids, mask, prompt in zip(batch["subtask_ids"], batch["subtask_mask"], batch["input_ids"]):
            text = tokenizer.decode(prompt[prompt != tokenizer.pad_token_id])
            if mask.any():
                assert ids[mask].tolist() in words.values() and text.rstrip().endswith("Subtask:")
                kept += 1
            else:
                assert text.rstrip().endswith("Action:")  # dropped: the plain prompt
                dropped += 1
    assert kept and dropped
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"subtask_ce", "eval_subtask_ce", "eval_subtask_accuracy", "eval_by_dataset/toy/subtask_accuracy",
            "eval_by_dataset/toy/subtask_ce"} <= logged, sorted(logged)
    out = tmp_path / "out"
    import json

    assert json.loads((out / "deployment_config.json").read_text())["subtask"] == {"layout": "joint", "every_chunks": 1}
    from transformers import AutoModel, AutoProcessor

    model, processor = AutoModel.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out)
    assert model.config.subtask_eos_token_id == tokenizer.eos_token_id and processor.subtask_layout == "joint"
    inputs = processor(images=torch.rand(1, 1, 3, 48, 64), text="reach target 0", state=torch.zeros(1, 3),
                       subtask="auto")
    decoded = model.generate_subtask(**{k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values",
                                                                "pixel_attention_mask")})
    assert isinstance(processor.decode_subtask(decoded.ids, decoded.mask)[0], str)


def test_subtask_settings_are_refused_in_one_line(tmp_path, capsys):
    from test_cotraining import _with_subtasks
    from test_data import make_dataset
    from test_failures import base_config, run_fails, write_config

    data = _with_subtasks(make_dataset(tmp_path / "toy", 4))
    plain = base_config(data, tmp_path / "out")
    code, message = run_fails(capsys, write_config(tmp_path, plain | {"subtask_layout": "joint"}))
    assert code == 2 and "no dataset names its subtasks" in message
    annotated = base_config(data, tmp_path / "out2")
    annotated["datasets"][0] |= {"subtask_key": "subtask"}
    code, message = run_fails(capsys, write_config(tmp_path, annotated, "a.json"))
    assert code == 2 and "set subtask_layout 'joint'" in message
    frozen = annotated | {"subtask_layout": "joint", "freeze": "vlm"}
    code, message = run_fails(capsys, write_config(tmp_path, frozen, "c.json"))
    assert code == 2 and "subtask_layout='joint' with freeze='vlm'" in message
    annotated["datasets"][0] |= {"subtask_key": "nope"}
    code, message = run_fails(capsys, write_config(tmp_path, annotated | {"subtask_layout": "joint"}, "b.json"))
    assert code == 2 and "subtask_key 'nope' is not a feature" in message


# ---- the runner, the episode loop and the server (one implementation) ---------------------------------------------
@pytest.fixture(scope="module")
def subtask_checkpoint(tmp_path_factory, tiny_tokenizer):
    """The demo's architecture trained with subtasks (random weights), on ColorReach's observations."""
    return _subtask_checkpoint(tmp_path_factory, tiny_tokenizer, "joint")


@pytest.fixture(scope="module")
def factorised_checkpoint(tmp_path_factory, tiny_tokenizer):
    return _subtask_checkpoint(tmp_path_factory, tiny_tokenizer, "factorised")


def _subtask_checkpoint(tmp_path_factory, tiny_tokenizer, layout):
    import json

    from conftest import REPO

    from hf_vla.models.pi05 import PI05Config, PI05Processor

    settings = json.loads((REPO / "hf_vla" / "configs" / "demo.json").read_text())["model_config"]
    config = PI05Config(**(settings | {"subtask_layout": layout, "subtask_eos_token_id": tiny_tokenizer.eos_token_id,
                                       "tokenizer_max_length": 24,  # the prompt and its "Subtask: " marker
                                       "subtask_max_tokens": 5}))
    model = randomize_(PI05ForConditionalGeneration(config), seed=3, scale=0.2).eval()
    head = "color_reach::delta_xy"
    stats = {head: {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]},
                    "actions": {"q01": [-0.1, -0.1], "q99": [0.1, 0.1]}}}
    processor = PI05Processor.from_config(model.config, tiny_tokenizer, norm_stats=stats, head_names=[head])
    from hf_vla.deployment.contract import DeploymentConfig

    processor.deployment = DeploymentConfig(policy="pi05", chunk_size=config.chunk_size, n_action_steps=4,
                                            image_size=processor.image_size,
                                            heads={head: {"cameras": [{"key": "observation.image", "height": 32,
                                                                       "width": 32}]}},
                                            subtask={"layout": layout, "every_chunks": 2}).to_dict()
    path = tmp_path_factory.mktemp(f"subtask_policy_{layout}")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def reach_observation(seed=0):
    import gymnasium as gym

    import hf_vla.envs  # noqa: F401  (registers ColorReach)

    observation, info = gym.make("hf_vla/ColorReach-v0").reset(seed=seed)
    return observation, info["task"]


def test_the_runner_decodes_every_k_chunks_and_acts_on_a_given_text(subtask_checkpoint):
    from hf_vla.serving.policy import load_policy

    runner = load_policy(subtask_checkpoint, seed=0)
    assert runner.subtask == "auto" and runner.subtask_every == 2  # from the checkpoint's contract
    observation, task = reach_observation()
    decodes = []
    model = runner.model
    original = model.generate_subtask

    def counted(*args, **kwargs):
        decodes.append(1)
        return original(*args, **kwargs)

    model.generate_subtask = counted
    for _ in range(3):
        runner(observation, task)
        assert isinstance(runner.last_subtask, str)
    assert len(decodes) == 2  # chunks 1 and 3 decode; chunk 2 acts on chunk 1's subtask
    runner.reset(seed=0)
    given = runner.prepare(observation, task, subtask="push the red block")
    assert not given.decode_subtask and "subtask_ids" in given.inputs
    runner.finish(given, runner.sample_batch([given])[0])
    assert runner.last_subtask == "push the red block"
    # acting on a decoded text given back equals acting on the decode (the cache re-used is exact)
    runner.reset(seed=7)
    decoded = runner(observation, task)
    text = runner.last_subtask
    runner.reset(seed=7)
    again = runner.prepare(observation, task, subtask=text)
    chunk = runner.finish(again, runner.sample_batch([again])[0])
    assert runner.last_subtask == text
    assert chunk.shape == decoded.shape and np.isfinite(chunk).all()


def test_a_policy_without_subtasks_refuses_a_subtask_request(tmp_path, tiny_tokenizer):
    from hf_vla.models.pi05 import PI05Processor
    from hf_vla.serving.policy import PolicyRunner, RequestError

    model = PI05ForConditionalGeneration(tiny_pi05_config()).eval()
    stats = {"arm": {"state": {"q01": [-1.0] * 2, "q99": [1.0] * 2}, "actions": {"q01": [-1.0] * 2, "q99": [1.0] * 2}}}
    runner = PolicyRunner(model, PI05Processor.from_config(model.config, tiny_tokenizer, norm_stats=stats))
    assert runner.subtask is None
    observation, task = reach_observation()
    with pytest.raises(RequestError, match="not trained with subtasks"):
        runner.prepare(observation, task, subtask="auto")


def test_the_episode_loop_logs_each_episodes_subtasks(subtask_checkpoint, tmp_path):
    import gymnasium as gym

    from hf_vla.evaluation.runner import run_episodes
    from hf_vla.serving.policy import load_policy

    runner = load_policy(subtask_checkpoint, seed=0)
    result = run_episodes(gym.make("hf_vla/ColorReach-v0", max_episode_steps=12), runner, [3, 4], 4, save_videos=1,
                          output_dir=tmp_path, progress=False)
    for record in result.episode_records:
        steps = [step for step, _ in record["subtasks"]]
        assert steps[0] == 0 and steps == sorted(steps) and all(isinstance(t, str) for _, t in record["subtasks"])
    assert result.videos and (tmp_path / result.videos[0].split("/")[-1]).is_file()


def test_the_server_decodes_per_session_and_takes_a_requests_subtask(subtask_checkpoint):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from test_serve import Server

    running = Server("--checkpoint", str(subtask_checkpoint), "--seed", "5")
    try:
        first, second = WebsocketClientPolicy(running.uri), WebsocketClientPolicy(running.uri)
        assert first.get_server_metadata()["subtask"] == {"layout": "joint", "default": "auto", "every_chunks": 2}
        observation, task = reach_observation()
        decoded = first.infer({**observation, "prompt": task})
        assert isinstance(decoded["subtask"], str)
        given = second.infer({**observation, "prompt": task, "subtask": "grasp the red cube"})
        assert given["subtask"] == "grasp the red cube"
        assert first.infer({**observation, "prompt": task})["subtask"] == decoded["subtask"]  # its own, kept
    finally:
        log = running.stop()
    assert "Traceback" not in log, log[-3000:]


# ---- subtasks recorded from the scripted expert's own decisions -------------------------------------------------------
def test_metaworld_recordings_carry_the_experts_stage_per_frame(tmp_path):
    """`hf_vla.record` writes each frame's `subtask`: the branch of the expert's `_desired_pos` that ran. On recorded
    (successful) episodes of three tasks the stages come in the expert's order and the last one is its final stage."""
    import pyarrow.parquet as pq

    from hf_vla.envs.expert_stages import STAGES, stage_order
    from hf_vla.envs.recording import RecordArguments, record

    tasks = ("pick-place-v3", "assembly-v3", "hammer-v3")
    out = tmp_path / "staged"
    record(RecordArguments(env="metaworld", output=out, episodes=1, task=",".join(tasks), image_size=32), progress=False)
    table = pq.read_table(sorted((out / "data").rglob("*.parquet"))).to_pandas()
    assert table["subtask"].notna().all()
    for _, episode in table.groupby("episode_index"):
        texts = episode.sort_values("frame_index")["subtask"].tolist()
        task = next(name for name in tasks if texts[0] in {words for words, _ in STAGES[name]})
        orders = [stage_order(task, text) for text in texts]
        assert None not in orders and orders == sorted(orders), (task, texts)
        assert orders[-1] == len(STAGES[task]) - 1 and orders[0] == 0


def test_evaluate_logs_the_decoded_subtasks_and_refuses_an_oracle_without_stages(subtask_checkpoint, tmp_path):
    import json

    from hf_vla.errors import VLAError
    from hf_vla.evaluation.arguments import EvaluateArguments
    from hf_vla.evaluation.runner import evaluate_checkpoint

    common = dict(env="hf_vla/ColorReach-v0", episodes=2, save_videos=1, device="cpu", n_action_steps=4,
                  max_episode_steps=10, num_envs=1)
    result = evaluate_checkpoint(EvaluateArguments(str(subtask_checkpoint), output_dir=str(tmp_path / "auto"),
                                                   **common), progress=False)
    saved = json.loads((tmp_path / "auto" / "eval_result.json").read_text())
    assert all(isinstance(e["subtasks"][0][1], str) for e in saved["episode_records"])
    assert result.subtask_accuracy is None  # ColorReach's expert has no stages to check against
    plain = evaluate_checkpoint(EvaluateArguments(str(subtask_checkpoint), output_dir=str(tmp_path / "none"),
                                                  subtask="none", **common), progress=False)
    assert all("subtasks" not in e for e in plain.episode_records)
    with pytest.raises(VLAError, match="oracle: acts on the env expert.s stage; env .hf_vla/ColorReach-v0. has none"):
        evaluate_checkpoint(EvaluateArguments(str(subtask_checkpoint), output_dir=str(tmp_path / "oracle"),
                                              subtask="oracle", **common), progress=False)


def test_factorised_training_mixes_high_and_low_level_samples(tmp_path):
    """lerobot's blend: an annotated sample is high-level (the prompt asks for the subtask, its tokens are the target,
    no flow loss) or low-level (the subtask in the task's place, the flow loss), drawn per sample."""
    from test_cotraining import _with_subtasks
    from test_data import make_dataset
    from test_failures import base_config, write_config

    from hf_vla.train import main

    data = _with_subtasks(make_dataset(tmp_path / "toy", 6))
    config = base_config(data, tmp_path / "out", max_steps=2, subtask_layout="factorised", subtask_dropout=0.0,
                         validation_ratio=0.3, eval_strategy="steps", eval_steps=2)
    config["datasets"][0] |= {"subtask_key": "subtask"}
    trainer = main([str(write_config(tmp_path, config))])
    tokenizer = trainer.processing_class.tokenizer
    high = low = 0
    loader = iter(trainer.get_train_dataloader())
    for _ in range(4):
        batch = next(loader)
        for row, prompt in enumerate(batch["input_ids"]):
            text = tokenizer.decode(prompt[prompt != tokenizer.pad_token_id])
            if "subtask_mask" in batch and batch["subtask_mask"][row].any():
                assert text.rstrip().endswith("Subtask:") and batch["action_is_pad"][row].all()
                high += 1
            else:
                assert text.startswith(("Task: approach", "Task: retreat")) and text.rstrip().endswith("Action:")
                low += 1
    assert high and low and high < low
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"eval_subtask_ce", "eval_subtask_accuracy"} <= logged


def test_the_factorised_runner_acts_on_a_second_prompt_with_the_decoded_subtask(factorised_checkpoint):
    from hf_vla.serving.policy import load_policy

    runner = load_policy(factorised_checkpoint, seed=0)
    observation, task = reach_observation()
    chunk = runner(observation, task)
    text = runner.last_subtask
    assert isinstance(text, str)
    runner.reset(seed=0)
    again = runner.prepare(observation, task, subtask=text or task)  # the same text given: the same second prompt
    assert not again.decode_subtask and "subtask_ids" not in again.inputs
    np.testing.assert_allclose(runner.finish(again, runner.sample_batch([again])[0]), chunk, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["joint", "factorised"])
def test_rl_rollouts_decode_and_the_update_recomputes_their_chains(layout, subtask_checkpoint, factorised_checkpoint):
    """RL's stochastic policy decodes the subtask where the runner would; each transition keeps the inputs it acted
    on (the subtask's tokens padded to `subtask_max_tokens`), from which the update recomputes the same chain means."""
    from hf_vla.hub.resolve import load_pretrained
    from hf_vla.rl import RolloutEngine, StochasticPolicy
    from hf_vla.rl.flow import FlowSDE, chain_means

    model, processor = load_pretrained(str(subtask_checkpoint if layout == "joint" else factorised_checkpoint))
    policy = StochasticPolicy(model=model.eval(), processor=processor, head="color_reach::delta_xy",
                              sde=FlowSDE(4, 0.5), n_action_steps=2, action_dims=2)
    engine = RolloutEngine("hf_vla/ColorReach-v0", [None], 1, {"max_episode_steps": 6}, 2, 8)
    try:
        episodes, transitions = engine.run(policy, {None: [0, 1]}, {None: [10, 11]})
    finally:
        engine.close()
    assert all(isinstance(e.subtasks[0][1], str) for e in episodes[None])
    inputs = {key: torch.cat([t.inputs[key] for t in transitions]) for key in transitions[0].inputs}
    if layout == "joint":
        assert inputs["subtask_ids"].shape[1] == model.config.subtask_max_tokens
    else:
        assert "subtask_ids" not in inputs  # the decoded subtask is in the second prompt, in the task's place
    chains = torch.stack([t.chain for t in transitions])
    with torch.no_grad():
        means = chain_means(model, inputs, chains, policy.sde)
    torch.testing.assert_close(means, torch.stack([t.means for t in transitions]), rtol=1e-4, atol=1e-4)
