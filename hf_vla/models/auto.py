"""Registers hf_vla's model types with the Auto classes (`AutoConfig`, `AutoModel`, `AutoProcessor`): imported by
`import hf_vla` and by every command where it builds or loads a model."""

from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText, AutoProcessor

from hf_vla.models.pi05 import PI05Config, PI05ForConditionalGeneration, PI05Processor
from hf_vla.models.value import PI05ValueConfig, PI05ValueModel

AutoConfig.register("pi05", PI05Config, exist_ok=True)
AutoModel.register(PI05Config, PI05ForConditionalGeneration, exist_ok=True)
# transformers maps pi0's policy to AutoModelForImageTextToText (AutoModel gives the headless PI0Model): same for pi05.
AutoModelForImageTextToText.register(PI05Config, PI05ForConditionalGeneration, exist_ok=True)
AutoProcessor.register(PI05Config, PI05Processor, exist_ok=True)
# (the classes set their own auto_map for save_pretrained where they are defined: trust_remote_code=True loads a
# checkpoint without hf_vla)
# RECAP's value model (docs/recap.md): its own model type, pi0.5's processor
AutoConfig.register("pi05_value", PI05ValueConfig, exist_ok=True)
AutoModel.register(PI05ValueConfig, PI05ValueModel, exist_ok=True)
AutoProcessor.register(PI05ValueConfig, PI05Processor, exist_ok=True)
