"""pi0.5's token objective: the backbone learns from target tokens too (docs/cotraining.md).

pi0.5 (arXiv 2504.16054, Eq. 1) trains the VLM with next-token cross-entropy on target tokens (FAST-encoded actions,
text) beside alpha x the expert's flow MSE; knowledge insulation (arXiv 2505.23705) puts a stop-gradient between them,
so the flow loss trains only the expert and the backbone learns only from the tokens. The model side is
`PI05Config.token_loss` / `knowledge_insulation` (`labels` in, `token_losses` out); this module holds the two pieces
around it:

- `fit_fast`: the FAST action tokenizer fitted at the start of training on chunks of the training mixture (or
  loaded), with its statistics logged, and the processor told where FAST ids live in the vocabulary;
- `token_per_sample_loss`: the cross-entropy reduced per sample into (sum, count), per component (`fast_ce`,
  `text_ce`), so the trainer aggregates and evaluates it per provenance exactly as the flow MSE.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hf_vla.errors import ConfigError
from hf_vla.training.losses import PerSampleLoss

logger = logging.getLogger("hf_vla.training.cotraining")

COMPONENTS = ("fast_ce", "text_ce", "subtask_ce")


def target_labels(inputs: dict) -> torch.Tensor | None:
    """Every target token of a batch as the model predicts them, `[B, S + L_t]`: the subtask span (`subtask_ids`
    where `subtask_mask`, else -100; pi0.5's high-level inference) then the token objective's `labels`; None when
    the batch has neither."""
    parts = []
    if "subtask_ids" in inputs:
        parts.append(inputs["subtask_ids"].masked_fill(~inputs["subtask_mask"].bool(), -100))
    if "labels" in inputs:
        parts.append(inputs["labels"])
    return torch.cat(parts, dim=1) if parts else None


def training_chunks(mixture, processor, chunk_size: int, max_chunks: int = 20_000, seed: int = 0) -> np.ndarray:
    """Normalised, zero-padded action chunks `[N, chunk_size, max_action_dim]` of the mixture's training blocks (no
    validation episode), as `target_labels` encodes them: steps past a block's end hold its last action. Windows
    start every `stride` frames, the stride chosen so that about `max_chunks` are taken; each source contributes in
    proportion to its frames."""
    total = sum(blocks.frames for blocks in mixture.train_blocks)
    stride = max(1, int(np.ceil(total / max(max_chunks, 1))))
    # windows start at frames origin, origin + stride, ... of all training blocks laid end to end
    origin = int(np.random.default_rng(seed).integers(stride))
    chunks, position = [], 0  # position: the first frame of the block in that layout
    for source, blocks in zip(mixture.sources, mixture.train_blocks):
        head = mixture.head_of_source[source.source_index]
        for block in blocks:
            length = block.end - block.start
            first = origin - position if position <= origin else (-(position - origin)) % stride
            position += length
            if first >= length:  # no window starts in this block: its rows are not read
                continue
            table = source.episode_table(block.episode)
            actions = table["actions"]
            for start in range(block.start + first, block.end, stride):
                state = table["state"][start]  # a relative head's chunk is offsets from it
                if "action_chunks" in table:  # the frame's own chunk (action_chunk_key), as training reads it
                    chunks.append((head, table["action_chunks"][start, :chunk_size], state))
                    continue
                end = min(start + chunk_size, block.end)
                chunk = np.empty((chunk_size, actions.shape[1]), dtype=np.float32)
                chunk[: end - start] = actions[start:end]
                chunk[end - start:] = actions[end - 1]
                chunks.append((head, chunk, state))
    if not chunks:
        raise ConfigError("token_loss: the training mixture has no action chunk to fit FAST on")
    from hf_vla.models.common.normalization import to_relative

    out = np.zeros((len(chunks), chunk_size, processor.max_action_dim), dtype=np.float32)
    by_head: dict[int, list[int]] = {}
    for index, (head, _, _) in enumerate(chunks):
        by_head.setdefault(head, []).append(index)
    for head, rows in by_head.items():
        stacked = torch.from_numpy(np.stack([chunks[r][1] for r in rows]))
        mask = processor.relative_mask(head)
        if mask is not None:  # in the model's space, as the training targets the tokens encode
            stacked = to_relative(stacked, torch.from_numpy(np.stack([chunks[r][2] for r in rows])), mask)
        normalised = processor.normalize(stacked, "actions", head).numpy()
        out[rows, :, : normalised.shape[-1]] = normalised
    return out


def fit_fast(mixture, processor, config, path: str | None = None, vocab_size: int = 1024, scale: float = 10.0,
             max_chunks: int = 20_000, seed: int = 0):
    """The FAST tokenizer of a run: loaded from `path` (a `fast_tokenizer.json`, its directory, or a checkpoint
    trained with the token loss), else fitted on `training_chunks`; its statistics are logged and it is set on the
    processor (`set_fast_tokenizer`, ids placed in the model's vocabulary). Every refusal is one `ConfigError` line."""
    from hf_vla.models.pi05.fast_tokenizer import FASTActionTokenizer, FASTError

    try:
        if path:
            fast = FASTActionTokenizer.from_pretrained(path)
        else:
            chunks = training_chunks(mixture, processor, config.chunk_size, max_chunks, seed)
            fast = FASTActionTokenizer.fit(chunks, scale=scale, vocab_size=vocab_size,
                                           source=f"the training mixture {mixture.names}")
    except FASTError as error:
        raise ConfigError(f"token_loss: {error}") from error
    if path:
        if (fast.chunk_size, fast.action_dim) != (config.chunk_size, config.max_action_dim):
            raise ConfigError(f"fast_tokenizer={path!r} encodes chunks of {fast.chunk_size} x {fast.action_dim}; "
                              f"this model's are {config.chunk_size} x {config.max_action_dim}")
        logger.info("FAST tokenizer from %s: %s", path, fast)
    try:  # where FAST ids go in the language model's vocabulary
        processor.set_fast_tokenizer(fast, config.vlm_config.text_config.vocab_size)
    except ValueError as error:
        raise ConfigError(f"fast_vocab_size={fast.vocab_size}: {error}") from error
    first, end = processor.fast_token_range
    logger.info("token_loss: FAST ids are language-model ids %d..%d; the LM head is the VLM's input embedding "
                "(tied, as PaliGemma's: a checkpoint that stores no lm_head, lerobot's pi0.5, trains it through "
                "the embedding)", first, end - 1)
    return fast


def token_per_sample_loss(token_losses: torch.Tensor, labels: torch.Tensor,
                          fast_range: tuple[int, int] | None, subtask_width: int = 0) -> dict[str, PerSampleLoss]:
    """Next-token cross-entropy of every target, summed per sample: `{"ce": all targets, "subtask_ce": the leading
    `subtask_width` columns (the subtask span), "fast_ce": FAST tokens, "text_ce": the others}` as
    `PerSampleLoss(sum [B], count [B])` (float32; -100 counts nowhere), from the model's per-target cross-entropy
    `[B, L_t]` (`PI05Output.token_losses`) and `target_labels`."""
    valid = labels != -100
    flat = token_losses.float() * valid
    subtask = torch.zeros_like(valid)
    subtask[:, :subtask_width] = valid[:, :subtask_width]
    if fast_range is not None:
        fast = valid & ~subtask & (labels >= fast_range[0]) & (labels < fast_range[1])
    else:
        fast = torch.zeros_like(valid)
    text = valid & ~fast & ~subtask
    out = {"ce": PerSampleLoss(flat.sum(-1), valid.sum(-1).float())}
    for name, mask in (("fast_ce", fast), ("text_ce", text), ("subtask_ce", subtask)):
        out[name] = PerSampleLoss((flat * mask).sum(-1), mask.sum(-1).float())
    return out


__all__ = ["COMPONENTS", "fit_fast", "target_labels", "token_per_sample_loss", "training_chunks"]
