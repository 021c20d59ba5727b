"""pi0.5's token objective (docs/cotraining.md): the FAST action tokenizer, and the model's target tokens under
knowledge insulation (masks as KI Appendix B, the expert reading stop-gradient backbone keys/values)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.fft import dct, idct

from hf_vla.errors import ConfigError
from hf_vla.models.fast_tokenizer import FASTActionTokenizer, dct_matrix


def recorded_chunks(root, chunk_size: int = 50, stride: int = 10) -> np.ndarray:
    """Normalised action chunks of a real recording: q01/q99 per dimension to [-1, 1] (the processor's pi0.5
    normalisation), windows that stay inside one episode."""
    tables = [pq.read_table(path, columns=["actions", "episode_index"]) for path in sorted(root.glob("data/*/*.parquet"))]
    actions = np.concatenate([np.stack(t["actions"].to_numpy(zero_copy_only=False)) for t in tables]).astype(np.float64)
    episodes = np.concatenate([t["episode_index"].to_numpy() for t in tables])
    q01, q99 = np.quantile(actions, [0.01, 0.99], axis=0)
    normalised = 2 * (actions - q01) / np.maximum(q99 - q01, 1e-8) - 1
    starts = [i for i in range(0, len(actions) - chunk_size, stride) if episodes[i] == episodes[i + chunk_size - 1]]
    return np.stack([normalised[i:i + chunk_size] for i in starts])


@pytest.fixture(scope="module")
def chunks(humanoid):
    return recorded_chunks(humanoid)


@pytest.fixture(scope="module")
def fitted(chunks):
    return FASTActionTokenizer.fit(chunks[::2], vocab_size=1024, source="humanoid_teleop_24")


def test_dct_is_scipys_orthonormal_dct():
    x = np.random.default_rng(0).normal(size=(50, 7))
    np.testing.assert_allclose(dct_matrix(50) @ x, dct(x, axis=0, norm="ortho"), atol=1e-12)
    np.testing.assert_allclose(dct_matrix(50).T @ x, idct(x, axis=0, norm="ortho"), atol=1e-12)


def test_round_trip_is_within_the_quantisation_bound_on_recorded_chunks(fitted, chunks):
    """Every value of every held-out chunk (the odd ones; the fit saw the even ones) comes back within 0.5 * sqrt(T) /
    scale (each coefficient is off by at most 0.5 / scale; a unit column of the DCT sums to at most sqrt(T)), and far
    fewer tokens than values are needed."""
    bound = 0.5 * np.sqrt(fitted.chunk_size) / fitted.scale
    held_out = chunks[1::2]
    worst, lengths = 0.0, []
    for chunk in held_out:
        try:
            ids = fitted.encode(chunk)
        except ValueError:  # a coefficient the fit never saw: refused, not silently clipped
            continue
        lengths.append(len(ids))
        assert max(ids) < fitted.vocab_size
        worst = max(worst, float(np.abs(fitted.decode(ids) - chunk).max()))
    assert len(lengths) >= 0.9 * len(held_out)
    assert worst <= bound, (worst, bound)
    assert np.mean(lengths) < 0.5 * fitted.chunk_size * fitted.action_dim  # BPE compresses the coefficients
    assert fitted.malformed == 0
    stats = fitted.stats
    assert len(stats["round_trip_max_error"]) == 34 and max(stats["round_trip_max_error"]) <= bound
    assert stats["tokens_per_chunk_mean"] > 0 and stats["chunks"] == len(chunks[::2])


def test_fit_is_deterministic_and_survives_saving(fitted, chunks, tmp_path):
    again = FASTActionTokenizer.fit(chunks[::2], vocab_size=1024)
    assert again.to_dict() == fitted.to_dict()
    fitted.save_pretrained(tmp_path)
    loaded = FASTActionTokenizer.from_pretrained(tmp_path)
    assert loaded.to_dict() == fitted.to_dict()
    assert loaded.encode(chunks[3]) == fitted.encode(chunks[3])


def test_malformed_sequences_decode_to_zeros_and_are_counted(fitted, chunks):
    tokenizer = FASTActionTokenizer.from_dict(fitted.to_dict())
    ids = tokenizer.encode(chunks[1])
    for broken in (ids[:-1], [], ids + ids[:1]):
        assert not tokenizer.decode(broken).any()
    assert tokenizer.malformed == 3
    assert np.abs(tokenizer.decode(ids) - chunks[1]).max() < 0.5 * np.sqrt(tokenizer.chunk_size) / tokenizer.scale


def test_bad_fits_are_refused_in_one_line(chunks, tmp_path):
    with pytest.raises(ConfigError, match=r"FAST fit on humanoid: the quantised coefficients span -?\d+\.\.\d+ "
                                          r"\(\d+ values\), more than vocab_size=64"):
        FASTActionTokenizer.fit(chunks, vocab_size=64, source="humanoid")
    with pytest.raises(ConfigError, match="FAST fit on tiny: 2 chunk\\(s\\) are too few"):
        FASTActionTokenizer.fit(chunks[:2], source="tiny")
    bad = chunks[:10].copy()
    bad[3, 4, 5] = np.nan
    with pytest.raises(ConfigError, match="NaN or inf"):
        FASTActionTokenizer.fit(bad)
    (tmp_path / "fast_tokenizer.json").write_text('{"chunk_size": 4}')
    with pytest.raises(ConfigError, match="not a FAST tokenizer"):
        FASTActionTokenizer.from_pretrained(tmp_path)
    tokenizer = FASTActionTokenizer.fit(chunks[:40] * 0.1)  # fitted on small actions: a large chunk is refused
    with pytest.raises(ValueError, match="outside the fitted range"):
        tokenizer.encode(chunks[0] * 0 + 1.0)
