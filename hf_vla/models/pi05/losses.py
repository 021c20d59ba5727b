"""pi0.5's token objective loss (`config.token_loss`): the next-token cross-entropy of every target through the
tied LM head, in pieces, without materialising the `[B, L_t, vocab]` logits (as transformers keeps its losses in
`loss/loss_utils.py`, beside the models)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _token_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-row next-token cross-entropy (float32) through the tied LM head `weight`."""
    return F.cross_entropy(F.linear(hidden.to(weight.dtype), weight).float(), labels, reduction="none")


def chunked_token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """`[B, L_t]` cross-entropy of every target (0 at -100) without the `[B, L_t, vocab]` logits: the valid rows go
    through the LM head `chunk` at a time, each piece recomputed in the backward pass (activation checkpointing)."""
    valid = labels != -100
    rows, targets = hidden[valid], labels[valid]
    if rows.shape[0] == 0:  # no target here: keep the last layer in the graph (DDP expects its gradient, 0)
        return torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device) + 0.0 * hidden.float().sum()
    step = chunk if chunk and chunk > 0 else rows.shape[0]
    pieces = []
    for start in range(0, rows.shape[0], step):
        args = (rows[start : start + step], weight, targets[start : start + step])
        if chunk and chunk > 0 and torch.is_grad_enabled():
            pieces.append(torch.utils.checkpoint.checkpoint(_token_cross_entropy, *args, use_reentrant=False))
        else:
            pieces.append(_token_cross_entropy(*args))
    return torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device).masked_scatter(valid, torch.cat(pieces))


__all__ = ["chunked_token_losses"]
