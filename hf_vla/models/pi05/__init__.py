from .configuration_pi05 import PI05Config
from .modeling_pi05 import PI05ForConditionalGeneration, PI05Model, PI05PreTrainedModel
from .processing_pi05 import PI05Processor
from .rtc import RTCConfig

__all__ = ["PI05Config", "PI05ForConditionalGeneration", "PI05Model", "PI05PreTrainedModel", "PI05Processor", "RTCConfig"]
