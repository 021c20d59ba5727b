"""hf_vla's own policy families: pi0.5 (`pi05`), transformers' pi0 (`pi0`) and RECAP's value model (`pi05_value`)."""

from __future__ import annotations

import json
from pathlib import Path

from hf_vla.policies import PolicyFamily, register_policy

_PI05 = "hf_vla.models.pi05"


def pi05_setup(processor, model, mixture, model_args, data_args, training_args) -> None:
    """pi0.5 before training: the FAST targets of the token objective (loaded, or fitted on the training chunks), and
    RECAP's advantage indicator (docs/recap.md): datasets with one make the policy advantage-conditioned, and it then
    asks for "Advantage: positive" at inference (the processor and the contract say so)."""
    if getattr(model.config, "token_loss", False):
        from hf_vla.training.cotraining import fit_fast

        fast_path = model_args.fast_tokenizer
        if fast_path is None and model_args.model_name_or_path:  # continuing a token-loss checkpoint: its FAST
            saved = Path(model_args.model_name_or_path) / "processor_config.json"
            if saved.is_file() and json.loads(saved.read_text()).get("fast_config"):
                fast_path = model_args.model_name_or_path
        fit_fast(mixture, processor, model.config, path=fast_path, vocab_size=model_args.fast_vocab_size,
                 scale=model_args.fast_scale, max_chunks=model_args.fast_fit_chunks, seed=training_args.seed)
    processor.advantage_conditioned = any(d.get("advantage") for d in data_args.datasets)


def value_setup(processor, model, mixture, model_args, data_args, training_args) -> None:
    """RECAP's value model learns the normalised returns of the episodes' outcomes."""
    mixture.use_returns(failure_cost=data_args.failure_cost, allow_unlabelled=data_args.allow_unlabelled)


PI05 = register_policy(PolicyFamily(
    name="pi05", description="pi0.5 (hf_vla's)",
    config=f"{_PI05}.configuration_pi05:PI05Config", model=f"{_PI05}.modeling_pi05:PI05ForConditionalGeneration",
    processor=f"{_PI05}.processing_pi05:PI05Processor", structure="hf_vla.training.structure:PI05Structure",
    setup="hf_vla.policies.builtin:pi05_setup", rtc_training=True, token_objective=True, advantage_prompt=True,
    rl_algorithms=("grpo", "ppo"), lerobot_type="pi05", lerobot_export=True, lerobot_plugin=True))

PI0 = register_policy(PolicyFamily(
    name="pi0", description="pi0 (transformers' own model, with hf_vla's per-head processor)",
    config="transformers:PI0Config", model="transformers:PI0ForConditionalGeneration",
    processor="hf_vla.models.pi0_adapter:PI0HeadProcessor", collator="hf_vla.data.collator:PI0Collator",
    structure="hf_vla.training.structure:PI0Structure", normalization_modes=("MEAN_STD",), relative_actions=False,
    needs_model_config=True, rl_algorithms=("grpo",), lerobot_type="pi0", lerobot_plugin=True))

PI05_VALUE = register_policy(PolicyFamily(
    name="pi05_value", description="RECAP's value model (pi0.5's backbone, a distribution over the return)",
    config="hf_vla.models.value.configuration_value:PI05ValueConfig",
    model="hf_vla.models.value.modeling_value:PI05ValueModel", processor=f"{_PI05}.processing_pi05:PI05Processor",
    structure="hf_vla.training.structure:ValueStructure", setup="hf_vla.policies.builtin:value_setup",
    starts_from=("pi05",), value_model=True,
    next_step="annotate advantages with python -m hf_vla.recap annotate --value {output_dir} --datasets ... "
              "--output DIR (docs/recap.md)"))
