"""Shared fixtures: the parity folder (``DIJAX_PARITY_DIR``, default the copy in tests/fixtures/parity, which
tests/test_parity.py keeps byte-identical to ../shared/parity when that exists) and a loaded tiny model."""

from __future__ import annotations

import os
import tempfile
import types

import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)
import jax  # noqa: E402

# conversions of Hugging Face checkpoints made by tests go to a throw-away cache, not ~/.cache/dijax
os.environ.setdefault("DIJAX_CACHE", tempfile.mkdtemp(prefix="dijax-cache-"))
# one on-disk cache of compiled executables for the whole run, made by the first process (pytest, or xdist's
# controller) and inherited by the workers and the tests' subprocesses: the tiny model's step buckets are compiled
# by many modules and processes, and a cached one loads in a fraction of its compile time (XLA CPU included)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="dijax-jax-cache-"))

FIXTURE_COPY = os.path.join(os.path.dirname(__file__), "fixtures", "parity")
SHARED_PARITY = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "parity"))
PARITY_DIR = os.environ.get("DIJAX_PARITY_DIR", FIXTURE_COPY)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


def pytest_configure(config):
    """Under pytest-xdist's --dist loadfile / loadgroup, hand the files out in collection order (the heaviest first,
    pytest_collection_modifyitems below) rather than xdist's default, most tests first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """Run the modules marked ``cost(seconds)`` first, the costliest first (the rest keep their order), so that on
    two workers the long files start at once and the short ones fill in behind them instead of one long file
    starting last. The mark is a scheduling hint, measured on the CI machine; it changes nothing else."""
    cost: dict = {}
    for item in items:
        mark = item.get_closest_marker("cost")
        cost.setdefault(getattr(item, "module", None), mark.args[0] if mark else 0)
    order = {module: i for i, module in enumerate(sorted(cost, key=lambda m: -cost[m]))}
    items.sort(key=lambda item: order[getattr(item, "module", None)])  # stable: a module's tests keep their order


def parity_path(*parts: str) -> str:
    """A path inside the parity folder; a missing one fails the test (a skip would hide it)."""
    path = os.path.join(PARITY_DIR, *parts)
    if not os.path.exists(path):
        pytest.fail(f"parity fixture file not found: {path} (DIJAX_PARITY_DIR={PARITY_DIR})")
    return path


@pytest.fixture(scope="session")
def tiny_nodrop():
    """(Fixture, params, consts) of the tiny-nodrop parity fixture."""
    from dijax.cli.parity import Fixture, load_model

    fixture = Fixture(parity_path("tiny-nodrop"))
    params, consts = load_model(fixture)
    return fixture, params, consts


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_steps():
    """Drop JAX's compiled executables after each test module: one pytest process compiles hundreds of step
    buckets (configs x kernels x shapes), and holding them all exhausted this 24 GB machine (XLA aborted while
    compiling, late in a full run)."""
    yield
    jax.clear_caches()


@pytest.fixture
def lower_for_cuda(monkeypatch):
    """``lower(fn, *abstract_args) -> str``: the StableHLO of ``jax.jit(fn)`` lowered for CUDA on any host, with
    the device that jax's Pallas Triton lowering asks about faked as an H200 (compute capability 9.0). Kernels are
    lowered to Triton IR on the way, so an operation the Triton lowering rejects fails here, before a GPU run."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError as exc:
        pytest.skip(f"jax's Pallas Triton lowering moved: {exc}")
    if not hasattr(registration, "gpu_info_lib"):
        pytest.skip("jax's Pallas Triton lowering no longer reads the device through gpu_info_lib")
    device = types.SimpleNamespace(compute_capability="9.0")
    monkeypatch.setattr(registration, "gpu_info_lib", types.SimpleNamespace(get_gpu_info=lambda: device))

    def lower(fn, *args) -> str:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    return lower
