"""The hyper-connection mix's split (v41_spec §8): a token's raw mixes -> pre [C], post [C] and the
Sinkhorn-normalised comb [C, C]: sigmoids, a softmax per comb row, a column normalisation, then (iters - 1) rounds
of row and column normalisation, every division by (sum + eps), sums taken strictly left to right (the reference's
order).

Two implementations behind ``split(..., impl=)``, with one signature:
  * ``"reference"``: jnp, a ``fori_loop`` over the rounds. On a GPU the rounds alone were ~680 of the tiny
    default's ~690 kernels before the kernel existed (docs/benchmarks.md), and the sigmoids, the softmax and the
    divisions around them ~5 launches per hyper-connection more;
  * ``"pallas"``: one Triton-lowered Pallas kernel. Each program holds BLOCK_T tokens; the M mix entries of a token
    live in M register vectors (entry e of the block's tokens a strided column load of the [T, M] mixes, then the
    affine part, mixes * scale + base), so a row or column sum is C - 1 vector adds in the reference's order. It
    writes pre [T, C] to a buffer of its own (the collapse kernel's input: a slice would be a copy) and post and comb
    token-major likewise, [T, M - C], column slices that fuse into their consumers; above ``TOKEN_MAJOR_MAX_TOKENS``
    tokens [M - C, T], which keeps long prefills' temporaries lower. (Until the thirty-eighth session the affine part
    ran in XLA, fused with a transpose to [M, T] and a pad, and the output was [M, T]: one launch more a
    hyper-connection, and in the tiny decode step two transpose kernels a layer for the consumers, deviceless.)

Division in the kernel. Triton lowers ``x / y`` in float32 to the approximate ``div.full.f32``; the reference (and
XLA) divide with correct rounding. PTX's ``div.rn.f32`` is correct, but ptxas wraps each one in a branch to a slow
path (taken when its ``FCHK`` range check fails) with a reconvergence barrier, so the kernel's 2 C^2 divisions per
round run one after another: 25 us per launch on the H200 at 1 and at 32 tokens (second session's profile; the
tiny decode step makes 18 launches). With ``SinkhornConfig.fast_divide`` (the default) the kernel runs that
branch's fast path itself, branch-free: per divisor one refined reciprocal (``rcp.approx`` and one Newton step, 2
FMAs), per quotient the product and one FMA-residual correction: the very instructions ``div.rn.f32`` executes when
its check passes (read in the SASS), so the same bits, and independent divisions overlap. The fast path is
correctly rounded only inside a range, so the kernel keeps the smallest dividend and the largest divisor it divided
by (a min / max per division) and, if any token of the program left a narrower range of its own (``FAST_RANGE``),
computes its block again with ``div.rn.f32``: exact in every case, and fast in the model's (entries are softmax rows
plus eps). Interpret mode (CPU tests) divides with ``/``, which is IEEE-rounded there, on every path.

The sigmoids are ``1 / (1 + exp(-z))`` (``exp(z) / (1 + exp(z))`` below 0) through the same divisions, and
``exp`` is libdevice's ``__nv_expf`` (Pallas' Triton lowering); XLA's ``logistic`` and ``exp`` on the GPU are other
code, so pre, post and comb agree with the reference to float32 ulps, not bit for bit (on the H200 up to 3 ulps in
pre and post and 4-44 in the comb; tests/gpu/test_sinkhorn_gpu.py prints them).

The mixes themselves (``mixes_reference``: the projection of a token's C * D stream values by fn, times their RMS
statistic, then the split) run in XLA around the split kernel: 7-8 launches a hyper-connection at decode sizes.
``mixes_pallas`` takes a decode step's (up to ``MIXES_MAX_TOKENS`` tokens) in two: a projection kernel whose
programs each take a part of K (fp32 products and sums, the sums of squares in the same pass), then the split
kernel with a prologue that adds the parts in order and applies the statistic and the affine. It runs where
it paid on an H100: decode steps of up to 16 tokens of streams up to 4096 values wide (``SinkhornConfig``). At
flash-slice's width a one-token step's projection and squares as one XLA reduction into 16 partial sums, added by
this kernel, took 34 launches off the step but no device time (forty-sixth session, H100: the split kernel and
the hyper-connection outputs' own converts gained what the reductions lost); removed.

Letters: T tokens, C hc copies, M = (2 + C) * C mix entries, P = M rounded up to a power of two (Triton's block),
K = C * D stream values of a token, S parts of K, N token columns (T rounded up to a power of two, at least 16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode
from dijax.kernels.division import asm_f32, div_rn, rms_factor_rn
from dijax.kernels.numerics import divide, matmul_f32, rms_factor, sum_in_order

BLOCK_T = 128
IMPLS = ("reference", "pallas")


@dataclasses.dataclass(frozen=True)
class SinkhornConfig:
    """fast_divide: divide by ``div.rn.f32``'s fast path, branch-free, with the exact fallback for blocks outside
    its range (module docstring); else ``div.rn.f32`` throughout. Both give the same bits (tests/gpu/
    test_sinkhorn_gpu.py); on the H200 the fast form of the rounds-only kernel took 41-51 us a launch against 52-58
    (``tools/bench_kernels.py --only sinkhorn``, docs/benchmarks.md), so it is the default."""
    fast_divide: bool = True
    # mixes_pallas (the projection, its RMS statistic and the split in two launches) for steps of up to
    # fused_mixes_max_tokens tokens (at most MIXES_MAX_TOKENS; 0: off) whose streams are at most
    # fused_mixes_max_width values (C * D) wide. Thirty-sixth session, on an H100 (docs/benchmarks.md): tiny (C * D
    # = 1024) decode B=1 1.97 -> 1.58 ms back to back with it on, while at flash-slice's width (20480) its 32
    # projection programs lost to XLA's split-K GEMM (B=1 3.27 -> 3.60 ms, B=64 19.61 -> 20.20 ms); at tiny's B=64
    # XLA's own path is already short (deviceless: 680 -> 685 launches with it on). Thirty-seventh session, same
    # card kind, alternating over two rounds: B=1 median 1.94 / 2.01 ms off against 1.81 / 1.78 on, B=16 1.99 /
    # 1.97 against 1.87 / 1.93, and on up to 128 tokens B=64 went 2.25 -> 2.48 / 3.02. By GPU time alone the pair
    # is slower than XLA's path even at C * D = 1024 (14.2 against 8.1 us a call at T=1): it pays in launches,
    # which bound the tiny step; a prologue loading 8 parts at once was slower still at every shape (removed), and
    # one loading each part a step ahead took the same time (H100, forty-second session: device busy 773 against 767
    # us a tiny B=1 step; removed). Fewer parts (8, 2) made the split faster and the projection slower by more.
    fused_mixes_max_tokens: int = 16
    fused_mixes_max_width: int = 4096

    def __post_init__(self):
        for name in ("fused_mixes_max_tokens", "fused_mixes_max_width"):
            if getattr(self, name) < 0:
                raise ValueError(f"SinkhornConfig.{name} must be >= 0 (0: off), got {getattr(self, name)}")


CONFIG = SinkhornConfig()


def affine(mixes_TM: jax.Array, scale_3: jax.Array, base_M: jax.Array, hc_mult: int) -> jax.Array:
    """``mixes * scale + base`` in float32, entry e of the pre / post / comb parts scaled by scale_3[0 / 1 / 2].
    mixes_TM [T, M], scale_3 float32 [3], base_M float32 [M] -> float32 [T, M]."""
    c = hc_mult
    scale_M = jnp.repeat(scale_3, np.array([c, c, c * c]), total_repeat_length=(2 + c) * c)
    return mixes_TM.astype(jnp.float32) * scale_M + base_M


def split_reference(mixes_TM: jax.Array, scale_3: jax.Array, base_M: jax.Array, hc_mult: int, iters: int,
                    eps: float, squares_T1: jax.Array | None = None, width: int = 0,
                    norm_eps: float = 0.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw mixes [T, M] -> (pre [T, C], post [T, C], comb [T, C, C]), float32.

    pre = sigmoid(z) + eps, post = 2 sigmoid(z), comb[i, j] = softmax_j(row i) + eps, then a column normalisation,
    then ``iters - 1`` rounds of (row, column) normalisation, each dividing by (sum + eps); the last operation is
    always a column one. z = ``affine(mixes, scale, base)``; with ``squares_T1`` (float32 [T, 1], each token's sum of
    x^2 over its ``width`` stream values) the raw mixes are ``mixes * rms_factor(squares_T1, width, norm_eps)``
    (``mixes_projection``'s bare product: the kernel applies the factor in its prologue)."""
    if squares_T1 is not None:
        mixes_TM = mixes_TM * rms_factor(squares_T1, width, norm_eps)
    c = hc_mult
    z_TM = affine(mixes_TM, scale_3, base_M, c)
    eps = np.float32(eps)
    pre = jax.nn.sigmoid(z_TM[..., :c]) + eps
    post = 2 * jax.nn.sigmoid(z_TM[..., c:2 * c])
    comb = z_TM[..., 2 * c:].reshape(*z_TM.shape[:-1], c, c)
    comb = jnp.exp(comb - jnp.max(comb, axis=-1, keepdims=True))
    comb = divide(comb, sum_in_order(comb, -1)) + eps
    comb = divide(comb, sum_in_order(comb, -2) + eps)
    return pre, post, sinkhorn_reference(comb, iters - 1, eps)


