"""hf_vla: train and serve vision-language-action robot policies (pi0, pi0.5) the Hugging Face way."""

import sys

from hf_vla.cli import lazy_attributes

__version__ = "0.1.0"

# public name -> the module that defines it, loaded on first use
_PUBLIC = {
    "MasterWeightOptimizer": "hf_vla.training.optim",
    "PerSampleLoss": "hf_vla.training.losses",
    "VLATrainer": "hf_vla.training.trainer",
    "VLATrainingArguments": "hf_vla.training.trainer",
    "PI05Config": "hf_vla.models.pi05",
    "PI05ForConditionalGeneration": "hf_vla.models.pi05",
    "PI05Model": "hf_vla.models.pi05",
    "PI05PreTrainedModel": "hf_vla.models.pi05",
    "PI05Processor": "hf_vla.models.pi05",
    "PI05ValueConfig": "hf_vla.models.value",
    "PI05ValueModel": "hf_vla.models.value",
    "RTCConfig": "hf_vla.models.pi05",
    "SamplingConfig": "hf_vla.models.pi05",
    "resolve_pretrained": "hf_vla.hub.resolve",
}
__all__ = [*_PUBLIC, "__version__"]
__getattr__ = lazy_attributes(__name__, _PUBLIC)


# `import hf_vla` makes "hf_vla_pi05" and "pi05_value" first-class transformers model types (hf_vla.models.auto registers
# them; transformers' own "pi05" is left in place).
# While `python -m hf_vla.<command>` locates its module, sys.argv[0] is "-m": a command imports the models where it
# builds or loads one, so its --help and its argument errors answer before torch is imported.
if sys.argv[:1] != ["-m"]:
    import hf_vla.models.auto  # noqa: F401
