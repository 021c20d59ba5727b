"""pi0.5 as a transformers model folder. Names load on first use (as transformers' own model folders do), so the
torch-free parts (`rtc_config`, the commands' RTC options) import without the model."""

import importlib

_PUBLIC = {"PI05Config": ".configuration_pi05", "PI05ForConditionalGeneration": ".modeling_pi05",
           "PI05Model": ".modeling_pi05", "PI05PreTrainedModel": ".modeling_pi05", "PI05Processor": ".processing_pi05",
           "RTCConfig": ".rtc_config"}
__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
