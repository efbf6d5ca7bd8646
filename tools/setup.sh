#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 (JAX >= 0.11 needs it) and install dijax with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for cand in python3.13 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv installs that are not on PATH as the global version
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$cand" ]; then echo "$cand"; return 0; fi
  done
  return 1
}
if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || { echo "setup: need Python >= 3.12 (JAX >= 0.11 requires it)" >&2; exit 1; }
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[test]"
# Only for tests/test_mosaic_lowering.py: jax's CUDA plugin (its Mosaic GPU extension) in a folder of its own, off
# the venv's path, so that the Mosaic GPU kernels can be lowered for CUDA here; it never runs anything. Optional:
# without it (no wheel for this platform or jaxlib) that test skips.
plugin="jax-cuda13-plugin==$(.venv/bin/python -c 'import jaxlib; print(jaxlib.__version__)')"
rm -rf .venv/mosaic-lowering
.venv/bin/python -m pip install -q --no-deps --target .venv/mosaic-lowering "$plugin" >/dev/null 2>&1 \
  || { rm -rf .venv/mosaic-lowering; echo "setup: no $plugin here; tests/test_mosaic_lowering.py will skip" >&2; }
