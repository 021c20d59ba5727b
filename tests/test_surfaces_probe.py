"""What a probe of the week's surfaces found getting through (#104), each case as it was found: guidance far beyond
any action range, a prompt that cuts a subtask's marker, over-long subtask annotations, a checkpoint's bad config
field, an unknown model type, an env a contract names that does not exist. Each ends in one line (or the documented
behaviour), never a traceback or a silent acceptance. The annotate cases are in test_recap.py, MEM's camera size in
test_memory_loops.py."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import refused
from test_serve import HEAD, NORM_STATS, checkpoint, demo_config, demo_policy  # noqa: F401  (module fixtures)

from hf_vla.errors import ConfigError


def test_guidance_is_bounded_so_actions_stay_finite(checkpoint, capsys):  # noqa: F811
    from hf_vla.evaluate import cli as evaluate_cli
    from hf_vla.models.common.flow import MAX_CFG_BETA
    from hf_vla.serve import cli as serve_cli

    message = refused(evaluate_cli, ["--checkpoint", str(checkpoint), "--cfg_beta", "1e308"], capsys)
    assert f"--cfg_beta 1e+308: a number in [0, {MAX_CFG_BETA:g}]" in message
    message = refused(serve_cli, ["--checkpoint", str(checkpoint), "--max_cfg_beta", "1e308"], capsys)
    assert f"--max_cfg_beta 1e+308: a number in [0, {MAX_CFG_BETA:g}]" in message


def test_the_processor_refuses_a_beta_beyond_the_bound(tiny_tokenizer):
    from hf_vla.models.pi05 import PI05Processor

    processor = PI05Processor.from_config(demo_config(), tiny_tokenizer, norm_stats=NORM_STATS, head_names=[HEAD])
    processor.advantage_conditioned = True
    with pytest.raises(ValueError, match=r"cfg_beta=1e\+308: a beta in \[0, 100\]"):
        processor(images=torch.zeros(1, 1, 3, 32, 32, dtype=torch.uint8), text=["reach"], state=torch.zeros(1, 2),
                  advantage=True, cfg_beta=1e308)


def _subtask_processor(tiny_tokenizer, **kwargs):
    from hf_vla.models.pi05 import PI05Processor

    config = demo_config(subtask_layout="joint", tokenizer_max_length=48, **kwargs)
    return PI05Processor.from_config(config, tiny_tokenizer, norm_stats=NORM_STATS, head_names=[HEAD])


def test_a_prompt_that_cuts_the_subtask_marker_is_refused(tiny_tokenizer):
    """A task long enough that truncation cuts `Subtask: ` off would be decoded after half a task: refused as the
    advantage indicator's cut is."""
    from hf_vla.models.pi05.processing_pi05 import PromptCutError

    processor = _subtask_processor(tiny_tokenizer)
    images, state = torch.zeros(1, 1, 3, 32, 32, dtype=torch.uint8), torch.zeros(1, 2)
    processor(images=images, text=["move to the red target"], state=state, subtask="auto")  # fits
    with pytest.raises(PromptCutError, match=r"the prompt is \d+ tokens, longer than tokenizer_max_length=48, "
                                             r"which cuts its 'Subtask: ' marker off"):
        processor(images=images, text=["red " * 400], state=state, subtask="auto")


def test_the_server_answers_a_cut_subtask_prompt_with_one_line(demo_policy, tiny_tokenizer):  # noqa: F811
    from hf_vla.models.pi05 import PI05ForConditionalGeneration
    from hf_vla.serving.policy import PolicyRunner, RequestError

    model = PI05ForConditionalGeneration(demo_config(subtask_layout="joint", tokenizer_max_length=48)).eval()
    runner = PolicyRunner(model, _subtask_processor(tiny_tokenizer), subtask="auto")
    observation = {"image": np.zeros((32, 32, 3), np.uint8), "state": np.zeros(2, np.float32),
                   "prompt": "red " * 400}
    with pytest.raises(RequestError, match="cuts its 'Subtask: ' marker off"):
        runner(observation)


def test_over_long_subtask_annotations_are_cut_to_the_decode_bound_with_a_warning(tiny_tokenizer, caplog):
    import logging

    processor = _subtask_processor(tiny_tokenizer, subtask_max_tokens=6)
    assert processor.subtask_max_tokens == 6
    with caplog.at_level(logging.WARNING, logger="hf_vla"):
        ids, mask = processor.subtask_tokens(["red " * 200, "go", None])
    assert mask.sum(-1).tolist()[0] == 6 and ids[0, 5] == tiny_tokenizer.eos_token_id
    assert ids.shape[1] == 6 and mask[1].sum() <= 6 and not mask[2].any()
    assert "is cut to subtask_max_tokens=6, the most the model decodes" in caplog.text
    # saved and reloaded with the checkpoint
    import tempfile

    from hf_vla.models.pi05 import PI05Processor

    with tempfile.TemporaryDirectory() as folder:
        processor.save_pretrained(folder)
        assert PI05Processor.from_pretrained(folder).subtask_max_tokens == 6


