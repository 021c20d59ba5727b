"""The registries, below every other room: the policy families (`policies.py`; hf_vla's own in `builtin.py`) and the
simulators (`envs.py`) every command and library path looks up by name. A user's package registers its own here:

    from hf_vla.registry import EnvFamily, PolicyFamily, register_env, register_policy

named in `HF_VLA_PLUGINS` (comma-separated module names) or declared as an entry point of the group `hf_vla.plugins`
(docs/layout.md, "Where a new part goes"). Nothing here imports torch."""

from hf_vla.registry.envs import (
    EnvFamily,
    RecordingPlan,
    contract_env,
    env_names,
    find_env,
    register_env,
    task_env,
)
from hf_vla.registry.policies import (
    PLUGINS_ENV,
    PolicyFamily,
    families_with,
    family_of,
    find_policy,
    get_policy,
    lerobot_types,
    load_object,
    load_plugins,
    policy_name,
    policy_names,
    register_policy,
    replace,
)

__all__ = ["PLUGINS_ENV", "EnvFamily", "PolicyFamily", "RecordingPlan", "contract_env", "env_names", "families_with", "family_of",
           "find_env", "find_policy", "get_policy", "lerobot_types", "load_object", "load_plugins", "policy_name", "policy_names",
           "register_env", "register_policy", "replace", "task_env"]
