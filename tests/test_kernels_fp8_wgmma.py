"""The Mosaic GPU fp8 linear's semantics on the CPU (dijax.kernels.fp8_wgmma).

The kernel needs a Hopper GPU (tests/gpu/test_fp8_wgmma_gpu.py runs it). Here: its reference against the fp8
linear's, and its index algebra in numpy: ``emulated_call`` computes what the kernel computes from the operands the
wrapper hands it (natural-layout words read through the fragment positions ``_decode`` gives each byte, the scales'
words, ``permute_k``'s activations, the split parts of K), so the wrapper's plumbing runs end to end against the
reference. The decode's bit trick is the fp8 linear's (its constants are this module's), checked there for every
code and scale byte (tests/test_kernels_fp8_linear.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dijax.kernels import fp8_linear as fl
from dijax.kernels import fp8_wgmma as f8
from dijax.kernels import quant
from dijax.kernels.stacked import of_layer


def fragment_codes() -> np.ndarray:
    """int [64]: the code (within a 64-wide chunk of a weight row) at each position of the kernel's fragment:
    ``_decode`` gives byte p + 2e of word 8g + 2q + h to column 8 (4g + 2p + h) + 2q + e."""
    out = np.full(64, -1)
    for g, q, p, h, e in np.ndindex(2, 4, 2, 2, 2):
        out[8 * (4 * g + 2 * p + h) + 2 * q + e] = 4 * (8 * g + 2 * q + h) + p + 2 * e
    return out


def emulated_call(w_LOW, s_LRS, x_NI, layer_1, *, splits, stages, warpgroups, block_scales, interpret):
    """What ``_call``'s kernel computes, in numpy (float64, exact here): float32 [splits, O, N]."""
    del stages, warpgroups, interpret
    layer = int(np.asarray(layer_1)[0])
    words = np.asarray(w_LOW)[layer]
    o, i = words.shape[0], 4 * words.shape[1]
    codes = words.view(np.uint8).reshape(o, i // 64, 64)[:, :, fragment_codes()].reshape(o, i)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scales = np.asarray(s_LRS)[layer] if block_scales else np.asarray(s_LRS)[0]
    blocks = scales.view(np.uint8).reshape(scales.shape[0], i // 32)  # byte j of step s's word: block 4 s + j
    if block_scales:
        blocks = np.repeat(blocks, 32, axis=0)
    w = values * np.exp2(np.repeat(blocks.astype(np.float64), 32, axis=1) - 127)  # fragment position p: block p // 32
    x = np.asarray(x_NI.astype(jnp.float32), np.float64)
    part = i // splits
    return np.stack([w[:, p * part:(p + 1) * part] @ x[:, p * part:(p + 1) * part].T
                     for p in range(splits)]).astype(np.float32)


def test_fragment_order_is_permute_k():
    """Position j of a chunk holds feature ``fragment_codes()[j]`` of the weight, and ``permute_k`` puts the
    activation of that same feature there: the fragment's dot is the natural dot. Scale blocks: the first four
    column groups read block 0, the last four block 1."""
    order = np.asarray(f8.permute_k(jnp.arange(128, dtype=jnp.float32)[None]))[0].astype(int)
    codes = fragment_codes()
    assert sorted(codes) == list(range(64))
    np.testing.assert_array_equal(order[:64], codes)
    np.testing.assert_array_equal(order[64:], codes + 64)
    np.testing.assert_array_equal(codes // 32, np.arange(64) // 32)


def _operands(o: int, i: int, t: int, seed: int, layers: int = 0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (max(layers, 1), o, i), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (checkpoints have none)
    weight = jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))
    scale = jnp.asarray(rng.integers(*f8.SCALE_RANGE, (max(layers, 1), -(-o // 32), i // 32), dtype=np.uint8))
    x = jnp.asarray(rng.standard_normal((t, i)), jnp.bfloat16)
    if layers:
        return x, of_layer(weight, 1, 2), of_layer(scale, 1, 2)
    return x, weight[0], scale[0]


@pytest.mark.parametrize("block_scales", [False, True], ids=["row_scales", "block_scales"])
@pytest.mark.parametrize("o, i, t, warpgroups, target, layers", [
    (128, 256, 1, 1, 1, 0),     # one split
    (128, 512, 3, 2, 16, 0),    # T padded to 8, K split in 4
    (64, 384, 13, 1, 64, 3),    # a layer of a stack, read in place; 16 rows, 3 splits
])
def test_wrapper_with_the_emulated_kernel_matches_the_reference(o, i, t, warpgroups, target, layers, block_scales,
                                                                 monkeypatch):
    """``linear_mgpu``'s XLA passes (fq8, padding, ``permute_k``, the scales spread to rows, or with
    ``block_scales`` the stack's blocks read in place, as words, the layer index, the splits' sum and transpose)
    around ``emulated_call``, against the reference."""
    monkeypatch.setattr(f8, "_call", emulated_call)
    x, weight, scale = _operands(o, i, t, seed=o + i + t, layers=layers)
    got = np.asarray(f8.linear_mgpu(x, weight, scale, warpgroups=warpgroups, target_ctas=target,
                                    block_scales=block_scales), np.float32)
    want = np.asarray(f8.linear_reference(x, weight, scale), np.float32)
    assert got.shape == (t, o)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-30)
    assert np.mean(got == want) >= 0.9


def test_quantised_activations_skip_the_fq8_pass(monkeypatch):
    """x that is ``quant.fq8``'s values already, said so: the same bits as quantising it again (the kernel's XLA
    fq8 pass skipped), from the emulated kernel and the reference."""
    monkeypatch.setattr(f8, "_call", emulated_call)
    x, weight, scale = _operands(128, 512, 3, seed=7)
    x_act = quant.fq8(x)
    for fn in (f8.linear_mgpu, f8.linear_reference):
        np.testing.assert_array_equal(np.asarray(fn(x_act, weight, scale, quantised=True), np.float32),
                                      np.asarray(fn(x, weight, scale), np.float32))


def test_reference_is_the_fp8_linears():
    x, weight, scale = _operands(64, 256, 5, seed=1)
    np.testing.assert_array_equal(np.asarray(f8.linear_reference(x, weight, scale), np.float32),
                                  np.asarray(fl.fp8_linear_reference(x, weight, scale), np.float32))


def test_one_decode_for_both_engines():
    """The fp8 linear's Triton kernel decodes with this module's constants and checks the same scale range."""
    assert fl.SCALE_RANGE == f8.SCALE_RANGE
    words = jnp.asarray(np.random.default_rng(0).integers(0, 2 ** 32, 64, dtype=np.uint32))
    for j in range(2):
        shifted = (words << 4) if j == 0 else (words >> 4)
        sign = (words << 8) if j == 0 else words
        np.testing.assert_array_equal(
            np.asarray(fl.pair_bits(words, j)),
            np.asarray((shifted & np.uint32(f8.E4M3_MAGNITUDE_PAIR)) | (sign & np.uint32(f8.E4M3_SIGN_PAIR))))


def test_splits_and_shape_errors():
    assert f8.splits_for(8, 40, 264) == 40 and f8.splits_for(512, 10, 264) == 1 and f8.splits_for(80, 64, 264) == 4
    assert f8.shape_error(1, 512, 5120, 1) is None
    assert "T must be in" in f8.shape_error(0, 512, 5120, 1)
    assert "T must be in" in f8.shape_error(257, 512, 5120, 1)
    assert "warpgroups must be one of" in f8.shape_error(1, 512, 5120, 3)
    assert "O 96 must be a multiple of 64" in f8.shape_error(1, 96, 5120, 1)
    assert "I 5056 of 128" in f8.shape_error(1, 512, 5056, 1)
    x, weight, scale = _operands(96, 256, 2, seed=3)
    with pytest.raises(ValueError, match="O 96 must be a multiple"):
        f8.linear_mgpu(x, weight, scale)


def test_engine_is_checked_and_needs_a_hopper_gpu(monkeypatch):
    """``fp8_linear.KernelConfig`` names a bad engine or warpgroup count; 'mgpu' runs only where fp8_wgmma can (not
    interpreted, a compute-capability-9 GPU, its shapes, ``mgpu_min_tokens`` to ``mgpu_max_tokens`` rows), else the
    Triton kernel."""
    import dataclasses

    for change, field in (({"engine": "cuda"}, "engine"), ({"mgpu_warpgroups": 4}, "mgpu_warpgroups"),
                          ({"mgpu_stages": 0}, "mgpu_stages"), ({"mgpu_min_tokens": 0}, "mgpu_min_tokens"),
                          ({"mgpu_min_tokens": 65, "mgpu_max_tokens": 64}, "mgpu_min_tokens")):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(fl.KernelConfig(), **change)
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, engine="mgpu", mgpu_min_tokens=1))
    x, weight, _ = _operands(128, 256, 2, seed=4)
    assert not fl._mgpu_takes(x, [weight], interpret=True)
    monkeypatch.setattr(f8, "available", lambda: True)
    assert fl._mgpu_takes(x, [weight], interpret=False)
    assert not fl._mgpu_takes(x, [weight[:96]], interpret=False)  # O not a multiple of 64
    assert not fl._mgpu_takes(jnp.zeros((fl.CONFIG.mgpu_max_tokens + 1, 256), jnp.bfloat16), [weight],
                              interpret=False)
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, mgpu_min_tokens=x.shape[0] + 1))
    assert not fl._mgpu_takes(x, [weight], interpret=False)  # fewer rows than mgpu_min_tokens: the Triton kernel


def test_seam_runs_each_linear_on_the_emulated_kernel(monkeypatch):
    """``fp8_linears`` with ``engine='mgpu'`` (a Hopper GPU faked, the kernel emulated): each linear of one input
    through ``linear_mgpu``, equal to the reference; the leading dims of x kept."""
    import dataclasses

    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, engine="mgpu", mgpu_min_tokens=1,
                                                          mgpu_warpgroups=1))
    monkeypatch.setattr(f8, "available", lambda: True)
    monkeypatch.setattr(fl, "interpret_mode", lambda requested=None: False)
    monkeypatch.setattr(f8, "_call", emulated_call)
    calls = []
    real = f8.linear_mgpu
    monkeypatch.setattr(f8, "linear_mgpu", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    x, w1, s1 = _operands(128, 256, 6, seed=5)
    _, w2, s2 = _operands(64, 256, 6, seed=6)
    got = fl.fp8_linears(x.reshape(2, 3, 256), [(w1, s1), (w2, s2)], impl="pallas")
    assert calls == [(128, 256), (64, 256)]
    for y, (w, s) in zip(got, [(w1, s1), (w2, s2)]):
        want = np.asarray(fl.fp8_linear_reference(x, w, s), np.float32).reshape(2, 3, -1)
        np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2.0 ** -7, atol=1e-30)


