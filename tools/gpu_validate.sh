#!/usr/bin/env bash
# Everything a GPU session should run before turning a kernel on by default (dijax/kernels AUTO_ON_GPU), in one
# device call (~8 minutes on an H200): the GPU kernel tests, the tiny benchmark with kernels off and on (with a
# profiler trace and its summary), then `dijax parity` with every kernel on for tiny-nodrop, tiny, chunked and the
# engine, the four parity runs side by side (each compiles its own buckets; compilation is mostly single-threaded
# and takes most of a run). Output goes to $OUT (or ./gpu-out); each command has its own time limit.
#   device: bash tools/gpu_validate.sh
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
fixtures=tests/fixtures/parity
log="$out/gpu_validate.log"
run() { local limit=$1; shift; echo "== $*" | tee -a "$log"; timeout "$limit" "$@" >> "$log" 2>&1 || echo "   (exit $?)" >> "$log"; }
run 120 python3 -m pytest -q -s tests/gpu
for kernels in off on; do
  run 150 python3 tools/bench.py --kernels "$kernels" --decode-batch 1,32 --context 256 --prefill 256 --block-size 16 \
    --dump "$out/dump-$kernels"
done
run 30 python3 tools/trace_summary.py "$out"/dump-on/*/ --top 15
# side by side: no preallocation, so the processes share the GPU's memory
export XLA_PYTHON_CLIENT_PREALLOCATE=false
parity() { local name=$1; shift; timeout 400 python3 -m dijax.cli.main parity "$@" --kernels on > "$out/parity-$name.txt" 2>&1; }
parity tiny-nodrop "$fixtures/tiny-nodrop" &
parity tiny "$fixtures/tiny" &
parity chunk7 "$fixtures/tiny-nodrop" --chunk 7 &
parity engine "$fixtures/tiny-nodrop" --engine &
wait
for f in "$out"/parity-*.txt; do echo "== $f"; tail -8 "$f"; done >> "$log"
cat "$log"
