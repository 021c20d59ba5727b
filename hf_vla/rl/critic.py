"""The critic of PPO fine-tuning: pi0.5's value head (`PI05ValueHead`, `config.value_head`), added, run and trained
here; the model only holds it, so a PPO run's output saves it with the policy and a later PPO run continues with it.

It reads the hidden states entering the VLM's last layer (the prefix computation sampling runs anyway: that layer
only gives its keys/values), caught on their way in during the policy's own forward (`PrefixValue`), so under DDP
and peft the critic runs inside the wrapped forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_vla.models.pi05.modeling_pi05 import PI05Output
from hf_vla.models.pi05.value_head import PI05ValueHead


def base_policy(model) -> nn.Module:
    """The pi0.5 module under DDP and peft wrappers."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def add_value_head(model) -> nn.Module:
    """The policy's critic, created (output layer at zero: it predicts 0) when it has none; trainable, and kept so by
    the trainer's freeze modes (`hf_vla.training.structure`)."""
    policy = base_policy(model)
    if policy.value_head is None:
        reference = policy.action_out_proj.weight
        policy.config.value_head = True
        head = PI05ValueHead(policy.config)
        head.apply(policy._init_weights)
        policy.value_head = head.to(device=reference.device, dtype=torch.float32)
    policy.value_head.requires_grad_(True)
    policy.value_head.trained_by_rl = True
    return policy.value_head


@dataclass
class ValuedOutput(PI05Output):
    """The policy's output with the critic's `value` `[B]` (what a forward inside `PrefixValue` returns)."""

    value: torch.FloatTensor | None = None


class PrefixValue:
    """`with PrefixValue(model) as critic:` around one forward of the policy that runs the prefix; afterwards
    `critic.value(inputs)` is the critic's estimate of the return `[B]` for that forward's observations.

    Two hooks: a forward pre-hook on the VLM's last layer catches its input, and a forward hook on the policy runs
    the critic on it and returns its output with `value` (`ValuedOutput`), so the critic runs inside the policy's forward: under
    DDP its parameters are used in the forward whose output the gradient all-reduce is prepared from."""

    def __init__(self, model):
        self.policy = base_policy(model)
        if self.policy.value_head is None:
            raise ValueError("the policy has no critic: add_value_head(model) first (PPO)")
        self.hidden = self.result = None

    def __enter__(self):
        def catch(module, args, kwargs):
            self.hidden = args[0] if args else kwargs["hidden_states"]

        def add_value(module, args, kwargs, output):
            if self.hidden is not None:  # a call on a prefix cache runs no prefix
                self.result = self._critic(kwargs)
                return ValuedOutput(**output, value=self.result)
            return output

        layer = self.policy.model.text_model.layers[-1]
        self._handles = [layer.register_forward_pre_hook(catch, with_kwargs=True),
                         self.policy.register_forward_hook(add_value, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()

    def _critic(self, inputs: dict) -> torch.Tensor:
        attention_mask, pixel_attention_mask = self.policy._default_masks(
            inputs["input_ids"], inputs.get("pixel_values"), inputs.get("attention_mask"),
            inputs.get("pixel_attention_mask"))
        return self.policy.value_head(self.hidden, self.policy.model.prefix_mask(pixel_attention_mask, attention_mask,
                                                                                  _memory(inputs)))

    def value(self, inputs: dict) -> torch.Tensor:
        if self.result is not None:
            return self.result
        if self.hidden is None:
            raise ValueError("no prefix ran inside the PrefixValue block (a call on a prefix cache runs none)")
        return self._critic(inputs)


def prefix_value(model, inputs: dict) -> torch.Tensor:
    """The critic's value `[B]` of the observations in `inputs` (prompt, images), from one prefix pass."""
    with PrefixValue(model) as critic:
        base_policy(model).prefix_cache(inputs["input_ids"], inputs["pixel_values"], inputs["pixel_attention_mask"],
                                        inputs["attention_mask"], memory=_memory(inputs))
    return critic.value(inputs)


def _memory(inputs: dict) -> dict:
    """MEM's past observations among a policy's inputs (none without memory)."""
    return {key: inputs[key] for key in ("memory_state", "memory_mask") if key in inputs}


__all__ = ["PI05ValueHead", "PrefixValue", "ValuedOutput", "add_value_head", "base_policy", "prefix_value"]
