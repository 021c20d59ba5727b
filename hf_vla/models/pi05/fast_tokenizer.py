"""FAST: action chunks as discrete tokens (Pertsch et al. 2025, arXiv 2501.09747), for pi0.5's token objective.

A normalised chunk `[T, D]` (the processor's quantile normalisation puts each dimension in about [-1, 1]) becomes
tokens in four steps:

1. an orthonormal DCT-II along time, per dimension (`scipy.fft.dct(x, axis=0, norm="ortho")`; a matrix here);
2. coefficients x `scale`, rounded to integers (the only lossy step: each coefficient is off by at most
   0.5 / scale, so each action value by at most 0.5 * sqrt(T) / scale);
3. flattened low frequency first, interleaved across dimensions (row-major over `[T, D]`: every dimension's lowest
   frequency, then every dimension's next one, ...);
4. byte-pair encoding over the integers (one character per integer, HF `tokenizers`), with a vocabulary fitted on a
   dataset's chunks (`FASTActionTokenizer.fit`).

Decoding inverts each step; a sequence that does not decode to `T * D` coefficients (a malformed prediction) decodes to
zeros and is counted in `malformed`. The tokenizer is saved beside a processor as `fast_tokenizer.json`.

Token ids here are FAST's own, `0 .. vocab_size - 1`; the processor places them in the language model's vocabulary
(`PI05Processor` / docs/cotraining.md: below PaliGemma's `<loc>` and `<seg>` tokens).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np


class FASTError(ValueError):
    """A FAST fit or file that cannot be used (this file has no hf_vla import: it loads as remote code too; the
    training start-up turns it into hf_vla's one-line configuration error)."""


logger = logging.getLogger("hf_vla.fast")

FILE_NAME = "fast_tokenizer.json"
_CHAR_OFFSET = 0x100  # integers map to characters from U+0100 on: no control or whitespace character reaches BPE


def dct_matrix(length: int) -> np.ndarray:
    """The orthonormal DCT-II matrix `C` `[length, length]` (float64): `C @ x` is `scipy.fft.dct(x, axis=0,
    norm="ortho")` and `C.T @ y` its inverse."""
    n = np.arange(length)
    matrix = np.sqrt(2.0 / length) * np.cos(np.pi * (n[None, :] + 0.5) * n[:, None] / length)
    matrix[0] /= np.sqrt(2.0)
    return matrix


class FASTActionTokenizer:
    """A fitted FAST tokenizer for chunks of `chunk_size` steps and `action_dim` dimensions.

    Attributes: `scale` (coefficient multiplier before rounding), `min_token` (the smallest quantised coefficient seen
    in the fit; integers are stored shifted by it), `vocab_size` (BPE vocabulary, the number of FAST ids), `stats`
    (what the fit measured: tokens per chunk, the round-trip error per dimension), `malformed` (sequences `decode`
    could not decode since this object was made), `clipped` (chunks `encode(clip=True)` clipped).
    """

    def __init__(self, bpe, chunk_size: int, action_dim: int, scale: float, min_token: int, vocab_size: int,
                 stats: dict | None = None):
        self.bpe, self.chunk_size, self.action_dim = bpe, int(chunk_size), int(action_dim)
        self.scale, self.min_token, self.vocab_size = float(scale), int(min_token), int(vocab_size)
        self.stats = dict(stats or {})
        self.malformed = 0
        self.clipped = 0
        self._dct = dct_matrix(self.chunk_size)

    # ---- fitting ------------------------------------------------------------------------------------------------
    @classmethod
    def fit(cls, chunks, scale: float = 10.0, vocab_size: int = 1024, min_frequency: int = 2,
            source: str = "the chunks") -> FASTActionTokenizer:
        """Fit the BPE vocabulary on normalised chunks `[N, T, D]` (deterministic: the same chunks give the same
        vocabulary). `source` names the data in errors (e.g. a dataset's name)."""
        from tokenizers import Tokenizer, models, trainers

        chunks = np.asarray(chunks, dtype=np.float64)
        if chunks.ndim != 3 or not chunks.shape[0]:
            raise FASTError(f"FAST fit on {source}: expected chunks [N, T, D] with N >= 1, got {chunks.shape}")
        if not np.isfinite(chunks).all():
            raise FASTError(f"FAST fit on {source}: the chunks hold NaN or inf")
        if not (math.isfinite(scale) and scale > 0):
            raise FASTError(f"FAST scale={scale!r}: must be a finite number > 0")
        count, chunk_size, action_dim = chunks.shape
        if count < 2 * min_frequency:  # a merge needs min_frequency occurrences: a handful of chunks fits nothing
            raise FASTError(f"FAST fit on {source}: {count} chunk(s) are too few to fit a vocabulary (at least "
                              f"{2 * min_frequency}; use more episodes or a smaller chunk stride)")
        matrix = dct_matrix(chunk_size)
        quantised = np.rint(np.einsum("ts,nsd->ntd", matrix, chunks) * scale).astype(np.int64)
        low, high = int(quantised.min()), int(quantised.max())
        alphabet = high - low + 1
        if alphabet > vocab_size:
            raise FASTError(f"FAST fit on {source}: the quantised coefficients span {low}..{high} ({alphabet} "
                              f"values), more than vocab_size={vocab_size} can hold; raise vocab_size or lower "
                              f"scale={scale:g} (are the actions normalised to about [-1, 1]?)")
        bpe = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                      initial_alphabet=[chr(_CHAR_OFFSET + i) for i in range(alphabet)],
                                      max_token_length=10_000)
        texts = ["".join(chr(_CHAR_OFFSET + v) for v in row) for row in (quantised.reshape(count, -1) - low).tolist()]
        bpe.train_from_iterator(texts, trainer=trainer)
        tokenizer = cls(bpe, chunk_size, action_dim, scale, low, vocab_size)
        lengths = np.array([len(bpe.encode(text).ids) for text in texts])
        restored = np.einsum("st,nsd->ntd", matrix, quantised / scale)
        error = np.abs(restored - chunks).max(axis=(0, 1))
        tokenizer.stats = {
            "chunks": int(count), "coefficient_range": [low, high], "bpe_vocab": bpe.get_vocab_size(),
            "tokens_per_chunk_mean": float(lengths.mean()), "tokens_per_chunk_max": int(lengths.max()),
            "compression": float(chunk_size * action_dim / lengths.mean()),
            "round_trip_max_error": [float(e) for e in error],
        }
        logger.info("FAST fitted on %s: %d chunks, %.1f tokens per chunk (max %d, %.1fx fewer than values), "
                    "round-trip error up to %.4f", source, count, lengths.mean(), lengths.max(),
                    tokenizer.stats["compression"], float(error.max()))
        return tokenizer

    # ---- encoding and decoding ----------------------------------------------------------------------------------
    def quantise(self, chunk) -> np.ndarray:
        """`[T, D]` -> the rounded, scaled DCT coefficients `[T, D]` (int64)."""
        chunk = np.asarray(chunk, dtype=np.float64)
        if chunk.shape != (self.chunk_size, self.action_dim):
            raise ValueError(f"FAST: expected a chunk of shape {(self.chunk_size, self.action_dim)}, got {chunk.shape}")
        return np.rint(self._dct @ chunk * self.scale).astype(np.int64)

    def encode(self, chunk, clip: bool = False) -> list[int]:
        """A normalised chunk `[T, D]` -> FAST ids. A coefficient outside the fitted range raises ValueError, or
        with `clip` is clipped to it (counted in `clipped`: training targets of a chunk the fit never saw)."""
        shifted = self.quantise(chunk).reshape(-1) - self.min_token
        alphabet = self.stats.get("coefficient_range")
        top = (alphabet[1] - alphabet[0]) if alphabet else None
        if shifted.min() < 0 or (top is not None and shifted.max() > top):
            if clip:
                self.clipped += 1
                shifted = np.clip(shifted, 0, top)
                return self.bpe.encode("".join(chr(_CHAR_OFFSET + int(v)) for v in shifted)).ids
            raise ValueError(f"FAST: a coefficient of this chunk ({int(shifted.min()) + self.min_token}.."
                             f"{int(shifted.max()) + self.min_token}) lies outside the fitted range "
                             f"{alphabet}; refit on data that covers it")
        return self.bpe.encode("".join(chr(_CHAR_OFFSET + int(v)) for v in shifted)).ids

    def decode(self, ids) -> np.ndarray:
        """FAST ids -> the chunk `[T, D]` (float64); zeros, counted in `malformed`, when they do not decode to
        `T * D` coefficients."""
        text = "".join(self.bpe.id_to_token(int(i)) or "\0" for i in ids)
        values = [ord(c) - _CHAR_OFFSET for c in text]
        if len(values) != self.chunk_size * self.action_dim or min(values, default=0) < 0:
            self.malformed += 1
            return np.zeros((self.chunk_size, self.action_dim))
        coefficients = (np.asarray(values, dtype=np.float64) + self.min_token).reshape(self.chunk_size,
                                                                                      self.action_dim)
        return self._dct.T @ (coefficients / self.scale)

    # ---- saving -------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"chunk_size": self.chunk_size, "action_dim": self.action_dim, "scale": self.scale,
                "min_token": self.min_token, "vocab_size": self.vocab_size, "stats": self.stats,
                "bpe": json.loads(self.bpe.to_str())}

    @classmethod
    def from_dict(cls, data: dict, source: str = "FAST tokenizer") -> FASTActionTokenizer:
        from tokenizers import Tokenizer

        if not isinstance(data, dict):
            raise FASTError(f"{source}: not a FAST tokenizer (a JSON {type(data).__name__}, not an object)")
        for name in ("chunk_size", "action_dim", "vocab_size"):  # before they size anything
            value = data.get(name)
            if name not in data:
                raise FASTError(f"{source}: not a FAST tokenizer (no {name!r})")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FASTError(f"{source}: {name}={value!r} must be an integer of at least 1")
        try:
            bpe = Tokenizer.from_str(json.dumps(data["bpe"]))
            fast = cls(bpe, data["chunk_size"], data["action_dim"], data["scale"], data["min_token"],
                       data["vocab_size"], data.get("stats"))
        except (KeyError, TypeError, ValueError, Exception) as error:  # tokenizers raises its own Exception
            raise FASTError(f"{source}: not a FAST tokenizer ({type(error).__name__}: {error})") from error
        fast._check(source)
        return fast

    def _check(self, source: str) -> None:
        """The fields of a loaded tokenizer agree with each other (a hand-edited file is refused naming the field)."""
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise FASTError(f"{source}: scale={self.scale!r} must be a finite number > 0 (coefficients are multiplied "
                            "by it before rounding)")
        bpe_ids = self.bpe.get_vocab_size()
        if bpe_ids > self.vocab_size:
            raise FASTError(f"{source}: vocab_size={self.vocab_size} but its BPE vocabulary has {bpe_ids} ids: FAST "
                            "ids past vocab_size would land on other tokens of the language model")

    def save_pretrained(self, directory) -> Path:
        path = Path(directory) / FILE_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def from_pretrained(cls, path) -> FASTActionTokenizer:
        """From `fast_tokenizer.json`, a directory holding it, or a processor directory whose
        `processor_config.json` carries one (a checkpoint trained with the token objective)."""
        path = Path(path)
        if path.is_dir():
            path = path / FILE_NAME if (path / FILE_NAME).is_file() else path / "processor_config.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:  # ValueError: not UTF-8 (UnicodeDecodeError) or not JSON
            raise FASTError(f"FAST tokenizer {path}: cannot be read ({type(error).__name__}: "
                            f"{str(error)[:200]})") from None
        if path.name == "processor_config.json":
            if not data.get("fast_config"):
                raise FASTError(f"FAST tokenizer {path}: this processor has none (trained without the token loss)")
            data = data["fast_config"]
        return cls.from_dict(data, source=str(path))

    def __repr__(self) -> str:
        return (f"FASTActionTokenizer(chunk_size={self.chunk_size}, action_dim={self.action_dim}, scale={self.scale:g},"
                f" vocab_size={self.vocab_size}, tokens_per_chunk={self.stats.get('tokens_per_chunk_mean')})")


__all__ = ["FASTActionTokenizer", "FASTError", "dct_matrix"]
