"""What training asks of a policy's structure: its freeze modes (`--freeze`), the linear layers LoRA adapts
(`lora_preset`) and the small heads trained in full beside them, for pi0.5 (`PI05Structure`) and transformers' pi0
(`PI0Structure`); `policy_structure(model)` picks one. The model files hold the models only."""

from __future__ import annotations

from torch import nn

from hf_vla.models.pi0_adapter import is_pi0, pi0_unused_modules

FREEZE_MODES = ("none", "vision_tower", "vlm", "expert_only")
LORA_PRESETS = ("expert", "all_linear")


def apply_freeze(mode: str, modes, policy: nn.Module, vlm: nn.Module, expert_layers: nn.Module) -> None:
    """The freeze modes of a PaliGemma + action-expert policy (pi0.5 here, transformers' pi0 in `pi0_adapter`)."""
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


class PI05Structure:
    """pi0.5's answers: freeze modes, LoRA targets, the heads trained in full (and the critic, when there is one)."""

    freeze_modes = FREEZE_MODES
    lora_presets = LORA_PRESETS

    def __init__(self, model: nn.Module):
        self.model = model

    def trained_heads(self) -> list[str]:
        """The small action/time heads (and the critic, when there is one): trained in full when the rest is frozen or
        adapted (peft `modules_to_save`)."""
        heads = ["action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out"]
        return heads + (["value_head"] if getattr(self.model, "value_head", None) is not None else [])

    def freeze(self, mode: str = "none") -> None:
        """`vision_tower`: SigLIP and its projector frozen; `vlm`: all of PaliGemma frozen (the expert and the heads
        train); `expert_only`: only the action expert's layers train. The modules pi0.5 never runs stay frozen."""
        model = self.model
        critic = model.value_head is not None and any(p.requires_grad for p in model.value_head.parameters())
        apply_freeze(mode, self.freeze_modes, model, model.model.vlm, model.model.expert.layers)
        model.model.freeze_unused()
        if model.value_head is not None:  # the critic trains when the RL trainer made it trainable, whatever the mode
            model.value_head.requires_grad_(critic)

    def lora_target_modules(self, preset: str) -> list[str]:
        """The linear layers LoRA adapts. `expert`: every linear of the action expert's layers (attention, MLP and the
        adaRMS modulation); `all_linear`: those and every linear of the VLM's language-model layers that pi0.5 runs
        (the last layer's query/output projections and MLP never run, so they get no adapter)."""
        if preset not in self.lora_presets:
            raise ValueError(f"LoRA preset {preset!r}: choose one of {self.lora_presets}")
        unused = {id(sub) for module in self.model.model.unused_modules() for sub in module.modules()}
        prefixes = ("model.expert.layers.",) + (("model.vlm.language_model.layers.",) if preset == "all_linear" else ())
        return [name for name, module in self.model.named_modules()
                if isinstance(module, nn.Linear) and name.startswith(prefixes) and id(module) not in unused]


class PI0Structure:
    """pi0's answers to what the trainer and peft ask a policy : freeze modes, LoRA targets,
    the heads trained in full."""

    freeze_modes = FREEZE_MODES
    lora_presets = LORA_PRESETS

    def __init__(self, model: nn.Module):
        self.model = model

    def trained_heads(self) -> list[str]:
        return ["embed_action_time", "action_out_proj"]

    def freeze(self, mode: str = "none") -> None:
        core = self.model.model
        apply_freeze(mode, self.freeze_modes, self.model, core.vlm, core.dit.layers)
        for module in pi0_unused_modules(self.model):
            module.requires_grad_(False)

    def lora_target_modules(self, preset: str) -> list[str]:
        if preset not in self.lora_presets:
            raise ValueError(f"LoRA preset {preset!r}: choose one of {self.lora_presets}")
        unused = {id(sub) for module in pi0_unused_modules(self.model) for sub in module.modules()}
        prefixes = ("model.dit.layers.",) + (("model.vlm.language_model.layers.",) if preset == "all_linear" else ())
        return [name for name, module in self.model.named_modules()
                if isinstance(module, nn.Linear) and name.startswith(prefixes) and id(module) not in unused]


def policy_structure(model: nn.Module):
    """The structure of a policy (`freeze`, `lora_target_modules`, `trained_heads`): pi0.5's, transformers' pi0's, or
    the model itself when it answers them."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    if is_pi0(core):
        return PI0Structure(core)
    if type(core).__name__ == "PI05ForConditionalGeneration":
        return PI05Structure(core)
    if all(hasattr(core, name) for name in ("freeze", "lora_target_modules", "trained_heads")):
        return core
    raise TypeError(f"{type(core).__name__} does not describe its structure (freeze, lora_target_modules, "
                    "trained_heads)")


__all__ = ["FREEZE_MODES", "LORA_PRESETS", "PI05Structure", "PI0Structure", "apply_freeze", "policy_structure"]
