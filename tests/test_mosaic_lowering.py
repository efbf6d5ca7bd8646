"""The Mosaic GPU kernels lowered for CUDA on this (CPU) machine: ``tools/mgpu_lower.py`` in a subprocess.

CI runs on CPUs with the newest jax from PyPI, so without this a jax release that changes Mosaic GPU's API or layout
rules, or a change to a kernel that breaks its lowering, would only show on the next GPU run. Lowering needs jax's
CUDA plugin for its Mosaic GPU extension (nothing runs on a GPU): ``tools/setup.sh`` installs the plugin of the
venv's jaxlib into ``.venv/mosaic-lowering``, off the venv's path, and only the subprocess sees it
(``DIJAX_MOSAIC_PLUGIN_DIR`` overrides the folder). Without that folder, or with a plugin of another jaxlib, the
test skips and says why.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import jaxlib
import pytest

pytestmark = pytest.mark.cost(25)  # CI seconds, a scheduling hint (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_DIR = os.environ.get("DIJAX_MOSAIC_PLUGIN_DIR", os.path.join(ROOT, ".venv", "mosaic-lowering"))


def plugin_version() -> str | None:
    """The jax CUDA plugin's version in ``PLUGIN_DIR`` (None when it holds none)."""
    found = glob.glob(os.path.join(PLUGIN_DIR, "jax_cuda1*_plugin-*.dist-info"))
    return os.path.basename(found[0]).removesuffix(".dist-info").split("-")[1] if found else None


def test_mosaic_gpu_kernels_lower_for_cuda():
    version = plugin_version()
    if version is None:
        pytest.skip(f"no jax CUDA plugin in {PLUGIN_DIR} (tools/setup.sh installs one where a wheel exists)")
    if version != jaxlib.__version__:
        pytest.skip(f"the plugin in {PLUGIN_DIR} is {version}, jaxlib is {jaxlib.__version__}: rerun tools/setup.sh")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, PLUGIN_DIR]), JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "mgpu_lower.py")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "FAILED" not in out and out.count("lowered") >= 2, out[-3000:]
