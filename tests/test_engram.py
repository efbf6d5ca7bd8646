"""Unit tests for the Engram host tables and the on-device n-gram hash (dijax.model.engram).

The device hash emulates int64 arithmetic with 16-bit limbs; it is checked bit for bit against numpy int64.
"""

import dijax  # noqa: F401  (sets XLA flags before jax initialises)

import os
import re
import unicodedata

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dijax.config import ModelConfig
from dijax.model import engram

from tests.conftest import PARITY_DIR

TINY = os.path.join(PARITY_DIR, "tiny")

INT64_MAX = np.iinfo(np.int64).max


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_file(os.path.join(TINY, "config.json"))


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(TINY, "tokenizer.json"))


@pytest.fixture(scope="module")
def token_map(tokenizer):
    return engram.build_compressed_token_map(tokenizer)


@pytest.fixture(scope="module")
def tables(cfg, tokenizer):
    return engram.EngramTables.build(cfg, tokenizer)


@pytest.fixture(scope="module")
def dev(tables):
    return tables.device_arrays()


# ---------------------------------------------------------------------------------------------------------------------
# independent references
# ---------------------------------------------------------------------------------------------------------------------

def ref_multipliers(layer_ids, max_ngram, compressed_vocab):
    bound = (INT64_MAX // compressed_vocab) // 2
    return np.array([2 * np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram, dtype=np.int64) + 1
                     for layer in layer_ids], np.int64)


def ref_hash(window_TG, mult_G, primes_J, offsets_J):
    """numpy int64: h_n = XOR_{s<n} tok_s * mult_s (wrapping), column (n, h) = h_n % prime + offset."""
    window = np.asarray(window_TG, np.int64)
    g = window.shape[1]
    heads = len(primes_J) // (g - 1)
    with np.errstate(over="ignore"):
        prods = window * np.asarray(mult_G, np.int64)[None, :]
    out = np.empty((window.shape[0], len(primes_J)), np.int64)
    h = prods[:, 0]
    for n in range(2, g + 1):
        h = h ^ prods[:, n - 1]
        for head in range(heads):
            j = (n - 2) * heads + head
            out[:, j] = h % np.int64(primes_J[j]) + np.int64(offsets_J[j])
    return out


def ref_window(ids_TG, positions_T, pad_id):
    ids = np.asarray(ids_TG)
    out = np.empty_like(ids)
    for t in range(ids.shape[0]):
        blocked = False
        for s in range(ids.shape[1]):
            blocked = blocked or positions_T[t] < s or ids[t, s] == engram.DEAD
            out[t, s] = pad_id if blocked else ids[t, s]
    return out


def is_prime(n):
    if n < 2:
        return False
    f = 2
    while f * f <= n:
        if n % f == 0:
            return False
        f += 1
    return True


def primes_above(start, count):
    out, n = [], start + 1
    while len(out) < count:
        if is_prime(n):
            out.append(n)
        n += 1
    return out


def limbs16(mult):
    """int64 [..., G] -> uint32 [..., G, 4] 16-bit limbs, low first (two's complement bits)."""
    u = np.asarray(mult, np.int64).view(np.uint64)
    return np.stack([(u >> np.uint64(16 * i)) & np.uint64(0xFFFF) for i in range(4)], axis=-1).astype(np.uint32)


# ---------------------------------------------------------------------------------------------------------------------
# compressed token map
# ---------------------------------------------------------------------------------------------------------------------

def test_compressed_token_map_size_and_first_seen_order(token_map, tokenizer, cfg):
    lookup, size = token_map
    assert size == 409 == cfg.engram_compressed_vocab_size
    assert lookup.dtype == np.int32 and lookup.shape == (tokenizer.get_vocab_size(with_added_tokens=True),)
    assert lookup[0] == 0 and lookup.max() == size - 1 and lookup.min() == 0
    assert set(lookup.tolist()) == set(range(size))
    first = [int(np.argmax(lookup == i)) for i in range(size)]
    assert first == sorted(first)  # id i is first seen before id i + 1
    # a new id is always exactly one more than every id seen before it
    running_max = np.maximum.accumulate(lookup)
    assert (lookup[1:] <= running_max[:-1] + 1).all()


