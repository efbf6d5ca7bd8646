"""The Sinkhorn rounds of the hyper-connection mix (v41_spec §8): alternate row and column normalisation of each
token's C x C matrix, every division by (sum + eps), sums taken strictly left to right (the reference's order).

Two implementations behind ``sinkhorn(..., impl=)``:
  * ``"reference"``: jnp, a ``fori_loop`` over the rounds. On a GPU each round is its own kernel launch, so the
    (iters - 1) rounds x 2 sublayers x every layer dominate a small model's step (the tiny default: ~680 of its ~690
    kernels, measured on an H200, docs/benchmarks.md);
  * ``"pallas"``: one Triton-lowered Pallas kernel for all rounds. Each program holds BLOCK_T tokens; the C * C
    entries of a token live in C * C registers vectors (the matrix is transposed to [C * C, T] outside), so a row or
    column sum is C - 1 vector adds in the reference's order.

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

Letters: T tokens, C hc copies, K = C * C matrix entries.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from dijax.kernels import interpret_mode
from dijax.kernels.numerics import divide, sum_in_order

BLOCK_T = 128
IMPLS = ("reference", "pallas")


@dataclasses.dataclass(frozen=True)
class SinkhornConfig:
    """fast_divide: divide by ``div.rn.f32``'s fast path, branch-free, with the exact fallback for blocks outside
    its range (module docstring); else ``div.rn.f32`` throughout. Both give the same bits (tests/gpu/
    test_sinkhorn_gpu.py against a numpy oracle); on the H200 the fast form takes 41-51 us a launch against 52-58
    (``tools/bench_kernels.py --only sinkhorn``, docs/benchmarks.md), so it is the default."""
    fast_divide: bool = True


CONFIG = SinkhornConfig()


def sinkhorn_reference(comb_TCC: jax.Array, rounds: int, eps: float) -> jax.Array:
    """``rounds`` rounds of (row, column) normalisation. comb_TCC: float32 [T, C, C] -> float32 [T, C, C]."""
    eps = np.float32(eps)

    def row_then_column(_, comb):
        comb = divide(comb, sum_in_order(comb, -1) + eps)
        return divide(comb, sum_in_order(comb, -2) + eps)

    return jax.lax.fori_loop(0, rounds, row_then_column, comb_TCC)


FAST_RANGE = (2.0 ** -40, 2.0 ** 40)  # dividends >= the first, divisors < the second: the fast path's range here


def _exact_divide(x: jax.Array, y: jax.Array) -> jax.Array:
    """Correctly rounded float32 division inside a Triton kernel (``div.rn.f32``: its branch serialises)."""
    return _asm("div.rn.f32 $0, $1, $2;", x, y)


def _reciprocal(y: jax.Array) -> jax.Array:
    """``div.rn.f32``'s reciprocal of ``y``: ``rcp.approx`` refined by one Newton step (its fast path's first three
    instructions)."""
    return _asm("{ .reg .f32 n, r, e; neg.f32 n, $1; rcp.approx.ftz.f32 r, $1; fma.rn.f32 e, n, r, 0f3F800000; "
                "fma.rn.f32 $0, r, e, r; }", y)


def _fast_divide(x: jax.Array, y: jax.Array, r: jax.Array) -> jax.Array:
    """``div.rn.f32``'s fast-path quotient x / y given ``r = _reciprocal(y)``: q = x r, then q + r (x - y q) by FMA.
    Correctly rounded inside ``FAST_RANGE`` (``_rounds``)."""
    return _asm("{ .reg .f32 n, q, d; neg.f32 n, $2; fma.rn.f32 q, $1, $3, 0f00000000; fma.rn.f32 d, n, q, $1; "
                "fma.rn.f32 $0, $3, d, q; }", x, y, r)


def _asm(code: str, *args: jax.Array) -> jax.Array:
    [out] = pltriton.elementwise_inline_asm(code, args=list(args), constraints="=r" + ",r" * len(args), pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, jnp.float32)])
    return out


def _rounds(m: list, *, c: int, rounds: int, eps: np.float32, reciprocal, divide, check: bool):
    """``rounds`` rounds of row then column normalisation of ``m`` (m[i][j]: one vector per entry), each division
    ``divide(x, y, reciprocal(y))``. -> (the new m, with ``check``: per token, whether every division had a dividend
    >= FAST_RANGE[0] and a divisor < FAST_RANGE[1], bool vector; else None). Within that range the fast path is
    correctly rounded: every operand, intermediate and quotient (>= 2^-80) is a normal float32. A dividend is at
    most its divisor (non-negative entries), so the divisors' maximum bounds both."""
    m = [list(row) for row in m]
    low = high = None  # the smallest dividend and the largest divisor seen, per token

    def normalise(values: list, total):
        nonlocal low, high
        if check:
            smallest = functools.reduce(jnp.minimum, values)
            low = smallest if low is None else jnp.minimum(low, smallest)
            high = total if high is None else jnp.maximum(high, total)
        r = reciprocal(total)
        return [divide(v, total, r) for v in values]

    for _ in range(rounds):
        for i in range(c):
            m[i] = normalise(m[i], functools.reduce(lambda a, b: a + b, m[i]) + eps)
        for j in range(c):
            column = normalise([m[i][j] for i in range(c)], functools.reduce(lambda a, b: a + b,
                                                                              [m[i][j] for i in range(c)]) + eps)
            for i in range(c):
                m[i][j] = column[i]
    if low is None:
        return m, None
    lo, hi = (np.float32(v) for v in FAST_RANGE)
    return m, (low >= lo) & (high < hi)  # a NaN compares false: the exact path


