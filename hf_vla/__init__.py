"""hf_vla: train and serve vision-language-action robot policies (pi0, pi0.5) the Hugging Face way."""

from transformers import AutoConfig, AutoModel, AutoModelForImageTextToText, AutoProcessor

from hf_vla.hub.resolve import resolve_pretrained
from hf_vla.models.pi05 import (
    PI05Config,
    PI05ForConditionalGeneration,
    PI05Model,
    PI05PreTrainedModel,
    PI05Processor,
    RTCConfig,
)
from hf_vla.models.value import PI05ValueConfig, PI05ValueModel
from hf_vla.training.losses import PerSampleLoss
from hf_vla.training.optim import MasterWeightOptimizer

__version__ = "0.1.0"

# `import hf_vla` makes "pi05" a first-class transformers model type.
AutoConfig.register("pi05", PI05Config, exist_ok=True)
AutoModel.register(PI05Config, PI05ForConditionalGeneration, exist_ok=True)
# transformers maps pi0's policy to AutoModelForImageTextToText (AutoModel gives the headless PI0Model): same for pi05.
AutoModelForImageTextToText.register(PI05Config, PI05ForConditionalGeneration, exist_ok=True)
AutoProcessor.register(PI05Config, PI05Processor, exist_ok=True)
# save_pretrained writes an auto_map, so a checkpoint also loads with trust_remote_code=True without hf_vla.
PI05Config.register_for_auto_class()
PI05ForConditionalGeneration.register_for_auto_class("AutoModel")
PI05Processor.register_for_auto_class("AutoProcessor")  # processor_config.json gets its auto_map too
# RECAP's value model (docs/recap.md): its own model type, pi0.5's processor
AutoConfig.register("pi05_value", PI05ValueConfig, exist_ok=True)
AutoModel.register(PI05ValueConfig, PI05ValueModel, exist_ok=True)
AutoProcessor.register(PI05ValueConfig, PI05Processor, exist_ok=True)

__all__ = [
    "MasterWeightOptimizer",
    "PerSampleLoss",
    "VLATrainer",
    "VLATrainingArguments",
    "PI05Config",
    "PI05ForConditionalGeneration",
    "PI05Model",
    "PI05PreTrainedModel",
    "PI05Processor",
    "PI05ValueConfig",
    "PI05ValueModel",
    "RTCConfig",
    "__version__",
    "resolve_pretrained",
]


def __getattr__(name):
    # The trainer pulls in the data stack (lerobot, PyAV); load it on first use so `import hf_vla` stays light.
    if name in ("VLATrainer", "VLATrainingArguments"):
        from hf_vla.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'hf_vla' has no attribute {name!r}")
