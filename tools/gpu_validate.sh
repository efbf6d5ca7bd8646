#!/usr/bin/env bash
# Everything a GPU session should run before turning a kernel on by default (dijax/kernels AUTO_ON_GPU), in stages
# that each fit one device call (600 s, about 100 s of it the machine's start):
#   tests    the first half of the GPU kernel tests (their files before the indexer's: 102 tests, ~425 s on an H100
#            in the fifty-third session, where the whole of tests/gpu, 242 tests, no longer fit one call);
#   tests-rest  the other half (the indexer's file on: 140 tests, 244 s there), then the engine's timeline and
#            warm-up tests (5 tests, 79 s);
#   kernels  the kernels' micro-benchmarks;
#   sweep    the GPU tests of the routed-experts and attention kernels (variants included), then the variants
#            timed beside the defaults (tools/bench_kernels.py --sweep: grouped-GEMM tilings and 2 stages);
#   sweep-fp8  the fp8 linear's GPU tests and its tile variants timed at 1 and 16 tokens;
#   profile  hardware counters (Nsight Compute, clocks left alone) of the routed-experts kernels at T = 16, 64 and
#            1024: throughput against peak, memory workload, occupancy, issue rate (ninth session: ncu read counters
#            on the H200 only in a machine's first ncu processes; the mat-vecs are issue-bound, the grouped GEMM ran
#            at 18 % occupancy: docs/benchmarks.md);
#   warmup   the warm-up total of the real config's 1M-context engine (tools/compile_time.py);
#   compile  where a bucket's compile time goes: two real-config buckets with XLA's defaults (the engine's), then
#            with XLA's GEMM autotuning off;
#   cache    the persistent compilation cache (dijax.runtime.compile_cache): its test on the GPU, then the two
#            buckets of `compile` compiled into a fresh cache and loaded from it by a second run;
#   stack    the flash-stack step (a stacked run of real-size layers whose weights the kernels read in place) and
#            the XLA GEMMs' rows;
#   engine   the engine's host work per decode step without the device (tools/host_probe.py), then the tiny
#            engine's ZOS on / off timeline against the device-only step at 1 and 64 prompts in flight (issue 11
#            item 2; its first generate compiles every engine bucket);
#   flash-engine  the ZOS timeline for flash-slice with 1 and 64 prompts in flight (issue 11 item 2), under JAX's
#            default memory fraction;
#   dispatch where the tiny step's host dispatch goes (tools/dispatch_probe.py: the engine's launches apart, no-ops on
#            the same arguments, launches as under ZOS, a host trace of those; issue 11 items 1-2), the ZOS rows again
#            without loops in the step's graphs, then XLA's log of the graph updates per probe row (fifteenth
#            session: it named the sampler's host arguments as what moved every step);
#   flash    flash-slice step rows, every kernel on: decode at batch 1, 16, 64, 128 and context 4095, prefill of
#            1024 and 8192 tokens (issues 12 and 13, item 5 / 4);
#   flash-profile  profiler traces of flash-slice decode B=64 and prefill 1024 (every kernel, GEMM autotuning) and
#            their kernel families (tools/trace_summary.py): the nineteenth session profiled B=1 and 16 only;
#   bench    the tiny step with kernels off and on, a profiler trace and its summary, the GEMM fusions' tilings;
#   ep-parity  (issue 15, device kind nvidia-h200-x2) `dijax parity --ep 2 --kernels on` on tiny-nodrop and tiny,
#            and `--engine --ep 2` on tiny-nodrop, side by side;
#   ep-bench (issue 15, on nvidia-h200-x2, EP=1 then EP=2: one call each) flash-slice decode at batch 1, 16, 64, 128
#            and context 4095, prefill of 4096 and 8192 tokens, at --ep $EP;
#   ep-trace (issue 15, on nvidia-h200-x2) profiler traces of decode B=64 and prefill 4096 at --ep 2, then each
#            GPU's streams and its collectives' time beside compute (tools/trace_summary.py --streams);
#   h200-owed  (~450 s; an H200's first call) what the issues still ask of an H200: the tiny decode step at batch 1,
#            the sparse-attention rows, flash-slice decode at batch 1 and 64, GPU parity;
#   mgpu-ab  a sparse-attention / indexer kernel change (thirty-second session: branch gather-under-scores) against
#            ab-base: their GPU tests, parity with sparse attention on Mosaic GPU at every step, then their Mosaic GPU
#            rows by GPU kernel time in both trees (bench_kernels --rows mgpu --sweep);
#   mgpu-profile  Nsight Compute counters of fp4_wgmma at decode sizes (T = 1 and 64, the ragged path forced);
#   attn-profile  (~240 s; first after a machine start) Nsight Compute of sparse attention's Mosaic GPU kernel at
#            decode B=64 and 256 (tools/profile_attn.py, the model's window + pool layout; issue 13's 70 %: it runs
#            at ~4.5 us a 64-row block against ~1.7 us of tensor work and ~2.6 us of its bytes on an H100) and of the
#            routed mat-vecs at T = 1 and 16: stall reasons per SASS instruction (SourceCounters) besides the
#            details page, both back as files ($out/ncu-*.txt, ncu-*-sass.csv);
#   wide-merge  (~250 s; sixtieth session, prepared and not yet run) sparse attention's cluster merge reading its
#            tiles 16 bytes a load (SparseAttnConfig.mgpu_wide_merge): its GPU tests (the same bits as the default),
#            the Mosaic GPU rows with it beside the default by GPU kernel time, and both timelines at batch 64;
#   attn-timeline  (~120 s) where a sparse-attention warpgroup's clocks go, step by step (Mosaic GPU's on-device
#            profiler: SparseAttnConfig.mgpu_trace_dir): its GPU tests, then the timeline's regions at batch 1 / 64 /
#            256 (tools/profile_attn.py --trace-dir, tools/kernel_regions.py; fifty-fifth session, H100: at batch 64
#            the cluster merge at the end is 31 % of a CTA's span; its parts are regions of their own since then);
#   indexer-profile  (~200 s) Nsight Compute counters of the Mosaic GPU indexer at prefill 8192 x 2048;
#   launch-check  launches per step from the device's own compile (bench.py) against tools/deviceless.py's compile
#            for this card on the CPU side of the same machine: tiny decode B=1 / 64 and prefill 256, flash-slice
#            decode B=1 / 16 / 64;
#   parity   `dijax parity --kernels on` on tiny-nodrop (one-step and --chunk 7 prefill), its engine run and tiny
#            (both tiers), side by side (since the twentieth session a fixture's cases share one runner: tiny
#            compiles 4 executables, not 16; twenty-first session: the four runs took 96 s side by side).
#   ab       the same bench rows of an earlier tree and of this one on one machine, alternating (base, this, base,
#            this; the second run of each loads its executables from a persistent compilation cache): machines of one
#            kind differ by more than most changes (twenty-first session: the tiny step's back-to-back pace ran
#            1.36-1.91 ms on four machines at one tree). Export the base first, then carry it:
#              rm -rf ab-base && mkdir ab-base && git archive REV dijax tools | tar -x -C ab-base
#            (ab-base/ is git-ignored; the device call needs carry ["ab-base"]). AB_ARGS: bench.py's arguments
#            (default: the tiny decode step at B=1; write an empty value as `--prefill=`). AB_ROUNDS: rounds
#            (default 2; 1 where a row's runs are long, e.g. flash-slice: ~130 s a run, its launches printed too).
# Compilation is mostly single-threaded and takes most of a parity run. Output goes to $OUT (or ./gpu-out); each
# command has its own time limit; the summary is printed last. Keep `bench.py --dump --engine on` (a profiler trace
# of an engine run) out of these stages: on the H200 it did not finish within 140 s.
#   device: bash tools/gpu_validate.sh tests     (then tests-rest, kernels, sweep, profile, warmup, compile, cache,
#           stack, engine, flash-engine, dispatch, flash, flash-profile, bench, parity: one call each)
# The one-off A/B stages of settled decisions (the sparse-attention variants, the Mosaic GPU engines against Triton,
# the launch cuts, the sampler's and mixes' thresholds, the stream probe, ...) were removed in the fifty-ninth
# session; docs/benchmarks.md has their results and `git show 9106ad4:tools/gpu_validate.sh` their commands.
set -uo pipefail
stages="h200-owed|wide-merge|attn-timeline|indexer-profile|attn-profile|tests|tests-rest|kernels|sweep|sweep-fp8|profile|warmup|compile|cache|stack|engine|flash-engine|dispatch|flash|flash-profile|bench|mgpu-ab|mgpu-profile|launch-check|parity|ab|ep-parity|ep-bench|ep-trace"
stage=${1:?usage: tools/gpu_validate.sh STAGE, one of $stages}
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: stages run some commands inside ab-base/
export PYTHONPATH=. PYTHONUNBUFFERED=1
fixtures=tests/fixtures/parity
log="$out/gpu_validate-$stage.log"
run() { local limit=$1; shift; echo "== $*" | tee -a "$log"; timeout "$limit" "$@" >> "$log" 2>&1 || echo "   (exit $?)" >> "$log"; }
parity() {  # name, time limit, arguments of dijax parity
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m dijax.cli.main parity "$@" --kernels on > "$out/parity-$name.txt" 2>&1
  echo "parity $name: exit $?" >> "$log"
}
parity_all() {  # time limit: GPU parity of tiny-nodrop (one step, --chunk 7, the engine) and tiny side by side (no
  # preallocation, so the processes share the GPU's memory), then their summary
  local limit=$1
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  parity tiny-nodrop "$limit" "$fixtures/tiny-nodrop" &
  parity chunk7 "$limit" "$fixtures/tiny-nodrop" --chunk 7 &
  parity engine "$limit" "$fixtures/tiny-nodrop" --engine &
  parity tiny "$limit" "$fixtures/tiny" &
  wait
  parity_summary "$out"/parity-*.txt
}
gpu_test_files() {  # first | rest: tests/gpu's files before the indexer's, or from it on (the two halves of `tests`)
  local f
  for f in tests/gpu/test_*.py; do
    if [[ "$f" < tests/gpu/test_indexer ]]; then [ "$1" = first ] && echo "$f"; else [ "$1" = rest ] && echo "$f"; fi
  done
}
need_base() {  # the stages that run a base tree beside this one: stop unless it was exported into ab-base/ (see ab)
  [ -d ab-base/dijax ] || { echo "$stage: export the base tree into ab-base/ first (see ab's note)" >&2; exit 2; }
}
tests_beside_parity() {  # time limit, GPU test files: each test file beside `parity_all`, all side by side, then
  # each file's summary into the log (its whole output under $out)
  local limit=$1 file name; shift
  parity_all "$limit" &
  for file in "$@"; do
    name=tests-$(basename "$file" .py)
    (timeout "$limit" python3 -m pytest -q -ra -p no:cacheprovider "$file" > "$out/$name.txt" 2>&1
     echo "$name: exit $?" >> "$log") &
  done
  wait
  for file in "$@"; do
    name=tests-$(basename "$file" .py)
    echo "== $name"; grep -E "passed|failed|FAILED|ERROR|Error" "$out/$name.txt" | tail -12
  done >> "$log"
}
parity_summary() {  # the parity outputs named, each one's header and its tier / check lines, into the log
  for f in "$@"; do
    echo "== $f"; grep -m1 "^parity on" "$f"; grep -E "tier|engine|chunk|checks|error" "$f" | tail -8
  done >> "$log"
}
case "$stage" in
  attn-profile)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section SourceCounters"
    run 200 ncu --clock-control none $sections -k regex:^kernel_mosaic_gpu -c 2 -o "$out/ncu-attn" \
      python3 tools/profile_attn.py 64 256
    run 200 ncu --clock-control none $sections -k regex:routed_ -c 4 -o "$out/ncu-matvec" \
      python3 tools/profile_routed.py 1:gathered 16:gathered
    for name in attn matvec; do
      ncu --import "$out/ncu-$name.ncu-rep" --page details > "$out/ncu-$name.txt" 2>&1
      ncu --import "$out/ncu-$name.ncu-rep" --page source --csv --print-source sass > "$out/ncu-$name-sass.csv" 2>&1
      rm -f "$out/ncu-$name.ncu-rep"
      grep -E "^  [A-Za-z_]|Duration|Throughput|Registers Per|Achieved Occupancy|Cycles Per Issued|Stall|Issued" \
        "$out/ncu-$name.txt" | head -120 >> "$log"
    done ;;
  wide-merge)
    # (~250 s) the cluster merge's pulled tiles are bound by the cluster's link at ~9 bytes a clock a multiprocessor
    # with 8-byte loads (fifty-ninth session, H100: reading and merging ~7,900 of a batch-64 CTA's ~50,000 clocks);
    # this reads them 16 bytes a load. Keep it (default on) if batch 64 gets faster with the same bits, else remove it
    run 150 python3 -m pytest -q -ra tests/gpu/test_attention_gpu.py -k "wide_merge or matches_reference"
    run 150 python3 tools/bench_kernels.py --only sparse_attn --rows mgpu --timing device --iters 10 --repeats 3 \
      --variant mgpu_wide_merge=True
    run 80 python3 tools/profile_attn.py 64 --trace-dir "$out/attn-trace"
    run 80 python3 tools/profile_attn.py 64 --config "{'mgpu_wide_merge': True}" --trace-dir "$out/attn-trace-wide" ;;
  attn-timeline)
    # (~120 s) the timeline's GPU tests (the same bits with it, a region entered once a block), then each region's
    # cycles and share of a warpgroup's span at batch 1 / 64 / 256 (fifty-fourth session: batch 64 spends ~3.8 us
    # a 64-row block, and neither the bytes nor the issue rate bound it; the timeline says which step does)
    run 150 python3 -m pytest -q -ra tests/gpu/test_attention_gpu.py -k timeline
    run 150 python3 tools/profile_attn.py 1 64 256 --trace-dir "$out/attn-trace" ;;
  indexer-profile)
    # (~200 s; first after a machine start, as `profile` says) hardware counters of the Mosaic GPU indexer at
    # prefill 8192 x 2048 (146-158 us of kernel time against an 86.8 us tensor-core floor on an H100, fiftieth
    # session): tensor-pipe use, L2 traffic of the key gathers, stall reasons. The details page comes back whole.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    run 250 ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
      -k regex:^kernel_mosaic_gpu -c 2 -o "$out/ncu-indexer" \
      python3 tools/bench_kernels.py --only indexer --rows mgpu --iters 1 --repeats 1
    ncu --import "$out/ncu-indexer.ncu-rep" --page details > "$out/ncu-indexer.txt" 2>&1
    grep -E "^  [A-Za-z_]|Duration|Throughput|Registers Per|Achieved Occupancy|Cycles Per Issued|Stall|Pipe|L2" \
      "$out/ncu-indexer.txt" | head -150 >> "$log" ;;
  tests)
    run 540 python3 -m pytest -q -ra $(gpu_test_files first) ;;
  tests-rest)
    run 420 python3 -m pytest -q -ra $(gpu_test_files rest)  # 330 s fell 17 tests short (fifty-eighth session)
    # the engine paths whose guards only mean something on a GPU (device-to-host reads) and the AOT warm-up
    run 140 python3 -m pytest -q -ra tests/test_step_timeline.py "tests/test_engine.py::test_no_new_compilations_after_warm_up" ;;
  kernels)
    run 450 python3 tools/bench_kernels.py --iters 10 --repeats 3 ;;
  sweep)
    run 120 python3 -m pytest -q -ra tests/gpu/test_routed_experts_gpu.py tests/gpu/test_attention_gpu.py
    run 260 python3 tools/bench_kernels.py --only routed_experts --sweep --iters 10 --repeats 3
    run 150 python3 tools/bench_kernels.py --only sparse_attn --sweep --iters 10 --repeats 3 ;;
  sweep-fp8)
    # the fp8 linear at decode sizes: its GPU tests, then its tilings timed at 1 and 16 tokens
    run 150 python3 -m pytest -q -ra tests/gpu/test_fp8_linear_gpu.py
    run 400 python3 tools/bench_kernels.py --only fp8_linear --sweep --tokens 1,16 --iters 10 --repeats 3 ;;
  profile)
    # one ncu process for every kernel (tools/profile_routed.py says why); run this stage first after a machine start
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    run 300 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section LaunchStats -k regex:routed_ -o "$out/ncu-routed" \
      python3 tools/profile_routed.py 16:gathered 64:ragged 1024:ragged
    ncu --import "$out/ncu-routed.ncu-rep" --print-summary per-kernel > "$out/ncu-routed.txt" 2>&1
    grep -E "^  routed|Duration|Throughput|Registers Per|Occupancy|Cycles Per Issued" "$out/ncu-routed.txt" >> "$log" ;;
  warmup)
    # the AOT warm-up of an 8192-token, 256-sequence, 1M-context engine on the real 40-layer config (55 buckets;
    # seventh session: 6.0 min with GEMM autotuning off, as the engine compiled then; it autotunes since the tenth)
    run 570 python3 tools/compile_time.py --engine 8192,256,1048576 --threads 16 ;;
  cache)
    # the persistent compilation cache: the engine's steps (Pallas kernels included) loaded by a second process and
    # generating the same tokens, then two real-config buckets compiled, and loaded by a second run
    run 200 python3 -m pytest -q -ra tests/test_compile_cache.py
    rm -rf /tmp/dijax-compile-cache
    for pass in fill load; do
      run 200 python3 tools/compile_time.py --buckets 64x64,8192x16 --max-blocks 1024 --threads 2 \
        --compile-cache /tmp/dijax-compile-cache
    done ;;
  stack)
    run 420 python3 tools/bench.py --model flash-stack --decode-batch 1,64 --context 4095 --prefill 1024 \
      --engine off --warmup 3 --iters 10
    run 150 python3 tools/bench_kernels.py --only xla_gemm --iters 10 --repeats 3 ;;
  compile)
    for option in "" --step-xla-option=xla_gpu_autotune_level=0; do
      run 150 python3 tools/compile_time.py --buckets 64x64,8192x16 --max-blocks 1024 --threads 2 $option
    done ;;
  engine)
    # a persistent compilation cache of the stage's own: the device-only rows' ahead-of-time compiles load what the
    # engine's first generate compiled (fifteenth session: 1 and 64 prompts then fit one call)
    export JAX_COMPILATION_CACHE_DIR=/tmp/dijax-engine-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    run 60 python3 tools/host_probe.py --batch 1,64  # the host's share of a decode step, this host, no device
    run 450 python3 tools/bench.py --kernels auto --decode-batch "" --prefill "" --block-size 16 --engine on \
      --engine-batch 1,64 --warmup 5 --iters 30 ;;
  flash-engine)
    export JAX_COMPILATION_CACHE_DIR=/tmp/dijax-engine-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    run 560 python3 tools/bench.py --model flash-slice --decode-batch "" --prefill "" --block-size 128 --engine on \
      --engine-batch 1,64 --warmup 3 --iters 10 ;;
  dispatch)
    run 200 python3 tools/dispatch_probe.py --batch 1,32 --trace "$out/trace-dispatch"
    run 60 python3 tools/trace_summary.py "$out/trace-dispatch" --host --steps 10 --top 25
    # the ZOS rows without the loops in the step's graphs (XLA's default list): does a WHILE / CONDITIONAL graph
    # make a launch wait for the step in flight?
    run 120 python3 tools/dispatch_probe.py --batch 1 \
      --step-xla-option xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN
    # which allocations move between runs: XLA logs each graph update (none expected: dijax.runtime.step_buffers)
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=3,gpu_executable=5 timeout 100 \
      python3 tools/dispatch_probe.py --batch 1 > "$out/dispatch-vlog.txt" 2>&1
    # per probe row (each measures 55-60 launches): which launches re-record a graph
    awk '/^-- row: /{row=substr($0, 9)} /[Uu]pdate command buffer/{n[row]++}
         END{for (r in n) print "graph updates in row " r ": " n[r]}' "$out/dispatch-vlog.txt" >> "$log"
    grep -iE "changed address|updated_allocs" "$out/dispatch-vlog.txt" | sed 's/^.*\] //' | sort | uniq -c | sort -rn | head -8 >> "$log" ;;
  flash)
    run 570 python3 tools/bench.py --model flash-slice --decode-batch 1,16,64,128 --context 4095 \
      --prefill 1024,8192 --kernels on --engine off --warmup 3 --iters 10 ;;
  flash-profile)
    run 420 python3 tools/bench.py --model flash-slice --decode-batch 64 --context 4095 --prefill 1024 \
      --kernels on --engine off --warmup 3 --iters 5 --dump "$out/dump-flash"
    for d in "$out"/dump-flash/*/; do
      run 60 python3 tools/trace_summary.py "$d" --top 30
    done ;;
  bench)
    for kernels in off on; do
      run 150 python3 tools/bench.py --kernels "$kernels" --decode-batch 1,32 --context 256 --prefill 256 \
        --block-size 16 --engine off --warmup 5 --iters 20 --dump "$out/dump-$kernels"
    done
    run 30 python3 tools/trace_summary.py "$out"/dump-on/*/ --top 15
    for hlo in "$out"/dump-on/*.hlo.txt; do  # the GEMM fusions' tilings: one 16 x 8 tiling for all = no autotuning
      run 30 python3 tools/hlo_kernels.py --gemm "$hlo"
    done ;;
  ep-parity)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
    parity ep2-tiny-nodrop 540 "$fixtures/tiny-nodrop" --ep 2 &
    parity ep2-engine 540 "$fixtures/tiny-nodrop" --engine --ep 2 &
    parity ep2-tiny 540 "$fixtures/tiny" --ep 2 &
    wait
    parity_summary "$out"/parity-ep2-*.txt ;;
  ep-bench)
    export NCCL_NVLS_ENABLE=0
    run 570 python3 tools/bench.py --model flash-slice --ep "${EP:?EP=1 or EP=2}" --decode-batch 1,16,64,128 \
      --context 4095 --prefill 4096,8192 --kernels on --engine off --warmup 3 --iters 10 ;;
  ep-trace)
    export NCCL_NVLS_ENABLE=0
    run 400 python3 tools/bench.py --model flash-slice --ep 2 --decode-batch 64 --context 4095 --prefill 4096 \
      --kernels on --engine off --warmup 3 --iters 5 --dump "$out/dump-ep2"
    for d in "$out"/dump-ep2/*/; do
      run 60 python3 tools/trace_summary.py "$d" --streams
      run 60 python3 tools/trace_summary.py "$d" --top 20
    done ;;
  ab)
    need_base
    export JAX_COMPILATION_CACHE_DIR=/tmp/dijax-ab-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    read -r -a ab_args <<< "${AB_ARGS:---kernels on --decode-batch 1 --context 256 --prefill= --block-size 16 --engine off --warmup 10 --iters 50}"
    for round in $(seq "${AB_ROUNDS:-2}"); do
      for tree in ab-base .; do
        name=$([ "$tree" = . ] && echo this || echo base)
        echo "== $name, round $round" | tee -a "$log"
        (cd "$tree" && PYTHONPATH=. timeout 240 python3 tools/bench.py "${ab_args[@]}") >> "$log" 2>&1 \
          || echo "   (exit $?)" >> "$log"
      done
    done ;;
  mgpu-ab)
    # (~550 s) a sparse-attention / indexer kernel change against ab-base (export it as for `ab`): the two kernels'
    # GPU tests and GPU parity (sparse attention on Mosaic GPU at every step, the default since the forty-seventh
    # session), side by side;
    # then their Mosaic GPU rows by GPU kernel time, ab-base's tree, then this one's
    need_base
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    tests_beside_parity 270 tests/gpu/test_attention_gpu.py tests/gpu/test_indexer_gpu.py
    for tree in ab-base .; do
      (cd $tree && run 140 python3 tools/bench_kernels.py --only sparse_attn,indexer --rows mgpu --sweep --timing device \
        --iters 10 --repeats 3)
    done ;;
  mgpu-profile)
    # (~300 s; first after a machine start, as `profile` says) hardware counters of fp4_wgmma at decode sizes, where
    # it streams its weights at 28-35 % of the bytes floor (T = 1: 89.7 us, T = 64: 2.85 ms a layer, thirty-first
    # session): stall reasons, bytes in flight, issue rate. The details page comes back whole ($out/ncu-mgpu.txt).
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    # (thirty-sixth session: without a kernel filter the 60 launches profiled were all the inputs' fusions; Mosaic
    # GPU names a kernel after its Python function, here "kernel_mosaic_gpu_kernel")
    run 280 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section WarpStateStats --section SchedulerStats --section LaunchStats -k regex:^kernel_mosaic_gpu -c 12 \
      -o "$out/ncu-mgpu" \
      python3 tools/profile_routed.py 1:ragged 64:ragged --config "{'mgpu_min_assignments': 0}"
    ncu --import "$out/ncu-mgpu.ncu-rep" --page details > "$out/ncu-mgpu.txt" 2>&1
    grep -E "^  [A-Za-z_]|Duration|Memory Throughput|Registers Per|Achieved Occupancy|Cycles Per Issued|Stall" \
      "$out/ncu-mgpu.txt" | head -150 >> "$log" ;;
  launch-check)
    # (~450 s)
    tiny="--decode 1,64 --context 256 --prefill 256 --block-size 16"
    flash="--model flash-slice --context 4095 --block-size 128"
    target=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)
    run 150 python3 tools/bench.py --kernels on ${tiny/--decode/--decode-batch} --engine off --warmup 1 --iters 3
    run 60 python3 tools/deviceless.py --kernels on --target $target $tiny
    run 150 python3 tools/bench.py $flash --decode-batch 1,16,64 --prefill= --kernels on --engine off --warmup 1 \
      --iters 3  # (on an 80 GB card too since the thirty-fourth session's sliced weight draw)
    run 90 python3 tools/deviceless.py --kernels on --target $target $flash --decode 1,16,64 ;;
  h200-owed)
    # (~450 s; an H200's first call, fifty-seventh session) what the issues still ask of an H200: the tiny decode
    # step at batch 1 back to back (issue 11: <= 1 ms), the sparse-attention rows by GPU kernel time (issue 13),
    # flash-slice decode at batch 1 and 64 (issue 12: 50 % / 60 %), then GPU parity side by side (the `parity` stage)
    run 70 python3 tools/bench.py --kernels on --decode-batch 1 --context 256 --prefill= --block-size 16 \
      --engine off --warmup 10 --iters 50
    run 70 python3 tools/bench_kernels.py --only sparse_attn --rows mgpu --timing device --iters 10 --repeats 3
    run 200 python3 tools/bench.py --model flash-slice --decode-batch 1,64 --context 4095 --prefill= --kernels on \
      --engine off --warmup 3 --iters 10
    parity_all 200 ;;
  parity)
    parity_all 540 ;;
  *) echo "unknown stage $stage (one of $stages)" >&2; exit 2 ;;
esac
grep -E "^(kernels of|==|   \(exit|\||parity|bucket|total|graph update|.*passed|.*failed|.*Triton GEMM fusions|.*warps, |.*device busy|  (decode|prefill|engine|device))" "$log" | tail -120