def sinkhorn_reference(comb_TCC: jax.Array, rounds: int, eps: float) -> jax.Array:
    """``rounds`` rounds of (row, column) normalisation. comb_TCC: float32 [T, C, C] -> float32 [T, C, C]."""
    eps = np.float32(eps)

    def row_then_column(_, comb):
        comb = divide(comb, sum_in_order(comb, -1) + eps)
        return divide(comb, sum_in_order(comb, -2) + eps)

    return jax.lax.fori_loop(0, rounds, row_then_column, comb_TCC)


FAST_RANGE = (2.0 ** -40, 2.0 ** 40)  # dividends >= the first, divisors < the second: the fast path's range here


def _reciprocal(y: jax.Array) -> jax.Array:
    """``div.rn.f32``'s reciprocal of ``y``: ``rcp.approx`` refined by one Newton step (its fast path's first three
    instructions)."""
    return asm_f32("{ .reg .f32 n, r, e; neg.f32 n, $1; rcp.approx.ftz.f32 r, $1; "
                   "fma.rn.f32 e, n, r, 0f3F800000; fma.rn.f32 $0, r, e, r; }", y)


def _fast_divide(x: jax.Array, y: jax.Array, r: jax.Array) -> jax.Array:
    """``div.rn.f32``'s fast-path quotient x / y given ``r = _reciprocal(y)``: q = x r, then q + r (x - y q) by FMA.
    Correctly rounded inside ``FAST_RANGE`` (``_rounds``)."""
    return asm_f32("{ .reg .f32 n, q, d; neg.f32 n, $2; fma.rn.f32 q, $1, $3, 0f00000000; "
                   "fma.rn.f32 d, n, q, $1; fma.rn.f32 $0, $3, d, q; }", x, y, r)


