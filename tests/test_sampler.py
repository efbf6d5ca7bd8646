"""Device sampling: greedy ties, top-k / top-p limits, noise keyed only by (seed, output position), and the static
greedy / temperature / sample modes: how a step's rows pick one, and that a row's token does not depend on it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dijax.kernels import lowering_for_gpu
from dijax.runtime import sampler
from dijax.runtime.sampler import (MODES, StepSampling, sample, sample_packed, sampling_inputs, sampling_mode,
                                   step_sampling)
from dijax.runtime.sampling_params import SamplingParams


def _sample(logits, temperature=1.0, top_k=0, top_p=1.0, seeds=None, positions=None, mode="sample"):
    r = logits.shape[0]
    seeds = np.arange(r, dtype=np.uint64) if seeds is None else np.asarray(seeds, np.uint64)
    positions = np.zeros(r, np.int32) if positions is None else np.asarray(positions, np.int32)
    temperature = np.broadcast_to(np.asarray(temperature, np.float32), (r,))
    top_k, top_p = np.broadcast_to(np.asarray(top_k, np.int32), (r,)), np.broadcast_to(np.float32(top_p), (r,))
    return np.asarray(sample(jnp.asarray(logits, jnp.float32), jnp.asarray(temperature), jnp.asarray(top_k),
                             jnp.asarray(top_p), jnp.asarray((seeds >> np.uint64(32)).astype(np.uint32)),
                             jnp.asarray((seeds & np.uint64(0xFFFFFFFF)).astype(np.uint32)), jnp.asarray(positions),
                             mode=mode))


class _Row:
    """What the sampler reads of a ScheduledChunk."""

    def __init__(self, params: SamplingParams, seed: int = 0, output_position: int = 0):
        self.params, self.seed, self.output_position = params, seed, output_position


def test_greedy_takes_the_lowest_index_among_ties():
    logits = np.array([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    for mode in MODES:
        assert _sample(logits, temperature=0.0, mode=mode).tolist() == [1, 0], mode


def test_noise_depends_only_on_seed_and_position():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (6, 64)).astype(np.float32)
    seeds, positions = np.arange(6) * 7 + 1, np.arange(6) % 3
    full = _sample(logits, seeds=seeds, positions=positions)
    reverse = _sample(logits[::-1], seeds=seeds[::-1], positions=positions[::-1])[::-1]
    single = np.array([_sample(logits[i:i + 1], seeds=seeds[i:i + 1], positions=positions[i:i + 1])[0]
                       for i in range(6)])
    assert np.array_equal(full, reverse) and np.array_equal(full, single)
    # and it does change with the position: a flat distribution is not sampled to one token
    flat = np.zeros((64, 32), np.float32)
    drawn = _sample(flat, seeds=np.full(64, 5), positions=np.arange(64))
    assert len(set(drawn.tolist())) > 10


def test_top_k_and_top_p_restrict_the_support():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1, (1, 50)).astype(np.float32)
    order = np.argsort(-logits[0])
    for position in range(40):
        assert _sample(logits, top_k=3, positions=[position])[0] in order[:3]
        assert _sample(logits, top_k=1, positions=[position])[0] == order[0]
        assert _sample(logits, top_p=1e-6, positions=[position])[0] == order[0]
    probs = np.exp(logits[0] - logits[0].max()); probs /= probs.sum()
    nucleus = order[:np.searchsorted(np.cumsum(probs[order]), 0.5) + 1]
    drawn = {_sample(logits, top_p=0.5, positions=[p])[0] for p in range(200)}
    assert drawn <= set(nucleus.tolist()) and len(drawn) > 1


def _three_sort_reference(logits_V, temperature, top_k, top_p, seed, position):
    """The sampler as first written (a sort for top-k, one for the top-p mass, one for its threshold)."""
    greedy = jnp.argmax(logits_V).astype(jnp.int32)
    scaled = logits_V / jnp.maximum(temperature, 1e-5)
    kth = jnp.sort(scaled)[::-1][jnp.clip(top_k - 1, 0, logits_V.shape[0] - 1)]
    scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(jnp.sort(scaled)[::-1])
    keep = ((jnp.cumsum(probs) - probs) < top_p) | (top_p >= 1)  # top_p = 1 is off (the first version's fix)
    scaled = jnp.where(scaled < jnp.min(jnp.where(keep, jnp.sort(scaled)[::-1], jnp.inf)), -jnp.inf, scaled)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), seed >> 32), position)
    sampled = jnp.argmax(scaled + jax.random.gumbel(key, scaled.shape, jnp.float32)).astype(jnp.int32)
    return int(jnp.where(temperature == 0, greedy, sampled))


def test_one_shared_sort_samples_what_three_sorts_did():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (12, 40)).astype(np.float32)
    logits[3, :5] = logits[3, 5]  # ties at the top-k boundary
    temperature = np.array([0.7, 1.0, 0.0, 1.3] * 3, np.float32)
    for top_k, top_p in ((0, 1.0), (3, 1.0), (0, 0.6), (5, 0.8), (1, 0.3), (40, 0.95), (99, 1.0)):
        seeds, positions = rng.integers(0, 2**63, 12, dtype=np.uint64), rng.integers(0, 50, 12)
        got = _sample(logits, temperature, top_k, top_p, seeds, positions)
        want = [_three_sort_reference(jnp.asarray(logits[i]), temperature[i], top_k, np.float32(top_p),
                                      int(seeds[i]), int(positions[i])) for i in range(12)]
        assert got.tolist() == want, (top_k, top_p)


def test_greedy_rows_take_the_argmax_in_greedy_and_mixed_steps():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (8, 64)).astype(np.float32)
    logits[0, [4, 9]] = logits[0].max() + 1  # a tie: the lowest index wins in both branches
    greedy = _sample(logits, temperature=0.0, top_k=7, top_p=0.5)
    mixed = _sample(logits, temperature=np.array([0.0] * 7 + [1.0], np.float32), top_k=7, top_p=0.5)
    assert greedy.tolist() == logits.argmax(-1).tolist() and greedy[0] == 4
    assert mixed[:7].tolist() == greedy[:7].tolist()


def test_all_64_bits_of_the_seed_key_the_noise():
    flat = np.zeros((64, 1000), np.float32)
    positions = np.arange(64)
    low = _sample(flat, seeds=np.full(64, 1, np.uint64), positions=positions)
    high = _sample(flat, seeds=np.full(64, 1 + 2**32, np.uint64), positions=positions)
    top = _sample(flat, seeds=np.full(64, 1 + 2**62, np.uint64), positions=positions)
    assert (low != high).sum() > 50 and (low != top).sum() > 50 and (high != top).sum() > 50
    again = _sample(flat, seeds=np.full(64, 1 + 2**32, np.uint64), positions=positions)
    assert np.array_equal(high, again)


def test_a_top_p_below_float32_resolution_keeps_the_most_likely_token():
    logits = np.array([[0.0, 2.0, 1.0, -1.0]], np.float32)
    assert all(_sample(logits, top_p=1e-50, positions=[p])[0] == 1 for p in range(20))


def test_a_step_is_greedy_only_when_every_sampled_row_is():
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    filtered_greedy = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)  # filters do not matter at temperature 0
    assert sampling_mode([]) == "greedy"  # a step that samples nothing (prefill chunks only)
    assert sampling_mode([_Row(greedy), _Row(filtered_greedy)]) == "greedy"
    assert sampling_mode([_Row(greedy), _Row(sampled), _Row(greedy)]) == "temperature"  # no sampled row filters
    assert sampling_mode([_Row(SamplingParams(temperature=1e-30))]) == "temperature"
    for filtering in (SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.7, top_p=0.99)):
        assert sampling_mode([_Row(filtered_greedy), _Row(sampled), _Row(filtering)]) == "sample"
    # padding rows are greedy: they neither change the mode nor count as sampled rows
    step = step_sampling([_Row(greedy, seed=2**40 + 3, output_position=5)], 4)
    assert step.mode == "greedy" and step.columns[0].tolist() == [0.0] * 4 and step.columns[5].tolist() == [5, 0, 0, 0]
    assert step_sampling([_Row(greedy), _Row(sampled)], 4).mode == "temperature"


def test_the_sampling_columns_travel_as_one_array_and_come_back_exact():
    rows = [_Row(SamplingParams(temperature=0.7, top_k=40, top_p=0.95), seed=2**63 - 1, output_position=9),
            _Row(SamplingParams(temperature=1e-30, top_p=1e-30), seed=2**32 + 5, output_position=0)]
    columns = sampling_inputs(rows, 3)
    step = StepSampling.of(columns, "sample")
    assert step.packed_7R.shape == (7, 3) and step.packed_7R.dtype == np.uint32
    assert step.packed_7R[6].tolist() == [MODES.index("sample")] * 3  # the mode, for the device
    assert len(jax.tree.leaves(step)) == 1  # one host -> device copy per step
    for host, packed in zip(columns, step.columns):  # unpacked eagerly: the same dtypes and bits
        assert packed.dtype == host.dtype and np.asarray(packed).tobytes() == host.tobytes()
    on_device = jax.jit(lambda s: s.columns)(step)  # the sampler's unpacking, by bitcasts in the trace
    for host, device in zip(columns, on_device):
        assert device.dtype == host.dtype and np.asarray(device).tobytes() == host.tobytes()


def test_a_greedy_sampler_copies_no_sampling_columns():
    def sampler(logits_RV, sampling):
        return sample(logits_RV, *sampling.columns, mode=sampling.mode)

    logits = np.zeros((4, 16), np.float32)
    greedy = jax.jit(sampler).lower(logits, step_sampling([], 4)).compile()
    sampled = jax.jit(sampler).lower(logits, step_sampling([_Row(SamplingParams(temperature=0.5))], 4)).compile()
    # jit drops arguments the computation never reads: the greedy executable takes the logits alone (the dropped
    # leaf's sharding is None), the sampling one the logits and the packed columns
    assert len(jax.tree.leaves(greedy.input_shardings[0])) == 1
    assert len(jax.tree.leaves(sampled.input_shardings[0])) == 2


def test_greedy_mode_takes_what_sample_mode_takes_for_temperature_0_rows():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, (16, 300)).astype(np.float32)
    logits[2, [7, 150, 299]] = logits[2].max() + 0.5  # a three-way tie at the top
    logits[5] = 1.0  # a flat row
    top_k, top_p = rng.integers(0, 400, 16), rng.choice([1.0, 0.9, 0.3, 1e-9], 16).astype(np.float32)
    seeds, positions = rng.integers(0, 2**63, 16, dtype=np.uint64), rng.integers(0, 1000, 16)
    args = dict(top_k=top_k, top_p=top_p, seeds=seeds, positions=positions)
    greedy = _sample(logits, temperature=0.0, mode="greedy", **args)
    assert greedy.tolist() == logits.argmax(-1).tolist() and greedy[2] == 7 and greedy[5] == 0
    assert _sample(logits, temperature=0.0, mode="sample", **args).tolist() == greedy.tolist()
    # in a mixed step the temperature-0 rows still take greedy's tokens, the others are sampled
    temperature = np.where(np.arange(16) % 3 == 0, 0.0, 1.5).astype(np.float32)
    mixed = _sample(logits, temperature=temperature, mode="sample", **args)
    assert mixed[temperature == 0].tolist() == greedy[temperature == 0].tolist()
    assert mixed[temperature > 0].tolist() != greedy[temperature > 0].tolist()


def test_greedy_mode_compiles_no_sort_and_no_noise_and_temperature_mode_no_sort():
    r, v = 4, 64
    args = (jnp.zeros((r, v)), jnp.zeros(r), jnp.zeros(r, jnp.int32), jnp.ones(r), jnp.zeros(r, jnp.uint32),
            jnp.zeros(r, jnp.uint32), jnp.zeros(r, jnp.int32))
    greedy, plain, full = (sample.lower(*args, mode=mode).as_text() for mode in ("greedy", "temperature", "sample"))
    assert "sort" not in greedy and "threefry" not in greedy and "exponential" not in greedy
    assert "sort" not in plain and "threefry" in plain
    # the sample mode sorts only with the sort filter: from SELECT_MIN_ROWS rows up "auto" takes the select
    assert r >= sampler.SELECT_MIN_ROWS and "sort" not in full and "threefry" in full
    assert "sort" in sample.lower(*args, mode="sample", top_filter="sort").as_text()
    one = [a[:1] for a in args]
    assert ("sort" in sample.lower(*one, mode="sample").as_text()) == (1 < sampler.SELECT_MIN_ROWS)


def test_auto_filter_by_rows_and_platform():
    """The sort below SELECT_MIN_ROWS rows, then the XLA select; the thresholds kernel from MANY_ROWS only where it
    compiles for a GPU (tools/deviceless.py's compile for an H100 included), never interpreted."""
    on_gpu = jax.default_backend() == "gpu"
    assert sampler.auto_filter(sampler.SELECT_MIN_ROWS - 1) == "sort"
    assert sampler.auto_filter(sampler.SELECT_MIN_ROWS) == "select"
    assert sampler.auto_filter(sampler.MANY_ROWS - 1) == "select"
    assert sampler.auto_filter(sampler.MANY_ROWS) == ("pallas" if on_gpu else "select")
    with lowering_for_gpu():
        assert sampler.auto_filter(sampler.MANY_ROWS) == "pallas" == sampler.MANY_ROWS_FILTER
        assert sampler.auto_filter(sampler.MANY_ROWS - 1) == "select"


@pytest.mark.parametrize("name", ["select", "pallas"])
def test_the_threshold_filters_keep_exactly_what_the_sort_filter_keeps(name):
    """The radix-descent filters (XLA's, and the kernel's, interpreted off a GPU) against the sort row by row: ties
    at both thresholds, -0.0 beside +0.0, top_k 0 / 1 / above the vocabulary, top_p 1, a top_p below float32's
    resolution, and heavy tails where many tokens carry the top-p mass."""
    rng = np.random.default_rng(12)
    by_sort, by_threshold = jax.jit(sampler.FILTERS["sort"]), jax.jit(sampler.FILTERS[name])
    for v in (40, 512, 5000):
        for trial in range(12 if name == "select" else 3):
            logits = (rng.standard_t(3, (16, v)) * rng.uniform(0.3, 4)).astype(np.float32)
            if trial % 3 == 0:
                logits[:, :v // 4] = np.round(logits[:, :v // 4])  # ties, and -0.0 beside +0.0
            top_k = rng.integers(0, v + 3, 16).astype(np.int32)
            top_k[::4], top_k[1] = 0, 1
            top_p = rng.uniform(0, 1, 16).astype(np.float32)
            top_p[::3], top_p[2] = 1.0, 1e-9
            want = np.asarray(by_sort(logits, top_k, top_p))
            got = np.asarray(by_threshold(logits, top_k, top_p))
            np.testing.assert_array_equal(got, want, err_msg=f"V {v}, trial {trial}")


def test_an_unknown_filter_is_refused_by_name():
    with pytest.raises(ValueError, match=r"top_filter must be 'auto' or one of \('sort', 'select', 'pallas'\), "
                                         r"got 'heap'"):
        sample(*(jnp.zeros((2, 4)),) + (jnp.zeros(2),) * 6, mode="sample", top_filter="heap")


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match=r"sampling mode must be one of \('greedy', 'temperature', 'sample'\), "
                                         r"got 'nucleus'"):
        _sample(np.zeros((1, 4), np.float32), mode="nucleus")


def test_top_p_1_is_an_exact_no_op_even_where_the_float32_mass_reaches_1_early():
    # two tokens of mass 1/2 each, then 4094 of mass ~1e-12: the float32 cumulative sum is exactly 1 after the
    # second token, so a `mass before < top_p` rule alone would drop the whole tail at top_p = 1
    logits_V = np.full(4096, -27.6, np.float32)
    logits_V[:2] = 0.0
    scaled = jnp.asarray(logits_V)
    probs = jax.nn.softmax(jnp.sort(scaled)[::-1])
    assert float((jnp.cumsum(probs) - probs)[2]) >= 1.0  # the premise
    for name, filter_fn in sampler.FILTERS.items():
        kept = np.asarray(filter_fn(scaled[None], jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.float32)))[0]
        np.testing.assert_array_equal(kept, logits_V, err_msg=name)
        kept = np.asarray(filter_fn(scaled[None], jnp.zeros(1, jnp.int32), jnp.full(1, 0.999, jnp.float32)))[0]
        assert np.isneginf(kept[2:]).all() and np.isfinite(kept[:2]).all(), name