def _sinkhorn_kernel(comb_ref, out_ref, *, c: int, rounds: int, eps: float, interpret: bool, fast_divide: bool):
    m0 = [[comb_ref[i * c + j, :] for j in range(c)] for i in range(c)]  # m[i][j]: [BLOCK_T] float32
    rounds_of = functools.partial(_rounds, c=c, rounds=rounds, eps=np.float32(eps))
    if interpret:  # '/' is IEEE-rounded off the GPU: every path divides with it
        fast, exact, reciprocal = (lambda x, y, r: x / y), (lambda x, y: x / y), (lambda y: y)
    else:
        fast, exact, reciprocal = _fast_divide, _exact_divide, _reciprocal
    exact_rounds = functools.partial(rounds_of, reciprocal=lambda y: y, divide=lambda x, y, r: exact(x, y),
                                     check=False)
    if fast_divide:
        m, inside = rounds_of(m0, reciprocal=reciprocal, divide=fast, check=True)
        if inside is not None:  # a division of the block outside the fast range: the block again, exact throughout
            m = jax.lax.cond(jnp.min(inside.astype(jnp.int32)) == 1, lambda: m, lambda: exact_rounds(m0)[0])
    else:
        m, _ = exact_rounds(m0)
    for i in range(c):
        for j in range(c):
            out_ref[i * c + j, :] = m[i][j]


@functools.partial(jax.jit, static_argnames=("rounds", "eps", "interpret", "config"))
def sinkhorn_pallas(comb_TCC: jax.Array, rounds: int, eps: float, interpret: bool | None = None,
                    config: SinkhornConfig | None = None) -> jax.Array:
    """Same contract as ``sinkhorn_reference``, one kernel launch. comb_TCC: float32 [T, C, C]. ``interpret``: run
    the kernel interpreted (default: off a GPU); ``config``: default ``CONFIG`` (read when a shape is first
    traced). Jitted, as every kernel's entry point: a step makes this call twice per layer with one shape, and the
    jit cache traces and lowers the kernel once per step shape."""
    interpret = interpret_mode(interpret)
    t, c, _ = comb_TCC.shape
    k = c * c
    padded = -(-t // BLOCK_T) * BLOCK_T
    comb_KT = jnp.pad(comb_TCC.reshape(t, k).T, ((0, 0), (0, padded - t)), constant_values=1.0)
    kernel = functools.partial(_sinkhorn_kernel, c=c, rounds=rounds, eps=eps, interpret=interpret,
                               fast_divide=(config or CONFIG).fast_divide)
    spec = pl.BlockSpec((k, BLOCK_T), lambda i: (0, i))
    out_KT = pl.pallas_call(kernel, grid=(padded // BLOCK_T,), in_specs=[spec], out_specs=spec,
                            out_shape=jax.ShapeDtypeStruct((k, padded), jnp.float32), interpret=interpret,
                            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(comb_KT)
    return out_KT[:, :t].T.reshape(t, c, c)


def sinkhorn(comb_TCC: jax.Array, rounds: int, eps: float, *, impl: str = "reference") -> jax.Array:
    """Dispatch to the implementation ``impl`` (one of IMPLS). float32 [T, C, C] -> float32 [T, C, C]."""
    if impl == "reference":
        return sinkhorn_reference(comb_TCC, rounds, eps)
    if impl == "pallas":
        return sinkhorn_pallas(comb_TCC, rounds, eps)
    raise ValueError(f"sinkhorn impl must be one of {IMPLS}, got {impl!r}")
