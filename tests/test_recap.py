"""RECAP (pi*0.6's learning from experience, #94): returns, value bins, advantages and thresholds against float64
computations written here; the advantage indicator in pi0.5's prompt; classifier-free guidance against two separate
forwards; the indicator's dropout in the episode-shuffle stream."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import randomize_

from hf_vla.data.stream import StreamSettings
from hf_vla.recap import advantages, bin_centers, episode_returns, hl_gauss_targets, positive_threshold, value_to_bin


# ---- the arithmetic -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cost", [None, 1000.0])
@pytest.mark.parametrize("success", [True, False])
def test_returns_against_a_float64_sum_of_rewards(success, cost):
    """The sum of the rewards from each frame, over the episode limit plus the failure cost (default: the limit)."""
    length, limit = 37, 50
    paid = limit if cost is None else cost
    expected = []
    for t in range(length):
        total = 0.0
        for k in range(t, length):
            total += (0.0 if success else -paid) if k == length - 1 else -1.0
        expected.append(min(0.0, max(-1.0, total / (limit + paid))))
    got = episode_returns(length, success, limit, cost)
    assert got.dtype == np.float64 and got.tolist() == expected
    if success:
        assert got[-1] == 0.0 and got[0] == -(length - 1) / (limit + paid)
    else:  # failures keep their time order (an earlier frame is worse), all below every success
        assert (np.diff(got) > 0).all() and got.max() < -(limit - 1) / (limit + paid) + 1e-12


def test_a_failure_is_worse_than_any_success_within_the_limit():
    limit = 40
    worst_success = episode_returns(limit, True, limit)[0]
    best_failure = episode_returns(1, False, limit)[0]
    assert best_failure < worst_success and episode_returns(limit, False, limit)[0] == -(2 * limit - 1) / (2 * limit)


def test_bins_are_the_nearest_centre_and_hl_gauss_sums_to_one():
    centres = bin_centers(201)
    assert len(centres) == 201 and centres[0] == -1.0 and centres[-1] == 0.0
    values = np.array([-1.0, -0.5, 0.0, -0.0026, -0.0024, -0.31234, 0.2, -7.0])
    expected = [int(np.argmin(np.abs(centres - min(0.0, max(-1.0, v))))) for v in values]
    assert value_to_bin(values).tolist() == expected == [0, 100, 200, 199, 200, 138, 200, 0]
    targets = hl_gauss_targets(values, 201, 0.75)
    assert targets.shape == (8, 201) and np.allclose(targets.sum(1), 1.0, atol=1e-12)
    interior = [1, 5]  # (near an end the outer bin also holds the tail beyond it)
    assert (targets[interior].argmax(1) == value_to_bin(values)[interior]).all()
    # the mass of bin i is the Gaussian's between the half-way edges (float64, math.erf)
    width, sigma, v = 1 / 200, 0.75 / 200, -0.5
    cdf = lambda x: 0.5 * (1 + math.erf((x - v) / (sigma * math.sqrt(2))))  # noqa: E731
    assert abs(targets[1, 101] - (cdf(centres[101] + width / 2) - cdf(centres[101] - width / 2))) < 1e-12


def test_the_n_step_advantage_on_a_hand_made_episode():
    """5 frames, success, limit 10 and failure cost 10 (the scale 20), N = 2, values chosen by hand:
    A_t = r_t/20 + r_{t+1}/20 + V_{t+2} - V_t, and the Monte-Carlo rest of the return where t + 2 passes the end."""
    returns = episode_returns(5, True, 10)  # [-0.2, -0.15, -0.1, -0.05, 0.0]
    np.testing.assert_allclose(returns, [-0.2, -0.15, -0.1, -0.05, 0.0], atol=1e-15)
    values = np.array([-0.5, -0.2, -0.25, -0.05, -0.02])
    got = advantages(returns, values, True, 10, lookahead=2)
    step = -1 / 20
    expected = [2 * step + values[2] - values[0], 2 * step + values[3] - values[1],
                2 * step + values[4] - values[2], returns[3] - values[3], returns[4] - values[4]]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(advantages(returns, values, True, 10, lookahead=None), returns - values)
    failing = episode_returns(5, False, 10)  # the last step costs 10: [-0.7, -0.65, -0.6, -0.55, -0.5]
    np.testing.assert_allclose(failing, [-0.7, -0.65, -0.6, -0.55, -0.5], atol=1e-15)
    failed = advantages(failing, values, False, 10, lookahead=2)
    # the failure's cost sits in the last step: inside a window only through the rest of the return
    np.testing.assert_allclose(failed, [2 * step + values[2] - values[0], 2 * step + values[3] - values[1],
                                        2 * step + values[4] - values[2], failing[3] - values[3],
                                        failing[4] - values[4]], atol=1e-15)


@pytest.mark.parametrize("fraction", [0.3, 0.4, 0.55])
def test_the_threshold_gives_the_requested_positive_fraction(fraction):
    rng = np.random.default_rng(0)
    for n in (10, 333, 1000):
        values = rng.normal(size=n)
        threshold = positive_threshold(values, fraction)
        assert abs(int((values > threshold).sum()) - fraction * n) <= 0.5  # to one frame


# ---- the indicator in the prompt ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(tiny_tokenizer):
    from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
    from hf_vla.tiny import tiny_pi05_config

    config = tiny_pi05_config(tokenizer_max_length=64)
    model = randomize_(PI05ForConditionalGeneration(config), seed=3).eval()
    stats = {"arm": {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}, "actions": {"q01": [-1.0] * 3, "q99": [1.0] * 3}}}
    processor = PI05Processor.from_config(config, tiny_tokenizer, norm_stats=stats)
    processor.advantage_conditioned = True
    return model, processor


def _inputs(processor, rows=2, **kwargs):
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 255, (rows, 2, 3, 32, 32), generator=generator, dtype=torch.uint8)
    state = torch.rand(rows, 2, generator=generator) * 2 - 1
    return processor(images=images, text=["pick the cube"] * rows, state=state, **kwargs)


def test_the_indicator_is_a_segment_of_its_own_before_the_answer(policy):
    _, processor = policy
    decode = processor.tokenizer.decode
    positive = _inputs(processor, 1, advantage=True)
    text = decode(positive["input_ids"][0][positive["attention_mask"][0]], skip_special_tokens=True)
    assert text.startswith("Task: pick the cube, State: ") and "Advantage: positive;" in text, text
    assert text.index("State:") < text.index("Advantage") < text.index("Action:")
    negative = _inputs(processor, 1, advantage=False)
    assert "Advantage: negative;" in decode(negative["input_ids"][0], skip_special_tokens=True)
    none = _inputs(processor, 1, advantage=None)
    assert "Advantage" not in decode(none["input_ids"][0], skip_special_tokens=True)
    # inference ("auto"): an advantage-conditioned processor asks for positive, with no flag
    assert torch.equal(_inputs(processor, 1)["input_ids"], positive["input_ids"])
    assert "uncond_input_ids" not in _inputs(processor, 1)  # beta = 1: one prompt, one forward


def _paligemma_style_tokenizer():
    """A tokenizer shaped as PaliGemma's (Gemma's SentencePiece BPE): spaces become "▁" in the normalizer and nothing
    splits the text first, so merges may cross words and punctuation ("▁drawer," can be one token), trained here on
    task-like text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Replace("▁", " ")
    words = ["open the drawer,", "pick the red cube,", "move to the target,", "Advantage: positive;",
             "State: 12 200 7;\n", "Action: ", "Task: "]
    corpus = [" ".join(words[i % len(words)] for i in range(start, start + 6)) for start in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    from tokenizers import processors

    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[
        ("<bos>", tokenizer.token_to_id("<bos>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


@pytest.mark.parametrize("kind", ["demo", "paligemma_style"])
def test_the_indicator_leaves_the_tasks_token_ids_unchanged(policy, kind):
    """The task's and the state's token ids are those of the plain prompt, with either indicator: appended to the
    task (the form before), "drawer," re-tokenized and every later token moved."""
    from hf_vla.models.pi05 import PI05Processor

    model, demo = policy
    tokenizer = demo.tokenizer if kind == "demo" else _paligemma_style_tokenizer()
    processor = PI05Processor.from_config(model.config, tokenizer, norm_stats=demo.norm_stats)
    processor.advantage_conditioned = True
    state = torch.tensor([[0.2, -0.4]])
    images = torch.zeros(1, 2, 3, 32, 32, dtype=torch.uint8)
    for task in ("open the drawer", "pick the red cube", "move to the target"):
        plain = processor(images=images, text=[task], state=state, advantage=None)
        head = processor.build_prompt(task, processor.normalize(state, "state", "arm")[0]).rpartition("\n")[0]
        kept = len(tokenizer(head)["input_ids"]) - 1  # the task and the state, up to the prompt's last newline
        for advantage in (True, False):
            tagged = processor(images=images, text=[task], state=state, advantage=advantage)
            assert tagged["input_ids"][0, :kept].tolist() == plain["input_ids"][0, :kept].tolist(), (task, advantage)
    processor.advantage_indicator = "appended"  # the form the review found: the task's own tokens move
    appended = processor(images=images, text=["open the drawer"], state=state, advantage=True)
    plain = processor(images=images, text=["open the drawer"], state=state, advantage=None)
    head = len(tokenizer("Task: open the drawer, State:")["input_ids"])
    assert appended["input_ids"][0, :head].tolist() != plain["input_ids"][0, :head].tolist()


def test_the_embedding_indicator_is_read_by_the_expert_and_guided_with_one_prompt(tiny_tokenizer):
    """`advantage_indicator="embedding"`: the prompt is the plain one, `advantage_ids` reach the expert's time
    conditioning (zero at the start: the policy as it was), and guidance's two halves share the prompt."""
    from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
    from hf_vla.tiny import tiny_pi05_config

    config = tiny_pi05_config(tokenizer_max_length=64, advantage_indicator="embedding")
    model = randomize_(PI05ForConditionalGeneration(config), seed=3).eval()
    fresh = PI05ForConditionalGeneration(config)
    assert fresh.advantage_embedding.weight.abs().sum() == 0
    stats = {"arm": {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}, "actions": {"q01": [-1.0] * 3, "q99": [1.0] * 3}}}
    processor = PI05Processor.from_config(config, tiny_tokenizer, norm_stats=stats)
    processor.advantage_conditioned = True
    positive, none = _inputs(processor, 2, advantage=True), _inputs(processor, 2, advantage=None)
    assert torch.equal(positive["input_ids"], none["input_ids"]) and positive["advantage_ids"].tolist() == [2, 2]
    noise = _noise(model)
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "advantage_ids")
    with torch.no_grad():
        conditioned = model.sample_actions(**{k: positive[k] for k in keys}, noise=noise)
        plain = model.sample_actions(**{k: none[k] for k in keys}, noise=noise)
        guided = _inputs(processor, 2, cfg_beta=2.0)
        assert torch.equal(guided["uncond_input_ids"], guided["input_ids"])
        both = model.sample_actions(**{k: v for k, v in guided.items() if k not in ("state",)}, noise=noise)
        beta_one = model.sample_actions(**{k: v for k, v in _inputs(processor, 2, cfg_beta=1.0).items()
                                           if k != "state"}, noise=noise)
    assert (conditioned - plain).abs().max() > 1e-4  # the expert reads the indicator
    assert torch.allclose(beta_one, conditioned, atol=1e-6)
    assert (both - conditioned).abs().max() > 1e-5  # beta 2 moves further from the unconditioned sample
    # one Euler step by hand: v_u + 2 (v_c - v_u) from two separate forwards
    with torch.no_grad():
        t = torch.ones(2)
        common = {k: positive[k] for k in keys if k != "advantage_ids"}
        v_c = model(noise=noise, timestep=t, advantage_ids=positive["advantage_ids"], **common).logits
        v_u = model(noise=noise, timestep=t, advantage_ids=torch.zeros(2, dtype=torch.long), **common).logits
        one_step = model.sample_actions(**{k: v for k, v in guided.items() if k != "state"}, noise=noise, num_steps=1)
    torch.testing.assert_close(one_step, noise - (v_u + 2.0 * (v_c - v_u)), atol=2e-5, rtol=0)


def test_guidance_is_refused_where_it_cannot_apply(policy, tiny_tokenizer):
    from hf_vla.models.pi05 import PI05Processor

    _, processor = policy
    plain = PI05Processor.from_config(policy[0].config, tiny_tokenizer, norm_stats=processor.norm_stats)
    with pytest.raises(ValueError, match="guidance needs an advantage-conditioned policy"):
        _inputs(plain, 1, cfg_beta=2.0)
    with pytest.raises(ValueError, match="a beta in \\[0, 100\\]"):
        _inputs(processor, 1, cfg_beta=float("nan"))
    with pytest.raises(ValueError, match="must ask for it"):
        _inputs(processor, 1, cfg_beta=2.0, advantage=False)


# ---- classifier-free guidance -------------------------------------------------------------------------------------
def _sample(model, inputs, noise, steps=10):
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "uncond_input_ids",
            "uncond_attention_mask", "cfg_beta")
    return model.sample_actions(**{k: inputs[k] for k in keys if k in inputs}, noise=noise.clone(), num_steps=steps)


def _noise(model, rows=2):
    config = model.config
    return torch.randn(rows, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(5))


def test_beta_one_is_the_conditioned_sample_and_beta_zero_the_unconditioned_bit_for_bit(policy):
    model, processor = policy
    noise = _noise(model)
    conditioned = _sample(model, _inputs(processor, advantage=True), noise)
    unconditioned = _sample(model, _inputs(processor, advantage=None), noise)
    assert not torch.equal(conditioned, unconditioned)  # the indicator changes what the policy does
    assert torch.equal(_sample(model, _inputs(processor, cfg_beta=1.0), noise), conditioned)
    assert torch.equal(_sample(model, _inputs(processor, cfg_beta=0.0), noise), unconditioned)


@pytest.mark.parametrize("beta", [0.5, 1.5, [2.0, 0.25]])
def test_the_batched_guided_velocity_equals_two_separate_forwards(policy, beta):
    """One forward over 2B rows per step against a reference Euler loop that runs the conditioned and unconditioned
    prompts through two separate prefix caches and forwards, in float64 arithmetic for the combination."""
    model, processor = policy
    noise = _noise(model)
    guided = _inputs(processor, cfg_beta=beta)
    assert guided["cfg_beta"].tolist() == ([beta] * 2 if isinstance(beta, float) else beta)
    got = _sample(model, guided, noise, steps=10)
    cond, uncond = _inputs(processor, advantage=True), _inputs(processor, advantage=None)
    caches = [model.prefix_cache(i["input_ids"], i["pixel_values"], i["pixel_attention_mask"], i["attention_mask"])
              for i in (cond, uncond)]
    betas = guided["cfg_beta"].double().view(-1, 1, 1)
    x, dt = noise.clone().double(), -1.0 / 10
    for step in range(10):
        timestep = torch.full((2,), 1.0 + step * dt, dtype=torch.float32)
        v = [model(noise=x.float(), timestep=timestep, input_ids=i["input_ids"], attention_mask=i["attention_mask"],
                   pixel_attention_mask=i["pixel_attention_mask"], past_key_values=c).logits.double()
             for i, c in zip((cond, uncond), caches)]
        x = x + dt * (v[1] + betas * (v[0] - v[1]))
    torch.testing.assert_close(got.double(), x, rtol=0, atol=1e-6)


# ---- the indicator's dropout in the stream -----------------------------------------------------------------------
def test_the_indicator_dropout_is_seeded_and_within_binomial_bounds(tmp_path):
    from test_data import CAM, make_dataset

    from hf_vla.data import WeightedDatasetMixture

    root = make_dataset(tmp_path / "demos", 6)
    spec = dict(root=str(root), name="demos", cameras=[CAM], control_mode="joint",
                advantage={"value": True, "dropout": 0.3})
    draws = []
    for _ in range(2):
        stream = WeightedDatasetMixture([spec]).train_stream(StreamSettings(image_size=16, chunk_size=2, open_blocks=3))
        draws.append([sample["advantage"] for sample, _ in zip(stream, range(2000))])
    assert draws[0] == draws[1]  # seeded: the same samples drop in a rerun
    dropped = sum(a is None for a in draws[0])
    assert set(draws[0]) == {True, None}  # dropped, never flipped
    mean, sd = 0.3 * 2000, math.sqrt(2000 * 0.3 * 0.7)
    assert abs(dropped - mean) < 4 * sd, dropped


def test_the_dataset_field_is_checked(tmp_path):
    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.errors import ConfigError

    for value, culprit in (({"key": "a", "value": True}, "give one of key"), ({"key": "a", "dropout": 1.0},
                           "dropout: a probability in [0, 1)"), ({"value": "yes"}, "value: true or false"),
                           ({"column": "a"}, "unknown field(s) ['column']")):
        with pytest.raises(ConfigError, match=culprit.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            DatasetConfig(root=str(tmp_path), cameras=["c"], advantage=value)


# ---- the value model, annotate and a policy trained on it (ColorReach) ---------------------------------------------
@pytest.fixture(scope="module")
def round_data(tmp_path_factory):
    """A 2-step demo policy on 4 expert episodes, 6 of its own episodes with the expert taking some steps (DAgger,
    beta 0.3: `intervention` and `next.success`), a value model trained on both for a few steps."""
    import json

    from conftest import REPO, colorreach_run

    from hf_vla.envs.recording import RecordArguments, record
    from hf_vla.train import main as train_main

    base = tmp_path_factory.mktemp("recap")
    run, datasets = colorreach_run(base, 20)
    record(RecordArguments(env="color_reach", output=base / "rollouts", episodes=6, image_size=24, max_episode_steps=20,
                           strategy="dagger", policy=str(run), beta=0.3), progress=False)
    config = json.loads((REPO / "configs/demo.json").read_text())
    demos = dict(datasets[0], name="demos")
    rollouts = dict(datasets[0], root=str(base / "rollouts"), name="rollouts")
    train_main([str(REPO / "configs/demo.json"), "--policy", "pi05_value", "--datasets", json.dumps([demos, rollouts]),
                "--output_dir", str(base / "value"), "--generate_demo_data", "false", "--validation_ratio", "0.3",
                "--per_device_train_batch_size", "4", "--stream_open_blocks", "2", "--max_steps", "4",
                "--warmup_steps", "0", "--eval_strategy", "no", "--disable_tqdm", "true",
                "--dataloader_num_workers", "0"])
    assert config["policy"] == "pi05"
    return {"base": base, "run": run, "demos": demos, "rollouts": rollouts, "value": base / "value"}


def test_a_value_model_round_trips_save_pretrained_and_automodel(round_data):
    from transformers import AutoModel, AutoProcessor

    from hf_vla.models.value import PI05ValueModel

    model = AutoModel.from_pretrained(round_data["value"])
    assert isinstance(model, PI05ValueModel) and model.config.num_bins == 201
    processor = AutoProcessor.from_pretrained(round_data["value"])
    inputs = _inputs_for(processor)
    value = model.eval().value(**inputs)
    again = round_data["base"] / "value_again"
    model.save_pretrained(again)
    reloaded = AutoModel.from_pretrained(again).eval()
    assert torch.equal(reloaded.value(**inputs), value) and ((value >= -1) & (value <= 0)).all()


def _inputs_for(processor):
    generator = torch.Generator().manual_seed(1)
    return processor(images=torch.randint(0, 255, (3, 1, 3, 24, 24), generator=generator, dtype=torch.uint8),
                     text=["move to the red target"] * 3, state=torch.zeros(3, 2), advantage=None)


def test_a_value_model_starts_from_a_pi05_checkpoints_backbone(round_data):
    from hf_vla.models.value import PI05ValueModel
    from hf_vla.training.arguments import ModelArguments
    from hf_vla.training.builders import build_model

    args = ModelArguments(policy="pi05_value", model_name_or_path=str(round_data["run"]))
    model = build_model(args, seed=0)
    assert isinstance(model, PI05ValueModel)
    from transformers import AutoModel

    policy = AutoModel.from_pretrained(round_data["run"]).state_dict()
    ours = model.state_dict()
    backbone = [k for k in policy if k.startswith("model.vlm.")]
    assert backbone and all(torch.equal(ours[k], policy[k]) for k in backbone)


def test_outcomes_are_read_or_refused_naming_the_episode(tmp_path):
    from test_data import CAM, make_dataset

    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource
    from hf_vla.errors import DataError

    root = make_dataset(tmp_path / "plain", 3)
    source = LeRobotSource(DatasetConfig(root=str(root), name="plain", cameras=[CAM]), 0)
    with pytest.raises(DataError, match=r"dataset 'plain': episode\(s\) \[0, 1, 2\] \(3 of 3\) have no outcome"):
        source.episode_outcomes()
    assert np.isnan(source.episode_outcomes(allow_unlabelled=True)).all()
    demos = LeRobotSource(DatasetConfig(root=str(root), name="plain", cameras=[CAM], success=True), 0)
    assert demos.episode_outcomes().tolist() == [1.0, 1.0, 1.0]
    np.testing.assert_array_equal(demos.frame_returns(1), episode_returns(13, True, 14))  # limit: the longest
    # a joined serve --record dataset: its run summary's per-episode success (None where the client sent none)
    import json

    summary = {"episodes": [{"episode": 5, "success": True}, {"episode": 9, "success": None},
                            {"episode": 7, "success": False}]}
    (root / "meta" / "hf_vla_serve_record.json").write_text(json.dumps(summary))
    served = LeRobotSource(DatasetConfig(root=str(root), name="served", cameras=[CAM]), 0)
    with pytest.raises(DataError, match=r"episode\(s\) \[2\] \(1 of 3\) have no outcome"):
        served.episode_outcomes()
    assert served.episode_outcomes(allow_unlabelled=True)[:2].tolist() == [1.0, 0.0]


def _annotate(round_data, output, *extra):
    import json

    from hf_vla.recap.__main__ import main

    main(["annotate", "--value", str(round_data["value"]), "--datasets", json.dumps([round_data["rollouts"]]),
          "--output", str(output), "--lookahead", "5", *extra])
    return output


def test_annotate_writes_the_indicator_and_leaves_the_source_byte_identical(round_data):
    import json

    import pyarrow.parquet as pq
    from test_safety import tree_hash

    source = Path(round_data["rollouts"]["root"])
    before = tree_hash(source)
    out = _annotate(round_data, round_data["base"] / "annotated")
    assert tree_hash(source) == before
    summary = json.loads((out / "meta" / "hf_vla_recap.json").read_text())
    table = pq.read_table(sorted((out / "data").rglob("*.parquet"))[0]).to_pandas()
    positive, intervention = table["advantage_positive"].to_numpy(), table["intervention"].to_numpy() > 0
    assert intervention.any() and positive[intervention].all()  # the expert's steps are positive
    # per task, the frames above the threshold are the requested share (to one frame), interventions added
    for task, entry in summary["tasks"].items():
        rows = table["task_index"].to_numpy() == _task_index(source, task)
        advantage = table["recap.advantage"].to_numpy()[rows]
        assert abs(int((advantage > entry["threshold"]).sum()) - 0.3 * rows.sum()) <= 0.5
    # returns as the float64 computation gives them (stored as float32)
    (limit,) = set(summary["episode_limits"].values())  # every colour's task: the recording's 20 steps
    assert limit == 20
    for _, frames in table.groupby("episode_index"):
        success = bool(frames["next.success"].any())
        expected = episode_returns(len(frames), success, limit)
        np.testing.assert_allclose(frames["recap.return"].to_numpy(), expected.astype(np.float32), rtol=0, atol=0)
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["features"]["advantage_positive"]["dtype"] == "bool"
    # how well the value model judged them, per task, against numpy on the written columns
    for task, entry in summary["tasks"].items():
        frames = table[table["task_index"].to_numpy() == _task_index(source, task)]
        expected = np.corrcoef(frames["recap.value"].to_numpy(np.float64), frames["recap.return"].to_numpy(np.float64))
        assert entry["value_return_correlation"] == pytest.approx(expected[0, 1], abs=1e-5)
        episodes = frames.groupby("episode_index").agg(mean=("recap.value", "mean"), won=("next.success", "any"))
        won, lost = episodes["mean"][episodes["won"]].to_numpy(), episodes["mean"][~episodes["won"]].to_numpy()
        if len(won) and len(lost):
            pairs = (won[:, None] > lost[None, :]).mean() + 0.5 * (won[:, None] == lost[None, :]).mean()
            assert entry["value_auc"] == pytest.approx(pairs, abs=1e-6)
        else:
            assert entry["value_auc"] is None


def test_value_quality_on_hand_made_episodes():
    from hf_vla.recap.annotate import value_quality

    frames = {0: {"value": np.array([-0.5, -0.2]), "return": np.array([-0.6, -0.1])},
              1: {"value": np.array([-0.9, -0.8, -0.7]), "return": np.array([-1.0, -1.0, -1.0])},
              2: {"value": np.zeros(0), "return": np.zeros(0)}}
    found = value_quality(frames, {0: 1.0, 1: 0.0, 2: 0.0})
    values, returns = np.array([-0.5, -0.2, -0.9, -0.8, -0.7]), np.array([-0.6, -0.1, -1.0, -1.0, -1.0])
    assert found["value_return_correlation"] == pytest.approx(np.corrcoef(values, returns)[0, 1])
    assert found["value_auc"] == 1.0  # the success's mean value above the failure's
    assert value_quality(frames, {0: 1.0, 1: 1.0})["value_auc"] is None  # no failure to compare


def _task_index(root, task):
    import pandas as pd

    tasks = pd.read_parquet(root / "meta" / "tasks.parquet")
    return int(tasks.loc[task, "task_index"]) if task in tasks.index else int(
        tasks[tasks.iloc[:, 0] == task]["task_index"].iloc[0])


def test_a_killed_annotate_leaves_no_output_and_a_rerun_reuses_its_values(round_data, monkeypatch):
    import hf_vla.recap.annotate as module

    out = round_data["base"] / "killed"
    real_write, calls = module._write, []

    def dies(*args, **kwargs):
        raise KeyboardInterrupt  # a kill after the values, before the rename

    monkeypatch.setattr(module, "_write", dies)
    with pytest.raises(KeyboardInterrupt):
        _annotate(round_data, out)
    assert not out.exists() and list((out.parent / f".{out.name}.annotating-values").rglob("episode_*.npy"))
    monkeypatch.setattr(module, "_write", real_write)
    real_value = module.PI05ValueModel.value if hasattr(module, "PI05ValueModel") else None
    from hf_vla.models.value import PI05ValueModel

    original = PI05ValueModel.value
    monkeypatch.setattr(PI05ValueModel, "value", lambda self, **kw: calls.append(1) or original(self, **kw))
    _annotate(round_data, out)
    assert out.is_dir() and not calls and real_value is None  # every episode's values came from the cache
    assert not (out.parent / f".{out.name}.annotating-values").exists()


@pytest.fixture(scope="module")
def recap_policy(round_data):
    """The demo policy trained 2 steps on the demonstrations (positive) and the annotated episodes."""
    import json

    from conftest import REPO

    from hf_vla.train import main as train_main

    annotated = round_data["base"] / "annotated"
    if not annotated.exists():
        _annotate(round_data, annotated)
    rollouts = dict(round_data["rollouts"], root=str(annotated), advantage={"key": "advantage_positive"})
    demos = dict(round_data["demos"], advantage={"value": True})
    out = round_data["base"] / "policy"
    common = [str(REPO / "configs/demo.json"), "--datasets", json.dumps([rollouts, demos]), "--output_dir", str(out),
              "--generate_demo_data", "false", "--per_device_train_batch_size", "4",
              "--stream_open_blocks", "2", "--max_steps", "2", "--warmup_steps", "0", "--disable_tqdm", "true",
              "--dataloader_num_workers", "0"]
    # in the prompt, the indicator would not fit the demo's 16 tokens: refused, never trained on in silence
    with pytest.raises(Exception, match="cuts the indicator off; raise the model's tokenizer_max_length"):
        train_main([*common, "--model_config.advantage_indicator", "text"])
    trainer = train_main([*common, "--model_config.tokenizer_max_length", "40", "--validation_ratio", "0.3"])
    return out, trainer.evaluate()  # the provenance evaluation, per indicator value too


def test_a_data_error_in_a_dataloader_worker_ends_the_command_in_one_line_without_hanging(round_data, tmp_path):
    """The indicator check fails inside a DataLoader worker mid-run: the command exits 1 with the worker's own message
    on one line. Before, the failed run's frames kept the worker and its queue threads alive until multiprocessing's
    exit handler joined them, and the process hung after the traceback."""
    import json
    import subprocess
    import sys

    from conftest import REPO

    demos = dict(round_data["demos"], advantage={"value": True})
    command = [sys.executable, "-m", "hf_vla.train", str(REPO / "configs/demo.json"), "--datasets", json.dumps([demos]),
               "--output_dir", str(tmp_path / "out"), "--generate_demo_data", "false",
               "--per_device_train_batch_size", "4", "--stream_open_blocks", "2", "--max_steps", "2",
               "--warmup_steps", "0", "--disable_tqdm", "true", "--dataloader_num_workers", "1",
               "--model_config.advantage_indicator", "text"]  # in the prompt, where the demo's 16 tokens cut it
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(__import__("os").environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hf_vla.train: error: the prompt with its advantage indicator is") and last.endswith(
        "(in a DataLoader worker)") and "Traceback" not in done.stderr, done.stderr[-3000:]


def test_worker_message_keeps_the_workers_own_line():
    from hf_vla.cli import worker_message

    wrapped = ("Caught DataError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
               '  File "x.py", line 1, in f\n    raise DataError(...)\nhf_vla.errors.DataError: the prompt is long')
    assert worker_message(wrapped) == "the prompt is long (in a DataLoader worker)"
    assert worker_message("plain: message") == "plain: message"


def test_a_policy_trained_on_the_annotation_asks_for_positive(recap_policy):
    import json

    from hf_vla.serving.policy import load_policy

    out, metrics = recap_policy  # metrics: validation episodes of the demonstrations and the annotated rollouts
    assert {"eval_by_advantage/positive/mse", "eval_by_advantage/negative/mse"} <= set(metrics), sorted(metrics)
    contract = json.loads((out / "deployment_config.json").read_text())
    assert contract["advantage"] == {"conditioned": True, "cfg_beta": 1.0, "indicator": "embedding"}
    runner = load_policy(out)
    rows = {"images": torch.zeros(1, 1, 3, 24, 24, dtype=torch.uint8), "states": np.zeros((1, 2), np.float32),
            "tasks": ["move to the red target"], "camera_mask": torch.ones(1, 1, dtype=torch.bool)}
    inputs, _ = runner._inputs(rows, runner.head_name())
    # the default form: the expert's embedding of "positive" (2), the prompt the plain one
    text = runner.processor.tokenizer.decode(inputs["input_ids"][0], skip_special_tokens=True)
    assert inputs["advantage_ids"].tolist() == [2] and "Advantage" not in text and "uncond_input_ids" not in inputs
    guided, _ = runner._inputs(rows, runner.head_name(), 2.0)
    assert guided["cfg_beta"].tolist() == [2.0] and guided["uncond_advantage_ids"].tolist() == [0]
    assert torch.equal(guided["uncond_input_ids"], guided["input_ids"])  # one prompt for both halves


def test_record_strategy_policy_keeps_every_episode_with_the_policys_own_actions(round_data, monkeypatch):
    """`--strategy policy`: the policy alone (the expert is never asked: an env without one records), its executed
    action is each frame's `action`, every episode kept with `next.success`."""
    import pyarrow.parquet as pq

    import hf_vla.envs.reach as reach
    from hf_vla.envs.recording import RecordArguments, record

    def no_expert(*args, **kwargs):
        raise AssertionError("the expert was consulted")

    monkeypatch.setattr(reach, "expert_action", no_expert)
    out = round_data["base"] / "own"
    record(RecordArguments(env="color_reach", output=out, episodes=5, strategy="policy", policy=str(round_data["run"])),
           progress=False)
    table = pq.read_table(sorted((out / "data").rglob("*.parquet"))[0]).to_pandas()
    assert table["episode_index"].nunique() == 5 and "next.success" in table
    assert all(list(a) == list(b) for a, b in zip(table["action"], table["policy_action"]))
    assert (table["intervention"] == 0).all()


def test_the_server_guides_per_request_as_the_runner_does(recap_policy):
    recap_policy, _ = recap_policy
    """openpi's client against `hf_vla.serve`: a request's `cfg_beta` gives the runner's guided chunk for the same
    seed; one beyond `--max_cfg_beta` is refused in one line and the connection serves on."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    from test_serve import Server

    from hf_vla.serving.policy import load_policy

    server = Server("--checkpoint", str(recap_policy), "--seed", "5", "--max_cfg_beta", "2.5")
    try:
        client = WebsocketClientPolicy(server.uri)
        assert client.get_server_metadata()["advantage"] == {"conditioned": True, "cfg_beta": 1.0, "indicator": "embedding",
                                                             "max_cfg_beta": 2.5}
        image = np.random.default_rng(0).integers(0, 255, (24, 24, 3), dtype=np.uint8)
        request = {"observation.image": image, "observation.state": np.array([0.1, -0.2], np.float32),
                   "prompt": "move to the red target"}
        runner = load_policy(recap_policy, seed=5)
        for beta in (2.0, None):
            reply = client.infer({**request, **({"cfg_beta": beta} if beta is not None else {})})
            runner.reset(seed=5)
            prepared = runner.prepare(dict(request), task=request["prompt"], cfg_beta=beta)
            assert ("uncond_input_ids" in prepared.inputs) == (beta is not None)
            expected = runner.finish(prepared, runner.sample_batch([prepared])[0])
            np.testing.assert_allclose(reply["actions"], expected, rtol=0, atol=1e-5)
            client = WebsocketClientPolicy(server.uri)  # a fresh connection: its noise from --seed again
        with pytest.raises(RuntimeError, match=r"cfg_beta=9.0: a number in \[0, 2.5\]"):
            client.infer({**request, "cfg_beta": 9.0})
        assert client.infer(request)["actions"].shape == (8, 2)
    finally:
        server.stop()


def test_recap_refusals_are_one_line(round_data, capsys):
    import json

    from conftest import refused

    from hf_vla.evaluate import cli as evaluate_cli
    from hf_vla.recap.__main__ import cli as recap_cli

    line = refused(recap_cli, ["annotate", "--value", str(round_data["run"]), "--datasets",
                               json.dumps([round_data["rollouts"]]), "--output", str(round_data["base"] / "no")],
                   capsys)
    assert "a 'pi05' checkpoint, not a value model" in line, line
    line = refused(evaluate_cli, ["--checkpoint", str(round_data["run"]), "--episodes", "2", "--cfg_beta", "1.5",
                                  "--output_dir", str(round_data["base"] / "no_eval")], capsys)
    assert "--cfg_beta 1.5: guidance needs an advantage-conditioned policy" in line, line
    line = refused(recap_cli, ["nope"], capsys)
    assert "a subcommand of python -m hf_vla.recap, one of ['annotate']" in line, line
    assert not (round_data["base"] / "no").exists()


@pytest.mark.parametrize("name", ["value", "policy"])
def test_the_recap_configs_parse(name, tmp_path):
    """configs/recap/*.json as docs/recap.md runs them (the datasets and checkpoint come from the command line)."""
    from conftest import REPO

    from hf_vla.training.arguments import parse_config

    model_args, data_args, _ = parse_config(REPO / "configs" / "recap" / f"{name}.json",
                                            ["--output_dir", str(tmp_path / "out")])
    assert model_args.policy == {"value": "pi05_value", "policy": "pi05"}[name]
    assert (data_args.datasets[0].get("success") is True) == (name == "value")
    assert ((data_args.datasets[0].get("advantage") or {}).get("value") is True) == (name == "policy")


@pytest.mark.parametrize("jacobian", [False, True])
def test_guidance_composes_with_real_time_chunking(policy, jacobian):
    """Guided sampling continues a previous chunk as plain sampling does (RTC's guidance through the guided
    velocity, the Jacobian through both halves of the batch): a finite chunk of the same shape, other than the
    unguided one."""
    from hf_vla.models.common.rtc import RTCConfig

    model, processor = policy
    noise = _noise(model)
    leftover = torch.randn(2, 4, model.config.max_action_dim, generator=torch.Generator().manual_seed(2))
    rtc = {"prev_chunk_left_over": leftover, "inference_delay": 2,
           "rtc_config": RTCConfig(method="guidance", jacobian=jacobian)}
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "uncond_input_ids",
            "uncond_attention_mask", "cfg_beta")
    guided_inputs = _inputs(processor, cfg_beta=2.0)
    with torch.enable_grad() if jacobian else torch.no_grad():
        guided = model.sample_actions(**{k: guided_inputs[k] for k in keys if k in guided_inputs},
                                      noise=noise.clone(), **rtc)
    plain_inputs = _inputs(processor)
    plain = model.sample_actions(**{k: plain_inputs[k] for k in keys if k in plain_inputs}, noise=noise.clone(), **rtc)
    assert torch.isfinite(guided).all() and guided.shape == plain.shape and not torch.equal(guided, plain)


@pytest.mark.parametrize("combo", ["token_loss", "relative_actions", "lora"])
def test_advantage_conditioning_trains_with_the_token_objective_relative_actions_and_lora(tmp_path, combo):
    """The indicator composes with pi0.5's token objective (FAST targets after the prompt), relative actions and a
    LoRA run: each trains, reports the provenance loss per indicator value, and saves a checkpoint whose contract and
    processor ask for "positive"."""
    import json

    from test_data import make_dataset
    from test_failures import base_config, write_config

    from hf_vla.serving.policy import load_policy
    from hf_vla.train import main

    data = make_dataset(tmp_path / "toy", 6)
    out = tmp_path / "out"
    spec = {"root": str(data), "name": "toy", "cameras": ["observation.images.cam"], "control_mode": "joint",
            "advantage": {"value": True, "dropout": 0.5}}
    extra = {"token_loss": dict(token_loss=True, fast_vocab_size=256),
             "relative_actions": {}, "lora": dict(lora_preset="expert", lora_r=4)}[combo]
    if combo == "relative_actions":
        spec["relative_actions"] = [True, False]
    config = base_config(data, out, max_steps=2, datasets=[spec], validation_ratio=0.34, eval_strategy="steps",
                         eval_steps=2, **extra)
    config["model_config"]["tokenizer_max_length"] = 64
    trainer = main([str(write_config(tmp_path, config))])
    metrics = trainer.evaluate()
    assert "eval_by_advantage/positive/mse" in metrics, sorted(metrics)
    if combo == "token_loss":
        assert "eval_fast_ce" in metrics and trainer.model.config.token_loss
    contract = json.loads((out / "deployment_config.json").read_text())
    assert contract["advantage"] == {"conditioned": True, "cfg_beta": 1.0, "indicator": "embedding"}
    runner = load_policy(out)
    inputs, _ = runner._inputs({"images": torch.zeros(1, 1, 3, 48, 64, dtype=torch.uint8),
                                "states": np.zeros((1, 3), np.float32), "tasks": ["reach target 0"],
                                "camera_mask": torch.ones(1, 1, dtype=torch.bool)}, runner.head_name())
    assert inputs["advantage_ids"].tolist() == [2]  # "positive", read by the expert
    chunk = runner.model.sample_actions(**inputs)
    assert torch.isfinite(chunk).all()


def test_rl_rollouts_act_on_positive_unguided_without_a_flag(recap_policy):
    """RL's stochastic policy is a `PolicyRunner`: an advantage-conditioned checkpoint's rollouts ask for "positive",
    unguided (Flow-SDE's likelihood is that of the one velocity sampled), even where the runner's default guides."""
    from hf_vla.rl import StochasticPolicy
    from hf_vla.rl.flow import FlowSDE
    from hf_vla.serving.policy import load_policy

    out, _ = recap_policy
    runner = load_policy(out)
    runner.cfg_beta = 2.0
    policy = StochasticPolicy(model=runner.model, processor=runner.processor, head=runner.head, sde=FlowSDE(4, 0.5),
                              n_action_steps=2, action_dims=2, cfg_beta=2.0)
    observation = {"observation.image": np.zeros((24, 24, 3), np.uint8),
                   "observation.state": np.zeros(2, np.float32)}
    request = policy.prepare(observation, "move to the red target")
    assert request.inputs["advantage_ids"].tolist() == [2] and "uncond_input_ids" not in request.inputs
    chunk = policy.sample_batch([request])
    assert torch.isfinite(chunk).all() and len(policy.transitions) == 0  # recorded in finish(), not here


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "zero2"])
def test_advantage_conditioning_trains_under_every_engine_with_the_per_indicator_evaluation(tmp_path, engine):
    """Two processes (gloo; DDP under torchrun, FSDP2 and DeepSpeed ZeRO-2 through their launch configs with the CPU
    dry run `HF_VLA_CPU_SHARDING=1`): the indicator's column travels with every rank's batches, and the provenance
    evaluation gathers the loss per indicator value over both ranks."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO
    from test_data import make_dataset
    from test_failures import base_config, write_config

    data = make_dataset(tmp_path / "toy", 8)
    out = tmp_path / "out"
    specs = [{"root": str(data), "name": "demos", "cameras": ["observation.images.cam"], "control_mode": "joint",
              "advantage": {"value": True, "dropout": 0.3}},
             {"root": str(data), "name": "collected", "cameras": ["observation.images.cam"], "control_mode": "joint",
              "advantage": {"value": False, "dropout": 0.3}}]
    config = base_config(data, out, max_steps=2, datasets=specs, validation_ratio=0.25, eval_strategy="steps",
                         eval_steps=2, dataloader_num_workers=0)
    config["model_config"]["tokenizer_max_length"] = 64
    path = write_config(tmp_path, config)
    port = {"ddp": "29543", "fsdp2": "29544", "zero2": "29545"}[engine]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MASTER_PORT=port, HF_VLA_CPU_SHARDING="1")
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
              if engine == "ddp" else
              [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO / "configs" / "accelerate" / f"{engine}.yaml"), "--num_processes", "2", "--main_process_port",
               port])
    done = subprocess.run([*launch, "-m", "hf_vla.train", str(path)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    metrics = json.loads((out / "eval_results.json").read_text())
    for value in ("positive", "negative"):
        assert math.isfinite(metrics[f"eval_by_advantage/{value}/mse"]), sorted(metrics)
    assert json.loads((out / "deployment_config.json").read_text())["advantage"]["conditioned"] is True


# ---- what a probe of annotate and value training found (#104) -------------------------------------------------------
def test_annotate_values_are_cached_by_model_data_prompt_and_settings(round_data, monkeypatch, tmp_path):
    """A killed run's cached values are reused only where everything they depend on is the same: a source re-recorded
    at the same path, or the dataset entry's task corrected, starts them over (a kill leaves the cache)."""
    import json

    import hf_vla.recap.annotate as module
    from hf_vla.models.value import PI05ValueModel

    source = tmp_path / "rollouts"
    shutil.copytree(round_data["rollouts"]["root"], source)
    entry = dict(round_data["rollouts"], root=str(source))
    out = tmp_path / "annotated"

    def run(spec):
        from hf_vla.recap.__main__ import main

        main(["annotate", "--value", str(round_data["value"]), "--datasets", json.dumps([spec]), "--output", str(out),
              "--lookahead", "5", "--overwrite"])

    real_write = module._write
    monkeypatch.setattr(module, "_write", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        run(entry)  # killed after the values: they stay cached
    monkeypatch.setattr(module, "_write", real_write)
    calls = []
    original = PI05ValueModel.value
    monkeypatch.setattr(PI05ValueModel, "value", lambda self, **kw: calls.append(1) or original(self, **kw))
    run(entry | {"task": "move to the blue target"})  # the prompt changed: the cache is not reused
    assert calls
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(module, "_write", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        run(entry)
    monkeypatch.setattr(module, "_write", real_write)
    calls.clear()
    shutil.rmtree(source)  # re-recorded at the same path with fewer, shorter episodes
    from hf_vla.envs.recording import RecordArguments, record

    record(RecordArguments(env="color_reach", output=source, episodes=2, image_size=24, max_episode_steps=20,
                           strategy="policy", policy=str(round_data["run"])), progress=False)
    run(entry)
    assert calls and out.is_dir()


def test_a_nan_success_is_unknown_never_a_success(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_data import CAM, make_dataset

    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource
    from hf_vla.errors import DataError

    root = make_dataset(tmp_path / "data", 3)
    path = sorted((root / "data").rglob("*.parquet"))[0]
    table = pq.read_table(path)
    episodes = table["episode_index"].to_numpy()
    last = np.r_[episodes[1:] != episodes[:-1], True]
    success = np.zeros(len(episodes), np.float32)
    success[last & (episodes == 0)] = 1.0  # episode 0: success at its last frame
    success[last & (episodes == 1)] = np.nan  # episode 1: failed, its last frame's value missing (NaN)
    pq.write_table(table.append_column("next.success", pa.array(success)), path)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["next.success"] = {"dtype": "float32", "shape": [1], "names": None}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    source = LeRobotSource(DatasetConfig(root=str(root), name="nan", cameras=[CAM]), 0)
    with pytest.raises(DataError, match=r"episode\(s\) \[1\] \(1 of 3\) have no outcome"):
        source.episode_outcomes()
    outcomes = source.episode_outcomes(allow_unlabelled=True)
    assert outcomes[0] == 1.0 and np.isnan(outcomes[1]) and outcomes[2] == 0.0


def test_an_episode_of_zero_frames_is_skipped_by_annotate(round_data, tmp_path, caplog):
    import json
    import logging

    import pandas as pd
    import pyarrow.parquet as pq

    source = tmp_path / "rollouts"
    shutil.copytree(round_data["rollouts"]["root"], source)
    episodes_file = sorted((source / "meta" / "episodes").rglob("*.parquet"))[0]
    table = pq.read_table(episodes_file).to_pandas()
    empty = table.iloc[[-1]].copy()
    empty["episode_index"] = int(table["episode_index"].max()) + 1
    empty["length"] = 0
    for column in ("dataset_from_index", "dataset_to_index"):
        if column in empty:
            empty[column] = int(table[column].max())
    pq.write_table(pa_table(pd.concat([table, empty], ignore_index=True)), episodes_file)
    info = json.loads((source / "meta" / "info.json").read_text())
    info["total_episodes"] += 1
    (source / "meta" / "info.json").write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING, logger="hf_vla"):
        out = _annotate(round_data | {"rollouts": dict(round_data["rollouts"], root=str(source))},
                        tmp_path / "annotated")
    assert "1 episode(s) of zero frames in meta/episodes, skipped" in caplog.text
    summary = json.loads((out / "meta" / "hf_vla_recap.json").read_text())
    assert summary["frames"] == info["total_frames"]


def pa_table(frame):
    import pyarrow as pa

    return pa.Table.from_pandas(frame, preserve_index=False)


def test_a_value_model_started_from_a_bf16_policy_trains(round_data, tmp_path):
    """Step 2 of a RECAP round in bf16: the value readout, new in the checkpoint, is built in fp32 like the rest of
    the modules the model keeps in fp32, and the first step runs."""
    import json

    from conftest import REPO

    from hf_vla.train import main as train_main

    train_main([str(REPO / "configs/demo.json"), "--policy", "pi05_value", "--model_name_or_path",
                str(round_data["run"]), "--dtype", "bfloat16", "--datasets", json.dumps([round_data["rollouts"]]),
                "--output_dir", str(tmp_path / "value"), "--generate_demo_data", "false", "--validation_ratio", "0",
                "--per_device_train_batch_size", "4", "--stream_open_blocks", "2", "--max_steps", "1",
                "--warmup_steps", "0", "--disable_tqdm", "true", "--dataloader_num_workers", "0",
                "--model_config", "null"])
    from hf_vla.models.value import PI05ValueModel

    model = PI05ValueModel.from_pretrained(tmp_path / "value")
    assert model.value_readout[0].weight.dtype == torch.float32


# ---- one episode limit per task, cross-fitting, decoys (#105) -------------------------------------------------------
def test_one_episode_limit_per_task_across_the_mixture(tmp_path):
    """Demonstrations recorded with the env's 500-step default and rollouts with 200: one task on two scales is
    refused naming both; the dataset field settles it; undeclared, the task's longest episode in any dataset."""
    from test_data import CAM, make_dataset

    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource, resolve_episode_limits
    from hf_vla.deployment.contract import RECORD_MARKER
    from hf_vla.errors import ConfigError

    demos, rollouts = make_dataset(tmp_path / "demos", 3), make_dataset(tmp_path / "rollouts", 3, lengths=[5, 6, 7])
    for root, limit in ((demos, 500), (rollouts, 200)):
        (root / "meta" / RECORD_MARKER).write_text(json.dumps({"env": "x", "max_episode_steps": limit}))

    def sources(**fields):
        return [LeRobotSource(DatasetConfig(root=str(root), name=name, cameras=[CAM], task="reach",
                                            **fields.get(name, {})), 0)
                for root, name in ((demos, "demos"), (rollouts, "rollouts"))]

    with pytest.raises(ConfigError, match=r"task 'reach': dataset 'rollouts' has episode limit 200 \(its recording\) "
                                          r"and dataset 'demos' 500 \(its recording\)"):
        resolve_episode_limits(sources())
    fixed = sources(demos={"max_episode_steps": 200})
    assert resolve_episode_limits(fixed) == {"reach": 200}
    assert fixed[0].episode_limit(0) == fixed[1].episode_limit(0) == 200
    for root in (demos, rollouts):
        (root / "meta" / RECORD_MARKER).unlink()
    undeclared = sources()
    longest = max(int(s.episodes["length"].max()) for s in undeclared)
    assert resolve_episode_limits(undeclared) == {"reach": longest}
    assert resolve_episode_limits(sources(), given={"reach": 300}) == {"reach": 300}  # a value model's own


def test_cross_fitted_annotation_judges_each_episode_with_the_model_that_held_it_out(round_data, tmp_path):
    """Two value models, each trained holding out one fold (`hold_out_fold`), annotate the rollouts: episode e's
    values are the model of fold e mod 2's; a model that trained on every episode is refused as a judge of them."""
    import json as json_module

    from conftest import REPO

    from hf_vla.errors import ConfigError
    from hf_vla.recap.annotate import AnnotateArguments, _judges_of, _load_value_model
    from hf_vla.train import main as train_main

    rollouts = round_data["rollouts"]
    models = []
    for fold in range(2):
        out = tmp_path / f"value{fold}"
        train_main([str(REPO / "configs/demo.json"), "--policy", "pi05_value", "--model_name_or_path",
                    str(round_data["value"]), "--model_config", "null", "--datasets",
                    json_module.dumps([dict(rollouts, hold_out_fold=[fold, 2])]), "--output_dir", str(out),
                    "--generate_demo_data", "false", "--validation_ratio", "0", "--per_device_train_batch_size", "4",
                    "--stream_open_blocks", "2", "--max_steps", "1", "--warmup_steps", "0", "--disable_tqdm", "true",
                    "--dataloader_num_workers", "0"])
        models.append(out)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models[1])
    assert config.held_out_fold["fold"] == 1 and config.held_out_fold["folds"] == 2
    assert config.episode_limits and set(config.episode_limits.values()) == {20}
    out = tmp_path / "annotated"
    from hf_vla.recap.__main__ import main

    main(["annotate", "--value", str(models[1]), str(models[0]), "--datasets", json_module.dumps([rollouts]),
          "--output", str(out), "--lookahead", "5"])
    import pyarrow.parquet as pq

    table = pq.read_table(sorted((out / "data").rglob("*.parquet"))[0]).to_pandas()
    from hf_vla.data.dataset_config import DatasetConfig
    from hf_vla.data.sources import LeRobotSource
    from hf_vla.recap.annotate import _values

    source = LeRobotSource(DatasetConfig(**rollouts), 0)
    args = AnnotateArguments(value=[str(m) for m in models], datasets=[rollouts], output=str(tmp_path / "x"))
    for fold, model_dir in enumerate(models):
        model, processor = _load_value_model(str(model_dir), "cpu")
        mine = [e for e in source.episodes["episode_index"].tolist() if e % 2 == fold]
        want = _values(source, model, processor, args, tmp_path / f"cache{fold}", str(model_dir), mine)
        for episode in mine:
            got = table[table["episode_index"] == episode]["recap.value"].to_numpy()
            np.testing.assert_allclose(got, want[episode].astype(np.float32), rtol=0, atol=0)
    judges = [_load_value_model(str(round_data["value"]), "cpu"), _load_value_model(str(models[0]), "cpu")]
    with pytest.raises(ConfigError, match="not trained for cross-fitting"):
        _judges_of(judges, [str(round_data["value"]), str(models[0])], [source])


def test_decoy_recordings_drive_to_another_target_than_the_instruction_names(tmp_path):
    from hf_vla.envs.reach import ColorReachWithExpert

    env = ColorReachWithExpert(seed=0, decoy=True, image_size=32, max_steps=40)
    for seed in range(10):
        env.reset(seed=seed)
        assert env.target != env.goal and env.target in env.targets and env.goal in env.task
        for _ in range(40):
            _, _, terminated, truncated, info = env.step(env.expert_action())
            if terminated or truncated:
                break
        assert terminated and info["is_success"]  # "successful" for the recorder: it reached the decoy
        assert np.linalg.norm(env.agent - env.targets[env.target]) < env.success_radius
        assert np.linalg.norm(env.agent - env.targets[env.goal]) >= env.success_radius


def test_a_policy_fine_tuned_with_the_embedding_indicator_starts_as_its_checkpoint(round_data, tmp_path):
    """`--model_config '{"advantage_indicator": "embedding"}'` on a fine-tune: the one field that adds a module (zero
    at the start, so the first forward is the checkpoint's), trained by the indicator's datasets."""
    import json as json_module

    from conftest import REPO
    from safetensors.torch import load_file

    from hf_vla.train import main as train_main

    demos = dict(round_data["demos"], advantage={"value": True})
    rollouts = dict(round_data["rollouts"], advantage={"value": False})
    out = tmp_path / "embedding"
    train_main([str(REPO / "configs/demo.json"), "--model_name_or_path", str(round_data["run"]), "--model_config",
                json_module.dumps({"advantage_indicator": "embedding"}), "--datasets",
                json_module.dumps([demos, rollouts]), "--output_dir", str(out), "--generate_demo_data", "false",
                "--validation_ratio", "0", "--per_device_train_batch_size", "4", "--stream_open_blocks", "2",
                "--max_steps", "3", "--warmup_steps", "0", "--disable_tqdm", "true", "--dataloader_num_workers", "0"])
    weights = load_file(out / "model.safetensors")
    assert weights["advantage_embedding.weight"].abs().sum() > 0  # trained from zero
    contract = json_module.loads((out / "deployment_config.json").read_text())
    assert contract["advantage"]["indicator"] == "embedding"
