#!/usr/bin/env bash
# Everything a GPU session should run before turning a kernel on by default (dijax/kernels AUTO_ON_GPU), in one
# device call: the GPU kernel tests, then `dijax parity` with every kernel on (tiny-nodrop, tiny, chunked, the
# engine with ZOS on and off), then the tiny benchmark with kernels on and off. Output goes to $OUT (or ./gpu-out).
#   device: bash tools/gpu_validate.sh
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
fixtures=tests/fixtures/parity
run() { echo "== $*"; "$@" 2>&1 | tee -a "$out/gpu_validate.log" | tail -4; }
run python3 -m pytest -q tests/gpu
run python3 -m dijax.cli.main parity "$fixtures/tiny-nodrop" --kernels on
run python3 -m dijax.cli.main parity "$fixtures/tiny" --kernels on
run python3 -m dijax.cli.main parity "$fixtures/tiny-nodrop" --kernels on --chunk 7
run python3 -m dijax.cli.main parity "$fixtures/tiny-nodrop" --kernels on --engine --zos on
run python3 -m dijax.cli.main parity "$fixtures/tiny-nodrop" --kernels on --engine --zos off
for kernels in off on; do
  run python3 tools/bench.py --kernels "$kernels" --decode-batch 1,32 --context 256 --prefill 256 --block-size 16
done
