"""The openpi recipes as configs: each value that changes results, pinned against openpi's own (its
`src/openpi/training/config.py`; `TrainConfig` defaults: batch 32, 30k steps, EMA 0.99, AdamW b1 0.9 b2 0.95 eps 1e-8
weight decay 1e-10, clip 1.0, cosine warmup 1k to 2.5e-5 decaying over 30k to 2.5e-6). The table is written here from
openpi's code, with the name of the openpi config each row comes from; docs/configs.md says where hf_vla differs."""

from pathlib import Path

import pytest

from hf_vla.training.arguments import parse_config

REPO = Path(__file__).resolve().parents[1]


def make_bool_mask(*dims: int) -> list[bool]:
    """openpi's `transforms.make_bool_mask`: n > 0 gives n True, n < 0 gives |n| False."""
    return [flag for n in dims for flag in ([n > 0] * abs(n))]


# config file -> (openpi config, its values)
OPENPI = {
    "pi05_libero.json": ("pi05_libero", dict(
        chunk_size=10, discrete_state_input=False, relative=None, batch=256, steps=30_000, peak_lr=5e-5,
        warmup=10_000, schedule="constant", ema=0.999)),
    "pi05_droid.json": ("pi05_full_droid_finetune", dict(
        chunk_size=16, discrete_state_input=True, relative=make_bool_mask(7, -1), batch=256, steps=100_000,
        peak_lr=5e-5, warmup=1_000, schedule="constant", ema=0.99)),
    "pi05_aloha.json": ("pi05_aloha", dict(
        chunk_size=50, discrete_state_input=True, relative=make_bool_mask(6, -1, 6, -1), batch=32, steps=30_000,
        peak_lr=2.5e-5, warmup=1_000, schedule="cosine", decay_lr=2.5e-6, ema=0.99)),
}
ADAMW = dict(adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=1e-10, max_grad_norm=1.0)


@pytest.mark.parametrize("name", list(OPENPI))
def test_config_takes_openpis_values(name):
    openpi_name, values = OPENPI[name]
    model_args, data_args, args = parse_config(REPO / "configs" / name)
    where = f"configs/{name} against openpi's {openpi_name}"
    model = model_args.model_config or {}
    assert model.get("chunk_size") == values["chunk_size"], where
    assert model.get("discrete_state_input", True) == values["discrete_state_input"], where
    (dataset,) = data_args.datasets
    assert dataset.get("relative_actions") == values["relative"], where
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == values["batch"], where
    assert args.max_steps == values["steps"] and args.learning_rate == values["peak_lr"], where
    assert args.warmup_steps == values["warmup"] and args.ema_decay == values["ema"], where
    schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if values["schedule"] == "constant":  # openpi's CosineDecaySchedule with decay_lr = peak_lr
        assert schedule == "constant_with_warmup", where
    else:
        assert schedule == "cosine_with_min_lr" and args.lr_scheduler_kwargs["min_lr"] == values["decay_lr"], where
    for key, value in ADAMW.items():
        assert getattr(args, key) == value, (where, key)
    assert model_args.model_name_or_path == "lerobot/pi05_base", where  # openpi's pi05_base weights



def test_a_fine_tune_sets_shape_free_fields_over_its_checkpoint(tmp_path):
    """openpi fine-tunes pi0.5's base with its own action horizon: `model_config.chunk_size` (and the other fields that
    change no weight's shape) override the checkpoint's; a field that would change the architecture is refused, not
    silently dropped, unless it equals the checkpoint's (a from-scratch config reused for a fine-tune)."""
    from hf_vla.errors import ConfigError
    from hf_vla.tiny import tiny_pi05_config
    from hf_vla.training.arguments import ModelArguments
    from hf_vla.training.builders import model_config

    tiny_pi05_config().save_pretrained(tmp_path)
    config = model_config(ModelArguments(model_name_or_path=str(tmp_path), tokenizer="tiny",
                                         model_config={"chunk_size": 10, "discrete_state_input": False}))
    assert config.chunk_size == 10 and config.discrete_state_input is False
    same = tiny_pi05_config().to_dict()
    config = model_config(ModelArguments(model_name_or_path=str(tmp_path), tokenizer="tiny",
                                         model_config={"max_action_dim": same["max_action_dim"],
                                                       "vlm_config": {"text_config": same["vlm_config"]["text_config"]}}))
    with pytest.raises(ConfigError, match=r"model_config.max_action_dim=99 but the checkpoint has "):
        model_config(ModelArguments(model_name_or_path=str(tmp_path), tokenizer="tiny",
                                    model_config={"max_action_dim": 99}))
