"""The deployment contract's file beside a processor: its name (`DEPLOYMENT_FILE`, the one definition) and the mixin
that saves and loads it with the processor. No torch: the contract module (`hf_vla.deployment.contract`) reads the name
from here; it travels with a checkpoint's remote code (`remote_code.py`)."""

from __future__ import annotations

import os

DEPLOYMENT_FILE = "deployment_config.json"


class DeploymentContractMixin:
    """A processor that carries its checkpoint's deployment contract (`hf_vla.deployment.contract`: camera keys and recorded
    sizes, actions executed per chunk, heads, benchmark settings) as the dict `deployment`: `save_pretrained` writes it
    to `deployment_config.json` beside `processor_config.json` (so every save of the processor, in checkpoints, rollout
    snapshots, conversions and Hub pushes, carries it) and `from_pretrained` reads it back (None when absent)."""

    deployment: dict | None = None

    def save_pretrained(self, save_directory, *args, **kwargs):
        if self.deployment is not None:  # before the processor's own files: a push_to_hub=True save uploads it too
            import json

            os.makedirs(save_directory, exist_ok=True)
            with open(os.path.join(save_directory, DEPLOYMENT_FILE), "w") as handle:
                handle.write(json.dumps(self.deployment, indent=2) + "\n")
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        import json

        from transformers.utils import cached_file

        processor = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        path = cached_file(pretrained_model_name_or_path, DEPLOYMENT_FILE, revision=kwargs.get("revision"),
                           _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
        processor.deployment = json.loads(open(path).read()) if path else None
        return processor


__all__ = ["DEPLOYMENT_FILE", "DeploymentContractMixin"]
