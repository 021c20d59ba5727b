"""The policy registry: one place where a policy family says what it is made of and what it can do, so that every
command and library path looks it up by a training config's `policy` or a checkpoint's `model_type` instead of
comparing names.

A family is a `PolicyFamily` (classes named as `"module:Class"` strings, imported on first use, so the registry costs
no torch) registered with `register_policy`. hf_vla's own (pi05, pi0, pi05_value) are in `hf_vla.registry.builtin`.
A third-party family registers the same way from its own module, which hf_vla imports when it is named in
`HF_VLA_PLUGINS` (comma-separated module names) or declared as an entry point of the group `hf_vla.plugins`:

    from hf_vla.registry import PolicyFamily, register_policy

    register_policy(PolicyFamily(name="my_policy", config="my_pkg.configuration:MyConfig",
                                 model="my_pkg.modeling:MyPolicy", processor="my_pkg.processing:MyProcessor"))

The model follows the batch contract (docs/layout.md); its config's `model_type` is the family's name. Envs
register the same way (`hf_vla.registry.envs`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass, field

from hf_vla.errors import ConfigError


def load_object(reference: str):
    """The object a `"module:attribute"` reference names, imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class PolicyFamily:
    """A policy family: its classes, and what training, conversion, serving and RL may ask of it.

    name: `policy` in a training config, and the `model_type` of its checkpoints' config.json unless `model_types`
        names them.
    model_types: the `model_type`s its checkpoints' config.json may declare (unset: its name), the first the one its
        config class writes; hf_vla's pi0.5 writes `hf_vla_pi05` and reads the `pi05` it wrote before (transformers'
        own pi0.5 is `pi05` too: its config refuses that format).
    config / model / processor: `"module:Class"`: a `PreTrainedConfig`, the `PreTrainedModel` trained and loaded
        (`from_pretrained(path, config=...)` and `Class(config)`), and its processor (`from_config(config, tokenizer,
        norm_stats=..., head_names=...)`, `from_pretrained(path)`).
    collator: `"module:Class"` taking the processor: the batches of the contract.
    structure: `"module:Class"` taking the model: its freeze modes, LoRA targets and heads trained in full
        (`hf_vla.training.structure`); unset, the model answers them itself.
    setup: `"module:function"` called as `setup(processor, model, mixture, model_args, data_args, training_args)`
        after the processor is built, before training (a FAST fit, returns as targets).
    rtc_training / token_objective / advantage_prompt: whether the family takes training-time RTC, the FAST token
        objective, RECAP's advantage indicator in its prompt.
    memory: it has MEM's observation memory (`use_visual_memory` / `use_proprioceptive_memory` in its config).
    normalization_modes: the only normalisation modes its processor applies (None: every mode of the pipeline);
        relative_actions: whether it takes relative actions.
    needs_model_config: without a checkpoint, `model_config` must be given (no default dims).
    starts_from: other families whose checkpoints a run of this one may start from (their shared backbone).
    rl: `python -m hf_vla.rl` can fine-tune it (Flow-SDE through a VLM prefix cache); rl_critic: it has a critic on
        that prefix, which PPO needs.
    value_model: it predicts returns (RECAP's value model): `hf_vla.recap annotate --value` takes it.
    chunk_critic: it predicts the return of an observation and an action chunk (best-of-N's critic): `evaluate` and
        `serve` take it as `--critic`.
    lerobot_type: lerobot's policy type its checkpoints convert from (`hf_vla.convert --to hf_vla`); lerobot_export:
        `--to lerobot` writes lerobot's own format; lerobot_plugin: lerobot's tools run it through the plugin.
    transformers_export: `--to transformers` writes transformers' own pi0.5 format (and that format converts into it).
    next_step: what the last line after training suggests, formatted with `output_dir` (None: evaluate or serve).
    prepare: `"module:function"` called as `prepare(model, engine)` before a training engine wraps the model (pi0:
        its unused modules frozen, its FSDP2 unit layout).
    state_input: the model takes the state as a tensor input (transformers' pi0), not as prompt tokens; such a model
        samples independent chunks (no real-time chunking when served).
    rl_velocity: `"module:function"` RL's flow uses for the velocity of a model not laid out as pi0.5
        (`velocity(model, core, inputs, state)`, `hf_vla.rl.flow`).
    """

    name: str
    config: str
    model: str
    processor: str
    collator: str = "hf_vla.data.collator:PI05Collator"
    structure: str | None = None
    setup: str | None = None
    description: str = ""
    rtc_training: bool = False
    token_objective: bool = False
    advantage_prompt: bool = False
    memory: bool = False
    normalization_modes: tuple[str, ...] | None = None
    relative_actions: bool = True
    needs_model_config: bool = False
    starts_from: tuple[str, ...] = ()
    rl: bool = False
    rl_critic: bool = False
    value_model: bool = False
    chunk_critic: bool = False
    lerobot_type: str | None = None
    lerobot_export: bool = False
    lerobot_plugin: bool = False
    transformers_export: bool = False
    next_step: str | None = None
    prepare: str | None = None
    state_input: bool = False
    rl_velocity: str | None = None
    extra: dict = field(default_factory=dict)
    model_types: tuple[str, ...] = ()

    def load(self, part: str):
        """The class (or function) of `part` ("config", "model", "processor", "collator", "structure", "setup")."""
        return load_object(getattr(self, part))


