"""The fp8 block-scaled linear (dijax/kernels/fp8_linear.py): its kernel arithmetic against quant's reference
functions bit for bit, and the Pallas kernel (interpret mode on CPU) against the jnp reference."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from dijax.kernels import fp8_linear as fl
from dijax.kernels import quant
from dijax.kernels.stacked import of_layer
from dijax.model.step import CacheSpec, SeqChunk, build_step, init_cache
from dijax.model.transformer import forward_step

# the mat-vec kernel on every one-token launch, whatever its shape (the tests' small weights)
MATVEC_EVERYWHERE = dict(matvec=True, matvec_min_in=0, matvec_min_codes=0)


def _bf16_values(limit: float) -> np.ndarray:
    """Every finite bf16 value with |v| <= limit, as float32."""
    v = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    return v[np.isfinite(v) & (np.abs(v) <= limit)]


def test_e4m3_round_arith_matches_conversion():
    """Every bf16 value and every e4m3 midpoint (the ties) and its float32 neighbours, both signs."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(np.abs(grid[np.isfinite(grid)]))
    mids = (grid[:-1] + grid[1:]) / 2
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), grid]).astype(np.float32)
    rng = np.random.default_rng(0)
    values = np.concatenate([_bf16_values(448.0), near, -near, rng.uniform(-448, 448, 20000).astype(np.float32)])
    values = values[np.abs(values) <= 448]
    got = np.asarray(quant.e4m3_round_arith(jnp.asarray(values)))
    want = np.asarray(quant.e4m3_round(jnp.asarray(values)))
    np.testing.assert_array_equal(got, want)


def test_decode_e4m3_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(fl.decode_e4m3(jnp.asarray(codes))) * np.float32(2.0 ** fl._F16_BIAS_FIX)
    finite = np.isfinite(want)
    assert finite.sum() == 254
    np.testing.assert_array_equal(got[finite], want[finite])


def test_scale_multiplier_every_exponent_in_range():
    s = np.arange(0, 247, dtype=np.uint8)
    got = np.asarray(fl.scale_multiplier(jnp.asarray(s))) * np.float32(2.0 ** -fl._F16_BIAS_FIX)
    np.testing.assert_array_equal(got, np.asarray(quant.ue8m0_to_f32(jnp.asarray(s))))


def test_fq8_tiles_match_fq8():
    """Blocks of every magnitude, an all-zero block (the 1e-4 amax floor) and exact powers of two; one tile, and the
    kernel's two tiles in ``pair_columns``' order."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 8, 32)) * np.exp2(rng.integers(-30, 20, (6, 8, 1)))
    x = x.astype(np.float32).reshape(6, 256)
    x[0, :32] = 0
    x[1, 32:64] = np.exp2(np.arange(32) - 16)
    x_bf16 = jnp.asarray(x, jnp.bfloat16)
    want = np.asarray(quant.fq8(x_bf16).astype(jnp.float32))
    [got] = quant.fq8_tiles([x_bf16.astype(jnp.float32)])
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    columns = [np.asarray(c) for c in fl.pair_columns(128)]
    for k0 in (0, 128):
        tiles = quant.fq8_tiles([x_bf16[:, k0 + c].astype(jnp.float32) for c in columns])
        for c, got in zip(columns, tiles):
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want[:, k0 + c])


def test_pair_columns_cover_each_slice_once():
    a, b = (np.asarray(c) for c in fl.pair_columns(64))
    np.testing.assert_array_equal(np.sort(np.concatenate([a, b])), np.arange(64))


def _natural(tiles, shape) -> np.ndarray:
    """``dequant_pairs``' tiles A and B [N, 2 W] back in natural K order [N, 4 W] (float32)."""
    out = np.zeros(shape, np.float32)
    for columns, tile in zip(fl.pair_columns(shape[1]), tiles):
        out[:, np.asarray(columns)] = np.asarray(tile, np.float32)
    return out


