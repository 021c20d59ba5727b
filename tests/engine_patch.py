"""accelerate turns FSDP and DeepSpeed on only for accelerator backends. Imported by the CPU engine tests (under
torchrun, gloo, `use_cpu=True`), this lets an FSDP or DeepSpeed plugin through on MULTI_CPU, exactly as accelerate
sets them up on GPUs, so that `VLATrainer` runs unchanged under FSDP2 and ZeRO-2/3 on CPU. (DeepSpeed picks its own
CPU accelerator, with gloo, by itself.)"""

import os

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

_original_init = AcceleratorState.__init__


def _init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    if self.distributed_type != DistributedType.MULTI_CPU:
        return
    fsdp_plugin = kwargs.get("fsdp_plugin")
    deepspeed_plugin = kwargs.get("deepspeed_plugin")
    if deepspeed_plugin is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        from accelerate.utils import DeepSpeedPlugin

        plugin = deepspeed_plugin if deepspeed_plugin is not None else DeepSpeedPlugin()
        self.distributed_type = DistributedType.DEEPSPEED
        plugin.set_mixed_precision(kwargs.get("mixed_precision") or self._mixed_precision)
        plugin.select(_from_accelerator_state=True)
        self.deepspeed_plugins = plugin
        self._mixed_precision = "no"  # DeepSpeed handles mixed precision itself, as accelerate does on GPUs
    elif fsdp_plugin is not None or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        self.distributed_type = DistributedType.FSDP
        if fsdp_plugin is not None:
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _init
