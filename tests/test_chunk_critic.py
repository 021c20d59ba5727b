"""Best-of-N's chunk critic: the model reads the chunk (each candidate scored alone, padded steps and dims left out),
the `critic` selector takes the highest score, the runner acts on the critic's choice among the policy's own
candidates, and `hf_vla.train` / `evaluate` / `serve` run it with one-line refusals of what cannot work."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import REPO, randomize_
from test_serve import HEAD, NORM_STATS, demo_config, observations

from hf_vla.errors import ConfigError
from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
from hf_vla.models.value import PI05ChunkCritic, PI05ChunkCriticConfig
from hf_vla.serving.critic import ChunkCriticScorer
from hf_vla.serving.policy import PolicyRunner
from hf_vla.serving.selection import check_selection_flags, select_chunk


def _critic_config(**overrides) -> PI05ChunkCriticConfig:
    fields = {k: v for k, v in demo_config().to_dict().items() if k in PI05ChunkCriticConfig.__dataclass_fields__
              and k not in ("model_type", "transformers_version", "architectures", "auto_map")}
    return PI05ChunkCriticConfig(**{**fields, **overrides})


@pytest.fixture(scope="module")
def critic():
    return randomize_(PI05ChunkCritic(_critic_config()), seed=5, scale=0.2).eval()


def _observation_inputs(config, rows=1, seed=0):
    generator = torch.Generator().manual_seed(seed)
    size = config.vlm_config.vision_config.image_size
    mask = torch.ones(rows, 9, dtype=torch.bool)
    mask[1:, -3:] = False  # prompts of different lengths (right-padded)
    return {"input_ids": torch.randint(1, 100, (rows, 9), generator=generator), "attention_mask": mask,
            "pixel_values": torch.randn(rows, 1, 3, size, size, generator=generator)}


def test_each_candidate_is_scored_alone_and_the_chunk_is_read(critic):
    """`chunk_values` (the prefix's key/value cache computed once, repeated per candidate) equals the forward of each
    candidate alone, prompts of different lengths included."""
    config = critic.config
    inputs = _observation_inputs(config, rows=2)
    candidates = torch.randn(2, 4, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(1))
    scores = critic.chunk_values(candidates, **inputs)
    assert scores.shape == (2, 4) and ((scores >= -1) & (scores <= 0)).all()
    with torch.no_grad():  # one candidate at a time, one observation at a time: the same scores
        alone = torch.stack([torch.cat([critic(**{k: v[r:r + 1] for k, v in inputs.items()},
                                               actions=candidates[r, i:i + 1]).value for i in range(4)])
                             for r in range(2)])
    torch.testing.assert_close(scores, alone, atol=1e-5, rtol=0)
    assert scores[0].std() > 0  # the chunk moves the score
    # a padded step (past an episode's end) is not read, nor a padded action dim of a candidate
    chunk = candidates[0, :1].clone()
    pad = torch.zeros(1, config.chunk_size, dtype=torch.bool)
    pad[:, -2:] = True
    first = {k: v[:1] for k, v in inputs.items()}
    with torch.no_grad():
        base = critic(**first, actions=chunk, action_is_pad=pad).value
        moved = chunk.clone()
        moved[:, -2:] += 5.0
        same = critic(**first, actions=moved, action_is_pad=pad).value
        read = critic(**first, actions=moved).value
    torch.testing.assert_close(same, base, atol=1e-5, rtol=0)
    assert not torch.allclose(read, base, atol=1e-4)
    dim_mask = torch.ones(1, config.max_action_dim)
    dim_mask[:, -1] = 0
    padded = candidates[:1].clone()
    padded[..., -1] += 5.0
    torch.testing.assert_close(critic.chunk_values(padded, action_dim_mask=dim_mask, **first),
                               critic.chunk_values(candidates[:1] * dim_mask, **first), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"actions: a chunk of shape \[B, 8, 2\]"):
        critic(**first, actions=chunk[:, :3])


def test_negative_chunks_read_another_rows_chunk_as_a_failure():
    """`negative_chunks`: in training, the drawn rows read the previous row's chunk (and padding) against the worst
    return, -1; the others, and every row outside training, are untouched."""
    critic = randomize_(PI05ChunkCritic(_critic_config(negative_chunks=0.5)), seed=5, scale=0.2).train()
    config = critic.config
    inputs = _observation_inputs(config, rows=4)
    generator = torch.Generator().manual_seed(2)
    actions = torch.randn(4, config.chunk_size, config.max_action_dim, generator=generator)
    pad = torch.zeros(4, config.chunk_size, dtype=torch.bool)
    pad[0, -3:] = True
    targets = torch.tensor([-0.1, -0.2, -0.3, -0.4])
    torch.manual_seed(0)
    swap = torch.rand(4) < 0.5
    assert swap.any() and not swap.all()
    torch.manual_seed(0)
    drawn = critic(**inputs, actions=actions, action_is_pad=pad, value_targets=targets).per_sample_loss
    critic.config.negative_chunks = 0.0
    expected = critic(**inputs, actions=torch.where(swap[:, None, None], actions.roll(1, 0), actions),
                      action_is_pad=torch.where(swap[:, None], pad.roll(1, 0), pad),
                      value_targets=torch.where(swap, torch.tensor(-1.0), targets)).per_sample_loss
    torch.testing.assert_close(drawn, expected, atol=1e-5, rtol=0)
    critic.config.negative_chunks = 0.5
    plain = critic.eval()(**inputs, actions=actions, action_is_pad=pad, value_targets=targets).per_sample_loss
    assert not torch.allclose(plain, expected, atol=1e-4)  # outside training every row reads its own chunk
    from huggingface_hub.errors import StrictDataclassClassValidationError

    with pytest.raises(StrictDataclassClassValidationError, match="negative_chunks=1.0: a share in"):
        _critic_config(negative_chunks=1.0)


def test_the_critic_selector_takes_the_highest_score():
    candidates = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(0))
    scores = torch.tensor([-0.5, -0.1, -0.9, -0.1, -0.3])
    chosen, selection = select_chunk(candidates, "critic", dims=3, scores=scores)
    assert selection.index == 1 and torch.equal(chosen, candidates[1])  # the first of equals
    assert selection.value == pytest.approx(-0.1) and selection.value_range == pytest.approx(0.8)
    assert set(selection.record()) == {"best_of/index", "best_of/spread", "best_of/value", "best_of/value_range"}
    with pytest.raises(ValueError, match="one critic score per candidate"):
        select_chunk(candidates, "critic", dims=3)


@pytest.fixture(scope="module")
def policy(tiny_tokenizer):
    model = randomize_(PI05ForConditionalGeneration(demo_config()), seed=3, scale=0.1).eval()
    processor = PI05Processor.from_config(model.config, tiny_tokenizer, norm_stats=NORM_STATS, head_names=[HEAD])
    return model, processor


def test_the_runner_acts_on_the_critics_choice_among_the_policys_own_candidates(policy, critic, tiny_tokenizer):
    model, processor = policy
    scorer = ChunkCriticScorer(critic, PI05Processor.from_config(critic.config, tiny_tokenizer, norm_stats=NORM_STATS,
                                                                 head_names=[HEAD]), "critic")
    observation, task = next(observations(1, seed=5))
    runner = PolicyRunner(model, processor, seed=11, best_of=6, selector="critic", critic=scorer)
    actions = runner({**observation, "prompt": task})
    config = model.config
    noise = torch.randn(1, 6, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(11))
    rows = PolicyRunner(model, processor, best_of=6, selector="critic", critic=scorer).prepare(
        {**observation, "prompt": task}).rows
    request = PolicyRunner(model, processor).prepare({**observation, "prompt": task})
    with torch.no_grad():
        candidates = model.sample_actions(**request.inputs, noise=noise, num_candidates=6)[0]
    critic_inputs = scorer.processor(images=rows["images"], text=[task], state=rows["states"], head=HEAD)
    masked = candidates.clone()
    masked[..., 2:] = 0  # the head's two action dims
    keys = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")
    scores = critic.chunk_values(masked[None], **{k: critic_inputs[k] for k in keys if k in critic_inputs})[0]
    index = int(scores.argmax())
    assert scores.max() > scores.min()
    expected = processor.unnormalize_actions(candidates[index][None], HEAD)[0].numpy()
    np.testing.assert_allclose(actions, expected, atol=1e-5, rtol=0)
    assert runner.last_selection.index == index and runner.last_selection.value == pytest.approx(float(scores[index]))
    # batched prediction picks per row, each with its own observation
    out = PolicyRunner(model, processor, seed=11, best_of=6, selector="critic", critic=scorer).predict(
        rows["images"].repeat(2, 1, 1, 1, 1), np.repeat(rows["states"], 2, axis=0), [task, task],
        torch.ones(2, rows["images"].shape[1], dtype=torch.bool))
    np.testing.assert_allclose(out[0], expected, atol=1e-5, rtol=0)


def test_the_critic_picks_among_real_time_chunked_candidates(policy, critic, tiny_tokenizer):
    """With real-time chunking every candidate continues the chunk being executed: the chosen one starts with the
    actions already committed, whichever the critic picks."""
    model, processor = policy
    scorer = ChunkCriticScorer(critic, PI05Processor.from_config(critic.config, tiny_tokenizer, norm_stats=NORM_STATS,
                                                                 head_names=[HEAD]), "critic")
    runner = PolicyRunner(model, processor, seed=2, best_of=5, selector="critic", critic=scorer)
    frames = observations(2, seed=9)
    observation, task = next(frames)
    first = runner({**observation, "prompt": task})
    observation, task = next(frames)
    second = runner({**observation, "prompt": task}, inference_delay=2, executed_steps=3)
    assert runner.last_rtc_method is not None and runner.last_selection is not None
    np.testing.assert_allclose(second[:2], first[3:5], atol=1e-5, rtol=0)  # the committed actions, as executed


def test_a_critic_of_another_action_space_or_without_a_critic_is_refused_in_one_line(policy, critic, tiny_tokenizer):
    model, processor = policy
    other = {HEAD: {**NORM_STATS[HEAD], "actions": {k: [v * 2 for v in vals] if isinstance(vals, list) else vals
                                                    for k, vals in NORM_STATS[HEAD]["actions"].items()}}}
    scorer = ChunkCriticScorer(critic, PI05Processor.from_config(critic.config, tiny_tokenizer, norm_stats=other,
                                                                 head_names=[HEAD]), "CRITIC")
    with pytest.raises(ConfigError, match="--critic CRITIC: head .* action statistics differ from the policy's"):
        PolicyRunner(model, processor, best_of=4, selector="critic", critic=scorer)
    short = randomize_(PI05ChunkCritic(_critic_config(chunk_size=4)), seed=1)
    scorer = ChunkCriticScorer(short, processor, "SHORT")
    with pytest.raises(ConfigError, match="--critic SHORT: chunk_size=4, the policy's is 8"):
        PolicyRunner(model, processor, best_of=4, selector="critic", critic=scorer)
    with pytest.raises(ValueError, match="give both or neither"):
        PolicyRunner(model, processor, best_of=4, selector="critic")
    for flags, culprit in (((4, "critic", None), "--selector critic: give --critic PATH"),
                           ((4, "medoid", "c"), "--critic with --selector medoid"),
                           ((1, None, "c"), "--best_of 1 draws one")):
        with pytest.raises(ConfigError, match=culprit):
            check_selection_flags(*flags)
    assert check_selection_flags(4, None, "c") == "critic" and check_selection_flags(4, None, None) == "medoid"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step demo policy on 4 ColorReach episodes and a chunk critic trained 3 steps from it on the same episodes
    with the policy's statistics."""
    from conftest import colorreach_run

    from hf_vla.train import main as train_main

    base = tmp_path_factory.mktemp("critic")
    run, datasets = colorreach_run(base, 20)
    train_main([str(REPO / "configs/demo.json"), "--policy", "pi05_chunk_critic", "--model_name_or_path", str(run),
                "--norm_stats_from", str(run), "--datasets", json.dumps(datasets), "--output_dir",
                str(base / "critic"), "--generate_demo_data", "false", "--validation_ratio", "0",
                "--per_device_train_batch_size", "4", "--stream_open_blocks", "2", "--max_steps", "3",
                "--warmup_steps", "0", "--eval_strategy", "no", "--disable_tqdm", "true",
                "--dataloader_num_workers", "0"])
    return {"base": base, "run": run, "critic": base / "critic"}


def test_a_critic_trains_loads_and_picks_in_evaluate(trained, capsys):
    from transformers import AutoModel

    from hf_vla.evaluate import main as evaluate_main
    from hf_vla.serving.critic import load_critic

    model = AutoModel.from_pretrained(trained["critic"])
    assert isinstance(model, PI05ChunkCritic) and model.config.episode_limits
    start = AutoModel.from_pretrained(trained["run"]).state_dict()
    assert any(not torch.equal(model.state_dict()[k], start[k]) for k in start if k.startswith("model.vlm.language"))
    out = trained["base"] / "eval"
    evaluate_main(["--checkpoint", str(trained["run"]), "--episodes", "2", "--best_of", "3", "--critic",
                   str(trained["critic"]), "--output_dir", str(out), "--save_videos", "0"])
    result = json.loads((out / "eval_result.json").read_text())
    assert result["settings"]["best_of"]["value"] == {"candidates": 3, "selector": "critic",
                                                      "critic": str(trained["critic"])}
    with pytest.raises(ConfigError, match="a 'pi05' checkpoint, not a chunk critic"):
        load_critic(trained["run"])
    # the policy's own rollouts, acting on the critic's choice of 3 (RECAP's and the critic's next data)
    from hf_vla.deployment.contract import RECORD_MARKER
    from hf_vla.envs.recording import RecordArguments, record

    rollouts = trained["base"] / "rollouts"
    record(RecordArguments(env="color_reach", output=rollouts, episodes=2,
                           strategy="policy", policy=str(trained["run"]), best_of=3, critic=str(trained["critic"])),
           progress=False)
    plan = json.loads((rollouts / "meta" / RECORD_MARKER).read_text())
    assert plan["best_of"]["candidates"] == 3 and plan["best_of"]["selector"] == "critic"
    with pytest.raises(ConfigError, match="--best_of / --selector / --critic: how the policy acts"):
        RecordArguments(env="color_reach", output=str(rollouts), episodes=2, best_of=3)
    from hf_vla.hub.resolve import load_pretrained

    with pytest.raises(ValueError, match="scores action chunks, not a policy"):
        load_pretrained(trained["critic"])


def test_a_critic_bundled_with_its_policy_runs_without_flags(trained, tmp_path, monkeypatch):
    """`hf_vla.convert --critic` copies the policy with the critic in `critic/` and best-of-N in its contract;
    evaluate, serve and record then run it without flags (a flag still wins), a Hub copy finds its critic, and what
    cannot work is one line."""
    from hf_vla.convert import main as convert_main
    from hf_vla.deployment.contract import RECORD_MARKER, read
    from hf_vla.envs.recording import RecordArguments, record
    from hf_vla.evaluate import main as evaluate_main
    from hf_vla.serving.critic import load_critic, plan_best_of

    bundle = tmp_path / "bundle"
    convert_main(["--input", str(trained["run"]), "--critic", str(trained["critic"]), "--best_of", "3", "--output",
                  str(bundle)])
    contract = read(bundle)
    assert contract.best_of == {"candidates": 3, "selector": "critic", "critic": "critic"}
    assert (bundle / "critic" / "model.safetensors").is_file() and not list(bundle.glob("checkpoint-*"))
    assert isinstance(load_critic(bundle / "critic").model, PI05ChunkCritic)

    def settings(*flags):
        out = tmp_path / f"eval{len(list(tmp_path.glob('eval*')))}"
        evaluate_main(["--checkpoint", str(bundle), "--episodes", "2", "--output_dir", str(out), "--save_videos", "0",
                       *flags])
        return json.loads((out / "eval_result.json").read_text())["settings"].get("best_of")

    assert settings() == {"value": {"candidates": 3, "selector": "critic", "critic": str(bundle / "critic")},
                          "source": "checkpoint"}
    assert settings("--best_of", "1") is None  # one sample, as asked
    assert settings("--best_of", "4", "--selector", "medoid") == {"value": {"candidates": 4, "selector": "medoid"},
                                                                  "source": "flag"}
    from hf_vla.serving.arguments import RTCArguments, ServeArguments
    from hf_vla.serving.launch import serve_checkpoint
    from hf_vla.serving.server import PolicyServer

    served = []  # the server as serve built it, not listening
    monkeypatch.setattr(PolicyServer, "serve", lambda self, host, port: served.append(self.metadata))
    serve_checkpoint(ServeArguments(checkpoint=str(bundle)), RTCArguments())
    assert served[0]["best_of"] == {"default": 3, "max": 3, "selector": "critic", "critic": str(bundle / "critic")}
    with pytest.raises(ConfigError, match="--max_best_of 2 is below the checkpoint's best-of-3"):
        serve_checkpoint(ServeArguments(checkpoint=str(bundle), max_best_of=2), RTCArguments())
    rollouts = tmp_path / "rollouts"
    record(RecordArguments(env="color_reach", output=rollouts, episodes=1, strategy="policy", policy=str(bundle)),
           progress=False)
    acted = json.loads((rollouts / "meta" / RECORD_MARKER).read_text())["best_of"]
    assert acted["candidates"] == 3 and acted["selector"] == "critic" and acted["critic"].endswith("critic")
    # a copy on the Hub (here its cache) finds the critic in its own folder
    from huggingface_hub import constants
    from test_hub import add_to_hub_cache

    cache = tmp_path / "hub_cache"
    add_to_hub_cache(cache, "someone/policy_best_of_3", bundle)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    hub = plan_best_of(None, None, None, contract, "someone/policy_best_of_3")
    assert hub.critic.startswith(str(cache)) and isinstance(load_critic(hub.critic).model, PI05ChunkCritic)
    # refused in one line: a critic that is not one, a bundle without its folder, flags that cannot run together
    with pytest.raises(ConfigError, match="--critic .*: a 'pi05' checkpoint, not a chunk critic"):
        convert_main(["--input", str(trained["run"]), "--critic", str(trained["run"]), "--output", str(tmp_path / "x")])
    with pytest.raises(ConfigError, match="--best_of 1: a critic picks among 2 or more"):
        convert_main(["--input", str(trained["run"]), "--critic", str(trained["critic"]), "--best_of", "1",
                      "--output", str(tmp_path / "x")])
    with pytest.raises(ConfigError, match="--best_of 3: taken with --critic"):
        convert_main(["--input", str(trained["run"]), "--best_of", "3", "--output", str(tmp_path / "x")])
    with pytest.raises(ConfigError, match="--critic bundles a critic with an hf_vla policy checkpoint .*pi05_chunk_critic"):
        convert_main(["--input", str(trained["critic"]), "--critic", str(trained["critic"]), "--output",
                      str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    import shutil

    shutil.rmtree(bundle / "critic")
    with pytest.raises(ConfigError, match="bundles a chunk critic at critic/, which is missing"):
        plan_best_of(None, None, None, contract, bundle)
    assert plan_best_of(1, None, None, contract, bundle).best_of == 1  # --best_of 1 needs no critic
    with pytest.raises(ConfigError, match="--selector critic: give --critic PATH"):
        plan_best_of(4, "critic", None, None, trained["run"])