def test_compressed_token_map_collapses_case_and_whitespace(token_map, tokenizer):
    lookup, _ = token_map
    tid = tokenizer.token_to_id
    upper, lower, sp_upper, sp_lower = tid("A"), tid("a"), tid("\u0120A"), tid("\u0120a")  # 'A', 'a', ' A', ' a'
    assert None not in (upper, lower, sp_upper, sp_lower)
    assert lookup[upper] == lookup[lower] == lookup[sp_upper] == lookup[sp_lower]
    assert lookup[tid("B")] != lookup[upper]
    # ' ', '  ', '\t', '\n' decode to whitespace runs that collapse to one lone space
    ws = [i for i in range(tokenizer.get_vocab_size()) if tokenizer.decode([i]) in (" ", "  ", "    ", "\t", "\n")]
    assert len(ws) >= 4
    assert len({int(lookup[i]) for i in ws}) == 1
    # special tokens are distinct
    assert len({int(lookup[i]) for i in range(4)}) == 4


def test_compressed_token_map_matches_unicodedata_reimplementation(token_map, tokenizer):
    # independent normalisation: NFKC, NFD, drop combining marks, lowercase, collapse [ \t\r\n]+, keep a lone
    # space, strip (Rust's char::is_whitespace set for ASCII); keys with U+FFFD use the raw token string
    def norm(text):
        s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
        s = "".join(ch for ch in s if unicodedata.category(ch) != "Mn").lower()
        s = re.sub(r"[ \t\r\n]+", " ", s)
        return s if s == " " else s.strip(" \t\n\x0b\x0c\r\x85\xa0")

    keys = {}
    want = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([i], skip_special_tokens=False)
        key = tokenizer.id_to_token(i) if "\ufffd" in text else (norm(text) or text)
        want.append(keys.setdefault(key, len(keys)))
    lookup, size = token_map
    assert size == len(keys)
    np.testing.assert_array_equal(lookup, np.array(want, np.int32))


# ---------------------------------------------------------------------------------------------------------------------
# primes, multipliers, tables
# ---------------------------------------------------------------------------------------------------------------------

def test_engram_primes_tiny(cfg):
    primes = engram.engram_primes(cfg)
    assert primes.dtype == np.int64 and primes.shape == (2, 2, 2)
    np.testing.assert_array_equal(primes, [[[1009, 1013], [1019, 1021]], [[1031, 1033], [1039, 1049]]])
    assert tuple(int(v) for v in primes.reshape(2, -1).sum(axis=1)) == cfg.engram_num_embeddings == (4062, 4152)


def test_hash_multipliers_independent_formula():
    for layers, g, vocab in [((1, 4), 3, 409), ((1, 14), 4, 99092), ((0,), 2, 7)]:
        got = engram.hash_multipliers(layers, g, vocab)
        assert got.dtype == np.int64 and got.shape == (len(layers), g)
        np.testing.assert_array_equal(got, ref_multipliers(layers, g, vocab))
        assert (got % 2 == 1).all() and (got > 0).all()
        assert (got.astype(object) * (vocab - 1) <= INT64_MAX).all()  # products never overflow int64


def test_engram_tables_build(tables, cfg, token_map):
    lookup, size = token_map
    np.testing.assert_array_equal(tables.token_map, lookup)
    assert tables.pad_id == int(lookup[cfg.engram_pad_id])
    np.testing.assert_array_equal(tables.primes, [[1009, 1013, 1019, 1021], [1031, 1033, 1039, 1049]])
    np.testing.assert_array_equal(tables.offsets, [[0, 1009, 2022, 3041], [0, 1031, 2064, 3103]])
    np.testing.assert_array_equal(tables.multipliers, ref_multipliers((1, 4), 3, 409))


