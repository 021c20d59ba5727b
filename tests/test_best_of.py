"""Best-of-N at inference: the selectors against a brute-force float64 medoid, the runner's chosen chunk against the
model's own candidates for the same noise, the server's reply through openpi's real client, and the evaluation's
settings and refusals."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import randomize_
from test_serve import HEAD, NORM_STATS, ThreadServer, demo_config, observations

from hf_vla.errors import ConfigError
from hf_vla.evaluation.arguments import EvaluateArguments
from hf_vla.models.pi05 import PI05ForConditionalGeneration, PI05Processor
from hf_vla.serving.policy import PolicyRunner
from hf_vla.serving.selection import select_chunk


def test_the_medoid_is_the_candidate_nearest_all_others_and_padded_dims_are_left_out():
    generator = torch.Generator().manual_seed(0)
    candidates = torch.randn(6, 4, 3, generator=generator)
    candidates[2] += 5.0  # an outlier is never the consensus
    chosen, selection = select_chunk(candidates, "medoid", dims=3)
    values = candidates.double().flatten(1).numpy()
    totals = [sum(np.linalg.norm(values[i] - values[j]) for j in range(6)) for i in range(6)]
    assert selection.index == int(np.argmin(totals)) != 2 and torch.equal(chosen, candidates[selection.index])
    mean = values.mean(0)
    assert selection.spread == pytest.approx(float(np.sqrt(((values - mean) ** 2).mean())), rel=1e-9)
    first, picked = select_chunk(candidates, "first", dims=3)
    assert picked.index == 0 and torch.equal(first, candidates[0])
    # candidates that differ only in the model's padded dims agree on every action: no spread, the first one
    same = torch.zeros(4, 4, 6)
    same[:, :, 3:] = torch.randn(4, 4, 3, generator=generator)
    assert select_chunk(same, "medoid", dims=3)[1].spread == 0.0
    with pytest.raises(ValueError, match="selector='best'"):
        select_chunk(candidates, "best")


@pytest.fixture(scope="module")
def policy(tiny_tokenizer):
    model = randomize_(PI05ForConditionalGeneration(demo_config()), seed=3, scale=0.1).eval()
    processor = PI05Processor.from_config(model.config, tiny_tokenizer, norm_stats=NORM_STATS, head_names=[HEAD])
    return model, processor


@pytest.mark.parametrize("selector", ["medoid", "first"])
def test_the_runner_acts_on_the_chosen_candidate_of_the_models_own(policy, selector):
    """The runner's chunk is the selector's choice among `sample_actions`' N candidates for the noise its seed draws,
    in robot units; `last_selection` says which and how far apart they were."""
    model, processor = policy
    observation, task = next(observations(1, seed=5))
    runner = PolicyRunner(model, processor, seed=11, best_of=4, selector=selector)
    actions = runner({**observation, "prompt": task})
    config = model.config
    noise = torch.randn(1, 4, config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(11))
    request = PolicyRunner(model, processor).prepare({**observation, "prompt": task})
    with torch.no_grad():
        candidates = model.sample_actions(**request.inputs, noise=noise, num_candidates=4)[0]
    chosen, selection = select_chunk(candidates, selector, dims=2)
    expected = processor.unnormalize_actions(chosen[None], HEAD)[0].numpy()
    np.testing.assert_allclose(actions, expected, atol=1e-5, rtol=0)
    assert runner.last_selection == selection and selection.spread > 0
    single = PolicyRunner(model, processor, seed=11)
    single({**observation, "prompt": task})
    assert single.last_selection is None


def test_the_server_replies_with_the_choice_and_the_spread(policy):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from hf_vla.serving.server import PolicyServer

    model, processor = policy
    from hf_vla.serving.policy import InputLimits

    served = ThreadServer(PolicyServer(PolicyRunner(model, processor, best_of=3, limits=InputLimits(max_best_of=6))))
    try:
        client = WebsocketClientPolicy(served.uri)
        assert client.get_server_metadata()["best_of"] == {"default": 3, "max": 6, "selector": "medoid",
                                                          "critic": None}
        observation, task = next(observations(1))
        reply = client.infer({**observation, "prompt": task})
        assert reply["best_of/index"] in (0, 1, 2) and reply["best_of/spread"] > 0
        assert reply["actions"].shape == (model.config.chunk_size, 2)
        # a request's own N, bounded by the server's max_best_of: the runner's choice among that many candidates
        observation, task = next(observations(1, seed=4))
        reply = client.infer({**observation, "prompt": task, "best_of": 6, "episode_seed": 21})
        runner = PolicyRunner(model, processor, best_of=6)  # the same draws as the request's 6
        runner.reset(seed=21)
        np.testing.assert_allclose(reply["actions"], runner({**observation, "prompt": task}), atol=1e-5, rtol=0)
        assert reply["best_of/index"] == runner.last_selection.index
        single = client.infer({**observation, "prompt": task, "best_of": 1})
        assert "best_of/index" not in single
        for value in (7, 0, 2.5, True):
            with pytest.raises(Exception, match=rf"best_of={value!r}: a whole number in \[1, 6\]"):
                client.infer({**observation, "prompt": task, "best_of": value})
    finally:
        served.stop()


def test_best_of_settings_are_recorded_and_refused_in_one_line(tmp_path, policy):
    from test_evaluation_plan import _contract

    from hf_vla.evaluation.plan import plan_evaluation

    checkpoint = _contract(tmp_path / "ckpt")
    plan = plan_evaluation(EvaluateArguments(checkpoint=str(checkpoint), episodes=1, best_of=8,
                                             output_dir=str(tmp_path / "out")))
    assert plan.record()["best_of"] == {"value": {"candidates": 8, "selector": "medoid"}, "source": "flag"}
    assert "best_of" not in plan_evaluation(EvaluateArguments(checkpoint=str(checkpoint), episodes=1)).record()
    for kwargs, message in [({"best_of": 65}, "--best_of 65: 1 to 64"), ({"best_of": 0}, "--best_of 0: 1 to 64"),
                            ({"best_of": 2, "server": "ws://127.0.0.1:1"},
                             "--best_of / --selector / --critic: in-process settings")]:
        with pytest.raises(ConfigError, match=message):
            EvaluateArguments(checkpoint=str(checkpoint), episodes=1, **kwargs)
    from hf_vla.serving.arguments import ServeArguments

    for kwargs, message in [({"best_of": 4, "max_best_of": 2}, "--max_best_of 2 is below --best_of 4"),
                            ({"max_best_of": 65}, "--max_best_of 65: 1 to 64"),
                            ({"best_of": 4, "selector": "critic"}, "--selector critic: give --critic PATH")]:
        with pytest.raises(ConfigError, match=message):
            ServeArguments(checkpoint=str(checkpoint), **kwargs)
    model, processor = policy
    for best_of, selector in itertools.product((0, 65, True), ("medoid",)):
        with pytest.raises(ValueError, match=f"best_of={best_of!r}"):
            PolicyRunner(model, processor, best_of=best_of, selector=selector)
    with pytest.raises(ValueError, match="selector='critic'"):
        PolicyRunner(model, processor, best_of=2, selector="critic")
