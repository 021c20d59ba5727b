"""pi0.5 as a transformers model folder. Names load on first use (as transformers' own model folders do), so the
torch-free parts (`rtc_config`, the commands' RTC options) import without the model."""

from hf_vla.cli import lazy_attributes

_PUBLIC = {"PI05Config": ".configuration_pi05", "PI05ForConditionalGeneration": ".modeling_pi05",
           "PI05Model": ".modeling_pi05", "PI05PreTrainedModel": ".modeling_pi05", "PI05Processor": ".processing_pi05",
           "RTCConfig": "hf_vla.models.common.rtc_config", "SamplingConfig": "hf_vla.models.common.sampling_config"}
__all__ = sorted(_PUBLIC)
__getattr__ = lazy_attributes(__name__, _PUBLIC)