def _split(z: list, *, c: int, rounds: int, eps: np.float32, reciprocal, divide, check: bool):
    """``split_reference`` on entry vectors: z[e] the affine mix entry e of every token (a vector). Every division
    is ``divide(x, y, reciprocal(y))``; the rounds are a loop (unrolled, 19 rounds of C = 4 were ~13k SASS
    instructions and ~30 s of Triton compilation per step shape). -> (pre, post, comb: lists of C, C, and C x C
    vectors; with ``check``: per token, whether every division had a dividend >= FAST_RANGE[0] and a divisor <
    FAST_RANGE[1], a bool vector; else None). Within that range the fast path is correctly rounded: every operand,
    intermediate and quotient (>= 2^-80) is a normal float32. A comb dividend is at most its divisor (non-negative
    entries), so the divisors' maximum bounds both, and a sigmoid's dividend is at most 1."""

    def normalise(values: list, total, seen):
        """values / total, and ``seen`` (the smallest dividend, the largest divisor so far, per token) updated."""
        if check:
            low, high = seen
            seen = (jnp.minimum(low, functools.reduce(jnp.minimum, values)), jnp.maximum(high, total))
        r = reciprocal(total)
        return [divide(v, total, r) for v in values], seen

    def total(values: list, plus=None):
        s = functools.reduce(lambda a, b: a + b, values)
        return s if plus is None else s + plus

    def rows_then_columns(m: list, seen, rows: bool):
        m = [list(row) for row in m]
        if rows:
            for i in range(c):
                m[i], seen = normalise(m[i], total(m[i], eps), seen)
        for j in range(c):
            column, seen = normalise([m[i][j] for i in range(c)], total([m[i][j] for i in range(c)], eps), seen)
            for i in range(c):
                m[i][j] = column[i]
        return m, seen

    def sigmoid(v, seen):  # e / (1 + e) below 0, 1 / (1 + e) above, with e = exp(-|v|): no cancellation either side
        e = jnp.exp(-jnp.abs(v))
        [out], seen = normalise([jnp.where(v >= 0, np.float32(1), e)], np.float32(1) + e, seen)
        return out, seen

    seen = (jnp.full_like(z[0], np.inf), jnp.full_like(z[0], -np.inf)) if check else None
    pre, post = [], []
    for k in range(c):
        value, seen = sigmoid(z[k], seen)
        pre.append(value + eps)
    for k in range(c):
        value, seen = sigmoid(z[c + k], seen)
        post.append(2 * value)
    m = [[z[2 * c + i * c + j] for j in range(c)] for i in range(c)]
    for i in range(c):
        peak = functools.reduce(jnp.maximum, m[i])
        row = [jnp.exp(v - peak) for v in m[i]]
        row, seen = normalise(row, total(row), seen)
        m[i] = [v + eps for v in row]
    m, seen = rows_then_columns(m, seen, rows=False)
    m, seen = jax.lax.fori_loop(0, rounds, lambda _, carry: rows_then_columns(*carry, rows=True), (m, seen))
    if not check:
        return pre, post, m, None
    lo, hi = (np.float32(v) for v in FAST_RANGE)
    return pre, post, m, (seen[0] >= lo) & (seen[1] < hi)  # a NaN compares false: the exact path


