"""Shared fixtures: the parity folder (``DIJAX_PARITY_DIR``, default ``../shared/parity``) and a loaded tiny model."""

from __future__ import annotations

import os
import tempfile

import pytest

import dijax  # noqa: F401  (sets XLA flags before JAX starts)

# conversions of Hugging Face checkpoints made by tests go to a throw-away cache, not ~/.cache/dijax
os.environ.setdefault("DIJAX_CACHE", tempfile.mkdtemp(prefix="dijax-cache-"))

PARITY_DIR = os.environ.get(
    "DIJAX_PARITY_DIR",
    os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "shared", "parity")))


def parity_path(*parts: str) -> str:
    path = os.path.join(PARITY_DIR, *parts)
    if not os.path.exists(path):
        pytest.skip(f"parity fixtures not found at {path} (set DIJAX_PARITY_DIR)")
    return path


@pytest.fixture(scope="session")
def tiny_nodrop():
    """(Fixture, params, consts) of the tiny-nodrop parity fixture."""
    from dijax.cli.parity import Fixture, load_model

    fixture = Fixture(parity_path("tiny-nodrop"))
    params, consts = load_model(fixture)
    return fixture, params, consts
