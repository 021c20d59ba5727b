"""What training asks of a policy's structure: its freeze modes (`--freeze`), the linear layers LoRA adapts
(`lora_preset`) and the small heads trained in full beside them, for pi0.5 (`PI05Structure`) and transformers' pi0
(`PI0Structure`); `policy_structure(model)` picks one. The model files hold the models only."""

from __future__ import annotations

from torch import nn

from hf_vla.models.pi0_adapter import pi0_unused_modules

FREEZE_MODES = ("none", "vision_tower", "vlm", "expert_only")
LORA_PRESETS = ("expert", "all_linear")


def apply_freeze(mode: str, modes, policy: nn.Module, vlm: nn.Module, expert_layers: nn.Module) -> None:
    """The freeze modes of a PaliGemma + action-expert policy (pi0.5's and transformers' pi0's alike)."""
    if mode not in modes:
        raise ValueError(f"freeze={mode!r}: choose one of {modes}")
    if mode == "vision_tower":
        vlm.vision_tower.requires_grad_(False)
        vlm.multi_modal_projector.requires_grad_(False)
    elif mode == "vlm":
        vlm.requires_grad_(False)
    elif mode == "expert_only":
        policy.requires_grad_(False)
        expert_layers.requires_grad_(True)


class _Structure:
    """What a PaliGemma + action-expert policy answers the trainer and peft: freeze modes, LoRA targets, the heads
    trained in full. A subclass names its expert's layers, the modules the policy never runs and its heads."""

    freeze_modes = FREEZE_MODES
    lora_presets = LORA_PRESETS
    expert_prefix = ""  # the expert's layers in the model's state-dict names

    def __init__(self, model: nn.Module):
        self.model = model

    def expert_layers(self) -> nn.Module:
        raise NotImplementedError

    def unused_modules(self) -> list[nn.Module]:
        raise NotImplementedError

    def trained_heads(self) -> list[str]:
        raise NotImplementedError

    def freeze(self, mode: str = "none") -> None:
        """`vision_tower`: SigLIP and its projector frozen; `vlm`: all of PaliGemma frozen (the expert and the heads
        train); `expert_only`: only the action expert's layers train. The modules the policy never runs stay
        frozen."""
        apply_freeze(mode, self.freeze_modes, self.model, self.model.model.vlm, self.expert_layers())
        for module in self.unused_modules():
            module.requires_grad_(False)

    def lora_target_modules(self, preset: str) -> list[str]:
        """The linear layers LoRA adapts. `expert`: every linear of the action expert's layers (for pi0.5 its
        attention, MLP and adaRMS modulation); `all_linear`: those and every linear of the VLM's language-model layers
        that the policy runs (modules it never runs, such as pi0.5's last-layer query/output projections and MLP, get
        no adapter)."""
        if preset not in self.lora_presets:
            raise ValueError(f"LoRA preset {preset!r}: choose one of {self.lora_presets}")
        unused = {id(sub) for module in self.unused_modules() for sub in module.modules()}
        prefixes = (self.expert_prefix,) + (("model.vlm.language_model.layers.",) if preset == "all_linear" else ())
        return [name for name, module in self.model.named_modules()
                if isinstance(module, nn.Linear) and name.startswith(prefixes) and id(module) not in unused]


class PI05Structure(_Structure):
    """pi0.5's: its expert is `model.expert`; the critic, when there is one, is trained in full beside the heads."""

    expert_prefix = "model.expert.layers."

    def expert_layers(self) -> nn.Module:
        return self.model.model.expert.layers

    def unused_modules(self) -> list[nn.Module]:
        return self.model.model.unused_modules()

    def trained_heads(self) -> list[str]:
        """The small action/time heads (and the critic, when there is one): trained in full when the rest is frozen or
        adapted (peft `modules_to_save`)."""
        heads = ["action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"]
        if getattr(self.model, "advantage_embedding", None) is not None:  # RECAP's indicator, read by the expert
            heads.append("advantage_embedding")
        return heads + (["value_head"] if self.model.value_head is not None else [])

    def freeze(self, mode: str = "none") -> None:
        super().freeze(mode)
        critic = self.model.value_head
        if critic is not None:  # the critic trains when the RL trainer (PPO) added it, whatever the mode
            critic.requires_grad_(getattr(critic, "trained_by_rl", False))


class PI0Structure(_Structure):
    """transformers' pi0's: its expert is `model.dit`."""

    expert_prefix = "model.dit.layers."

    def expert_layers(self) -> nn.Module:
        return self.model.model.dit.layers

    def unused_modules(self) -> list[nn.Module]:
        return pi0_unused_modules(self.model)

    def trained_heads(self) -> list[str]:
        return ["embed_action_time", "action_out_proj"]


class ValueStructure:
    """RECAP's value model: pi0.5's backbone and a value readout. `vision_tower` / `vlm` freeze what pi0.5's modes
    freeze (the readout and the query token always train); `expert_only` has no expert to train and is refused.
    LoRA (`all_linear`; `expert` has no expert) adapts the language model's linears, the readout trains in full."""

    freeze_modes = ("none", "vision_tower", "vlm")
    lora_presets = ("all_linear",)

    def __init__(self, model: nn.Module):
        self.model = model

    def freeze(self, mode: str = "none") -> None:
        if mode not in self.freeze_modes:
            raise ValueError(f"freeze={mode!r}: a value model takes one of {self.freeze_modes}")
        apply_freeze(mode, self.freeze_modes, self.model, self.model.model.vlm, nn.ModuleList())

    def lora_target_modules(self, preset: str) -> list[str]:
        if preset not in self.lora_presets:
            raise ValueError(f"LoRA preset {preset!r}: a value model takes one of {self.lora_presets}")
        return [name for name, module in self.model.named_modules()
                if isinstance(module, nn.Linear) and name.startswith("model.vlm.language_model.layers.")]

    def trained_heads(self) -> list[str]:
        return ["value_readout", "value_query"]


class ChunkCriticStructure(ValueStructure):
    """Best-of-N's chunk critic: the value model's structure; the chunk's input map and positions train in full."""

    def trained_heads(self) -> list[str]:
        return [*super().trained_heads(), "chunk_in", "chunk_position"]


def policy_structure(model: nn.Module):
    """The structure of a policy (`freeze`, `lora_target_modules`, `trained_heads`): its registered family's
    (`PolicyFamily.structure`, by the config's model_type), or the model itself when it answers them."""
    from hf_vla.registry import family_of

    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = family_of(core)  # by model_type: a remote-code copy too
    if family is not None and family.structure:
        return family.load("structure")(core)
    if all(hasattr(core, name) for name in ("freeze", "lora_target_modules", "trained_heads")):
        return core
    raise TypeError(f"{type(core).__name__} does not describe its structure (freeze, lora_target_modules, "
                    "trained_heads)")


__all__ = ["FREEZE_MODES", "LORA_PRESETS", "PI05Structure", "PI0Structure", "ValueStructure", "apply_freeze",
           "policy_structure"]