def test_pair_decode_is_exact_for_every_code_and_scale_in_range():
    """Every e4m3 code (NaN excepted) at every scale byte of ``SCALE_RANGE``: the GPU form (bf16 pair bits times a
    bf16x2 multiplier, through bf16 subnormals) replayed in numpy, which keeps subnormals (XLA on the CPU flushes
    them), and the interpreted form, both equal to ``quant.dequant_fp8_weight`` bit for bit."""
    lo, hi = fl.SCALE_RANGE
    exponents = np.arange(lo, hi + 1, dtype=np.uint8)
    codes = np.tile(np.arange(256, dtype=np.uint8), (32 * exponents.size, 1))  # rows of every code
    codes[(codes & 0x7F) == 0x7F] = 0x38
    scale = np.repeat(exponents[:, None], 256 // 32, axis=1)
    expected = np.asarray(quant.dequant_fp8_weight(jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn)),
                                                   jnp.asarray(scale)).astype(jnp.float32))
    words = codes.view(np.uint32)  # little-endian: byte j of word w is code 4 w + j
    got = _natural(fl.dequant_pairs(jnp.asarray(words), jnp.asarray(scale), asm=False), codes.shape)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    scale_W = np.repeat(np.repeat(np.asarray(fl.scale_pair(jnp.asarray(scale))), 32, axis=0), 8, axis=1)
    gpu_form = []
    for j in range(2):
        bits = np.asarray(fl.pair_bits(jnp.asarray(words), j))
        halves = [(v >> np.uint32(16 * h)).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
                  for v in (bits, scale_W) for h in (0, 1)]
        low, high = halves[0] * halves[2], halves[1] * halves[3]  # exact products: no rounding to bf16 needed
        assert np.all((np.abs(low) >= 2.0 ** -126) | (low == 0)), "a weight below bf16's normal range"
        gpu_form.append(np.stack([low, high], axis=-1).reshape(codes.shape[0], -1))
    got = _natural(gpu_form, codes.shape)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def _weights(out_dim: int, in_dim: int, seed: int, exponents: tuple[int, int] = (110, 135)):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (out_dim, in_dim), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes (checkpoints have none)
    weight = jnp.asarray(codes.view(ml_dtypes.float8_e4m3fn))
    scale = jnp.asarray(rng.integers(*exponents, (-(-out_dim // 32), in_dim // 32), dtype=np.uint8))
    x = jnp.asarray(rng.standard_normal((0, in_dim)), jnp.bfloat16)
    return weight, scale, x


def assert_close_bf16(got: jax.Array, want: jax.Array, x_TI: jax.Array, weight_OI: jax.Array,
                      scale_BB: jax.Array) -> None:
    """The same exact products summed in another order: within one bf16 ulp of the output plus the accumulation's
    error, bounded by 2^-16 of the sum of |products| (fp32 sums in any order, and tensor cores, which align and
    truncate partial sums, stay far below it; a wrong scale or code is of the size of that sum); most identical."""
    g, w = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert not np.isnan(g).any(), "an output element was never written"
    x = np.abs(np.asarray(quant.fq8(x_TI).astype(jnp.float32)))
    wd = np.abs(np.asarray(quant.dequant_fp8_weight(weight_OI, scale_BB).astype(jnp.float32)))
    bound = np.abs(w) * np.float32(2.0 ** -7) + (x @ wd.T) * np.float32(2.0 ** -16)
    assert np.all(np.abs(g - w) <= bound), np.max(np.abs(g - w) / bound)
    assert np.mean(g == w) >= 0.9


@pytest.fixture
def poison(monkeypatch):  # and every token count through the kernel
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, poison=True, max_tokens=1 << 20))


@pytest.mark.parametrize("t, out_dim, in_dim, target", [(1, 64, 256, 264), (5, 96, 160, 264), (16, 256, 64, 1),
                                                        (70, 128, 96, 1), (70, 128, 96, 264)])
def test_pallas_matches_reference(monkeypatch, poison, t, out_dim, in_dim, target):
    """``target`` 1: no K split (bf16 out of the kernel); 264: K split into as many parts as it has slices."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, target_programs=target))
    weight, scale, _ = _weights(out_dim, in_dim, seed=t)
    x = jax.random.normal(jax.random.key(t), (t, in_dim), jnp.float32) * 3
    x = x.astype(jnp.bfloat16)
    assert_close_bf16(fl.fp8_linear_pallas(x, weight, scale), fl.fp8_linear_reference(x, weight, scale), x, weight,
                      scale)


@pytest.mark.parametrize("t, target", [(1, 264), (5, 1), (20, 264)])
def test_quantised_activations_are_taken_as_they_are(monkeypatch, poison, t, target):
    """``quantised`` x (``quant.fq8``'s values) with ``take_quantised``: the kernel skips its own fake-quantisation
    and gives the very bits it gives when it quantises (fq8 is idempotent), on one launch of two linears too."""
    weight, scale, _ = _weights(96, 160, seed=t + 2)
    x_act = quant.fq8((jax.random.normal(jax.random.key(t + 2), (t, 160), jnp.float32) * 3).astype(jnp.bfloat16))
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, target_programs=target))
    want = fl.fp8_linears(x_act, [(weight, scale), (weight, scale)], impl="pallas")
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, target_programs=target, take_quantised=True))
    got = fl.fp8_linears(x_act, [(weight, scale), (weight, scale)], impl="pallas", quantised=True)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert_close_bf16(got[0], fl.fp8_linear_reference(x_act, weight, scale), x_act, weight, scale)
    reference = fl.fp8_linears(x_act, [(weight, scale)], impl="reference", quantised=True)[0]
    np.testing.assert_array_equal(np.asarray(reference), np.asarray(fl.fp8_linear_reference(x_act, weight, scale)))


@pytest.mark.parametrize("wide_from", [1, 17])
def test_wide_and_narrow_column_tiles_agree_with_the_reference(monkeypatch, poison, wide_from):
    """Steps of ``wide_from`` tokens or more take ``wide_cols``-wide column tiles (here 64 against 32: two tiles
    against four of the 128 outputs); both tilings give the reference's values."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, cols=32, wide_cols=64, wide_from=wide_from))
    weight, scale, _ = _weights(128, 128, seed=11)
    x = (jax.random.normal(jax.random.key(11), (16, 128), jnp.float32) * 3).astype(jnp.bfloat16)
    assert_close_bf16(fl.fp8_linear_pallas(x, weight, scale), fl.fp8_linear_reference(x, weight, scale), x, weight,
                      scale)


@pytest.mark.parametrize("t, target", [(3, 1), (3, 264), (20, 264)])
def test_several_linears_in_one_launch(monkeypatch, poison, t, target):
    """Weights of 64, 96 and 32 outputs (32-wide column tiles for all) side by side in one grid, with K unsplit and
    split: each output is its reference's (poisoned outputs: every element written), and unsplit the very bits of
    the weight's launch alone."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, target_programs=target))
    pairs = [_weights(out_dim, 160, seed=out_dim)[:2] for out_dim in (64, 96, 32)]
    x = (jax.random.normal(jax.random.key(t), (t, 160), jnp.float32) * 3).astype(jnp.bfloat16)
    got = fl.fp8_linears(x, pairs, impl="pallas")
    assert [y.shape for y in got] == [(t, 64), (t, 96), (t, 32)]
    for (weight, scale), y in zip(pairs, got):
        assert_close_bf16(y, fl.fp8_linear_reference(x, weight, scale), x, weight, scale)
        if target == 1:
            np.testing.assert_array_equal(np.asarray(y), np.asarray(fl.fp8_linear_pallas(x, weight, scale)))


def test_several_linears_lower_to_one_kernel(lower_for_cuda, monkeypatch):
    """wq_a and wkv at decode: one Triton kernel, or with ``CONFIG.fuse`` off (the A/B setting) one each."""
    x = jax.ShapeDtypeStruct((1, 5120), jnp.bfloat16)
    args = [jax.ShapeDtypeStruct(shape, dtype) for o in (1280, 512)
            for shape, dtype in (((o, 5120), jnp.float8_e4m3fn), ((o // 32, 160), jnp.uint8))]
    for fuse, kernels in ((True, 1), (False, 2)):
        monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, fuse=fuse))
        text = lower_for_cuda(lambda x, *a: fl.fp8_linears_pallas(x, [a[:2], a[2:]], interpret=False), x, *args)
        assert text.count("xla.gpu.triton") == kernels


@pytest.mark.parametrize("out_dims, in_dim, rows, words", [
    ((64,), 256, 8, 1024), ((96, 32, 64), 160, 8, 1024), ((128,), 1024, 32, 1024),
    ((1280, 512), 512, 8, 1024), ((64, 32), 512, 4, 2048), ((96,), 256, 32, 4096)])
def test_matvec_matches_the_reference(monkeypatch, poison, out_dims, in_dim, rows, words):
    """One token on the mat-vec kernel (``CONFIG.matvec``): 8-row programs, 32-row programs, one launch of several
    weights, 4 rows a program with wide steps (``matvec_rows``, ``matvec_words``), and 32 rows over outputs of 96
    (three programs); each output is its reference's (poisoned: every element written)."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, **MATVEC_EVERYWHERE, matvec_rows=rows,
                                                          matvec_words=words))
    pairs = [_weights(o, in_dim, seed=o + in_dim)[:2] for o in out_dims]
    x = (jax.random.normal(jax.random.key(in_dim), (1, in_dim), jnp.float32) * 3).astype(jnp.bfloat16)
    got = fl.fp8_linears(x, pairs, impl="pallas")
    for (weight, scale), y in zip(pairs, got, strict=True):
        assert_close_bf16(y, fl.fp8_linear_reference(x, weight, scale), x, weight, scale)
    x_act = quant.fq8(x)  # quantised activations taken as they are: the same bits
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, take_quantised=True))
    for g, y in zip(fl.fp8_linears(x_act, pairs, impl="pallas", quantised=True), got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(y))