def test_engram_tables_device_arrays(tables, dev):
    assert dev["token_map"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(dev["token_map"]), tables.token_map)
    assert dev["mult_limbs"].dtype == jnp.uint32 and dev["mult_limbs"].shape == (2, 3, 4)
    np.testing.assert_array_equal(np.asarray(dev["mult_limbs"]), limbs16(tables.multipliers))
    limbs = np.asarray(dev["mult_limbs"]).astype(object)
    back = sum(limbs[..., i] << (16 * i) for i in range(4))
    np.testing.assert_array_equal(back.astype(np.int64), tables.multipliers)
    assert dev["primes"].dtype == jnp.uint32 and dev["offsets"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(dev["primes"]), tables.primes)
    np.testing.assert_array_equal(np.asarray(dev["offsets"]), tables.offsets)


def test_engram_tables_build_rejects_mismatched_config(cfg, tokenizer):
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        engram.EngramTables.build(cfg.replace(engram_compressed_vocab_size=400), tokenizer)
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        engram.EngramTables.build(cfg.replace(engram_num_embeddings=(4062, 4000)), tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# ngram_window
# ---------------------------------------------------------------------------------------------------------------------

def test_ngram_window_hand_cases():
    pad, dead = 7, engram.DEAD
    ids = np.array([
        [10, 11, 12],  # p = 5: nothing blocked
        [10, 11, 12],  # p = 0: shifts 1, 2 look before the start
        [10, 11, 12],  # p = 1: shift 2 looks before the start
        [10, dead, 12],  # DEAD at shift 1 blocks shifts 1 and 2
        [dead, 11, 12],  # DEAD at shift 0 blocks everything
        [10, 11, dead],  # DEAD at shift 2 blocks only shift 2
    ], np.int32)
    pos = np.array([5, 0, 1, 9, 9, 9], np.int32)
    got = np.asarray(engram.ngram_window(jnp.asarray(ids), jnp.asarray(pos), pad))
    want = [[10, 11, 12], [10, pad, pad], [10, 11, pad], [10, pad, pad], [pad, pad, pad], [10, 11, pad]]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12).flatmap(lambda t: st.tuples(
    st.lists(st.lists(st.integers(-1, 408), min_size=4, max_size=4), min_size=t, max_size=t),
    st.lists(st.integers(0, 6), min_size=t, max_size=t))))
def test_ngram_window_matches_loop_reference(case):
    ids, pos = np.array(case[0], np.int32), np.array(case[1], np.int32)
    got = np.asarray(engram.ngram_window(jnp.asarray(ids), jnp.asarray(pos), 3))
    np.testing.assert_array_equal(got, ref_window(ids, pos, 3))


# ---------------------------------------------------------------------------------------------------------------------
# hash_rows
# ---------------------------------------------------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.integers(0, 1), st.lists(st.lists(st.integers(0, 408), min_size=3, max_size=3), min_size=1, max_size=16))
def test_hash_rows_tiny_matches_numpy_int64(dev, tables, engram_index, rows):
    window = np.array(rows, np.int32)
    got = np.asarray(engram.hash_rows(jnp.asarray(window), dev, engram_index))
    assert got.dtype == np.int32 and got.shape == (len(rows), 4)
    want = ref_hash(window, tables.multipliers[engram_index], tables.primes[engram_index],
                    tables.offsets[engram_index])
    np.testing.assert_array_equal(got, want)
    # every row index lands inside its own column's slice of the table
    lo, hi = tables.offsets[engram_index], tables.offsets[engram_index] + tables.primes[engram_index]
    assert ((got >= lo) & (got < hi)).all()