@pytest.mark.parametrize("value", [0, -3])
def test_a_checkpoint_with_a_bad_config_field_is_one_line(checkpoint, tmp_path, value, capsys):  # noqa: F811
    from hf_vla.serve import cli as serve_cli
    from hf_vla.serving.policy import load_policy

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"subtask_max_tokens": value}))
    with pytest.raises(ConfigError, match=f"subtask_max_tokens={value}"):
        load_policy(bad)
    message = refused(serve_cli, ["--checkpoint", str(bad)], capsys)
    assert f"subtask_max_tokens={value}" in message and "Traceback" not in message


def test_an_unknown_model_type_names_it_and_the_registered_families(checkpoint, tmp_path):  # noqa: F811
    from hf_vla.serving.policy import load_policy

    bad = tmp_path / "nope"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"model_type": "nope"}))
    with pytest.raises(ConfigError) as raised:
        load_policy(bad)
    message = str(raised.value)
    assert "model_type='nope': not a registered policy; registered: " in message and "pi05" in message
    assert "custom code" not in message and len(message.splitlines()) == 1


def test_an_env_the_contract_names_that_does_not_exist_is_one_line(checkpoint, tmp_path, capsys):  # noqa: F811
    from hf_vla.deployment.contract import DeploymentConfig
    from hf_vla.evaluate import cli as evaluate_cli
    from hf_vla.registry import env_names

    bad = tmp_path / "contract"
    shutil.copytree(checkpoint, bad)
    DeploymentConfig(policy="pi05", chunk_size=5, n_action_steps=5, image_size=32, heads={HEAD: {
        "cameras": [{"key": "image", "height": 32, "width": 32}],
        "benchmark": {"env": "nope/NoSuchEnv-v0"}}}).save(bad)
    message = refused(evaluate_cli, ["--checkpoint", str(bad), "--episodes", "1"], capsys)
    assert "the checkpoint's deployment contract: env 'nope/NoSuchEnv-v0': not an env" in message
    assert all(name in message for name in env_names())
    message = refused(evaluate_cli, ["--checkpoint", str(checkpoint), "--env", "nope/NoSuchEnv-v0"], capsys)
    assert "--env 'nope/NoSuchEnv-v0': not an env" in message and "color_reach" in message


def _lerobot_shapes(vision_width=32, vision_layers=1):
    """The tensor shapes of a tiny lerobot pi0.5 state dict (what `dims_from_weights` reads)."""
    prefix = "paligemma_with_expert.paligemma.model."
    shapes = {f"{prefix}vision_tower.vision_model.embeddings.patch_embedding.weight": (vision_width, 3, 8, 8),
              f"{prefix}vision_tower.vision_model.embeddings.position_embedding.weight": (16, vision_width)}
    for layer in range(vision_layers):
        shapes[f"{prefix}vision_tower.vision_model.encoder.layers.{layer}.mlp.fc1.weight"] = (64, vision_width)
    return shapes


def test_a_mem_checkpoint_with_too_few_vision_layers_is_one_line():
    from hf_vla.hub.convert import config_from_lerobot

    lerobot = {"type": "pi05", "use_visual_memory": True, "memory_frames": 3, "memory_temporal_attention_every": 4}
    with pytest.raises(ConfigError) as raised:
        config_from_lerobot(lerobot, _lerobot_shapes(vision_layers=2), vision_heads=2, where="ckpt/config.json")
    message = str(raised.value)
    assert message.startswith("ckpt/config.json: ") and "memory_temporal_attention_every" in message
    assert len(message.splitlines()) == 1


def test_the_vision_heads_of_a_tower_that_is_not_so400m(caplog):
    import logging

    from hf_vla.hub.convert import config_from_lerobot

    lerobot = {"type": "pi05"}
    with caplog.at_level(logging.WARNING):
        guessed = config_from_lerobot(lerobot, _lerobot_shapes(), where="ckpt/config.json")
    assert guessed.vlm_config.vision_config.num_attention_heads == 1
    assert "a SigLIP tower 32 wide is not pi0's So400m" in caplog.text and "--vision_heads" in caplog.text
    told = config_from_lerobot(lerobot, _lerobot_shapes(), vision_heads=2)
    assert told.vlm_config.vision_config.num_attention_heads == 2
    with pytest.raises(ConfigError, match="--vision_heads 3: does not divide the vision tower's width 32"):
        config_from_lerobot(lerobot, _lerobot_shapes(), vision_heads=3)