@pytest.mark.parametrize("block_scales", [False, True], ids=["row_scales", "block_scales"])
@pytest.mark.parametrize("o, i, t, warpgroups, target, stages, layers", [
    (64, 256, 1, 1, 1, 2, 0),      # one split of two steps
    (128, 512, 3, 2, 8, 3, 0),     # two warpgroups, K split in 4, T padded to 8
    (64, 384, 13, 1, 3, 2, 3),     # a layer of a stack, 16 rows, 3 splits of one step
    (64, 768, 3, 1, 2, 2, 0),      # 2 splits of 3 steps (the scale words loaded a step ahead within each)
    (128, 512, 5, 2, 1, 3, 2),     # one split of 4 steps, two warpgroups, a layer of a stack
])
def test_interpreted_kernel_matches_reference(o, i, t, warpgroups, target, stages, layers, block_scales):
    """The Mosaic GPU kernel itself (pipeline, TMA copies, the scale words read from GMEM, spread to rows or by
    block (``block_scales``: each warpgroup's two blocks, selected by row; swapping them fails every case), wgmma,
    split K, the fp32 partial sums' store) in jax's Mosaic GPU interpreter on the CPU, with ``_decode_values`` in
    place of the register decode, against the reference: the same exact products in another order (a bf16 ulp at
    ties)."""
    x, weight, scale = _operands(o, i, t, seed=o + i + t + 7, layers=layers)
    got = np.asarray(f8.linear_mgpu(x, weight, scale, warpgroups=warpgroups, target_ctas=target, stages=stages,
                                    block_scales=block_scales, interpret=True), np.float32)
    want = np.asarray(f8.linear_reference(x, weight, scale), np.float32)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=1e-30)
    assert np.mean(got == want) >= 0.9