def test_the_temperature_mode_draws_the_sample_modes_tokens():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 3, (16, 300)).astype(np.float32)
    temperature = np.array([0.0, 0.3, 1.0, 1.7] * 4, np.float32)
    for trial in range(3):
        seeds, positions = rng.integers(0, 2**63, 16, dtype=np.uint64), rng.integers(0, 1000, 16)
        fast = _sample(logits, temperature, seeds=seeds, positions=positions, mode="temperature")
        full = _sample(logits, temperature, seeds=seeds, positions=positions, mode="sample")
        assert fast.tolist() == full.tolist(), trial
        assert fast[0] == logits[0].argmax()
    # the mode never reads the filters: rows that filter must not be sent to it (sampling_mode)
    assert len(set(_sample(np.zeros((64, 50), np.float32), seeds=np.full(64, 3), positions=np.arange(64),
                           mode="temperature").tolist())) > 10


def test_the_packed_sampler_draws_what_each_mode_draws():
    """``sample_packed`` (the engine step's sampler: the mode read on the device) gives exactly ``sample``'s tokens
    in each of ``MODES``, for rows that mix greedy, unfiltered and filtered sampling; a mode outside the table is
    refused on the host."""
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 2, (6, 500)).astype(np.float32)
    temperatures, top_ks, top_ps = [0.0, 0.7, 1.3, 0.5, 0.0, 0.9], [0, 0, 20, 0, 5, 3], [1.0, 1.0, 0.9, 0.5, 1.0, 1.0]
    rows = [_Row(SamplingParams(temperature=t, top_k=k, top_p=p), seed=int(s), output_position=int(n))
            for t, k, p, s, n in zip(temperatures, top_ks, top_ps, rng.integers(0, 2**63, 6, dtype=np.uint64),
                                     rng.integers(0, 100, 6))]
    columns = sampling_inputs(rows, 6)
    packed_sampler = jax.jit(sample_packed)
    for mode in MODES:
        want = np.asarray(sample(jnp.asarray(logits), *columns, mode=mode))
        got = np.asarray(packed_sampler(logits, StepSampling.of(columns, mode).packed_7R))
        assert got.tolist() == want.tolist(), mode
    with pytest.raises(ValueError, match="sampling mode must be one of"):
        StepSampling.of(columns, "beam")
