"""The processors lerobot runs around an `HFVLAPolicy`, and the lerobot-side directory of an hf_vla checkpoint.

The policy normalises, un-normalises and applies relative actions itself (hf_vla's processor, as every hf_vla runner
does), so lerobot's pipelines keep only what its tools expect by name: renaming (`--rename_map`), the batch
dimension and the device (pre), back to the CPU (post)."""

from __future__ import annotations

import os
from pathlib import Path

from lerobot.processor import (
    AddBatchDimensionProcessorStep,
    DeviceProcessorStep,
    RenameObservationsProcessorStep,
)
from lerobot.processor.factory import make_policy_processor_pipelines

from .configuration_hf_vla import HFVLAConfig


def make_hf_vla_pre_post_processors(config: HFVLAConfig, dataset_stats=None):
    """lerobot's (preprocessor, postprocessor) for an hf_vla policy; `dataset_stats` are not used: the checkpoint's
    processor holds its statistics."""
    return make_policy_processor_pipelines(
        input_steps=[RenameObservationsProcessorStep(rename_map={}), AddBatchDimensionProcessorStep(),
                     DeviceProcessorStep(device=config.device or "cpu")],
        output_steps=[DeviceProcessorStep(device="cpu")],
    )


def write_policy_dir(checkpoint: str | os.PathLike, output: str | os.PathLike, head: str | None = None,
                     n_action_steps: int | None = None, overwrite: bool = False) -> Path:
    """Write the lerobot-side directory of hf_vla `checkpoint` to `output`: `config.json` (`"type": "hf_vla"`, the
    checkpoint's path relative to `output` when both are local) and lerobot's processor files, so
    `lerobot-eval / lerobot-record / lerobot-rollout --policy.path=output` load it. Staged, then renamed into place."""
    from hf_vla.errors import ConfigError
    from hf_vla.hub.resolve import resolve_contract
    from hf_vla.storage import check_output, replace_dir, staging_dir, write_marker

    source = Path(checkpoint)
    output = check_output("--output", output, overwrite, inputs={"--input": source if source.exists() else None},
                          kind="lerobot_plugin", legacy=_plugin_config, what="lerobot plugin directory")
    contract = resolve_contract(checkpoint)
    if contract is None:
        raise ConfigError(f"--input {str(checkpoint)!r}: no deployment_config.json (the contract an hf_vla checkpoint "
                          "carries: cameras, head, n_action_steps); write one with python -m hf_vla.train or convert")
    try:
        contract.head(head)
    except KeyError:
        raise ConfigError(f"--head {head!r}: the checkpoint has the heads {sorted(contract.heads)}; name one "
                          "(a multi-head checkpoint runs one head per robot)") from None
    if source.is_dir():
        reference = os.path.relpath(source.resolve(), output.resolve())
    else:
        reference = str(checkpoint)  # a Hub id
    config = HFVLAConfig(checkpoint=reference, head=head, n_action_steps=n_action_steps, device="cpu")
    staging = staging_dir(output, "writing")
    staging.mkdir(parents=True)
    config.save_pretrained(staging)
    preprocessor, postprocessor = make_hf_vla_pre_post_processors(config)
    preprocessor.save_pretrained(staging)
    postprocessor.save_pretrained(staging)
    write_marker(staging, "lerobot_plugin", source=str(checkpoint))
    return replace_dir(staging, output)


def _plugin_config(directory: Path) -> bool:
    """A plugin directory written before output markers: its config.json names the policy type `hf_vla`, which only
    this plugin writes."""
    import json

    try:
        return json.loads((directory / "config.json").read_text()).get("type") == "hf_vla"
    except (OSError, ValueError, AttributeError):
        return False


__all__ = ["make_hf_vla_pre_post_processors", "write_policy_dir"]
