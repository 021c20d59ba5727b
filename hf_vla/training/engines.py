"""Distributed engines: which one a run asks for, the rules hf_vla applies before accelerate builds it, and a CPU mode.

| engine | how | bf16 model with `master_weights` |
|---|---|---|
| DDP (and one process) | `configs/accelerate/ddp.yaml` | `MasterWeightOptimizer`: fp32 masters and Adam state per rank |
| FSDP2 | `configs/accelerate/fsdp2.yaml` | bf16 mixed precision over sharded fp32 parameters (they are the masters) |
| DeepSpeed ZeRO-2 / ZeRO-3 | `configs/accelerate/zero2.yaml`, `zero3.yaml` | DeepSpeed's bf16 mode (fp32 master partitions) |
| FSDP1 | refused | |

Per-layer units (FSDP2) and ZeRO-3 hooks see every parameter use because pi0.5 runs each layer through its module's
`forward`; for transformers' pi0, see `hf_vla.models.pi0_adapter`.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

from hf_vla.errors import ConfigError

logger = logging.getLogger("hf_vla.training.engines")


def requested_engine(args) -> str:
    """`deepspeed`, `fsdp1`, `fsdp2` or `ddp` (also one process), from the arguments or `accelerate launch`'s env."""
    if args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "deepspeed"
    if args.fsdp_plugin_args is not None:
        return f"fsdp{int(args.fsdp_plugin_args.get('fsdp_version', 1))}"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return f"fsdp{int(os.environ.get('FSDP_VERSION', '1'))}"
    return "ddp"


def configure_engine(model, args) -> str:
    """Engine rules, applied before the Accelerator is built from `args`.

    - FSDP1 is refused: FSDP2 is its successor, shards pi0.5 per layer and keeps fp32 masters through its mixed
      precision; FSDP1 cannot start without an accelerator, so no CPU test covers it here.
    - FSDP2 with a bf16 model and `master_weights`: bf16 mixed precision, so accelerate upcasts the trainable
      parameters to fp32 before sharding them (the sharded fp32 parameters are the masters, with fp32 Adam state)
      and the layers compute in bf16; reductions are fp32.
    - DeepSpeed with a bf16 model needs DeepSpeed's bf16 mode (it keeps fp32 master partitions itself).
    """
    engine = requested_engine(args)
    bf16_model = any(p.dtype == torch.bfloat16 for p in model.parameters())
    if engine == "deepspeed":
        _register_zero3_token_head(model, args)
    from hf_vla.registry import family_of

    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = family_of(core)
    if family is not None and family.prepare:  # transformers' pi0: freeze what it never runs, its FSDP2 unit layout
        family.load("prepare")(core, engine)
    if engine == "fsdp1":
        raise ConfigError("FSDP version 1 is not supported: use fsdp_version 2 (configs/accelerate/fsdp2.yaml). FSDP2 "
                          "shards pi0.5 per layer and keeps the fp32 masters sharded; FSDP1 (flat parameters) is not "
                          "tested here, as it needs an accelerator device even to start")
    if engine == "fsdp2":
        # per-layer units by class name: keep only the names this model has (transformers' pi0 lists SigLIP's pooling
        # head and text embeddings, which it does not contain, and accelerate refuses unknown names)
        from hf_vla.models.pi05.modeling_pi05 import present_module_classes

        core = model.get_base_model() if hasattr(model, "get_base_model") else model
        core._no_split_modules = present_module_classes(core, getattr(core, "_no_split_modules", None))
    if engine == "fsdp2" and bf16_model:
        if args.master_weights:
            if args.mixed_precision == "fp16":
                raise ConfigError("a bfloat16 model under FSDP2 with master_weights trains in bf16 mixed precision; "
                                  "mixed_precision is fp16: use bf16 (or dtype float32)")
            if args.mixed_precision != "bf16":
                logger.info("FSDP2 with a bfloat16 model and master_weights: bf16 mixed precision, fp32 sharded "
                            "parameters as the masters")
                args.mixed_precision, args.bf16 = "bf16", True
        else:
            logger.warning("FSDP2 with a bfloat16 model and master_weights=False: parameters and Adam state stay bf16")
    if engine == "deepspeed" and bf16_model and args.mixed_precision != "bf16":
        raise ConfigError("a bfloat16 model under DeepSpeed needs DeepSpeed's bf16 mode, which keeps fp32 master "
                          "partitions: set mixed_precision bf16 in the accelerate config (bf16.enabled in the DeepSpeed "
                          "config), or use dtype float32")
    return engine