_FAMILIES: dict[str, PolicyFamily] = {}
_BUILTIN = "hf_vla.registry.builtin"
PLUGINS_ENV = "HF_VLA_PLUGINS"
_plugins_loaded = False


def register_in(table: dict, entry, kind: type, what: str):
    """`entry` (a `kind`) into `table` under its name: a name registered twice is an error, unless it is the same
    entry (a module imported again)."""
    if not isinstance(entry, kind):
        raise TypeError(f"register_{what} takes a {kind.__name__}, got {type(entry).__name__}")
    known = table.get(entry.name)
    if known is not None and known != entry:
        raise ValueError(f"{what} {entry.name!r} is registered already, as another {kind.__name__}")
    table[entry.name] = entry
    return entry


def register_policy(family: PolicyFamily) -> PolicyFamily:
    """Make `family` known to every command (a name registered twice is an error, unless it is the same family)."""
    return register_in(_FAMILIES, family, PolicyFamily, "policy")


def load_plugins() -> None:
    """Import the modules that register third-party families and envs: those named in `HF_VLA_PLUGINS`, then the
    entry points of the group `hf_vla.plugins` (once per process)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for name in filter(None, (part.strip() for part in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ConfigError(f"{PLUGINS_ENV}={os.environ[PLUGINS_ENV]!r}: module {name!r} could not be imported "
                              f"({error})") from error
    from importlib.metadata import entry_points

    for entry in entry_points(group="hf_vla.plugins"):
        entry.load()


def _ensure_registered() -> None:
    importlib.import_module(_BUILTIN)
    load_plugins()


def policy_names() -> list[str]:
    """Every registered family's name (hf_vla's and the plugins')."""
    _ensure_registered()
    return list(_FAMILIES)


def get_policy(name: str | None, where: str = "policy") -> PolicyFamily:
    """The family registered as `name` (or whose checkpoints declare `name` as their model type); a `ConfigError`
    naming `where` and the registered families otherwise."""
    family = find_policy(name)
    if family is None:
        raise ConfigError(f"{where}={name!r}: not a registered policy; registered: {', '.join(_FAMILIES)} (a new "
                          f"family registers with hf_vla.registry.register_policy, from a module named in "
                          f"{PLUGINS_ENV})")
    return family


def family_of(model) -> PolicyFamily | None:
    """The registered family of a model (by its config's `model_type`; a peft, DDP or remote-code copy too)."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else getattr(model, "module", model)
    return find_policy(getattr(getattr(core, "config", None), "model_type", None))


def policy_name(model) -> str | None:
    """The registered family's name of a model (a peft, DDP or remote-code copy too), else its config's model_type:
    what metadata and model cards call the policy ("pi05" for hf_vla's pi0.5, whatever its model type)."""
    family = family_of(model)
    if family is not None:
        return family.name
    core = model.get_base_model() if hasattr(model, "get_base_model") else getattr(model, "module", model)
    return getattr(getattr(core, "config", None), "model_type", None)


def find_policy(name: str | None) -> PolicyFamily | None:
    """The family registered as `name`, or whose checkpoints declare `name` as their `model_type`; None otherwise."""
    _ensure_registered()
    if name in _FAMILIES:
        return _FAMILIES[name]
    return next((family for family in _FAMILIES.values() if name in family.model_types), None)


def families_with(capability: str) -> str:
    """The registered families that have `capability` (a `PolicyFamily` flag), quoted for a message."""
    _ensure_registered()
    return " or ".join(repr(name) for name, family in _FAMILIES.items() if getattr(family, capability)) or "none"


def lerobot_types() -> set[str]:
    """The lerobot policy types whose checkpoints a registered family converts from."""
    _ensure_registered()
    return {family.lerobot_type for family in _FAMILIES.values() if family.lerobot_type}


def replace(family: PolicyFamily, **changes) -> PolicyFamily:
    """A copy of `family` with `changes` (to derive a family from another)."""
    return dataclasses.replace(family, **changes)


__all__ = ["PLUGINS_ENV", "PolicyFamily", "families_with", "family_of", "find_policy", "get_policy", "lerobot_types", "load_object", "load_plugins", "policy_name", "policy_names",
           "register_policy", "replace"]