def test_matvec_rows_are_checked():
    for rows in (0, 3, 64):
        with pytest.raises(ValueError, match=r"matvec_rows must be one of \(1, 2, 4, 8, 16, 32\)"):
            dataclasses.replace(fl.CONFIG, matvec_rows=rows)


def test_matvec_reads_a_layer_of_a_stack_and_every_scale_exponent(monkeypatch, poison):
    """Layer 1 of a 3-layer stack read in place (``LayerSlice``), with scale bytes 0..246 across its blocks."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, **MATVEC_EVERYWHERE))
    layers = [_weights(64, 256, seed=20 + i)[:2] for i in range(3)]
    scale = jnp.asarray(np.arange(0, 247, 16, dtype=np.uint8)[:16].reshape(2, 8))
    layers[1] = (layers[1][0], scale)
    w_stack, s_stack = (jnp.stack([pair[k] for pair in layers]) for k in range(2))
    x = (jax.random.normal(jax.random.key(8), (1, 256), jnp.float32) * 3).astype(jnp.bfloat16)
    got = fl.fp8_linear(x, of_layer(w_stack, 1, 2), of_layer(s_stack, 1, 2), impl="pallas")
    assert_close_bf16(got, fl.fp8_linear_reference(x, layers[1][0], scale), x, layers[1][0], scale)


@pytest.mark.parametrize("out_dims, in_dim, matvec", [
    ((5120,), 8192, True), ((25600,), 6144, True), ((2304, 2304), 5120, True),  # wo_b, Engram wkv, shared w1 + w3
    ((32768,), 1280, False), ((1280, 512), 5120, False), ((5120,), 2304, False)])  # wq_b, wq_a + wkv, shared w2
def test_matvec_takes_the_launches_it_was_faster_at(lower_for_cuda, monkeypatch, out_dims, in_dim, matvec):
    """With ``CONFIG.matvec`` on, a one-token launch takes the mat-vec kernel only from ``matvec_min_in`` inputs and
    ``matvec_min_codes`` codes (the flash-slice shapes: where it measured faster), the dot kernel otherwise."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, matvec=True))
    x = jax.ShapeDtypeStruct((1, in_dim), jnp.bfloat16)
    args = [jax.ShapeDtypeStruct(shape, dtype) for o in out_dims
            for shape, dtype in (((o, in_dim), jnp.float8_e4m3fn), ((o // 32, in_dim // 32), jnp.uint8))]
    text = lower_for_cuda(lambda x, *a: fl.fp8_linears_pallas(x, [a[i:i + 2] for i in range(0, len(a), 2)],
                                                             interpret=False), x, *args)
    assert ("fp8_matvec" in text) == matvec, text.count("xla.gpu.triton")


def test_matvec_lowers_to_triton_without_a_gpu(lower_for_cuda, monkeypatch):
    """wq_a and wkv at one token on the mat-vec kernel: one Triton kernel, its e4m3 pairs converted by PTX."""
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, **MATVEC_EVERYWHERE))
    x = jax.ShapeDtypeStruct((1, 5120), jnp.bfloat16)
    args = [jax.ShapeDtypeStruct(shape, dtype) for o in (1280, 512)
            for shape, dtype in (((o, 5120), jnp.float8_e4m3fn), ((o // 32, 160), jnp.uint8))]
    text = lower_for_cuda(lambda x, *a: fl.fp8_linears_pallas(x, [a[:2], a[2:]], interpret=False), x, *args)
    assert text.count("xla.gpu.triton") == 1 and "fp8_matvec" in text


def test_every_scale_exponent_in_range(monkeypatch, poison):
    """Scale exponents 0..246 (the interpreted kernel's exact range; the GPU form's is narrower:
    ``test_pair_decode_is_exact_for_every_code_and_scale_in_range``), several per tile row."""
    weight, _, _ = _weights(64, 8 * 32, seed=9)
    scale = jnp.asarray(np.arange(0, 247, 16, dtype=np.uint8)[:16].reshape(2, 8))
    x = jax.random.normal(jax.random.key(3), (4, 256), jnp.bfloat16)
    assert_close_bf16(fl.fp8_linear_pallas(x, weight, scale), fl.fp8_linear_reference(x, weight, scale), x, weight,
                      scale)


def test_seam_shapes_fallback_and_errors(monkeypatch):
    weight, scale, _ = _weights(48, 64, seed=2)  # O not a multiple of 32: the reference serves it
    x = jax.random.normal(jax.random.key(0), (2, 3, 64), jnp.bfloat16)
    got = fl.fp8_linear(x, weight, scale, impl="pallas")
    assert got.shape == (2, 3, 48)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(fl.fp8_linear(x, weight, scale)))
    assert fl.fp8_linear(x[:, :0], weight, scale, impl="pallas").shape == (2, 0, 48)
    weight, scale, _ = _weights(64, 64, seed=3)  # more tokens than CONFIG.max_tokens: the reference serves them
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, max_tokens=4))
    np.testing.assert_array_equal(np.asarray(fl.fp8_linear(x, weight, scale, impl="pallas")),
                                  np.asarray(fl.fp8_linear(x, weight, scale)))
    with pytest.raises(ValueError, match="fp8 linear impl must be one of"):
        fl.fp8_linear(x, weight, scale, impl="triton")
    # several linears, one of which the kernel cannot take (48 outputs): each runs alone, on its own path
    odd, odd_scale, _ = _weights(48, 64, seed=2)
    monkeypatch.setattr(fl, "CONFIG", dataclasses.replace(fl.CONFIG, max_tokens=32))
    got = fl.fp8_linears(x, [(weight, scale), (odd, odd_scale)], impl="pallas")
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(fl.fp8_linear(x, weight, scale, impl="pallas")))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(fl.fp8_linear(x, odd, odd_scale)))


def test_every_fp8_linear_of_the_model_goes_through_the_seam(tiny_nodrop, monkeypatch):
    """Trace the tiny-nodrop step with ``linear_impl='pallas'``: every fp8 linear's weight shape (attention, indexer,
    shared expert, Engram projection) reaches the kernel seam, and nothing else does."""
    fixture, params, consts = tiny_nodrop
    cfg = fixture.cfg
    seen = set()

    def record(x_TI, pairs, joined, quantised):
        seen.update(weight_OI.shape for weight_OI, _ in pairs)
        return fl.fp8_linears_reference(x_TI, pairs, joined, quantised)

    monkeypatch.setitem(fl._IMPLEMENTATIONS, "pallas", record)
    chunks = [SeqChunk(slot=0, block_table=[0, 1], start=0, tokens=list(range(3, 20)), logits="all")]
    batch, _ = build_step(chunks, 32, 2, 2, 32)
    cache = init_cache(cfg, CacheSpec(num_blocks=4, num_slots=2, block_size=16))
    jax.eval_shape(functools.partial(forward_step, cfg=cfg, linear_impl="pallas"), params, cache, batch, consts)
    fp8_linears = {leaf.shape[-2:] for path, leaf in nnx.to_flat_state(params)
                   if leaf.get_value().dtype == jnp.float8_e4m3fn and "experts" not in path and "embed" not in path}
    assert len(fp8_linears) >= 5 and seen == fp8_linears


@pytest.mark.parametrize("t, out_dim, in_dim", [(1, 512, 5120), (64, 5120, 8192), (8, 96, 160)])
def test_lowers_to_triton_without_a_gpu(lower_for_cuda, monkeypatch, t, out_dim, in_dim):
    """Both output forms (bf16, and split K's fp32 partial sums), the poisoned output and quantised activations
    taken as they are lower to Triton IR."""
    x = jax.ShapeDtypeStruct((t, in_dim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((out_dim, in_dim), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((out_dim // 32, in_dim // 32), jnp.uint8)
    for config in (dataclasses.replace(fl.CONFIG, max_tokens=t),
                   dataclasses.replace(fl.CONFIG, max_tokens=t, target_programs=1, poison=True),
                   dataclasses.replace(fl.CONFIG, max_tokens=t, take_quantised=False)):
        monkeypatch.setattr(fl, "CONFIG", config)
        fn = functools.partial(fl.fp8_linear_pallas, interpret=False, quantised=True)
        assert "triton" in lower_for_cuda(fn, x, w, s)
