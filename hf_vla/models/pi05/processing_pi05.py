"""pi0.5 processor: prompt (task + discretized state), images, normalization per head (quantiles by default; the modes
and relative actions of `hf_vla.models.common.normalization`), un-normalization."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from transformers import BatchFeature, ProcessorMixin

from hf_vla.models.common.contract_io import DeploymentContractMixin
from hf_vla.models.common.flow import MAX_CFG_BETA
from hf_vla.models.common.images import as_image_batch, resize_with_pad
from hf_vla.models.common.normalization import normalize as _normalize
from hf_vla.models.common.normalization import relative_mask as _relative_mask
from hf_vla.models.common.normalization import to_absolute, to_relative
from hf_vla.models.common.normalization import unnormalize as _unnormalize
from hf_vla.models.common.remote_code import SharedCodeMixin


def stat_width(stats: dict) -> int:
    """How many dims one normalised quantity has (whichever statistic it carries)."""
    for name in ("q01", "mean", "min", "q10"):
        if name in stats:
            return len(stats[name])
    raise ValueError(f"statistics without q01, mean, min or q10: {sorted(stats)}")


def _as_tensor(value, dtype=torch.float32) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    array = np.asarray(value)
    if not array.flags.writeable:  # a pandas or memory-mapped read-only view: torch warns on sharing it, so copy
        array = array.copy()
    return torch.as_tensor(array, dtype=dtype)


# RECAP's advantage indicator (pi*0.6, arXiv 2511.14759, Sec. V-B: "Advantage: positive" / "Advantage: negative").
# "text" (the default): a prompt segment of its own, tokenized apart and placed after the task and state, right before
# the answer marker, so the task's and the state's token ids are those of the plain prompt (docs/recap.md: appended to
# the task, the indicator re-tokenized the task's last word and moved every later token). "appended": the task with
# the indicator on a line of its own, as lerobot's `feat/add-recap` branch writes it (checkpoints trained before the
# segment). "embedding": no text; the expert reads a learned embedding of the indicator (`advantage_ids`).
ADVANTAGE_TAGS = {True: "Advantage: positive", False: "Advantage: negative"}
INDICATOR_FORMS = ("text", "appended", "embedding")
ADVANTAGE_IDS = {None: 0, False: 1, True: 2}  # the embedding form's ids: none (dropped), negative, positive


def advantage_task(task: str, advantage: bool | None) -> str:
    """`task` with the advantage indicator appended on a line of its own (the "appended" form; None: the task alone)."""
    if advantage is None:
        return task
    tag = ADVANTAGE_TAGS[bool(advantage)]
    return f"{task}\n{tag}" if task else tag


logger = logging.getLogger("hf_vla")


class IndicatorCutError(ValueError):
    """A prompt too long for `tokenizer_max_length` once RECAP's advantage indicator is in it (the indicator would be
    cut off). Its own type, so a trainer can report it as a data error (this file also runs without hf_vla)."""


class PromptCutError(ValueError):
    """A prompt too long for `tokenizer_max_length` once the `Subtask: ` marker that a subtask follows is in it."""


class PI05Processor(SharedCodeMixin, DeploymentContractMixin, ProcessorMixin):
    r"""
    Turns raw robot observations into pi0.5 inputs and predicted chunks back into robot actions.

    tokenizer: any HF tokenizer (real runs: `google/paligemma-3b-pt-224`'s).
    norm_stats (`dict`): `{head: {"state": {"q01": [...], "q99": [...]}, "actions": {...}}}`, one head per
        `robot_type::control_mode`; quantile normalization maps q01..q99 to [-1, 1] unless a quantity's `mode` says
        otherwise (`MEAN_STD`, `MIN_MAX`, `QUANTILE10`, `IDENTITY`: `hf_vla.models.pi05.normalization`). Dimensions with
        q01 == q99 (std 0, min == max) are degenerate and map to 0 (and back to their constant), instead of exploding.
        An `actions` entry with a `relative_mask` makes those dims offsets from the state: targets are converted
        before normalising, predictions back after (`unnormalize_actions`).
    head_names (`list[str]`): heads in `dataset_index` order.
    image_size, max_state_dim, max_action_dim, chunk_size, state_bins: as in `PI05Config`; prompt_max_length is its
        `tokenizer_max_length`.
    fast_config (`dict`, *optional*): the FAST action tokenizer of the token objective (`FASTActionTokenizer`'s
        `to_dict()`; `PI05Config.token_loss`), saved in `processor_config.json`. Training batches then carry `labels`
        (`target_labels`); inference never uses it.
    fast_token_offset (`int`, *optional*): the language-model id of FAST id 0 (`set_fast_tokenizer` chooses it).
    advantage_conditioned (`bool`): the policy was trained with RECAP's advantage indicator; at inference every prompt
        asks for "Advantage: positive" unless a call says otherwise.
    advantage_indicator (`str`): how the indicator reaches the model (`INDICATOR_FORMS`): "text", a prompt segment of
        its own before the answer marker (the task's and state's token ids unchanged); "embedding", `advantage_ids`
        (0 none, 1 negative, 2 positive) the expert reads as a learned embedding in its time conditioning (the
        prompt is the plain one); "appended", the task with the indicator appended (checkpoints trained before the
        segment; the default of a saved processor that does not name one).
    memory (`dict`, *optional*): MEM's observation memory of the policy (`PI05Config.use_visual_memory` /
        `use_proprioceptive_memory`): `{"frames", "stride", "visual", "proprio"}`. Calls then take the past
        observations (`memory=`) and build `pixel_values` with a frame axis and/or `memory_state`, and `memory_mask`;
        with proprioceptive memory the prompt holds no state (`Task: {task};\nAction: `, as lerobot's).
    cfg_beta (`float`): classifier-free guidance of an advantage-conditioned policy, v = v_u + beta (v_c - v_u)
        (1: plain conditioning on "positive", one forward; other values add the unconditioned prompt to the inputs
        and `sample_actions` runs both in one batched forward per denoising step).

    No image processor (transformers' `PI0Processor(image_processor, tokenizer)` has one), on purpose: the image path is
    one fused step, openpi's aspect-preserving resize with black padding and SigLIP's [-1, 1] scaling
    (`resize_with_pad`, on any `[B, n_cams, 3, H, W]` batch from `as_image_batch`), done in place on tensors the
    DataLoader worker owns and written into shared memory faulted in ahead (`_SharedBuffers`): 5 ms for 32 frames at
    224 px against 20-40 ms allocated step by step, the values bit for bit the same. Its one setting, `image_size`, is
    the processor's own and is saved with it; an `image_processor` attribute would add a second config file to every
    checkpoint and a second place for that size, with no setting of its own to hold.
    """

    attributes = ["tokenizer"]
    tokenizer_class = "AutoTokenizer"

    def __init__(
        self,
        tokenizer=None,
        norm_stats: dict | None = None,
        head_names: list[str] | None = None,
        image_size: int = 224,
        max_state_dim: int = 32,
        max_action_dim: int = 32,
        chunk_size: int = 50,
        prompt_max_length: int = 200,
        state_bins: int = 256,
        discrete_state_input: bool = True,
        fast_config: dict | None = None,
        fast_token_offset: int | None = None,
        advantage_conditioned: bool = False,
        cfg_beta: float = 1.0,
        subtask_layout: str | None = None,
        memory: dict | None = None,
        subtask_max_tokens: int | None = None,
        advantage_indicator: str = "appended",
        **kwargs,
    ):
        self.norm_stats = norm_stats or {}
        self.head_names = list(head_names) if head_names is not None else list(self.norm_stats)
        self.image_size = image_size
        self.max_state_dim = max_state_dim
        self.max_action_dim = max_action_dim
        self.chunk_size = chunk_size
        self.prompt_max_length = prompt_max_length
        self.state_bins = state_bins
        self.discrete_state_input = discrete_state_input
        self.fast_config = fast_config
        self.fast_token_offset = fast_token_offset
        self.advantage_conditioned = bool(advantage_conditioned)
        self.cfg_beta = float(cfg_beta)
        self.subtask_layout = subtask_layout
        self.subtask_max_tokens = None if subtask_max_tokens is None else int(subtask_max_tokens)
        if advantage_indicator not in INDICATOR_FORMS:
            raise ValueError(f"advantage_indicator={advantage_indicator!r}: one of {INDICATOR_FORMS}")
        self.advantage_indicator = advantage_indicator
        self._subtask_cut_warned = False
        self.memory = _memory_settings(memory)
        self._last_state = None  # the raw states of the last call (relative actions are offsets from them)
        super().__init__(tokenizer, **kwargs)

    @classmethod
    def from_config(cls, config, tokenizer, norm_stats: dict | None = None, head_names=None) -> PI05Processor:
        return cls(
            tokenizer=tokenizer,
            norm_stats=norm_stats,
            head_names=head_names,
            image_size=config.image_size,
            max_state_dim=config.max_state_dim,
            max_action_dim=config.max_action_dim,
            chunk_size=config.chunk_size,
            prompt_max_length=config.tokenizer_max_length,
            state_bins=config.state_bins,
            discrete_state_input=getattr(config, "discrete_state_input", True),
            subtask_layout=getattr(config, "subtask_layout", None),
            memory=memory_settings_of(config),
            subtask_max_tokens=getattr(config, "subtask_max_tokens", None) if getattr(config, "subtask_layout", None)
            else None,
            advantage_indicator=getattr(config, "advantage_indicator", None) or "text",
        )

    # ---- normalization -------------------------------------------------------------------------------------------
    def _head(self, head: str | int | None) -> str:
        if head is None:
            if len(self.head_names) != 1:
                raise ValueError(f"Pass a normalization head: this processor has {self.head_names}.")
            return self.head_names[0]
        if isinstance(head, int):
            return self.head_names[head]
        if head not in self.norm_stats:
            raise KeyError(f"unknown normalization head {head!r}; known: {sorted(self.norm_stats)}")
        return head

    def _stats(self, head, key: str) -> dict:
        return self.norm_stats[self._head(head)][key]

    def normalize(self, values, key: str, head=None) -> torch.Tensor:
        """Robot units -> the model's on the last dim, by the head's mode for `key` (`hf_vla.models.pi05.normalization`:
        quantiles unless the statistics say otherwise); degenerate dims -> 0."""
        head = self._head(head)
        values, stats = _as_tensor(values), self._stats(head, key)
        if values.shape[-1] != stat_width(stats):
            raise ValueError(f"{key} has {values.shape[-1]} dims but head {head!r} has stats for {stat_width(stats)}")
        return _normalize(values, stats, f"{key} of head {head!r}")

    def unnormalize(self, values, key: str, head=None) -> torch.Tensor:
        """Inverse of `normalize` on the head's real dims (extra padded dims are dropped)."""
        head = self._head(head)
        stats = self._stats(head, key)
        values = _as_tensor(values)[..., : stat_width(stats)]
        return _unnormalize(values, stats, f"{key} of head {head!r}")

    def relative_mask(self, head=None) -> list[bool] | None:
        """The head's relative-action mask (dims that are offsets from the state), or None (absolute actions)."""
        return _relative_mask(self._stats(head, "actions"))

    def unnormalize_actions(self, actions, head=None, state=None) -> torch.Tensor:
        """A predicted chunk in robot units. For a head trained on relative actions the observation's state is added
        back: `state` (raw, `[B, state_dim]` or one vector), or by default the state of this processor's last call
        (lerobot's `AbsoluteActionsProcessorStep` reads its pre-processor's cached state the same way)."""
        absolute = self.unnormalize(actions, "actions", head)
        mask = self.relative_mask(head)
        if mask is None:
            return absolute
        if state is None:
            state = self._last_state
            if state is None:
                raise ValueError(f"head {self._head(head)!r} predicts relative actions: pass the observation's "
                                 "state (unnormalize_actions(chunk, state=...)), or call the processor on it first")
        state = _as_tensor(state)
        if absolute.ndim == 3 and state.ndim == 1:
            state = state[None]
        return to_absolute(absolute, state, mask)

    # ---- prompt --------------------------------------------------------------------------------------------------
    def discretize_state(self, normalized_state: torch.Tensor) -> np.ndarray:
        """`state_bins` uniform bins over [-1, 1], exactly as openpi and lerobot (`np.digitize(..., linspace(-1, 1,
        bins + 1)[:-1]) - 1`): a value below -1 is bin -1 and one above 1 the last bin, as their prompts have it (a
        MEAN_STD or IDENTITY state leaves [-1, 1] often; a checkpoint trained on those prompts must see them)."""
        bins = np.linspace(-1, 1, self.state_bins + 1)[:-1]
        return np.digitize(normalized_state.detach().cpu().numpy(), bins=bins) - 1

    def build_prompt(self, task: str, normalized_state: torch.Tensor, subtask_next: bool = False) -> str:
        """openpi's pi0.5 prompt, `Task: {task}, State: {bins};\nAction: `; with `subtask_next` (a subtask follows
        it, `docs/subtasks.md`) it ends in `Subtask: ` instead. With proprioceptive memory the state is a prefix token
        of its own and the prompt is `Task: {task};\nAction: ` (lerobot's MEM prompt)."""
        cleaned = task.strip().replace("_", " ").replace("\n", " ")
        answer = "Subtask" if subtask_next else "Action"
        if self.memory and self.memory["proprio"]:
            return f"Task: {cleaned};\n{answer}: "
        state = " ".join(map(str, self.discretize_state(normalized_state).tolist()))
        return f"Task: {cleaned}, State: {state};\n{answer}: "

    def _prompt_tokens(self, texts: list[str], padded_state: torch.Tensor, states: list[torch.Tensor],
                       subtask_next: list[bool] | None = None, advantages: list | None = None) -> dict:
        """The prompts' token ids and attention masks (plain lists), right-padded to `prompt_max_length`; a row's
        advantage indicator (True / False; None: none) in the processor's `advantage_indicator` form."""
        advantages = advantages or [None] * len(texts)
        form = self.advantage_indicator
        if form == "appended":
            texts, advantages = [advantage_task(t, a) for t, a in zip(texts, advantages)], [None] * len(texts)
        elif form == "embedding":  # the expert reads it (`advantage_ids`); the prompt is the plain one
            advantages = [None] * len(texts)
        if not self.discrete_state_input and not (self.memory and self.memory["proprio"]):
            if subtask_next and any(subtask_next):
                raise ValueError("a subtask follows the prompt's state: it needs discrete_state_input")
            return self._task_only_tokens(texts, advantages)
        subtask_next = subtask_next or [False] * len(texts)
        prompts = [self.build_prompt(t, padded_state[i, : states[i].shape[-1]], subtask_next[i])
                   for i, t in enumerate(texts)]
        # plain lists, then one tensor: about twice as fast as the tokenizer's own tensor conversion
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=self.prompt_max_length,
                                padding_side="right")
        for row, advantage in enumerate(advantages):
            if advantage is not None:  # the indicator as a segment of its own before the answer marker
                head, _, answer = prompts[row].rpartition("\n")
                ids = (self.tokenizer(head + "\n")["input_ids"] + self._indicator_ids(advantage, "\n")
                       + self.tokenizer(answer, add_special_tokens=False)["input_ids"])
                self._set_row(tokens, row, ids)
        return tokens

    def _indicator_ids(self, advantage: bool, end: str) -> list[int]:
        """The indicator's own tokens: `Advantage: positive;` (or negative) and `end`, tokenized apart."""
        return self.tokenizer(f"{ADVANTAGE_TAGS[bool(advantage)]};{end}", add_special_tokens=False)["input_ids"]

    def _set_row(self, tokens: dict, row: int, ids: list[int]) -> None:
        """Row `row` of `tokens` becomes `ids`, right-padded; an indicator the length would cut is refused."""
        length = self.prompt_max_length
        if len(ids) > length:
            raise IndicatorCutError(f"the prompt with its advantage indicator is {len(ids)} tokens, longer than "
                                    f"tokenizer_max_length={length}, which cuts the indicator off; raise the model's "
                                    f"tokenizer_max_length (e.g. --model_config.tokenizer_max_length {len(ids) + 8} for "
                                    "a model built from a config, or a fine-tune of one)")
        pad = self.tokenizer.pad_token_id or 0
        tokens["input_ids"][row] = ids + [pad] * (length - len(ids))
        tokens["attention_mask"][row] = [1] * len(ids) + [0] * (length - len(ids))

    def _check_subtask_marker_fits(self, texts: list[str], subtask_next: list[bool], padded_state, states,
                                   tokens: dict) -> None:
        """A prompt followed by a subtask must keep its `Subtask: ` marker through the truncation to
        `prompt_max_length` tokens: cut, the subtask would be decoded (or trained) after half a task. Only a row that
        fills the length can have been cut, so only such a row is tokenized again, whole."""
        for row, text in enumerate(texts):
            if not subtask_next[row] or sum(tokens["attention_mask"][row]) < self.prompt_max_length:
                continue
            prompt = self.build_prompt(text, padded_state[row, : states[row].shape[-1]], subtask_next=True)
            length = len(self.tokenizer(prompt)["input_ids"])
            if length > self.prompt_max_length:
                raise PromptCutError(f"the prompt is {length} tokens, longer than tokenizer_max_length="
                                     f"{self.prompt_max_length}, which cuts its 'Subtask: ' marker off; shorten the "
                                     "task (or train with a larger tokenizer_max_length)")

    def _check_indicator_fits(self, texts: list[str], advantages: list, padded_state, states, tokens: dict) -> None:
        """The "appended" form: the indicator must survive the prompt's truncation to `prompt_max_length` tokens (a
        cut one would train, and run, a policy that never reads it). Only a row that fills the length can have been
        cut, so only such a row is tokenized again, whole, to say how long it is. (The "text" form is checked where
        its segment is placed.)"""
        for row, (text, advantage) in enumerate(zip(texts, advantages)):
            if advantage is None or sum(tokens["attention_mask"][row]) < self.prompt_max_length:
                continue
            tagged = advantage_task(text, advantage)
            if self.discrete_state_input:
                prompt = self.build_prompt(tagged, padded_state[row, : states[row].shape[-1]])
                length = len(self.tokenizer(prompt)["input_ids"])
            else:
                cleaned = tagged.strip().replace("_", " ").replace("\n", " ")
                length = len(self.tokenizer(cleaned)["input_ids"]) + 1
            if length > self.prompt_max_length:
                raise IndicatorCutError(f"the prompt with its advantage indicator is {length} tokens, longer than "
                                        f"tokenizer_max_length={self.prompt_max_length}, which cuts the indicator off; "
                                        "raise the model's tokenizer_max_length (e.g. --model_config."
                                        f"tokenizer_max_length {length + 8} for a model built from a config, or a "
                                        "fine-tune of one)")

    def _advantages(self, advantage, cfg_beta, rows: int) -> tuple[list, list[float] | None]:
        """Each row's advantage indicator, and the rows' guidance betas when any is not 1 (else None)."""
        if isinstance(advantage, str):
            if advantage != "auto":
                raise ValueError(f"advantage={advantage!r}: True, False, None, one per row, or 'auto'")
            advantage = True if self.advantage_conditioned else None
        values = list(advantage) if isinstance(advantage, list | tuple) else [advantage] * rows
        if len(values) != rows:
            raise ValueError(f"got {len(values)} advantage values for {rows} rows")
        values = [None if a is None else bool(a) for a in values]
        if cfg_beta is None:
            cfg_beta = self.cfg_beta
        betas = [float(b) for b in cfg_beta] if isinstance(cfg_beta, list | tuple | torch.Tensor) else (
            [float(cfg_beta)] * rows)
        if len(betas) != rows or not all(math.isfinite(b) and 0 <= b <= MAX_CFG_BETA for b in betas):
            raise ValueError(f"cfg_beta={cfg_beta!r}: a beta in [0, {MAX_CFG_BETA:g}] per row (1: plain "
                             "conditioning)")
        guided = [b != 1.0 for b in betas]
        if not any(guided):
            return values, None
        if all(b == 0.0 for b in betas):  # v_u + 0 (v_c - v_u): the unconditioned prompt alone, one forward
            return [None] * rows, None
        if not self.advantage_conditioned:
            raise ValueError(f"cfg_beta={cfg_beta!r}: guidance needs an advantage-conditioned policy (trained with "
                             "RECAP's advantage indicator); this one is not")
        if any(g and a is not True for g, a in zip(guided, values)):
            raise ValueError("cfg_beta != 1 guides towards 'Advantage: positive': those rows must ask for it")
        return values, betas

    def _subtasks(self, subtask, rows: int) -> list:
        """Each row's subtask (None, "auto" or a text), refused in one line where the policy was not trained for
        them."""
        values = list(subtask) if isinstance(subtask, list | tuple) else [subtask] * rows
        if len(values) != rows:
            raise ValueError(f"got {len(values)} subtasks for {rows} rows")
        if any(v is not None for v in values) and not self.subtask_layout:
            raise ValueError("subtask: this policy was not trained with subtasks (its processor has no "
                             "subtask_layout); leave subtask out")
        if any(v is not None and not isinstance(v, str) for v in values):
            raise ValueError(f"subtask: a text, 'auto' or None per row, got {values!r}")
        return [None if v is None else (v if v == "auto" else " ".join(v.split())) for v in values]

    def subtask_tokens(self, subtasks: Sequence[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """`subtask_ids` / `subtask_mask` `[B, S]`: each row's subtask as text tokens then EOS (what the model predicts
        and acts on after the prompt's `Subtask: `), right-padded; a None row is all False."""
        eos = self.tokenizer.eos_token_id
        rows = [[] if s is None else self.tokenizer(s, add_special_tokens=False)["input_ids"] + [eos]
                for s in subtasks]
        bound = self.subtask_max_tokens
        if bound is not None and any(len(r) > bound for r in rows):  # the model decodes at most `bound` tokens
            longest = max(range(len(rows)), key=lambda i: len(rows[i]))
            if not self._subtask_cut_warned:
                logger.warning("a subtask of %d tokens (EOS included; %r...) is cut to subtask_max_tokens=%d, the most "
                               "the model decodes; shorten the annotations or raise subtask_max_tokens",
                               len(rows[longest]), str(subtasks[longest])[:40], bound)
                self._subtask_cut_warned = True
            rows = [r if len(r) <= bound else r[: bound - 1] + [eos] for r in rows]
        width = max(1, max(len(r) for r in rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for index, row in enumerate(rows):
            ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[index, : len(row)] = True
        return ids, mask

    def decode_subtask(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str | None]:
        """The text of each row's decoded subtask (`generate_subtask`'s ids and mask), EOS left out."""
        eos = self.tokenizer.eos_token_id
        texts = []
        for row, valid in zip(ids.tolist(), mask.tolist()):
            tokens = [t for t, v in zip(row, valid) if v]
            texts.append(self.tokenizer.decode([t for t in tokens if t != eos], skip_special_tokens=True).strip()
                         if tokens else None)
        return texts

    def _task_only_tokens(self, texts: list[str], advantages: list | None = None) -> dict:
        """Prompts without the state (`discrete_state_input=False`), as openpi's tokenizer builds them: the cleaned
        task with BOS, then "\n" tokenized on its own (its start-of-answer token), right-padded to the prompt
        length; a row's indicator (the "text" form) between them, tokenized apart."""
        newline = self.tokenizer("\n", add_special_tokens=False)["input_ids"]
        cleaned = [t.strip().replace("_", " ").replace("\n", " ") for t in texts]
        advantages = advantages or [None] * len(texts)
        ids = [row + ([] if a is None else self._indicator_ids(a, "")) + newline
               for row, a in zip(self.tokenizer(cleaned)["input_ids"], advantages)]
        length, pad = self.prompt_max_length, self.tokenizer.pad_token_id or 0
        tokens = {"input_ids": [None] * len(ids), "attention_mask": [None] * len(ids)}
        for row, (advantage, row_ids) in enumerate(zip(advantages, ids)):
            if advantage is not None:
                self._set_row(tokens, row, row_ids)  # refused where the length would cut the indicator
                continue
            row_ids = row_ids[:length]
            tokens["input_ids"][row] = row_ids + [pad] * (length - len(row_ids))
            tokens["attention_mask"][row] = [1] * len(row_ids) + [0] * (length - len(row_ids))
        return tokens

    def pad(self, values: torch.Tensor, size: int) -> torch.Tensor:
        if values.shape[-1] > size:
            raise ValueError(f"vector of {values.shape[-1]} dims does not fit the model's max of {size}")
        return F.pad(values, (0, size - values.shape[-1]))

    # ---- the call ------------------------------------------------------------------------------------------------
    def _rows_by_head(self, head, batch: int) -> dict:
        """head name -> row indices; `head` is one head for every row, or one per row (names or indices)."""
        if isinstance(head, torch.Tensor):
            head = head.tolist()
        if isinstance(head, list | tuple):
            if len(head) != batch:
                raise ValueError(f"got {len(head)} heads for {batch} rows")
            rows: dict = {}
            for row, value in enumerate(head):
                rows.setdefault(self._head(value), []).append(row)
            return rows
        return {self._head(head): list(range(batch))}

    def _normalize_rows(self, values: list[torch.Tensor], key: str, rows_by_head: dict, size: int,
                        normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row values (widths may differ by head) -> normalized, zero-padded `[B, ..., size]` and the width mask."""
        if any(v.shape[-1] > size for v in values):
            width = max(v.shape[-1] for v in values)
            raise ValueError(f"{key} has {width} dims but the model's max is {size}")
        out = torch.zeros(len(values), *values[0].shape[:-1], size)
        mask = torch.zeros(len(values), size, dtype=torch.bool)
        for head, rows in rows_by_head.items():
            stacked = torch.stack([values[r] for r in rows])  # one head: one width
            if not normalized:
                stacked = self.normalize(stacked, key, head)
            index = torch.tensor(rows)
            out[index, ..., : stacked.shape[-1]] = stacked
            mask[index, : stacked.shape[-1]] = True
        return out, mask

    def __call__(
        self,
        images: torch.Tensor | Sequence | None = None,
        text: str | Sequence[str] | None = None,
        state=None,
        actions=None,
        head: str | int | Sequence | torch.Tensor | None = None,
        camera_mask=None,
        normalized: bool = False,
        advantage="auto",
        cfg_beta: float | Sequence[float] | None = None,
        subtask: str | Sequence[str | None] | None = None,
        memory: dict | None = None,
        sampling_config=None,
        **kwargs,
    ) -> BatchFeature:
        """Build model inputs for a batch: the one path for training (the collator) and inference.

        images: `[B, n_cams, 3, H, W]`, one sample `[n_cams, 3, H, W]` or one image `[3, H, W]`; channels last
            (`[..., H, W, 3]`) and PIL images too; uint8 (0..255) or float in [0, 1] (`as_image_batch`).
        text: task strings. state: `[B, state_dim]` raw (or already normalized with `normalized=True`), or one vector
            per row when rows have different heads (and widths).
        actions: optional raw targets, `[B, chunk, action_dim]` or one `[chunk, dim]` per row.
        head: normalization head (name or index) of every row, or one per row.
        camera_mask: optional `[B, n_cams]` presence (default: all present).
        advantage: RECAP's indicator per row (True, False, or None for no indicator), one value for every row, or
            "auto" (inference): "positive" for an advantage-conditioned processor, none otherwise.
        cfg_beta: the guidance of an advantage-conditioned policy at inference (one value, or one per row; default
            the processor's `cfg_beta`). Where a row's beta is not 1 the unconditioned prompt is added to the inputs
            (`uncond_input_ids`, `uncond_attention_mask`, `cfg_beta` `[B]`), which `sample_actions` guides with.
        subtask (a processor of a subtask-trained policy, `subtask_layout`): each row's subtask text (or one for every
            row; None: none, the plain prompt), or "auto" (the prompt ends in `Subtask: `, for the model to decode
            it: `sample_actions(subtask="auto")`). `"joint"`: a row with a text gets the prompt ending in `Subtask: `
            and `subtask_ids` / `subtask_mask` (its tokens and EOS); `"factorised"`: the text takes the task's place
            in the plain prompt.
        memory (a processor of a MEM policy, `self.memory`): the past observations of each row, oldest first:
            `{"images": [B, n_cams, T-1, 3, H, W], "state": [B, T-1, state_dim] (raw, or normalized with
            `normalized=True`), "mask": [B, T-1] bool}` (T = `memory["frames"]`; mask False: before the episode's
            start, ignored). None: every row is at its episode's start (no past). The outputs then carry
            `pixel_values` `[B, n_cams, T, 3, S, S]` (visual), `memory_state` `[B, T, max_state_dim]` (proprio) and
            `memory_mask` `[B, T]`, the current observation last.
        sampling_config: the `SamplingConfig` the inputs will be sampled with (`sample_actions(sampling_config=...)`,
            one object for both calls): its `cfg_beta` and `subtask="auto"` apply where `cfg_beta` / `subtask` are not
            given here.
        """
        if sampling_config is not None:
            if cfg_beta is None and sampling_config.cfg_beta is not None:
                beta = sampling_config.cfg_beta
                cfg_beta = beta.tolist() if isinstance(beta, torch.Tensor) else beta
            if subtask is None and isinstance(sampling_config.subtask, str):  # "auto" (a SubtaskDecode is the model's)
                subtask = sampling_config.subtask
        if text is None:
            raise ValueError("PI05Processor needs the task text.")
        texts = [text] if isinstance(text, str) else list(text)
        if state is None:
            raise ValueError("PI05Processor needs the robot state (pi0.5 puts it in the prompt).")
        if isinstance(state, torch.Tensor | np.ndarray) or (len(state) and not isinstance(state[0], torch.Tensor)):
            state = _as_tensor(state)
            if state.ndim == 1:
                state = state[None]
        states = [_as_tensor(row) for row in state]
        if len(states) != len(texts):
            raise ValueError(f"got {len(states)} states for {len(texts)} prompts")
        rows_by_head = self._rows_by_head(head, len(states))
        if not normalized and len({s.shape[-1] for s in states}) == 1:  # raw states: the reference of relative actions
            self._last_state = torch.stack(states)
        padded_state, _ = self._normalize_rows(states, "state", rows_by_head, self.max_state_dim, normalized)
        advantages, betas = self._advantages(advantage, cfg_beta, len(texts))
        subtasks = self._subtasks(subtask, len(texts))
        subtask_next = [s is not None for s in subtasks]
        if self.subtask_layout == "factorised":  # a given subtask replaces the task; "auto" asks for it after the task
            texts = [s if s not in (None, "auto") else t for t, s in zip(texts, subtasks)]
            subtask_next = [s == "auto" for s in subtasks]
        tokens = self._prompt_tokens(texts, padded_state, states, subtask_next, advantages)
        appended = self.advantage_indicator == "appended"
        if appended and any(a is not None for a in advantages):
            self._check_indicator_fits(texts, advantages, padded_state, states, tokens)
        if any(subtask_next):
            self._check_subtask_marker_fits([advantage_task(t, a) if appended else t
                                             for t, a in zip(texts, advantages)], subtask_next,
                                            padded_state, states, tokens)
        data = {"input_ids": torch.tensor(tokens["input_ids"], dtype=torch.long),
                "attention_mask": torch.tensor(tokens["attention_mask"], dtype=torch.bool), "state": padded_state}
        if self.advantage_indicator == "embedding":  # what the expert reads instead of a prompt segment
            data["advantage_ids"] = torch.tensor([ADVANTAGE_IDS[a] for a in advantages], dtype=torch.long)
        if self.subtask_layout == "joint" and any(s not in (None, "auto") for s in subtasks):
            data["subtask_ids"], data["subtask_mask"] = self.subtask_tokens(
                [s if s != "auto" else None for s in subtasks])
        if betas is not None:  # classifier-free guidance: the unconditioned prompt beside the conditioned one
            uncond = self._prompt_tokens(texts, padded_state, states)
            data["uncond_input_ids"] = torch.tensor(uncond["input_ids"], dtype=torch.long)
            data["uncond_attention_mask"] = torch.tensor(uncond["attention_mask"], dtype=torch.bool)
            data["cfg_beta"] = torch.tensor(betas, dtype=torch.float32)
            if "advantage_ids" in data:  # the embedding form: the same prompt, no indicator for the other half
                data["uncond_advantage_ids"] = torch.zeros_like(data["advantage_ids"])
        if images is not None:
            images = as_image_batch(images, len(texts))
            if self.memory and self.memory["visual"]:  # MEM: the past frames and the current one, `[B, n_cams, T, ...]`
                data["pixel_values"] = self._frames(images, memory)
            else:
                data["pixel_values"] = resize_with_pad(images, self.image_size)
            mask = torch.ones(images.shape[:2], dtype=torch.bool) if camera_mask is None else _as_tensor(camera_mask, torch.bool)
            data["pixel_attention_mask"] = mask
        if self.memory:
            data.update(self._memory_inputs(memory, data, states, rows_by_head, normalized))
        elif memory is not None:
            raise ValueError("memory= was passed, but this policy has no observation memory (PI05Config."
                             "use_visual_memory / use_proprioceptive_memory)")
        if actions is not None:
            if isinstance(actions, torch.Tensor | np.ndarray) or not isinstance(actions[0], torch.Tensor):
                actions = _as_tensor(actions)
                if actions.ndim == 2:
                    actions = actions[None]
            chunks = [_as_tensor(row) for row in actions]
            if not normalized:  # relative heads: every step an offset from the row's own state, before normalising
                for head_name, rows in rows_by_head.items():
                    mask = self.relative_mask(head_name)
                    for row in rows if mask else ():
                        chunks[row] = to_relative(chunks[row], states[row], mask)
            data["actions"], data["action_dim_mask"] = self._normalize_rows(chunks, "actions", rows_by_head,
                                                                            self.max_action_dim, normalized)
        return BatchFeature(data=data)

    def _memory_inputs(self, memory: dict | None, data: dict, states: list, rows_by_head: dict,
                       normalized: bool) -> dict:
        """MEM's inputs: the past frames before the current ones (visual), the past and current normalised states
        (proprio), and which are real. No `memory`: the episode's start (the past is the current observation, masked,
        as lerobot's queue fills it)."""
        frames, rows = self.memory["frames"], len(states)
        past = frames - 1
        memory = dict(memory or {})
        mask = memory.get("mask")
        mask = torch.zeros(rows, past, dtype=torch.bool) if mask is None else _as_tensor(mask, torch.bool).reshape(rows, past)
        out = {"memory_mask": torch.cat([mask, torch.ones(rows, 1, dtype=torch.bool)], dim=1)}
        if self.memory["proprio"]:
            given = memory.get("state")
            rows_states = []
            for row, state in enumerate(states):
                previous = state[None].expand(past, -1) if given is None else _as_tensor(given[row]).reshape(past, -1)
                if previous.shape[-1] != state.shape[-1]:
                    raise ValueError(f"memory['state'] row {row} has {previous.shape[-1]} dims, the state "
                                     f"{state.shape[-1]}")
                rows_states.append(torch.cat([previous, state[None]], dim=0))
            out["memory_state"], _ = self._normalize_rows(rows_states, "state", rows_by_head, self.max_state_dim,
                                                          normalized)
        return out

    def _frames(self, images: torch.Tensor, memory: dict | None) -> torch.Tensor:
        """Visual memory's `pixel_values` `[B, n_cams, T, 3, S, S]`: the past frames (`memory["images"]`; none: the
        current frame, masked) and the current ones, joined before the one resize and scaling pass."""
        rows, cameras = images.shape[:2]
        past = self.memory["frames"] - 1
        history = (memory or {}).get("images")
        if history is None:
            history = images[:, :, None].expand(-1, -1, past, -1, -1, -1)
        else:
            history = torch.as_tensor(np.asarray(history)) if not isinstance(history, torch.Tensor) else history
            if history.ndim != 6 or tuple(history.shape[:3]) != (rows, cameras, past) or history.shape[3:] != images.shape[2:]:
                raise ValueError(f"memory['images'] must be [B={rows}, n_cams={cameras}, T-1={past}, "
                                 f"{', '.join(map(str, images.shape[2:]))}] (as the current images), got "
                                 f"{tuple(history.shape)}")
            if history.dtype != images.dtype:  # one uint8, the other float in [0, 1]: both as floats in [0, 1]
                history, images = (x.float().div(255.0) if x.dtype == torch.uint8 else x for x in (history, images))
        return resize_with_pad(torch.cat([history, images[:, :, None]], dim=2), self.image_size)

    # ---- the token objective's targets (training only) ----------------------------------------------------------
    @property
    def fast(self):
        """The `FASTActionTokenizer` (None without one), built once from `fast_config`."""
        if not self.fast_config:
            return None
        cached = _FAST_CACHE.get(id(self))
        if cached is None or cached[0] is not self.fast_config:
            from .fast_tokenizer import FASTActionTokenizer

            cached = _FAST_CACHE[id(self)] = (self.fast_config, FASTActionTokenizer.from_dict(self.fast_config))
        return cached[1]

    def set_fast_tokenizer(self, fast, vocab_size: int) -> None:
        """Use `fast` (a `FASTActionTokenizer`) for the action targets, its ids placed in a language-model vocabulary
        of `vocab_size`: just below `<loc0000>` when the tokenizer has PaliGemma's location tokens (so FAST ids collide
        neither with `<loc>` nor `<seg>`, nor with text), else right after the tokenizer's own tokens. ValueError when
        they do not fit."""
        if len(self.tokenizer) > vocab_size:
            raise ValueError(f"the language model's vocabulary of {vocab_size} is smaller than its tokenizer's "
                             f"{len(self.tokenizer)} tokens, so no FAST vocabulary fits: the model's vocabulary is "
                             "too small for the tokenizer (a tokenizer of another model?)")
        loc = self.tokenizer.convert_tokens_to_ids("<loc0000>")
        has_loc = isinstance(loc, int) and loc != self.tokenizer.unk_token_id and loc is not None
        offset = loc - fast.vocab_size if has_loc else len(self.tokenizer)
        if offset < 0 or offset + fast.vocab_size > vocab_size:
            room = (loc if has_loc else vocab_size - len(self.tokenizer))
            raise ValueError(f"FAST ids {offset}..{offset + fast.vocab_size - 1} do not fit the language model's "
                             f"vocabulary of {vocab_size} ({len(self.tokenizer)} tokenizer tokens"
                             f"{', <loc0000> at ' + str(loc) if has_loc else ''}); a FAST vocabulary of at most "
                             f"{max(room, 0)} fits")
        self.fast_config, self.fast_token_offset = fast.to_dict(), int(offset)

    @property
    def fast_token_range(self) -> tuple[int, int] | None:
        """[first, end) language-model ids of FAST tokens (None without FAST)."""
        if not self.fast_config:
            return None
        return self.fast_token_offset, self.fast_token_offset + int(self.fast_config["vocab_size"])

    def target_labels(self, actions: torch.Tensor, action_is_pad: torch.Tensor | None = None,
                      texts: Sequence[str | None] | None = None) -> torch.Tensor:
        """`labels` `[B, L_t]` of the token objective: each normalised, zero-padded chunk `[B, chunk, max_action_dim]`
        as FAST tokens (steps past the episode end hold its last action; coefficients outside the fitted range are
        clipped and counted in `fast.clipped`), then the row's target text (`texts`, e.g. a subtask annotation) as
        text tokens and EOS, right-padded with -100. A sample without a real step has no FAST tokens."""
        fast = self.fast
        if fast is None:
            raise ValueError("target_labels needs a FAST tokenizer (set_fast_tokenizer)")
        rows = []
        values = actions.detach().float().cpu().numpy()
        pad = action_is_pad.cpu().numpy() if action_is_pad is not None else np.zeros(values.shape[:2], dtype=bool)
        for chunk, is_pad in zip(values, pad):
            real = np.flatnonzero(~is_pad)
            if not len(real):
                rows.append([])
                continue
            held = chunk.copy()
            held[real[-1] + 1:] = chunk[real[-1]]
            rows.append([self.fast_token_offset + i for i in fast.encode(held[:, : fast.action_dim], clip=True)])
        for row, text in zip(rows, texts if texts is not None else []):
            if text is not None:
                row += self.tokenizer(str(text), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        labels = torch.full((len(rows), max(1, max(len(r) for r in rows))), -100, dtype=torch.long)
        for index, row in enumerate(rows):
            labels[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        return labels

    @property
    def model_input_names(self):
        return ["input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "state", "subtask_ids",
                "subtask_mask", "memory_state", "memory_mask"]


def memory_settings_of(config) -> dict | None:
    """A model config's MEM settings as the processor holds them (None: no memory)."""
    if not (getattr(config, "use_visual_memory", False) or getattr(config, "use_proprioceptive_memory", False)):
        return None
    return {"frames": int(config.memory_frames), "stride": int(config.memory_stride),
            "visual": bool(config.use_visual_memory), "proprio": bool(config.use_proprioceptive_memory)}


def _memory_settings(memory: dict | None) -> dict | None:
    if not memory:
        return None
    unknown = set(memory) - {"frames", "stride", "visual", "proprio"}
    if unknown or int(memory.get("frames", 0)) < 1:
        raise ValueError(f"PI05Processor: memory={memory!r} must be {{'frames': >= 1, 'stride', 'visual', 'proprio'}}")
    return {"frames": int(memory["frames"]), "stride": int(memory.get("stride", 1)),
            "visual": bool(memory.get("visual")), "proprio": bool(memory.get("proprio"))}


_FAST_CACHE: dict = {}  # id(processor) -> (its fast_config dict, the tokenizer built from it)

PI05Processor.register_for_auto_class("AutoProcessor")  # processor_config.json gets its auto_map (trust_remote_code)

__all__ = ["IndicatorCutError", "PI05Processor"]
