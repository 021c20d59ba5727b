"""hf_vla's own policy families: pi0.5 (`pi05`), transformers' pi0 (`pi0`), RECAP's value model (`pi05_value`) and
best-of-N's chunk critic (`pi05_chunk_critic`)."""

from __future__ import annotations

from hf_vla.registry.policies import PolicyFamily, register_policy

_PI05 = "hf_vla.models.pi05"


PI05 = register_policy(PolicyFamily(
    name="pi05", description="pi0.5 (hf_vla's)",
    config=f"{_PI05}.configuration_pi05:PI05Config", model=f"{_PI05}.modeling_pi05:PI05ForConditionalGeneration",
    processor=f"{_PI05}.processing_pi05:PI05Processor", structure="hf_vla.training.structure:PI05Structure",
    setup="hf_vla.training.builders:pi05_setup", rtc_training=True, token_objective=True, advantage_prompt=True,
    memory=True,
    rl=True, rl_critic=True, lerobot_type="pi05", lerobot_export=True, lerobot_plugin=True,
    transformers_export=True, model_types=("hf_vla_pi05", "pi05")))

PI0 = register_policy(PolicyFamily(
    name="pi0", description="pi0 (transformers' own model, with hf_vla's per-head processor)",
    config="transformers:PI0Config", model="transformers:PI0ForConditionalGeneration",
    processor="hf_vla.models.pi0_adapter:PI0HeadProcessor", collator="hf_vla.data.collator:PI0Collator",
    structure="hf_vla.training.structure:PI0Structure", normalization_modes=("MEAN_STD",), relative_actions=False,
    needs_model_config=True, rl=True, lerobot_type="pi0", lerobot_plugin=True,
    prepare="hf_vla.models.pi0_adapter:prepare_pi0", state_input=True, rl_velocity="hf_vla.rl.flow:pi0_velocity_fn"))

PI05_VALUE = register_policy(PolicyFamily(
    name="pi05_value", description="RECAP's value model (pi0.5's backbone, a distribution over the return)",
    config="hf_vla.models.value.configuration_value:PI05ValueConfig",
    model="hf_vla.models.value.modeling_value:PI05ValueModel", processor=f"{_PI05}.processing_pi05:PI05Processor",
    structure="hf_vla.training.structure:ValueStructure", setup="hf_vla.training.builders:value_setup",
    starts_from=("pi05",), value_model=True,
    next_step="annotate advantages with python -m hf_vla.recap annotate --value {output_dir} --datasets ... "
              "--output DIR (docs/recap.md)"))

PI05_CHUNK_CRITIC = register_policy(PolicyFamily(
    name="pi05_chunk_critic", description="best-of-N's chunk critic (the value model reading an action chunk too)",
    config="hf_vla.models.value.configuration_value:PI05ChunkCriticConfig",
    model="hf_vla.models.value.modeling_value:PI05ChunkCritic", processor=f"{_PI05}.processing_pi05:PI05Processor",
    structure="hf_vla.training.structure:ChunkCriticStructure", setup="hf_vla.training.builders:value_setup",
    starts_from=("pi05", "pi05_value"), chunk_critic=True,
    next_step="pick among a policy's candidate chunks with python -m hf_vla.evaluate --checkpoint POLICY "
              "--best_of 8 --critic {output_dir} (docs/best_of_n.md)"))
