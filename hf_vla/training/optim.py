"""fp32 master weights for a bf16 model.

With the model held in bf16, Adam must not keep bf16 state (updates below bf16 resolution vanish).
`MasterWeightOptimizer` is a real `torch.optim.Optimizer` over the model's parameters (so accelerate wraps it, the
Trainer's gradient accumulation and LR scheduler drive it); inside it keeps fp32 master copies and an fp32 inner
optimizer. Per step: gradients are upcast into the masters and the bf16 gradients freed (clipping happens on the fp32
ones), the inner optimizer steps with the outer param groups' hyper-parameters (the scheduler writes those), and the
masters are rounded back into the bf16 parameters.

The masters are taken from the parameters at the first step, not when the optimizer is built: wrapping (DDP's
broadcast from rank 0) may change the parameters in between, and accelerate round-trips the optimizer through
`state_dict`/`load_state_dict` while wrapping it. Until then `state_dict()` carries no masters, and loading one without
masters leaves the parameters alone; only a checkpoint's masters are ever written into the parameters (on resume, where
every rank loads the same ones). Memory: 2 (bf16 param) + 4 (master) + 4 (fp32 grad) + 8 (Adam) = 18 bytes/parameter.
"""

from __future__ import annotations

import torch


class MasterWeightOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **defaults):
        super().__init__(params, defaults)
        self.optimizer_cls = optimizer_cls
        groups = []
        for group in self.param_groups:
            masters = [p.detach().to(torch.float32).clone().requires_grad_(p.requires_grad) for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        self.inner = optimizer_cls(groups, **defaults)
        self._masters_synced = False
        self._grads_ready = False
        self.last_grad_norm: float | None = None

    def move_to_new_group(self, params, **options) -> None:
        """Move `params` (with their masters) out of their groups into a new one with `options` (its own `lr`, ...),
        before the first step, as a plain optimizer's groups can be edited then (RL's critic learning rate)."""
        wanted = {id(p) for p in params}
        moved = []
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            pairs = list(zip(outer["params"], inner["params"]))
            moved += [(p, m) for p, m in pairs if id(p) in wanted]
            outer["params"] = [p for p, _ in pairs if id(p) not in wanted]
            inner["params"] = [m for p, m in pairs if id(p) not in wanted]
        if any(m in self.inner.state for _, m in moved):
            raise RuntimeError("move_to_new_group after the first step: the moved parameters have optimizer state")
        if not moved:
            return
        self.add_param_group({"params": [p for p, _ in moved], **options})
        options = {k: v for k, v in self.param_groups[-1].items() if k != "params"}  # with the defaults filled in
        self.inner.add_param_group({**options, "params": [m for _, m in moved]})

    # ---- the mapping model param <-> master ----------------------------------------------------------------------
    def _pairs(self):
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            yield from zip(outer["params"], inner["params"])

    def _follow_device(self):
        """Masters (and their state) live where the parameters live. The scalar `step` stays on the CPU, except for
        fused or capturable optimizers, whose kernels read it on the parameters' device."""
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            step_follows = bool(inner.get("fused") or inner.get("capturable"))
            for param, master in zip(outer["params"], inner["params"]):
                if master.device == param.device:
                    continue
                state = self.inner.state.pop(master, None)
                master.data = master.data.to(param.device)
                if state is not None:
                    self.inner.state[master] = {
                        k: v.to(param.device) if torch.is_tensor(v) and (v.dim() or step_follows) else v
                        for k, v in state.items()
                    }

    @torch.no_grad()
    def sync_masters(self):
        """Take the masters from the parameters as they are now (after any wrapping or broadcast)."""
        self._follow_device()
        for param, master in self._pairs():
            master.copy_(param)
        self._masters_synced = True

    @torch.no_grad()
    def upcast_grads(self):
        """fp32 copies of the gradients into the masters; the bf16 gradients are freed."""
        if not self._masters_synced:
            self.sync_masters()
        self._follow_device()
        for param, master in self._pairs():
            master.grad = None if param.grad is None else param.grad.detach().to(torch.float32)
            param.grad = None
        self._grads_ready = True

    @torch.no_grad()
    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Upcast, then clip on the fp32 master gradients; returns the pre-clip norm."""
        self.upcast_grads()
        masters = [m for _, m in self._pairs() if m.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(masters, max_norm, norm_type=norm_type)
        self.last_grad_norm = float(norm)
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError("MasterWeightOptimizer does not take a closure")
        if not self._grads_ready:
            self.upcast_grads()
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in outer.items():  # the LR scheduler writes the outer groups
                if key != "params":
                    inner[key] = value
        self.inner.step()
        for param, master in self._pairs():
            param.copy_(master)  # round-to-nearest into bf16
        self._grads_ready = False

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none=set_to_none)
        self.inner.zero_grad(set_to_none=set_to_none)

    # ---- checkpoints: the fp32 masters themselves, not a re-cast of bf16 weights ------------------------------------
    def state_dict(self):
        masters = [master.detach().clone() for _, master in self._pairs()] if self._masters_synced else None
        return {"outer": super().state_dict(), "inner": self.inner.state_dict(), "masters": masters}

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict) or "masters" not in state_dict:
            raise ValueError("this optimizer state was not written by MasterWeightOptimizer (a run without fp32 master "
                             "weights, or another precision): resume with the dtype/master_weights it was saved with")
        super().load_state_dict(state_dict["outer"])
        masters = state_dict["masters"]
        if masters is not None:
            pairs = list(self._pairs())
            if len(pairs) != len(masters):
                raise ValueError(f"checkpoint holds {len(masters)} masters for {len(pairs)} parameters")
            with torch.no_grad():
                for (param, master), saved in zip(pairs, masters):
                    master.copy_(saved.to(master.device))
                    param.copy_(master)
            self._masters_synced = True
        self.inner.load_state_dict(state_dict["inner"])