def _affine_entries(raw: list, scale_ref, base_ref, c: int) -> list:
    """``affine`` inside a kernel: raw[e] the raw mix entry e of a block's tokens (a float32 vector) -> z[e]."""
    scales = [scale_ref[0], scale_ref[1], scale_ref[2]]
    return [v * scales[min(e // c, 2)] + base_ref[e] for e, v in enumerate(raw)]


def _split_kernel(mixes_ref, *refs, width: int, norm_eps: float, **split):
    """Program i: the BLOCK_T tokens [i * BLOCK_T, ...) of mixes_ref [T, M] (rows past T read token T - 1 and are
    not written: a duplicate leaves the block's fast-range check as it was). refs: the sums of squares [T] where the
    mixes are a bare projection (``split_pallas``' squares_T1), then scale [3], base [M] and the outputs
    (``_split_block``)."""
    *squares, scale_ref, base_ref, pre_ref, out_ref = refs
    c, t = split["c"], mixes_ref.shape[0]
    safe_N = jnp.minimum(pl.program_id(0) * BLOCK_T + jnp.arange(BLOCK_T), t - 1)
    raw = [pltriton.load(mixes_ref.at[safe_N, jnp.full((BLOCK_T,), e)]) for e in range((2 + c) * c)]
    if squares:
        rsqrt_N = rms_factor_rn(pltriton.load(squares[0].at[safe_N]), width, norm_eps, split["interpret"])
        raw = [v * rsqrt_N for v in raw]
    _split_block(_affine_entries(raw, scale_ref, base_ref, c), pre_ref, out_ref, pl.program_id(0), **split)


def _split_block(z: list, pre_ref, out_ref, block: int, *, c: int, rounds: int, eps: float, interpret: bool,
                 fast_divide: bool, token_major: bool):
    """The split of block ``block`` of tokens: z[e] the affine mix entry e of each of its N tokens (a float32
    vector); of tokens [block * N, (block + 1) * N) (tokens past T are not written), pre_ref [T, C] gets their pre,
    out_ref [T, M - C] (``token_major``, else [M - C, T]) their post and comb as entries 0 .. M - C - 1. (pre has a
    buffer of its own: ``dijax.kernels.collapse``'s kernel reads it, and a slice of one output would be a copy.)"""
    split_of = functools.partial(_split, z, c=c, rounds=rounds, eps=np.float32(eps))
    if interpret:  # '/' is IEEE-rounded off the GPU: every path divides with it
        fast, exact, reciprocal = (lambda x, y, r: x / y), (lambda x, y: x / y), (lambda y: y)
    else:
        fast, exact, reciprocal = _fast_divide, div_rn, _reciprocal
    exact_split = functools.partial(split_of, reciprocal=lambda y: y, divide=lambda x, y, r: exact(x, y),
                                    check=False)
    if fast_divide:
        *parts, inside = split_of(reciprocal=reciprocal, divide=fast, check=True)
        # a division of the block outside the fast range: the block again, exact throughout
        parts = jax.lax.cond(jnp.min(inside.astype(jnp.int32)) == 1, lambda: parts,
                             lambda: list(exact_split()[:3]))
    else:
        parts = exact_split()[:3]
    pre, post, m = parts
    n = z[0].shape[0]
    # rows past T keep their own indices, masked: clamped duplicates of a live row would overwrite it, interpreted
    token_N = block * n + jnp.arange(n)
    live_N = token_N < pre_ref.shape[0]
    for e, v in enumerate(pre):
        pltriton.store(pre_ref.at[token_N, jnp.full((n,), e)], v, mask=live_N)
    for e, v in enumerate([*post, *(v for row in m for v in row)]):
        index = (token_N, jnp.full((n,), e)) if token_major else (jnp.full((n,), e), token_N)
        pltriton.store(out_ref.at[index], v, mask=live_N)


def _parts(pre_TC: jax.Array, out: jax.Array, c: int, token_major: bool = True
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A split kernel's outputs (pre float32 [T, C]; post then comb, [T, M - C] a token a row, or [M - C, T]) as
    (pre [T, C], post [T, C], comb [T, C, C])."""
    out_TE = out if token_major else out.T
    return pre_TC, out_TE[:, :c], out_TE[:, c:].reshape(-1, c, c)


# ``split_pallas`` writes [T, M] for steps of up to this many tokens (its consumers then need no transposes; with
# [M, T], as before the thirty-eighth session, deviceless flash-slice prefill 1024 had 766 launches against 736),
# [M, T] above (flash-slice's prefill of 8192 tokens needed 3.29 GB of temporaries with [T, M], 3.04 with [M, T])
TOKEN_MAJOR_MAX_TOKENS = 1024


def entry_major(tokens: int) -> bool:
    """Whether ``split_pallas`` writes its output entry-major ([M, T]) in a step of ``tokens`` tokens. The stream
    sums that read the split's output (``dijax.kernels.collapse.collapse``, ``dijax.model.hc.post``) take
    ``sum_in_order``'s axis-first form there: either form beside the other's kernel output gave XLA more launches
    (deviceless, thirty-eighth session: tiny prefill 256 728 against 668, flash-slice prefill 1024 782 against
    736)."""
    return tokens > TOKEN_MAJOR_MAX_TOKENS


@functools.partial(jax.jit, static_argnames=("hc_mult", "iters", "eps", "width", "norm_eps", "interpret", "config"))
def split_pallas(mixes_TM: jax.Array, scale_3: jax.Array, base_M: jax.Array, hc_mult: int, iters: int,
                 eps: float, squares_T1: jax.Array | None = None, width: int = 0, norm_eps: float = 0.0,
                 interpret: bool | None = None,
                 config: SinkhornConfig | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Same contract as ``split_reference``, one kernel launch (the affine part in the kernel; the thirty-seventh
    session's form ran it, transposed and padded, as an XLA fusion of its own: one launch more a hyper-connection).
    ``interpret``: run the kernel interpreted (default: off a GPU); ``config``: default ``CONFIG`` (read when a
    shape is first traced). With ``squares_T1`` the kernel applies the RMS factor to the mixes first
    (``split_reference``): in XLA the mean, rsqrt and product after the reduction were a launch of their own.
    Jitted, as every kernel's entry point: a step makes this call twice per layer with one shape, and the jit cache
    traces and lowers the kernel once per step shape."""
    interpret = interpret_mode(interpret)
    c = hc_mult
    t, m = mixes_TM.shape
    if t == 0:  # no program to launch
        return _parts(jnp.zeros((0, c), jnp.float32), jnp.zeros((0, m - c), jnp.float32), c)
    token_major = not entry_major(t)
    kernel = functools.partial(_split_kernel, width=width, norm_eps=norm_eps, c=c, rounds=max(iters - 1, 0), eps=eps,
                               interpret=interpret, fast_divide=(config or CONFIG).fast_divide,
                               token_major=token_major)
    out_shape = (jax.ShapeDtypeStruct((t, c), jnp.float32),
                 jax.ShapeDtypeStruct((t, m - c) if token_major else (m - c, t), jnp.float32))
    pre_TC, out = pl.pallas_call(kernel, grid=(-(-t // BLOCK_T),), out_shape=out_shape, interpret=interpret,
                                 compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(
        mixes_TM.astype(jnp.float32), *([] if squares_T1 is None else [squares_T1.reshape(t).astype(jnp.float32)]),
        scale_3.astype(jnp.float32), base_M.astype(jnp.float32))
    return _parts(pre_TC, out, c, token_major)


def sum_squares(x_TK: jax.Array) -> jax.Array:
    """Each token's sum of x^2 over its C * D stream values, float32 [T, 1]."""
    return jnp.sum(jnp.square(x_TK.astype(jnp.float32)), axis=-1, keepdims=True)


def mixes_projection(x_TK: jax.Array, fn_MK: jax.Array) -> jax.Array:
    """x @ fn.T in float32 (exact bf16 -> float32 x, float32 products and sums). x_TK [T, C * D], fn_MK float32
    [M, C * D] -> float32 [T, M]."""
    return matmul_f32(x_TK.astype(jnp.float32), fn_MK)


def mixes_reference(x_TK: jax.Array, fn_MK: jax.Array, scale_3: jax.Array, base_M: jax.Array, hc_mult: int,
                    iters: int, hc_eps: float, norm_eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A hyper-connection's mixes (v41_spec §8, ``dijax.model.hc.mixes``): ``mixes_projection`` and
    ``sum_squares``, then ``split_reference`` (the projection times the RMS factor, then the split). x_TK bf16
    [T, C * D], fn_MK float32 [M, C * D] -> (pre [T, C], post [T, C], comb [T, C, C]) float32."""
    return split_reference(mixes_projection(x_TK, fn_MK), scale_3, base_M, hc_mult, iters, hc_eps, sum_squares(x_TK),
                           x_TK.shape[-1], norm_eps)


MIXES_CHUNK = 64  # K columns a step of mixes_pallas' projection kernel at up to 16 tokens (its operands' multiple)
MIXES_MAX_SPLITS = 32  # its programs (each a part of K), a power of two
MIXES_MAX_TOKENS = BLOCK_T  # its split runs as one program


def fused_mixes(tokens: int, width: int, config: SinkhornConfig | None = None) -> bool:
    """Whether ``mixes_pallas`` takes a step of ``tokens`` tokens whose streams are ``width`` (C * D) values wide
    (``SinkhornConfig.fused_mixes_max_tokens`` and ``fused_mixes_max_width``)."""
    config = config or CONFIG
    return (0 < tokens <= min(config.fused_mixes_max_tokens, MIXES_MAX_TOKENS)
            and width <= config.fused_mixes_max_width)


def project_tiling(n: int) -> tuple[int, int]:
    """(K columns a step, warps) of the projection kernel for ``n`` token columns: its x tile [n, columns] and the
    fp32 dot's operands fit in registers (sm_90 builds, tools/kernel_report.py: 128 columns spilled at 16 tokens,
    64 at 64 tokens)."""
    return (MIXES_CHUNK, 4) if n <= 16 else (MIXES_CHUNK // 2, 4 if n <= 32 else 8)


def _project_kernel(x_ref, fn_ref, out_ref, *, t: int, m: int, chunks: int, chunk: int):
    """Program s: x @ fn.T over its ``chunks`` K chunks, float32 [P, N] (mix rows, token columns), with each
    token's sum of x^2 over them in row ``m``. x_ref bf16 [T, K] and fn_ref float32 [M, K] whole (rows past T / M
    are not loaded: zeros)."""
    p, n = out_ref.shape
    row_N = jnp.arange(n)
    live_NC, safe_N1 = jnp.broadcast_to((row_N < t)[:, None], (n, chunk)), jnp.minimum(row_N, t - 1)[:, None]
    mix_P = jnp.arange(p)
    live_PC, safe_P1 = jnp.broadcast_to((mix_P < m)[:, None], (p, chunk)), jnp.minimum(mix_P, m - 1)[:, None]
    first = pl.program_id(0) * chunks

    def step(j, carry):
        acc_PN, squares_N = carry
        col_1C = ((first + j) * chunk + jnp.arange(chunk))[None, :]
        x_NC = pltriton.load(x_ref.at[safe_N1, col_1C], mask=live_NC, other=0).astype(jnp.float32)
        fn_PC = pltriton.load(fn_ref.at[safe_P1, col_1C], mask=live_PC, other=0)
        acc_PN = acc_PN + lax.dot_general(fn_PC, x_NC, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                          preferred_element_type=jnp.float32)
        return acc_PN, squares_N + jnp.sum(x_NC * x_NC, axis=1)

    acc_PN, squares_N = lax.fori_loop(0, chunks, step, (jnp.zeros((p, n), jnp.float32), jnp.zeros((n,), jnp.float32)))
    out_ref[...] = jnp.where(mix_P[:, None] == m, squares_N[None, :], acc_PN)


def _mixes_split_kernel(part_ref, scale_ref, base_ref, pre_ref, out_ref, *, m: int, k: int, norm_eps: float,
                        **split):
    """The projection kernel's parts summed in order, the RMS statistic, the affine, then ``_split_block``."""
    c, n = split["c"], part_ref.shape[2]
    total = lax.fori_loop(0, part_ref.shape[0], lambda s, acc: [a + part_ref[s, e, :] for e, a in enumerate(acc)],
                          [jnp.zeros((n,), jnp.float32)] * (m + 1))
    rsqrt_N = rms_factor_rn(total[m], k, norm_eps, split["interpret"])
    z = _affine_entries([total[e] * rsqrt_N for e in range(m)], scale_ref, base_ref, c)
    _split_block(z, pre_ref, out_ref, 0, **split)


@functools.partial(jax.jit, static_argnames=("hc_mult", "iters", "hc_eps", "norm_eps", "interpret", "config"))
def mixes_pallas(x_TK: jax.Array, fn_MK: jax.Array, scale_3: jax.Array, base_M: jax.Array, hc_mult: int,
                 iters: int, hc_eps: float, norm_eps: float, interpret: bool | None = None,
                 config: SinkhornConfig | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``mixes_reference`` in two Triton-lowered launches, for decode-sized steps (T <= ``MIXES_MAX_TOKENS``):
    a projection kernel whose S programs each take a part of K (x @ fn.T and the sums of x^2, float32 [S, P, N]),
    then ``split_pallas``' kernel with a prologue that sums the parts, applies the RMS statistic and the affine.
    XLA's path takes 7-8 launches a hyper-connection for the same (an fp32 copy of x, the split-K GEMM and its
    reduction, the two-stage sum of squares, the affine-and-transpose pad, the split). The sums run in another
    order than XLA's: float32 rounding apart, the same values."""
    interpret, config = interpret_mode(interpret), config or CONFIG
    c = hc_mult
    (t, k), m = x_TK.shape, fn_MK.shape[0]
    if t == 0:
        return _parts(jnp.zeros((0, c), jnp.float32), jnp.zeros((0, m - c), jnp.float32), c)
    if t > MIXES_MAX_TOKENS or k % MIXES_CHUNK or m != (2 + c) * c:
        raise ValueError(f"mixes_pallas: T {t} must be at most {MIXES_MAX_TOKENS}, K {k} a multiple of "
                         f"{MIXES_CHUNK} and M {m} equal to (2 + C) * C = {(2 + c) * c}")
    n, p = max(16, pl.next_power_of_2(t)), pl.next_power_of_2(m + 1)  # + 1: the row of the sums of x^2
    chunk, warps = project_tiling(n)
    chunks = k // chunk
    splits = max(s for s in (1, 2, 4, 8, 16, MIXES_MAX_SPLITS) if chunks % s == 0)
    part_SPN = pl.pallas_call(
        functools.partial(_project_kernel, t=t, m=m, chunks=chunks // splits, chunk=chunk), grid=(splits,),
        out_specs=pl.BlockSpec((None, p, n), lambda s: (s, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, p, n), jnp.float32), interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=2))(x_TK, fn_MK)
    kernel = functools.partial(_mixes_split_kernel, m=m, k=k, norm_eps=norm_eps, c=c, rounds=max(iters - 1, 0),
                               eps=hc_eps, interpret=interpret, fast_divide=config.fast_divide, token_major=True)
    out_shape = (jax.ShapeDtypeStruct((t, c), jnp.float32), jax.ShapeDtypeStruct((t, m - c), jnp.float32))
    pre_TC, out_TE = pl.pallas_call(kernel, grid=(1,), out_shape=out_shape, interpret=interpret,
                                    compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(
        part_SPN, scale_3.astype(jnp.float32), base_M.astype(jnp.float32))
    return _parts(pre_TC, out_TE, c)


_IMPLEMENTATIONS = {"reference": split_reference, "pallas": split_pallas}


def split(mixes_TM: jax.Array, scale_3: jax.Array, base_M: jax.Array, hc_mult: int, iters: int, eps: float,
          squares_T1: jax.Array | None = None, width: int = 0, norm_eps: float = 0.0, *,
          impl: str = "reference") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dispatch to the implementation ``impl`` (one of IMPLS): raw mixes [T, M] (with ``squares_T1``, a bare
    projection and its tokens' sums of squares over ``width`` values: ``split_reference``) -> (pre [T, C], post
    [T, C], comb [T, C, C]) float32."""
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"sinkhorn impl must be one of {IMPLS}, got {impl!r}")
    return _IMPLEMENTATIONS[impl](mixes_TM, scale_3, base_M, hc_mult, iters, eps, squares_T1, width, norm_eps)
