"""Registers hf_vla's model types with the Auto classes (`AutoConfig`, `AutoModel`, `AutoProcessor`): imported by
`import hf_vla` and by every command where it builds or loads a model.

hf_vla's pi0.5 is `hf_vla_pi05`; transformers' own pi0.5 (5.25+) keeps `pi05`. Checkpoints hf_vla wrote as `pi05`
load through the Auto classes where transformers has no `pi05` of its own; where it has, hf_vla's own loaders
(`hf_vla.hub.resolve.load_pretrained`, every command) still read them, and `python -m hf_vla.convert` rewrites them."""

from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText, AutoProcessor
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_vla.models.pi05 import PI05Config, PI05ForConditionalGeneration, PI05Processor
from hf_vla.models.pi05.configuration_pi05 import LEGACY_MODEL_TYPE, LegacyPI05Config
from hf_vla.models.value import PI05ChunkCritic, PI05ChunkCriticConfig, PI05ValueConfig, PI05ValueModel

AutoConfig.register(PI05Config.model_type, PI05Config, exist_ok=True)
AutoModel.register(PI05Config, PI05ForConditionalGeneration, exist_ok=True)
# transformers maps pi0's policy to AutoModelForImageTextToText (AutoModel gives the headless PI0Model): same for pi05.
AutoModelForImageTextToText.register(PI05Config, PI05ForConditionalGeneration, exist_ok=True)
AutoProcessor.register(PI05Config, PI05Processor, exist_ok=True)
if LEGACY_MODEL_TYPE not in CONFIG_MAPPING:  # transformers' own pi0.5 is never replaced
    AutoConfig.register(LEGACY_MODEL_TYPE, LegacyPI05Config)
# (the classes set their own auto_map for save_pretrained where they are defined: trust_remote_code=True loads a
# checkpoint without hf_vla)
# RECAP's value model (docs/recap.md): its own model type, pi0.5's processor
AutoConfig.register("pi05_value", PI05ValueConfig, exist_ok=True)
AutoModel.register(PI05ValueConfig, PI05ValueModel, exist_ok=True)
AutoProcessor.register(PI05ValueConfig, PI05Processor, exist_ok=True)
# best-of-N's chunk critic (docs/best_of_n.md)
AutoConfig.register("pi05_chunk_critic", PI05ChunkCriticConfig, exist_ok=True)
AutoModel.register(PI05ChunkCriticConfig, PI05ChunkCritic, exist_ok=True)
AutoProcessor.register(PI05ChunkCriticConfig, PI05Processor, exist_ok=True)
