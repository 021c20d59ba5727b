"""lerobot's door for hf_vla checkpoints: the policy type `hf_vla` (`HFVLAConfig`, `HFVLAPolicy` and its processors).

lerobot imports this distribution by its name in `register_third_party_plugins()` (lerobot-train, -eval, -record,
-rollout), which registers the type; `python -m hf_vla.convert --input CKPT --to lerobot_plugin --output DIR` writes
the small lerobot-side directory (`config.json` with `"type": "hf_vla"`, the processor files) that
`--policy.path=DIR` loads."""

from .configuration_hf_vla import HFVLAConfig
from .modeling_hf_vla import HFVLAPolicy
from .processor_hf_vla import make_hf_vla_pre_post_processors, write_policy_dir

__all__ = ["HFVLAConfig", "HFVLAPolicy", "make_hf_vla_pre_post_processors", "write_policy_dir"]
