"""Routed-experts kernel seam: the Pallas MXFP4 kernels (interpret mode on CPU) against the jnp reference.

Covers the in-register e2m1 / ue8m0 decode for every byte and scale exponent, both kernel paths (mat-vec and the
grouped GEMM over expert-sorted tiles) on ragged group sizes with empty experts and groups spanning several tiles,
the SwiGLU clamp firing, padding assignments (expert -1), the tile layout's invariants and the dispatcher.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dijax
from dijax.config import ModelConfig
from dijax.io.random_init import random_params
from dijax.kernels import quant
from dijax.kernels import routed_experts as rx
from dijax.model import moe
from dijax.model.param_map import checkpoint_tree

pytestmark = pytest.mark.cost(110)  # CI seconds, a scheduling hint (tests/conftest.py)

LIMIT = 10.0


def make_experts(rng: np.random.Generator, n_experts: int, d: int, f: int, exponents: tuple[int, int]) -> dict:
    """Random MXFP4 stacked experts: every byte value, ue8m0 exponents uniform in [lo, hi]."""
    def one(out_dim: int, in_dim: int) -> dict:
        return {"weight": jnp.asarray(rng.integers(0, 256, (n_experts, out_dim, in_dim // 2), dtype=np.uint8)),
                "scale": jnp.asarray(rng.integers(exponents[0], exponents[1] + 1, (n_experts, out_dim, in_dim // 32),
                                                  dtype=np.uint8))}
    return {"w1": one(f, d), "w3": one(f, d), "w2": one(d, f)}


def make_routing(rng: np.random.Generator, t: int, n_experts: int, n_per_token: int, pool: int | None = None,
                 pad_tokens: tuple[int, ...] = (), pad_slots: tuple[int, ...] = ()):
    """(weights_TX float32, experts_TX int32 ascending). Experts drawn from the first ``pool`` ids only (so the
    others stay empty and the pool's groups grow); ``pad_tokens`` get -1 in every slot, ``pad_slots`` (token, slot)
    pairs -1 in the last slot of those tokens, with a NaN weight there (a padding weight is ignored)."""
    pool = pool or n_experts
    experts_TX = np.sort(np.stack([rng.choice(pool, n_per_token, replace=False) for _ in range(t)]), axis=1)
    weights_TX = rng.uniform(0.05, 1.0, (t, n_per_token)).astype(np.float32)
    for token in pad_tokens:
        experts_TX[token] = -1
    for token in pad_slots:
        experts_TX[token, -1] = -1
        weights_TX[token, -1] = np.nan
    return jnp.asarray(weights_TX), jnp.asarray(experts_TX.astype(np.int32))


def make_x(rng: np.random.Generator, t: int, d: int, scale: float) -> jax.Array:
    """Activations [t, d] as the seam takes them: bf16, fq8'd (the MoE's quantisation, module docstring)."""
    return quant.fq8(jnp.asarray(rng.normal(0.0, scale, (t, d)).astype(np.float32)).astype(jnp.bfloat16))


def gate_values(experts: dict, x_TD: jax.Array, experts_TX: jax.Array) -> np.ndarray:
    """The w1 outputs of every valid assignment (reference dequantisation, float64 sums). [A', F]."""
    x = np.asarray(quant.fq8(x_TD), np.float64)
    out = []
    for t, e in zip(*np.nonzero(np.asarray(experts_TX) >= 0)):
        w = np.asarray(rx.expert_weights(experts, "w1", jnp.asarray([int(experts_TX[t, e])])), np.float64)[0]
        out.append(w @ x[t])
    return np.stack(out)


def assert_close(got: np.ndarray, expected: np.ndarray, min_equal: float = 0.99) -> None:
    """The kernels sum in another order than the reference: allow a few bf16 ulps of the output's magnitude."""
    assert got.shape == expected.shape and got.dtype == np.float32
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, expected, rtol=0, atol=4 * 2.0 ** -8 * np.abs(expected).max())
    assert np.mean(got == expected) >= min_equal


