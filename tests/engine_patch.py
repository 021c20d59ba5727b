"""Imported first by the CPU engine drivers: accelerate builds FSDP/DeepSpeed on gloo CPU processes as on GPUs."""

from hf_vla.training.engines import allow_sharding_on_cpu

allow_sharding_on_cpu()