@contextmanager
def built_without_zero3_init():
    """Build a model from its config with full tensors and transformers' own initialisation under ZeRO-3.

    Once a ZeRO-3 config is registered (`accelerate launch` with DeepSpeed registers it when the training arguments
    are parsed, whatever `zero3_init_flag` says), every `AutoModel.from_config` inside pi0.5's and pi0's constructors
    partitions its sub-model under `deepspeed.zero.Init` and then initialises it module by module, gathering only each
    module's own parameters; SigLIP's attention init reads its children's (partitioned, empty) projections and fails
    ("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions"). A from-scratch model is
    therefore built whole, like any model built before the arguments, and DeepSpeed partitions it when the Trainer
    wraps it. `from_pretrained` keeps zero.Init (it loads the weights into the partitions and works).
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    reference = hf_deepspeed._hf_deepspeed_config_weak_ref  # transformers keeps only this weak reference
    registered = reference() if reference is not None else None
    if registered is None or not registered.is_zero3():
        yield
        return
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed.set_hf_deepspeed_config(registered)


@contextmanager
def saved_as_own_class(model):
    """Save an FSDP2-sharded model under its own class.

    `fully_shard` swaps the module's class for a dynamic `FSDP<Name>` subclass defined in torch; `save_pretrained`
    would record that class in config.json's `auto_map` and copy torch's FSDP sources instead of `modeling_pi05.py`,
    so the checkpoint would not load with `trust_remote_code` where hf_vla is not installed (a robot). Nothing runs
    the model while it saves.
    """
    from torch.distributed.fsdp import FSDPModule

    sharded = type(model)
    if not issubclass(sharded, FSDPModule):
        yield
        return
    model.__class__ = next(c for c in sharded.__mro__[1:] if not issubclass(c, FSDPModule))
    try:
        yield
    finally:
        model.__class__ = sharded


def finish_engine(accelerator) -> None:
    """Rules applied once the Accelerator exists, before the model is wrapped.

    FSDP2 in bf16 mixed precision reduces gradients in fp32: accelerate's default policy reduces them in bf16, which
    rounds every reduced gradient before it reaches the fp32 masters. A policy set by the user is left alone.
    """
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = plugin.mixed_precision_policy
    if isinstance(policy, MixedPrecisionPolicy) and policy.param_dtype == torch.bfloat16 \
            and policy.reduce_dtype == torch.bfloat16:
        plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs)


def _deepspeed_config(args) -> dict:
    """The DeepSpeed config of this run: `args.deepspeed` (a dict or a JSON file), or `accelerate launch`'s file."""
    config = args.deepspeed or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if isinstance(config, str) and config and config.lower() != "none":
        import json
        from pathlib import Path

        try:
            return json.loads(Path(config).read_text())
        except (OSError, ValueError):
            return {}
    return config if isinstance(config, dict) else {}


def _register_zero3_token_head(model, args) -> None:
    """The token objective's LM head is the input embedding's weight, read outside the embedding module (tied, as
    PaliGemma's). ZeRO-3 gathers a partitioned parameter while its own module runs, so the weight is registered as an
    external parameter of the model whose forward reads it (DeepSpeed's `register_external_parameter`): gathered for
    the model's forward and for its backward, where the head's pieces are recomputed."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(core.config, "token_loss", False):
        return
    zero = _deepspeed_config(args).get("zero_optimization") or {}
    if int(zero.get("stage", 0) or 0) != 3:
        return
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    register_external_parameter(core, core.get_input_embeddings().weight)


def allow_sharding_on_cpu():
    """Let accelerate build FSDP and DeepSpeed on CPU processes (gloo), exactly as it does on GPUs.

    accelerate enables FSDP and DeepSpeed only for accelerator backends. With this called first (and `use_cpu=True`),
    a multi-process CPU run under `accelerate launch --config_file configs/accelerate/fsdp2.yaml` (or zero2/zero3) runs
    `VLATrainer` under that engine: how the tests and `benchmarks/speed/engine_memory.py` check the engines on a machine
    without GPUs, and a way to dry-run a launch config before renting any. DeepSpeed picks its CPU accelerator itself.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_hf_vla_cpu_sharding", False):
        return
    original = AcceleratorState.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.distributed_type != DistributedType.MULTI_CPU:
            return
        fsdp_plugin, deepspeed_plugin = kwargs.get("fsdp_plugin"), kwargs.get("deepspeed_plugin")
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

    init._hf_vla_cpu_sharding = True
    AcceleratorState.__init__ = init


__all__ = ["allow_sharding_on_cpu", "configure_engine", "finish_engine", "requested_engine"]