def test_hash_rows_tiny_hand_value(dev, tables):
    # one token, explicit Python-int arithmetic for the first 2-gram column of layer 1
    m = [int(v) for v in tables.multipliers[0]]
    window = np.array([[5, 17, 400]], np.int32)
    h2 = (5 * m[0]) ^ (17 * m[1])
    h3 = h2 ^ (400 * m[2])
    want = [h2 % 1009, h2 % 1013 + 1009, h3 % 1019 + 2022, h3 % 1021 + 3041]
    got = np.asarray(engram.hash_rows(jnp.asarray(window), dev, 0))
    np.testing.assert_array_equal(got[0], want)


@pytest.fixture(scope="module")
def big_dev():
    """A synthetic large config: compressed vocab 99092, G = 4, 8 heads, primes just above 16e6 (< 2^24)."""
    vocab = 99092
    mult = engram.hash_multipliers((1, 14), 4, vocab)
    np.testing.assert_array_equal(mult, ref_multipliers((1, 14), 4, vocab))
    ps = primes_above(15_999_999, 48)
    assert ps[-1] < 1 << 24
    primes = np.array([ps[:24], ps[24:]], np.int64)
    offsets = np.concatenate([np.zeros((2, 1), np.int64), np.cumsum(primes, axis=1)[:, :-1]], axis=1)
    dev = {"mult_limbs": jnp.asarray(limbs16(mult)), "primes": jnp.asarray(primes.astype(np.uint32)),
           "offsets": jnp.asarray(offsets.astype(np.int32))}
    return dev, mult, primes, offsets


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 1), st.lists(st.lists(st.integers(0, 99091), min_size=4, max_size=4), min_size=1, max_size=16))
def test_hash_rows_large_config_matches_numpy_int64(big_dev, engram_index, rows):
    dev, mult, primes, offsets = big_dev
    window = np.array(rows, np.int32)
    got = np.asarray(engram.hash_rows(jnp.asarray(window), dev, engram_index))
    assert got.shape == (len(rows), 24)
    np.testing.assert_array_equal(got, ref_hash(window, mult[engram_index], primes[engram_index],
                                                offsets[engram_index]))


def test_hash_rows_large_config_extreme_ids(big_dev):
    # the largest ids give products just below 2^63: every limb and carry of the emulation is exercised
    dev, mult, primes, offsets = big_dev
    window = np.array([[99091] * 4, [0, 99091, 0, 99091], [65535, 65536, 65537, 1], [0, 0, 0, 0],
                       [99091, 99090, 99089, 99088]], np.int32)
    for e in range(2):
        got = np.asarray(engram.hash_rows(jnp.asarray(window), dev, e))
        np.testing.assert_array_equal(got, ref_hash(window, mult[e], primes[e], offsets[e]))


# ---------------------------------------------------------------------------------------------------------------------
# end to end: window rules feed the hash
# ---------------------------------------------------------------------------------------------------------------------

def test_dead_token_then_hash_matches_numpy(dev, tables):
    pad = tables.pad_id
    tm = tables.token_map
    raw = np.array([[tm[100], engram.DEAD, tm[300]],  # DEAD at shift 1: shifts 1 and 2 become pad
                    [tm[100], tm[200], tm[300]],  # nothing blocked
                    [tm[100], tm[200], tm[300]]], np.int32)  # position 1: shift 2 is before the start
    pos = np.array([10, 10, 1], np.int32)
    window = np.asarray(engram.ngram_window(jnp.asarray(raw), jnp.asarray(pos), pad))
    np.testing.assert_array_equal(window, [[tm[100], pad, pad], [tm[100], tm[200], tm[300]],
                                           [tm[100], tm[200], pad]])
    for e in range(2):
        got = np.asarray(engram.hash_rows(jnp.asarray(window), dev, e))
        want = ref_hash(np.array([[tm[100], pad, pad], [tm[100], tm[200], tm[300]], [tm[100], tm[200], pad]]),
                        tables.multipliers[e], tables.primes[e], tables.offsets[e])
        np.testing.assert_array_equal(got, want)
        # the DEAD row hashes exactly like the explicit (id, pad, pad) n-gram and differs from the live one
        assert not np.array_equal(got[0], got[1])
