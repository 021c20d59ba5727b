"""lerobot's door for hf_vla checkpoints: the policy type `hf_vla` (`HFVLAConfig`, `HFVLAPolicy` and its processors).

lerobot imports this distribution by its name in `register_third_party_plugins()` (lerobot-train, -eval, -record,
-rollout), which registers the type; `python -m hf_vla.convert --input CKPT --to lerobot_plugin --output DIR` writes
the small lerobot-side directory (`config.json` with `"type": "hf_vla"`, the processor files) that
`--policy.path=DIR` loads."""

import os

# lerobot's envs set no OpenGL backend, and on a machine without a display mujoco then fails after minutes of start-up
# (`an OpenGL platform library has not been loaded`). lerobot imports this plugin before it builds an env, so headless
# rendering through EGL (as hf_vla's own env) is chosen here, where no display and no backend is set.
if not os.environ.get("MUJOCO_GL") and not os.environ.get("DISPLAY"):
    os.environ["MUJOCO_GL"] = "egl"
    os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

from .configuration_hf_vla import HFVLAConfig  # noqa: E402  (after the backend: nothing here renders)
from .modeling_hf_vla import HFVLAPolicy  # noqa: E402
from .processor_hf_vla import make_hf_vla_pre_post_processors, write_policy_dir  # noqa: E402

__all__ = ["HFVLAConfig", "HFVLAPolicy", "make_hf_vla_pre_post_processors", "write_policy_dir"]
