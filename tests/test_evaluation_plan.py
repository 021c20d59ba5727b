"""An evaluation's plan (`hf_vla.evaluation.plan`): built once from the checkpoint's contract, the arguments and the
env registry, every setting with its source, and every refusal raised while it is built, before the policy or any
of the run's envs is made. The plan reads the contract alone, so these checkpoints are contracts without weights."""

from __future__ import annotations

import pytest

from hf_vla.deployment.contract import DeploymentConfig
from hf_vla.errors import ConfigError
from hf_vla.evaluation.arguments import EvaluateArguments

HEAD = "color_reach"
SOURCES = {"checkpoint", "flag", "flag (override)", "default"}


def _contract(path, **extra):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "hf_vla_pi05"}')  # a checkpoint directory's mark; never read
    benchmark = extra.pop("benchmark", {"env": "hf_vla/ColorReach-v0", "max_episode_steps": 40,
                                        "env_kwargs": {"layout": "random"}})
    DeploymentConfig(policy="pi05", chunk_size=8, n_action_steps=4, image_size=32, heads={HEAD: {
        "cameras": [{"key": "observation.image", "height": 32, "width": 32}], "benchmark": benchmark,
        "control_mode": "delta_xy"}}, default_head=HEAD, **extra).save(path)
    return path


@pytest.fixture
def nothing_is_built(monkeypatch):
    """The policy and the run's envs fail if made: a refusal must come first."""
    import hf_vla.evaluation.runner as runner

    def built(*args, **kwargs):
        raise AssertionError("built before the plan refused")

    monkeypatch.setattr(runner, "load_policy", built)
    monkeypatch.setattr(runner, "_make_envs", built)


def test_every_setting_of_a_plan_names_its_source(tmp_path):
    from hf_vla.evaluation.plan import plan_evaluation

    checkpoint = _contract(tmp_path / "recap", advantage={"conditioned": True, "cfg_beta": 1.0})
    plan = plan_evaluation(EvaluateArguments(checkpoint=str(checkpoint), episodes=3, cfg_beta=2.0, seed=20_000,
                                             output_dir=str(tmp_path / "out")))
    record = plan.record()
    assert all(entry["source"] in SOURCES for entry in record.values()), record
    expected = {"env": ("hf_vla/ColorReach-v0", "checkpoint"), "n_action_steps": (4, "checkpoint"),
                "max_episode_steps": (40, "checkpoint"), "image_size": (32, "checkpoint"),
                "cameras": (["observation.image"], "checkpoint"), "head": (HEAD, "checkpoint"),
                "control_mode": ("delta_xy", "checkpoint"), "seed": (20_000, "flag"), "cfg_beta": (2.0, "flag"),
                "env_kwargs": ({"layout": "random"}, "checkpoint"), "num_envs": (plan.num_envs, "default")}
    assert {name: (record[name]["value"], record[name]["source"]) for name in expected} == expected
    assert plan.seeds == [20_000, 20_001, 20_002] and plan.env.tasks == [None]
    assert plan.env.env_kwargs == {"layout": "random", "image_size": 32}

    # guidance left to the checkpoint: its recorded beta; a plain checkpoint records none
    plan = plan_evaluation(EvaluateArguments(checkpoint=str(checkpoint), episodes=1))
    assert plan.record()["cfg_beta"] == {"value": 1.0, "source": "checkpoint"}
    plain = _contract(tmp_path / "plain")
    assert "cfg_beta" not in plan_evaluation(EvaluateArguments(checkpoint=str(plain), episodes=1)).record()


@pytest.mark.parametrize("case", ["guidance", "subtask", "subtask_oracle", "contradiction", "env", "cameras",
                                  "memory_stride", "output_dir", "episodes"])
def test_each_refusal_happens_before_any_env_or_policy_is_built(tmp_path, nothing_is_built, case):
    from hf_vla.evaluation.runner import evaluate_checkpoint

    plain = str(_contract(tmp_path / "plain"))
    cases = {
        "guidance": (dict(checkpoint=plain, cfg_beta=2.0), "guidance needs an advantage-conditioned policy"),
        "subtask": (dict(checkpoint=plain, subtask="auto"), "not trained with subtasks"),
        "subtask_oracle": (dict(checkpoint=plain, subtask="oracle"), "has none"),
        "contradiction": (dict(checkpoint=plain, n_action_steps=2), "--override n_action_steps"),
        "env": (dict(checkpoint=plain, env="nope/NoSuchEnv-v0"), "not an env"),
        "cameras": (dict(checkpoint=plain, cameras=["wrist"], override=["cameras"]), "not an image"),
        "output_dir": (dict(checkpoint=plain, output_dir="/proc/hf_vla_eval"), "--output_dir"),
        "episodes": (dict(checkpoint=plain, episodes=0), "episodes=0"),
    }
    if case == "memory_stride":  # 1 frame of 30 fps data is no whole number of Meta-World's 80 Hz steps
        mem = _contract(tmp_path / "mem", benchmark={"env": "metaworld", "tasks": ["reach-v3"]},
                        memory={"stride": 1, "frames": 2, "fps": 30})
        cases[case] = (dict(checkpoint=str(mem)), "not a whole number")
    arguments, message = cases[case]
    with pytest.raises(ConfigError) as refused:
        evaluate_checkpoint(EvaluateArguments(**{"episodes": 1, **arguments}), progress=False)
    assert message in str(refused.value) and len(str(refused.value).splitlines()) == 1, str(refused.value)