def test_decode_matches_dequant_for_every_byte_and_exponent():
    exponents = np.arange(2, 241, dtype=np.uint8)  # the range scale_multiplier documents as exact
    packed = np.tile(np.arange(256, dtype=np.uint8), (exponents.size, 1))  # [S, 256 bytes] = 512 codes a row
    scale = np.repeat(exponents[:, None], 512 // 32, axis=1)
    expected = np.asarray(quant.dequant_fp4_weight(jnp.asarray(packed), jnp.asarray(scale)), np.float32)
    words = rx.pack_words(jnp.asarray(packed))
    scale_W = jnp.repeat(rx.scale_multiplier(jnp.asarray(scale)), rx.WORDS_PER_SCALE, axis=1)
    phases = [None] * 8
    for j in range(4):
        low, high = rx.decode_pair(words, j)
        phases[j], phases[j + 4] = (np.asarray((v * scale_W).astype(jnp.bfloat16), np.float32) for v in (low, high))
    got = np.stack(phases, axis=-1).reshape(expected.shape)  # code j of word w is element 8 w + j
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))  # bit for bit, signed zeros too
    assert np.isfinite(got).all() and (got != 0).any()


def test_gemm_decode_is_exact_for_every_byte_in_its_exponent_range():
    """The grouped GEMM's weight tiles: both forms give dequant * 2^-_GEMM_SHIFT bit for bit, every byte, every
    exponent of the documented range. The GPU form (bf16 bits times a bf16x2 multiplier, through bf16 subnormals)
    is replayed in numpy, which keeps subnormals (XLA on the CPU flushes them)."""
    lo, hi = rx.GEMM_SCALE_RANGE
    exponents = np.arange(lo, hi + 1, dtype=np.uint8)
    packed = np.tile(np.arange(256, dtype=np.uint8), (exponents.size, 1))  # [S, 256 bytes] = 512 codes a row
    scale = np.repeat(exponents[:, None], 512 // 32, axis=1)
    expected = np.asarray(quant.dequant_fp4_weight(jnp.asarray(packed), jnp.asarray(scale)), np.float32)
    expected = expected * np.float32(2.0 ** -rx._GEMM_SHIFT)
    words = rx.pack_words(jnp.asarray(packed))
    s_words = words.shape[1]

    def natural(tiles) -> np.ndarray:  # 4 tiles [S, 2 words] (codes j, j + 4 side by side) -> [S, 512]
        out = np.zeros((exponents.size, s_words, 8), np.float32)
        for j, tile in enumerate(tiles):
            pair = np.asarray(tile, np.float32).reshape(exponents.size, s_words, 2)
            out[:, :, j], out[:, :, j + 4] = pair[..., 0], pair[..., 1]
        return out.reshape(expected.shape)

    got = natural(rx._dequant_pairs(words, jnp.asarray(scale), asm=False))
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    scale_W = np.repeat(np.asarray(rx.gemm_scale_bits(jnp.asarray(scale))), rx.WORDS_PER_SCALE, axis=1)
    gpu_form = []
    for j in range(4):
        bits = np.asarray(rx._pair_bits_bf16(words, j))
        halves = [(v >> np.uint32(16 * h)).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
                  for v in (bits, scale_W) for h in (0, 1)]
        low, high = halves[0] * halves[2], halves[1] * halves[3]  # exact products: no rounding to bf16 needed
        gpu_form.append(np.stack([low, high], axis=-1).reshape(exponents.size, -1))
    got = natural(gpu_form)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    assert np.isfinite(got).all() and (got != 0).any()


CASES = {  # name: (T, E, X, D, F, pool, pad_tokens, pad_slots, exponent range)
    "one-token": (1, 8, 2, 256, 128, None, (), (), (118, 124)),
    "padding": (4, 8, 2, 256, 128, None, (1,), (3,), (118, 124)),
    "ragged-empty-experts": (24, 16, 3, 256, 128, 5, (7,), (2,), (116, 126)),
    "wide-exponents": (6, 8, 2, 256, 128, None, (), (), (100, 150)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    t, e, x, d, f, pool, pad_tokens, pad_slots, exponents = CASES[request.param]
    rng = np.random.default_rng(sorted(CASES).index(request.param))
    experts = make_experts(rng, e, d, f, exponents)
    weights_TX, experts_TX = make_routing(rng, t, e, x, pool, pad_tokens, pad_slots)
    x_TD = make_x(rng, t, d, 3.0)
    expected = np.asarray(rx.routed_experts_reference(experts, x_TD, weights_TX, experts_TX, LIMIT))
    return request.param, experts, x_TD, weights_TX, experts_TX, expected


def test_pair_major_puts_each_code_pair_beside_its_words():
    """K step k (words k * words .. of 8 codes each) holds, per pair j, codes j and j + 4 of each word side by
    side."""
    words = 2
    x_TD = jnp.arange(2 * 32, dtype=jnp.float32).reshape(2, 32)
    got = np.asarray(rx.pair_major(x_TD, words))
    for k in range(2):
        for j in range(4):
            for w in range(words):
                for h in range(2):
                    col = k * 8 * words + j * 2 * words + 2 * w + h
                    np.testing.assert_array_equal(got[:, col], np.asarray(x_TD[:, 8 * (k * words + w) + j + 4 * h]))


@pytest.mark.parametrize("path", rx.PATHS)
def test_pallas_matches_reference(case, path):
    name, experts, x_TD, weights_TX, experts_TX, expected = case
    got = np.asarray(rx.routed_experts(experts, x_TD, weights_TX, experts_TX, LIMIT, impl="pallas", path=path))
    assert_close(got, expected)
    pad_rows = np.all(np.asarray(experts_TX) < 0, axis=1)
    assert np.all(got[pad_rows] == 0) and np.all(expected[pad_rows] == 0)
    if name == "one-token":
        assert (gate_values(experts, x_TD, experts_TX) > LIMIT).any()  # the clamp fires


@pytest.mark.parametrize("impl", rx.IMPLS)
def test_activations_are_taken_as_given(case, impl):
    """The seam takes x fq8'd by its caller (``dijax.model.moe``, or the collapse kernel's second output) and does
    not quantise it again: fq8 is idempotent, so x fq8'd once or twice gives the same bits on each path, and the
    MoE's own fq8 (below) is the only one."""
    name, experts, x_TD, weights_TX, experts_TX, _ = case
    x_act_TD = quant.fq8(x_TD)
    for path in rx.PATHS:
        want = rx.routed_experts(experts, quant.fq8(x_act_TD), weights_TX, experts_TX, LIMIT, impl=impl, path=path)
        got = rx.routed_experts(experts, x_act_TD, weights_TX, experts_TX, LIMIT, impl=impl, path=path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{name} {path}")


def test_several_k_steps_on_both_paths():
    """D = F = 1024 takes several K steps on both paths (mat-vec: 64 words a step; grouped GEMM: 16 words, so
    pair_major's column order changes from step to step)."""
    rng = np.random.default_rng(21)
    experts = make_experts(rng, 4, 1024, 1024, (116, 122))
    weights_TX, experts_TX = make_routing(rng, 3, 4, 2, pad_slots=(1,))
    x_TD = make_x(rng, 3, 1024, 3.0)
    expected = np.asarray(rx.routed_experts_reference(experts, x_TD, weights_TX, experts_TX, LIMIT))
    for path in rx.PATHS:
        got = np.asarray(rx.routed_experts(experts, x_TD, weights_TX, experts_TX, LIMIT, impl="pallas", path=path))
        assert_close(got, expected)


def test_gate_up_kernel_quantises_h_as_xla_does(monkeypatch):
    """With whole 32-wide scale blocks per program (``matvec_rows`` 32, the default) the gate-up mat-vec writes h
    fq8'd and phase-major itself; with 16 rows XLA does (``quant.fq8``, ``phase_major``). The down kernel's sums do
    not depend on its rows, so the two give the same bits, padding slots and several K steps included."""
    rng = np.random.default_rng(5)
    experts = make_experts(rng, 4, 512, 256, (114, 124))
    weights_TX, experts_TX = make_routing(rng, 3, 4, 2, pad_tokens=(2,), pad_slots=(0,))
    x_TD = make_x(rng, 3, 512, 3.0)
    got = {}
    for rows in (32, 16):
        monkeypatch.setattr(rx, "CONFIG", dataclasses.replace(rx.CONFIG, matvec_rows=rows, matvec_words=16))
        got[rows] = np.asarray(rx.routed_experts(experts, x_TD, weights_TX, experts_TX, LIMIT, impl="pallas",
                                                 path="gathered"))
    np.testing.assert_array_equal(got[32], got[16])
    assert_close(got[32], np.asarray(rx.routed_experts_reference(experts, x_TD, weights_TX, experts_TX, LIMIT)))


def test_matvecs_lower_to_triton_without_a_gpu(lower_for_cuda):
    """The mat-vecs as the GPU builds them (inline PTX, the gate-up kernel's fq8 epilogue and transposed store,
    the stack offset read in the kernels) lower to Triton IR: two kernels."""
    rng = np.random.default_rng(23)
    experts = make_experts(rng, 4, 1024, 512, (116, 122))
    weights_TX, experts_TX = make_routing(rng, 2, 4, 2)
    with dijax.kernels.lowering_for_gpu():
        text = lower_for_cuda(lambda e, x, w, i: rx.routed_experts_pallas(e, x, w, i, LIMIT, "gathered"), experts,
                              make_x(rng, 2, 1024, 3.0), weights_TX, experts_TX)
    assert text.count("xla.gpu.triton") == 2


def test_a_padding_slot_adds_exactly_nothing():
    rng = np.random.default_rng(11)
    experts = make_experts(rng, 8, 256, 128, (118, 124))
    x_TD = make_x(rng, 3, 256, 3.0)
    weights_TX, experts_TX = make_routing(rng, 3, 8, 2, pad_slots=(0, 1, 2))  # one real expert per token
    single_w, single_e = weights_TX[:, :1], experts_TX[:, :1]
    for impl in rx.IMPLS:
        for path in rx.PATHS:
            padded = rx.routed_experts(experts, x_TD, weights_TX, experts_TX, LIMIT, impl=impl, path=path)
            single = rx.routed_experts(experts, x_TD, single_w, single_e, LIMIT, impl=impl, path=path)
            np.testing.assert_array_equal(np.asarray(padded), np.asarray(single), err_msg=f"{impl} {path}")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rows", (16, 64))
def test_tile_layout_invariants(seed, rows):
    rng = np.random.default_rng(seed)
    n_experts, n_per_token, t = 12, 3, int(rng.integers(1, 120))
    pool = int(rng.integers(1, n_experts)) + 1 if seed % 2 else n_experts  # empty experts and big groups
    pool = max(pool, n_per_token)
    _, experts_TX = make_routing(rng, t, n_experts, n_per_token, pool, pad_tokens=tuple(range(0, t, 7)))
    expert_A = np.asarray(experts_TX).reshape(-1)
    tile_expert_I, token_R, slot_R, pos_A = map(np.asarray, rx.tile_layout(jnp.asarray(expert_A), n_experts,
                                                                           n_per_token, rows))
    a = expert_A.size
    assert tile_expert_I.size == min(a, -(-a // rows) + min(n_experts, a)) and slot_R.size == tile_expert_I.size * rows
    valid = np.nonzero(expert_A >= 0)[0]
    assert np.array_equal(slot_R[pos_A[valid]], valid)  # each assignment sits in its own row
    assert np.array_equal(tile_expert_I[pos_A[valid] // rows], expert_A[valid])  # in a tile of its expert
    assert np.array_equal(token_R[pos_A[valid]], valid // n_per_token)
    assert np.sum(slot_R >= 0) == valid.size and np.all(token_R[slot_R < 0] == 0)
    sizes = np.bincount(expert_A[valid], minlength=n_experts)
    assert np.sum(tile_expert_I >= 0) == np.sum(-(-sizes // rows))  # no tile is launched for an empty expert
    launched = tile_expert_I[tile_expert_I >= 0]
    assert np.all(np.diff(launched) >= 0) and np.all(tile_expert_I[len(launched):] == -1)


@pytest.mark.parametrize("seed", range(4))
def test_tile_layout_by_comparisons_equals_the_sorted_one(monkeypatch, seed):
    """Up to ``COMPARE_MAX`` assignments both layouts come from comparisons (no sort, no scatter): the same integers
    as the sort's, padding assignments and empty experts included."""
    rng = np.random.default_rng(seed)
    n_experts, n_assign, rows = int(rng.integers(1, 40)), int(rng.integers(1, 400)), int(rng.choice([1, 4, 16]))
    expert_A = jnp.asarray(rng.integers(-1, n_experts, n_assign), jnp.int32)
    assert n_assign <= rx.COMPARE_MAX
    layouts = [lambda: rx.tile_layout(expert_A, n_experts, 3, rows),
               lambda: rx.fit_tiles(expert_A, n_experts, 3, (8, 16, 64))]
    got = [layout() for layout in layouts]
    monkeypatch.setattr(rx, "COMPARE_MAX", 0)
    for outputs, layout in zip(got, layouts):
        for g, w in zip(outputs, layout()):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fp8_experts_take_the_reference_path():
    rng = np.random.default_rng(5)

    def fp8(out_dim: int, in_dim: int) -> dict:
        w = rng.normal(0, 1, (4, out_dim, in_dim)).astype(ml_dtypes.float8_e4m3fn)
        return {"weight": jnp.asarray(w), "scale": jnp.asarray(rng.integers(120, 124, (4, out_dim // 32, in_dim // 32),
                                                                             dtype=np.uint8))}

    experts = {"w1": fp8(64, 128), "w3": fp8(64, 128), "w2": fp8(128, 64)}
    weights_TX, experts_TX = make_routing(rng, 3, 4, 2)
    x_TD = make_x(rng, 3, 128, 1.0)
    ref = rx.routed_experts(experts, x_TD, weights_TX, experts_TX, LIMIT)
    got = rx.routed_experts(experts, x_TD, weights_TX, experts_TX, LIMIT, impl="pallas")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_unknown_impl_is_refused():
    rng = np.random.default_rng(0)
    experts = make_experts(rng, 4, 64, 64, (120, 122))
    weights_TX, experts_TX = make_routing(rng, 1, 4, 2)
    with pytest.raises(ValueError, match="impl must be one of"):
        rx.routed_experts(experts, make_x(rng, 1, 64, 1.0), weights_TX, experts_TX, LIMIT, impl="cuda")


@pytest.mark.parametrize("t", (3, 60))  # tiny: E = 8, X = 2; A = 6 takes the mat-vec path, A = 120 the GEMM
def test_moe_with_pallas_matches_reference(t):
    cfg = ModelConfig.from_file(os.path.join(os.path.dirname(dijax.__file__), "assets", "tiny", "config.json"))
    ffn = checkpoint_tree(cfg, random_params(cfg, seed=4))["layers"][1]["ffn"]
    x_TD = make_x(np.random.default_rng(t), t, cfg.dim, 4.0)
    ref = np.asarray(moe.moe(ffn, x_TD, cfg), np.float32)
    got = np.asarray(moe.moe(ffn, x_TD, cfg, impl="pallas"), np.float32)
    assert_close(got, ref, min_equal=0.97)
    for impl, y in (("reference", ref), ("pallas", got)):  # x_act_TD: the collapse kernel's fq8 output
        given = moe.moe(ffn, x_TD, cfg, x_act_TD=quant.fq8(x_TD), impl=impl)
        np.testing.assert_array_equal(np.asarray(given, np.float32), y)


@pytest.mark.parametrize("change, field", [({"gemm_cols": 16}, "gemm_cols"), ({"gemm_rows_max": 48}, "gemm_rows_max"),
                                           ({"gemm_rows_min": 128}, "gemm_rows_min"), ({"gemm_warps": 3}, "gemm_warps"),
                                           ({"matvec_stages": 0}, "matvec_stages"),
                                           ({"gemm_engine": "cuda"}, "gemm_engine"),
                                           ({"mgpu_sizes": (64, 100)}, "mgpu_sizes"),
                                           ({"mgpu_chunks": 4}, "mgpu_chunks"),
                                           ({"mgpu_warpgroups": 3}, "mgpu_warpgroups")])
def test_kernel_config_refuses_bad_tilings(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(rx.KernelConfig(), **change)


def test_mgpu_engine_needs_a_hopper_gpu_and_its_sizes():
    """gemm_engine='mgpu' runs only where fp4_wgmma can: not interpreted, a compute-capability-9 GPU, sizes it takes
    (else the ragged path keeps the Triton kernels)."""
    cfg = dataclasses.replace(rx.CONFIG, gemm_engine="mgpu")
    assert not rx._mgpu_takes(5120, 2304, cfg, interpret=True)
    if jax.default_backend() != "gpu":
        assert not rx._mgpu_takes(5120, 2304, cfg, interpret=False)
    assert not rx._mgpu_takes(5120, 2304 + 32, cfg, interpret=False)  # F not a multiple of 128


def test_mgpu_engine_from_its_fewest_assignments(monkeypatch):
    """Below ``mgpu_min_assignments`` the ragged path keeps the Triton kernels (fp4_wgmma never called), from it on
    it takes fp4_wgmma."""
    calls, reference = [], rx.fp4_wgmma.grouped_gemm_t_reference  # the kernel's signature, counted
    monkeypatch.setattr(rx.fp4_wgmma, "grouped_gemm_t_mgpu", lambda *a, **k: calls.append(1) or reference(*a, **k))
    monkeypatch.setattr(rx, "_mgpu_takes", lambda *args: True)
    rng = np.random.default_rng(3)
    experts = make_experts(rng, 8, 128, 128, (116, 122))
    weights_TX, experts_TX = make_routing(rng, 5, 8, 2, None, (), ())
    x_TD = make_x(rng, 5, 128, 1.0)
    for fewest, used in ((11, False), (10, True)):  # 5 tokens x 2 experts = 10 assignments
        monkeypatch.setattr(rx, "CONFIG", dataclasses.replace(rx.CONFIG, gemm_engine="mgpu", gathered_max=0,
                                                              mgpu_min_assignments=fewest))
        rx._routed_experts_call.clear_cache()
        try:
            rx.routed_experts_pallas(experts, x_TD, weights_TX, experts_TX, LIMIT)
        finally:
            rx._routed_experts_call.clear_cache()
        assert bool(calls) == used, fewest
        calls.clear()


@pytest.mark.parametrize("t, pool, pad_tokens, pad_slots, gemm", [
    (1, None, (), (), "reference"), (3, 8, (1,), (2,), "reference"), (3, 8, (1,), (2,), "interpreted"),
    (16, None, (3,), (5,), "reference"), (200, 9, (17,), (2,), "reference"), (200, 9, (17,), (2,), "interpreted")])
def test_mgpu_path_on_the_cpu(t, pool, pad_tokens, pad_slots, gemm, monkeypatch):
    """The 'mgpu' ragged path on the CPU: its tile layout (``lone_tiles`` up to ``mgpu_lone_max`` assignments,
    else fit_tiles), the row gathers, SwiGLU and routing weights and the combine around fp4_wgmma's reference
    (same signature) or its kernel run by the Mosaic GPU interpreter. Decode (a tile per assignment, experts
    shared by two tokens), padding tokens and slots, empty experts and tiles of several sizes, against the
    reference path. The interpreter (25 s a case on the CI machine) runs one lone-tiles case and one fit-tiles
    case; the layouts of the others are the same code around the reference."""
    kernel = (rx.fp4_wgmma.grouped_gemm_t_reference if gemm == "reference"
              else functools.partial(rx.fp4_wgmma.grouped_gemm_t_mgpu, interpret=True))
    monkeypatch.setattr(rx.fp4_wgmma, "grouped_gemm_t_mgpu", kernel)
    monkeypatch.setattr(rx, "_mgpu_takes", lambda *args: True)
    monkeypatch.setattr(rx, "CONFIG", dataclasses.replace(rx.CONFIG, gemm_engine="mgpu", gathered_max=0,
                                                          mgpu_min_assignments=0))
    rx._routed_experts_call.clear_cache()
    rng = np.random.default_rng(t)
    n_experts, per_token, d, f = 32, 6, 256, 128
    experts = make_experts(rng, n_experts, d, f, (116, 122))
    weights_TX, experts_TX = make_routing(rng, t, n_experts, per_token, pool, pad_tokens, pad_slots)
    x_TD = make_x(rng, t, d, 3.0)
    try:
        got = np.asarray(rx.routed_experts_pallas(experts, x_TD, weights_TX, experts_TX, LIMIT))
    finally:
        rx._routed_experts_call.clear_cache()
    expected = np.asarray(rx.routed_experts_reference(experts, x_TD, weights_TX, experts_TX, LIMIT))
    assert_close(got, expected, min_equal=0.95)
    assert np.all(got[np.all(np.asarray(experts_TX) < 0, axis=1)] == 0)


@pytest.mark.parametrize("layout", ["tile_layout", "fit_tiles"])
def test_tile_layouts_have_no_loop(layout):
    # on a GPU each trip of a loop is kernels of its own: jnp.searchsorted's default binary search was a 9-trip loop
    # per layer, 315 of a flash-slice decode step's 1036 launches at batch 64 (docs/benchmarks.md, 33rd session)
    expert_A = jnp.zeros((384,), jnp.int32)
    fn = {"tile_layout": lambda e: rx.tile_layout(e, 384, 6, 16),
          "fit_tiles": lambda e: rx.fit_tiles(e, 384, 6, (8, 16, 64, 128))}[layout]
    assert "stablehlo.while" not in jax.jit(fn).lower(expert_A).as_text()


@pytest.mark.parametrize("sizes", [(64, 128, 192, 256), (16, 64), (128,)])
def test_fit_tiles_cover_each_expert_exactly(sizes):
    """Every assignment's row lies in exactly one tile, of its own expert; a tile's size is one of ``sizes``; each
    expert's rows are contiguous, the large tiles first; padding assignments (-1) get no row."""
    rng = np.random.default_rng(len(sizes))
    n_experts, per_token, tokens = 12, 4, 333
    expert_TX = np.stack([rng.choice(n_experts, per_token, replace=False) for _ in range(tokens)])
    expert_TX[rng.random(expert_TX.shape) < 0.05] = -1
    expert_A = jnp.asarray(expert_TX.reshape(-1), jnp.int32)
    tiles_I3, token_R, slot_R, pos_A = (np.asarray(a) for a in rx.fit_tiles(expert_A, n_experts, per_token, sizes))
    row_tile = np.full(token_R.shape[0], -1)
    for i, (e, r, n) in enumerate(tiles_I3):
        if e < 0:
            continue
        assert n in sizes and r + n <= token_R.shape[0]
        assert np.all(row_tile[r:r + n] == -1), "tiles overlap"
        row_tile[r:r + n] = i
    for a, e in enumerate(np.asarray(expert_A)):
        if e < 0:
            assert a not in slot_R
            continue
        row = pos_A[a]
        assert slot_R[row] == a and token_R[row] == a // per_token
        assert tiles_I3[row_tile[row], 0] == e
    for e in range(n_experts):  # whole tiles of the largest size, then at most one smaller tile
        mine = tiles_I3[tiles_I3[:, 0] == e]
        assert np.sum(mine[:, 2] != max(sizes)) <= 1
        count = np.sum(np.asarray(expert_A) == e)
        assert mine[:, 2].sum() - count < max(b - a for a, b in zip([0, *sorted(sizes)], sorted(sizes)))


def _pad_rows(count: int, sizes: tuple[int, ...]) -> int:
    """The rows ``fit_tiles`` gives an expert of ``count`` assignments (numpy restatement of its rule)."""
    big = max(sizes)
    rest = count % big
    return count - rest + (min(n for n in sizes if n >= rest) if rest else 0)


@pytest.mark.parametrize("sizes", [(8, 16, 32, 64, 128, 192, 256), (64, 128, 192, 256), (16, 64), (128,)])
def test_fit_rows_bounds_every_layout(sizes):
    """``fit_rows`` is at least the rows of the worst distributions (every expert one assignment, every expert one
    past a size, everything on one expert) and of random ones; it is never above the plain A + n (gap - 1)."""
    rng = np.random.default_rng(7)
    gap = max(b - a for a, b in zip([0, *sorted(sizes)], sorted(sizes)))
    for n_experts, n_assign in [(384, 6), (384, 96), (384, 384), (384, 8192), (12, 333), (3, 1000)]:
        bound = rx.fit_rows(sizes, n_assign, n_experts)
        n = min(n_experts, n_assign)
        assert bound % 8 == 0 and bound <= -(-(n_assign + n * (gap - 1)) // 8) * 8
        layouts = [np.bincount(np.arange(n_assign) % n, minlength=n_experts),
                   np.eye(n_experts, dtype=int)[0] * n_assign]
        for size in sizes:  # as many experts as fit with one row past each size, the rest on one more
            per = size % max(sizes) + 1
            k = min(n, n_assign // per)
            counts = np.zeros(n_experts, int)
            counts[:k] = per
            counts[k % n_experts] += n_assign - counts.sum()
            layouts.append(counts)
        layouts += [np.bincount(rng.integers(0, n_experts, n_assign), minlength=n_experts) for _ in range(20)]
        for counts in layouts:
            assert counts.sum() == n_assign
            assert sum(_pad_rows(int(c), sizes) for c in counts if c) <= bound, (n_experts, n_assign, counts)


def test_fit_rows_is_tight_at_decode():
    """Lone assignments at decode lay out one smallest tile each: the bound is exactly that, not A + n (gap - 1)."""
    sizes = rx.CONFIG.mgpu_sizes
    assert rx.fit_rows(sizes, 384, 384) == 384 * min(sizes)
    assert rx.fit_rows(sizes, 6, 384) == 6 * min(sizes)


@pytest.mark.parametrize("n_assign, expected", [(6, (8,)), (8, (8,)), (9, (8, 16)), (100, (8, 16, 32, 64, 128)),
                                                (384, (8, 16, 32, 64, 128, 192, 256)),
                                                (49152, (8, 16, 32, 64, 128, 192, 256))])
def test_fit_sizes_keeps_the_sizes_a_tile_can_take(n_assign, expected):
    """No expert has more rows than A, so sizes above the smallest holding A never occur and are not compiled; the
    tiles are the same with the full and the kept sizes."""
    sizes = (8, 16, 32, 64, 128, 192, 256)
    assert rx.fit_sizes(sizes, n_assign) == expected
    rng = np.random.default_rng(n_assign)
    expert_A = jnp.asarray(rng.integers(-1, 5, n_assign), jnp.int32)
    full, kept = (rx.fit_tiles(expert_A, 5, 1, s) for s in (sizes, expected))
    used = np.asarray(full[0])[:, 0] >= 0
    np.testing.assert_array_equal(np.asarray(full[0])[used], np.asarray(kept[0])[np.asarray(kept[0])[:, 0] >= 0])
    for a, b in zip(full[1:], kept[1:]):
        n = min(a.shape[0], b.shape[0])
        np.testing.assert_array_equal(np.asarray(a)[:n], np.asarray(b)[:n])


def test_lone_tiles_give_each_assignment_its_row():
    """A tile of LONE_ROWS rows per assignment, the assignment in its first row; padding assignments' tiles unused
    and their rows padding."""
    expert_A = jnp.asarray([3, -1, 0, 3], jnp.int32)
    tiles_I3, token_R, slot_R, pos_A = (np.asarray(a) for a in rx.lone_tiles(expert_A, n_per_token=2))
    n = rx.LONE_ROWS
    np.testing.assert_array_equal(tiles_I3, [[3, 0, n], [-1, n, 0], [0, 2 * n, n], [3, 3 * n, n]])
    np.testing.assert_array_equal(pos_A, [0, n, 2 * n, 3 * n])
    assert token_R.shape == slot_R.shape == (4 * n,)
    np.testing.assert_array_equal(slot_R[pos_A], [0, -1, 2, 3])
    np.testing.assert_array_equal(token_R[pos_A], [0, 0, 1, 1])
    assert np.all(slot_R[np.setdiff1d(np.arange(4 * n), pos_A)] == -1)
