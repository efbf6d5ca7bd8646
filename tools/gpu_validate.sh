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
#   device-timing  (twenty-seventh session, not yet run) bench_kernels' --timing device, the GPU kernel time of each
#            row from a profiler trace, on the rows wall time could not rank: the routed mat-vecs' tilings at 1
#            token (one configuration timed 83-100 us by wall time across calls) and the fused linears, then the
#            same rows by wall time for comparison;
#   sinkhorn the Sinkhorn kernel's GPU tests and its two division forms timed (SinkhornConfig.fast_divide, on by
#            default since the thirteenth session's run: the same bits, faster);
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
#            the XLA GEMMs' rows; stack-dsf the same decode rows with XLA's dynamic-slice fusion on;
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
#   prefill-moe  (issue 12: the grouped GEMMs are 46 % of prefill 8192 at 30 % of bf16 peak, twenty-third session)
#            the routed-experts layer alone at T = 1024 and 8192 with 128-row tiles (mean 128 assignments an expert
#            at 8192), 8 warps or 64 columns (built for sm_90 on the CPU: 4 warps at 128 rows spill 808 bytes, these
#            two do not), then flash-slice prefill 8192 with each against the default (twenty-fourth session: in
#            prefill 8192 they lost 15 % and 27 %; the layer-alone rows at 8192 need bench_kernels' pallas baseline,
#            since added: XLA's dense ragged_dot reference did not fit);
#   xla-gemms  flash-slice decode B=1 and 16 with XLA's Triton GEMM fusions (the default), then with them off
#            (cuBLAS): the twenty-second session's trace had 19 bf16 GEMM fusions at 9.7 us mean at B=1 (router,
#            compressor, index weights; ~10 % of their bytes' floor);
#   mgpu-check  (thirty-first session) the Mosaic GPU kernels' GPU tests, and GPU parity with the defaults (each
#            Mosaic GPU engine where it takes a step) beside a copy of the tree with every engine 'triton', all side
#            by side; then sparse attention's and the indexer's rows, Triton against Mosaic GPU (with ALL_TESTS=1: every
#            other GPU test and the engine's timeline and warm-up tests side by side instead of the rows);
#   mgpu-ab  a sparse-attention / indexer kernel change (thirty-second session: branch gather-under-scores) against
#            ab-base: their GPU tests, parity with sparse attention on Mosaic GPU at every step, then their Mosaic GPU
#            rows by GPU kernel time in both trees (bench_kernels --rows mgpu --sweep);
#   mgpu-rows  the routed experts on Mosaic GPU against the Triton kernels at decode sizes (GPU
#            kernel time; the routed GEMM also at 8 stages, whose 80 KB in flight a CTA at 8-row tiles is twice
#            the default's, and with `overlap`: at decode one CTA a multiprocessor streams 327 KB of weights, and its
#            SASS waits for every step's wgmma before the next step's scale load and decode, thirty-second session)
#            and the routed layer at 8192 tokens;
#   mgpu-fp8  the fp8 linears on Mosaic GPU against the Triton kernel at decode sizes (GPU kernel time);
#   mgpu-profile  Nsight Compute counters of fp4_wgmma at decode sizes (T = 1 and 64, the ragged path forced);
#   mgpu-attn-time  sparse attention's rows and variants by GPU kernel time, then by wall time;
#   mgpu-flash  flash-slice decode at batch 1 / 64 and prefill 8192 with the defaults, then with every engine
#            'triton' (TRITON_SETTINGS);
#   stream-probe  (~60 s) tools/stream_probe.py: a Mosaic GPU pipeline that only streams the routed experts' words,
#            in their stored layout (64-byte pieces of rows 2560 bytes apart) and in a tiled one (each step's 8 KB
#            contiguous), beside XLA's reduction of the same words (thirty-sixth session, H100: tiles 1.24 TB/s at 8
#            stages against the stored rows' 1.06 at 4, XLA 1.42; fp4_wgmma itself streamed 1.5-2.0 under ncu);
#   mixes-ab  (~300 s) the hyper-connection mixes alone (bench_kernels --only mixes: both widths, GPU kernel time),
#            then the tiny decode rows at batch 1, 16 and 64 with the mixes in two launches (sinkhorn.mixes_pallas: on
#            by default since the thirty-sixth session up to 16 tokens and width 4096), off, and on up to 128 tokens,
#            alternating over two rounds;
#   attn-profile  (~240 s; first after a machine start) Nsight Compute of sparse attention's Mosaic GPU kernel at
#            decode B=64 and 256 (tools/profile_attn.py, the model's window + pool layout; issue 13's 70 %: it runs
#            at ~4.5 us a 64-row block against ~1.7 us of tensor work and ~2.6 us of its bytes on an H100) and of the
#            routed mat-vecs at T = 1 and 16: stall reasons per SASS instruction (SourceCounters) besides the
#            details page, both back as files ($out/ncu-*.txt, ncu-*-sass.csv);
#   cluster-probe  (~300 s) sparse attention's splits merged across clusters of 2 and 4 against XLA's merge, by GPU
#            kernel time, then Nsight Compute's launch and occupancy sections of both cluster sizes (forty-eighth
#            session: clusters of 4 lost by up to 1.7x; forty-ninth, H100: at most 30 clusters of 4 are resident);
#   host-ab  (~300 s) the tiny step's host work of a base tree (ab-base/, exported as for `ab`) against this one:
#            tools/dispatch_probe.py at B=1, alternating over three rounds (the host's spread needs them: the same
#            executable ran 0.91-1.52 ms back to back on one H100 in the forty-ninth session), then the staging
#            change's GPU tests;
#   indexer-rows  (~200 s) the indexer's GPU tests, then its prefill row (8192 x 2048) by GPU kernel time with each
#            kernel apart (bench_kernels --kernel-split) at one (the default) and two compute warpgroups a CTA and
#            16 blocks a CTA (fifty-second session, H100: 168.2 us with one warpgroup, 191.3 with two, 171.8 with
#            16 blocks);
#   indexer-e2e  (~400 s) flash-slice prefill 8192 with the indexer's two warpgroups a CTA against one (the default;
#            fifty-third session, H100: 193.3 against 193.6 ms, within the rounds' spread);
#   attn-timeline  (~120 s) where a sparse-attention warpgroup's clocks go, step by step (Mosaic GPU's on-device
#            profiler: SparseAttnConfig.mgpu_trace_dir): its GPU tests, then the timeline's regions at batch 1 / 64 /
#            256 (tools/profile_attn.py --trace-dir, tools/kernel_regions.py; fifty-fifth session, H100: at batch 64
#            the cluster merge at the end is 31 % of a CTA's span; its parts are regions of their own since then);
#   attn-shared  (~400 s) sparse attention with warpgroup 0 alone computing the scores and softmax, P through shared
#            memory (SparseAttnConfig.mgpu_shared_scores, the default since the fifty-fifth session) against each
#            warpgroup computing them: the GPU tests (the same bits), the rows, the timeline at 64 / 256 unshared
#            (attn-timeline gives the default's), flash-slice decode at 64 / 128 (fifty-sixth session, H100, B=64
#            alone: 18.60 against 18.59 ms back to back);
#   attn-merge  (~220 s) the cluster merge without shared-memory bank conflicts: the Mosaic GPU kernel's GPU tests,
#            the kernel rows of a base tree (ab-base/) against this one's, the timeline (fifty-sixth session, H100:
#            21 passed, batch 64 29.2 -> 27.8 us, the merge ~15,800 -> ~12,600 clocks, ~7,800 of them its reads);
#   indexer-profile  (~200 s) Nsight Compute counters of the Mosaic GPU indexer at prefill 8192 x 2048;
#   launch-ab  (~400 s) the collapse kernel's GPU test file, then the tiny step at B=1 / 16 with the latents and
#            collapse kernels on and off, each with a profiler trace and its device-busy time a step (fortieth
#            session: wall time could not rank their launch cuts);
#   launch-cuts  (~240 s) the forty-second session's launch cuts (the routed gate-up kernel's fq8 epilogue, the
#            router's padding mask): their GPU tests beside GPU parity, then the tiny step of a base tree (ab-base/)
#            and of this one alternating, with profiler traces;
#   layouts  (~480 s) the thirty-eighth session's changed kernels (token-major split and router outputs, the
#            split's prologue) on the GPU: their tests, tiny-nodrop parity, the tiny step's rows and launches;
#   sampler  (~500 s) the sampler's tests (the thresholds kernel's GPU test among them), its rows at V4.1's
#            vocabulary by GPU kernel time (bench_kernels --only sampler: the step's every-mode sampler, each mode
#            alone, the sample mode with each top-k / top-p filter, the bare sort; R = 1 / 16 / 64), then
#            flash-slice decode B=16 / 64 in one process (bench.py --variant): the XLA select, the thresholds
#            kernel, the sort, two rounds;
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
#           stack, stack-dsf, engine, flash-engine, dispatch, flash, flash-profile, bench, parity: one call each)
set -uo pipefail
stages="h200-owed|attn-dims|attn-dims-flash|attn-merge|attn-shared|attn-timeline|indexer-rows|indexer-e2e|indexer-profile|attn-profile|cluster-probe|host-ab|launch-ab|launch-cuts|layouts|stream-probe|mixes-ab|sampler|tests|tests-rest|kernels|sweep|sweep-fp8|device-timing|sinkhorn|profile|warmup|compile|cache|stack|stack-dsf|engine|flash-engine|dispatch|flash|flash-profile|bench|prefill-moe|xla-gemms|mgpu-check|mgpu-ab|mgpu-rows|mgpu-fp8|mgpu-profile|mgpu-attn-time|mgpu-flash|launch-check|parity|ab|ep-parity|ep-bench|ep-trace"
stage=${1:?usage: tools/gpu_validate.sh STAGE, one of $stages}
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: stages run some commands inside a copy of the tree
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
ncu_attn() {  # sections, batches ("1 32"), then SparseAttnConfig changes: Nsight Compute of sparse attention's
  # Mosaic GPU kernel (tools/profile_attn.py) under each change in turn
  local sections=$1 batches=$2 config
  shift 2
  for config in "$@"; do
    run 120 ncu --clock-control none $sections -k regex:^kernel_mosaic_gpu -c 2 \
      python3 tools/profile_attn.py $batches --config "$config"
  done
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
sub=/tmp/gv  # side-by-side runs' outputs (check) and copies of the tree with other defaults
check() {  # name, tree (. or a copy), time limit, command...: run in the background of a stage, output to $sub/name.txt
  local name=$1 tree=$2 limit=$3; shift 3
  (cd "$tree" && timeout "$limit" "$@" > "$sub/$name.txt" 2>&1; echo "$name: exit $?" >> "$sub/exits.txt")
}  # (python -m puts the working folder first on the path: a copy is run from inside it)
tree_with() {  # name, then (module, old line, new line) triples: a fresh $sub with a copy of dijax/ at $sub/tree-NAME
  # whose dijax/kernels/MODULE.py has each old line replaced (sed patterns), the new lines logged
  local tree=$sub/tree-$1; shift
  rm -rf $sub; mkdir -p $tree; cp -r dijax $tree/
  while [ $# -ge 3 ]; do
    sed -i "s/^$2\$/$3/" $tree/dijax/kernels/$1.py
    grep -H "^$3\$" $tree/dijax/kernels/$1.py >> "$log" || echo "   (tree_with: no line '$2' in $1.py)" >> "$log"
    shift 3
  done
}
parity_checks() {  # tree, time limit: GPU parity of tiny-nodrop (one step, --chunk 7, the engine) and tiny, each a
  # check in the background of a stage
  local tree=$1 limit=$2 f=$PWD/$fixtures p="python3 -m dijax.cli.main parity --kernels on"
  check parity-tiny-nodrop "$tree" "$limit" $p $f/tiny-nodrop &
  check parity-chunk7 "$tree" "$limit" $p $f/tiny-nodrop --chunk 7 &
  check parity-engine "$tree" "$limit" $p $f/tiny-nodrop --engine &
  check parity-tiny "$tree" "$limit" $p $f/tiny &
}
checks_with() {  # tree, time limit, GPU test files: parity_checks of the tree and each test file (of this tree), side
  # by side, then checked
  local tree=$1 limit=$2 file; shift 2
  parity_checks "$tree" "$limit"
  for file in "$@"; do
    check "tests-$(basename "$file" .py)" . "$limit" python3 -m pytest -q -ra -p no:cacheprovider "$file" &
  done
  wait
  checked
}
checked() {  # after `wait`: the exits, the tests' summaries and the parity runs' into the log; every output in one
  # archive under $out (a device call brings back at most 8 files)
  tar czf "$out/checks.tgz" -C $sub --exclude='tree-*' .
  cat $sub/exits.txt >> "$log"
  for f in $sub/tests-*.txt; do echo "== $f"; grep -E "passed|failed|FAILED|ERROR|Error" "$f" | tail -12; done >> "$log"
  parity_summary $sub/parity-*.txt
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
  cluster-probe)
    # (~300 s) why 4 splits in clusters of 4 lost (forty-eighth session, H200: batch 32 47.3 us against 27.0 for 3
    # splits merged in XLA, batch 1 23.2 against 18.7): sparse attention's splits rows by GPU kernel time (pairs in a
    # cluster and in XLA, 4 in clusters of 4 and in XLA), then Nsight Compute's launch, occupancy and throughput
    # sections (Max Active Clusters among them) of 4 splits in clusters of 4 and of pairs, at batch 1 and 32
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    run 150 python3 tools/bench_kernels.py --only sparse_attn --rows "mgpu 2,mgpu 3,mgpu 4" --sweep --tokens 1,16,32,64 \
      --timing device --iters 10 --repeats 3
    ncu_attn "--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats" "1 32" \
      "{'num_splits': 4, 'cluster_splits': (2, 4)}" "{'num_splits': 2}"
    grep -E "^  [A-Za-z_]|Duration|Cluster|Occupancy|Throughput|Waves" "$log" | head -100 ;;  # the ncu lines, shown
  host-ab)
    need_base
    for round in 1 2 3; do
      for tree in ab-base .; do
        name=$([ "$tree" = . ] && echo this || echo base)
        echo "== $name, round $round" | tee -a "$log"
        (cd "$tree" && PYTHONPATH=. timeout 80 python3 tools/dispatch_probe.py --batch 1 --context 256) 2>&1 \
          | grep -E "^\| (engine|stage|model step|tokens|no-op|ZOS)" >> "$log"
      done
    done
    run 150 python3 -m pytest -q -ra tests/test_step_buffers.py tests/test_step_timeline.py ;;
  stream-probe)
    run 150 python3 tools/stream_probe.py ;;
  indexer-rows)
    run 150 python3 -m pytest -q -ra tests/gpu/test_indexer_gpu.py
    run 200 python3 tools/bench_kernels.py --only indexer --rows mgpu --timing device --kernel-split --iters 10 \
      --repeats 3 --variant mgpu_warpgroups=2 --variant mgpu_blocks=16 ;;
  attn-timeline)
    # (~120 s) the timeline's GPU tests (the same bits with it, a region entered once a block), then each region's
    # cycles and share of a warpgroup's span at batch 1 / 64 / 256 (fifty-fourth session: batch 64 spends ~3.8 us
    # a 64-row block, and neither the bytes nor the issue rate bound it; the timeline says which step does)
    run 150 python3 -m pytest -q -ra tests/gpu/test_attention_gpu.py -k timeline
    run 150 python3 tools/profile_attn.py 1 64 256 --trace-dir "$out/attn-trace" ;;
  attn-merge)
    # (~220 s) the cluster merge's fp32 tiles a row padded (cluster.tiles_shape: no bank conflicts) and its leaving
    # meeting split (fifty-sixth session; the fifty-fifth's timeline gave the merge ~16,000 of a CTA's ~52,000
    # clocks at batch 64): the Mosaic GPU kernel's GPU tests (the merge at 2, 4 and 8 splits, shared scores), the
    # kernel rows of a base tree (ab-base/, exported as for `ab`, carried) and of this one by GPU kernel time, then
    # this one's timeline at batch 64 and 256 (the merge's parts: store, meeting, merge, write, leave)
    need_base
    run 150 python3 -m pytest -q -ra tests/gpu/test_attention_gpu.py -k "mgpu_matches or mgpu_shapes or shared_scores"
    rows=(tools/bench_kernels.py --only sparse_attn --rows mgpu --timing device --iters 10 --repeats 3)
    echo "== base tree (ab-base)" >> "$log"
    (cd ab-base && run 90 python3 "${rows[@]}")
    run 90 python3 "${rows[@]}"
    run 80 python3 tools/profile_attn.py 64 256 --trace-dir "$out/attn-trace" ;;
  attn-dims)
    # (~330 s) a head group's output dims split over CTAs (SparseAttnConfig.mgpu_dim_splits; fifty-seventh session:
    # at batch 64 two CTAs each walking the whole list for half the dims, instead of half the list each and the
    # cluster merge): the Mosaic GPU kernel's GPU tests, its rows by GPU kernel time with 1, 2 and 4 dim splits,
    # the timeline at batch 64 with 2, then flash-slice decode at batch 1 and 64 with 1 and 2 in one process
    run 200 python3 -m pytest -q -ra tests/gpu/test_attention_gpu.py \
      -k "dim_splits or mgpu_matches or mgpu_shapes or shared_scores"
    run 100 python3 tools/bench_kernels.py --only sparse_attn --rows mgpu --timing device --iters 10 --repeats 3 \
      --variant mgpu_dim_splits=2 --variant mgpu_dim_splits=4
    run 80 python3 tools/profile_attn.py 64 --config "{'mgpu_dim_splits': 2}" --trace-dir "$out/attn-trace" ;;
  attn-dims-flash)
    run 400 python3 tools/bench.py --model flash-slice --decode-batch 1,64 --context 4095 --prefill= --kernels on \
      --engine off --warmup 3 --iters 10 --variant "sparse_attn.CONFIG.mgpu_dim_splits=2" ;;
  attn-shared)
    # (~400 s) shared scores (the default; fifty-fifth session, H100: batch 64 29.2 against 30.1 us unshared, 256 78.4
    # against 81.6): the GPU tests (the same bits as unshared through the seam), the kernel rows shared and unshared
    # by GPU kernel time, where a warpgroup's clocks go unshared (the timeline; attn-timeline gives the default's),
    # then flash-slice decode at batch 64 and 128 shared and unshared (one process)
    run 150 python3 -m pytest -q -ra tests/gpu/test_attention_gpu.py -k shared_scores
    run 120 python3 tools/bench_kernels.py --only sparse_attn --rows mgpu --timing device --iters 10 \
      --repeats 3 --variant mgpu_shared_scores=False
    run 100 python3 tools/profile_attn.py 64 256 --trace-dir "$out/attn-trace-unshared" \
      --config "{'mgpu_shared_scores': False}"
    run 200 python3 tools/bench.py --model flash-slice --decode-batch 64,128 --context 4095 --prefill= --kernels on \
      --engine off --warmup 3 --iters 10 --rounds 1 --variant "sparse_attn.CONFIG.mgpu_shared_scores=False" ;;
  indexer-e2e)
    # (~400 s) flash-slice prefill 8192 with the indexer's two compute warpgroups a CTA against one (the default),
    # alternating over two rounds in one process (the model loaded once)
    run 560 python3 tools/bench.py --model flash-slice --decode-batch 1 --context 255 --prefill 8192 --kernels on \
      --engine off --warmup 2 --iters 5 --rounds 2 \
      --variant "indexer.CONFIG.mgpu_warpgroups=2" ;;
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
  mixes-ab)
    # (~250 s) the hyper-connection mixes alone at both widths by GPU kernel time (bench_kernels: 14 a jitted call, as
    # in a flash-slice step), then the tiny decode rows at batch 1, 16 and 64 with the mixes in two launches as by
    # default (steps of up to 16 tokens of streams up to 4096 wide), off, and on up to 128 tokens, alternating over
    # two rounds in one process (thirty-seventh session: the default held, docs/benchmarks.md)
    run 150 python3 tools/bench_kernels.py --only mixes --timing device --iters 10 --repeats 3
    export JAX_COMPILATION_CACHE_DIR=/tmp/dijax-mixes-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    run 240 python3 tools/bench.py --kernels on --decode-batch 1,16,64 --context 256 --prefill= --block-size 16 \
      --engine off --warmup 5 --iters 30 --variant "sinkhorn.CONFIG.fused_mixes_max_tokens=0" \
      --variant "sinkhorn.CONFIG.fused_mixes_max_tokens=128" --rounds 2 ;;
  launch-ab)
    # (~400 s; fortieth session, not yet run) do the launch-count cuts pay on the device? Wall time could not tell
    # (one H100: the same tiny B=64 executable ran 2.78 and 3.24 ms back to back in two processes). The collapse
    # GPU test file first (the script form of it passed), then the tiny step at B=1 and 16 with every kernel on and
    # with the latents and collapse kernels off (`on,...=reference`, 56 / 48 launches more), each with a profiler
    # trace; trace_summary gives each trace's device-busy time and launch gaps a step, the figures to compare
    run 120 python3 -m pytest -q -ra tests/gpu/test_collapse_gpu.py
    for kernels in on on,latents_impl=reference,collapse_impl=reference; do
      run 150 python3 tools/bench.py --kernels "$kernels" --decode-batch 1,16 --context 256 --prefill= \
        --block-size 16 --engine off --warmup 5 --iters 20 --dump "$out/dump-${kernels//[,=]/-}"
    done
    for trace in "$out"/dump-*/decode_*/; do
      run 30 python3 tools/trace_summary.py "$trace" --top 5
    done ;;
  launch-cuts)
    # (~240 s on an H100; forty-second session: the tests passed, parity as before, device busy 761 -> 736 us at
    # tiny B=1) the routed gate-up mat-vec writing h fq8'd and phase-major, and the router
    # masking padding tokens (both took an XLA launch of their own before): GPU parity of tiny-nodrop and tiny beside
    # those kernels' GPU test files, then the tiny step (B=1 / 16) of the base tree (ab-base/, exported as for `ab`)
    # and of this one, alternating over two rounds, the second round with profiler traces (device busy a step)
    need_base
    rm -rf $sub; mkdir -p $sub
    XLA_PYTHON_CLIENT_PREALLOCATE=false checks_with . 300 tests/gpu/test_routed_experts_gpu.py \
      tests/gpu/test_router_gpu.py
    for round in 1 2; do
      for tree in ab-base .; do
        name=$([ "$tree" = . ] && echo this || echo base)
        dump=(); [ "$round" = 2 ] && dump=(--dump "$(realpath "$out")/dump-$name")
        echo "== $name, round $round" | tee -a "$log"
        (cd "$tree" && PYTHONPATH=. timeout 150 python3 tools/bench.py --kernels on --decode-batch 1,16 --context 256 \
          --prefill= --block-size 16 --engine off --warmup 5 --iters 30 "${dump[@]}") >> "$log" 2>&1 \
          || echo "   (exit $?)" >> "$log"
      done
    done
    for trace in "$out"/dump-*/decode_*/; do
      run 30 python3 tools/trace_summary.py "$trace" --top 5
    done ;;
  layouts)
    # (~500 s; first run in the fortieth session, H100: every test passed, parity as before) the kernels built
    # without a device: the split kernel's token-major output with the affine part and the RMS factor in its
    # prologue (and pre in a buffer of its own), the router's [T, X] outputs, the sampler's thresholds kernel, the
    # latents and collapse-and-norm kernels (their GPU tests); then GPU parity of tiny-nodrop (the model and the
    # engine, every kernel on) and the tiny step's rows with their launch counts, with the latents kernel and without
    run 180 python3 -m pytest -q -ra tests/gpu/test_sinkhorn_gpu.py tests/gpu/test_router_gpu.py \
      tests/gpu/test_latents_gpu.py tests/gpu/test_collapse_gpu.py tests/gpu/test_sample_filter_gpu.py
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    parity tiny-nodrop 200 "$fixtures/tiny-nodrop" &
    parity engine 200 "$fixtures/tiny-nodrop" --engine &
    wait
    parity_summary "$out"/parity-*.txt
    for kernels in on on,latents_impl=reference; do
      run 90 python3 tools/bench.py --kernels $kernels --decode-batch 1,64 --context 256 --prefill= \
        --block-size 16 --engine off --warmup 5 --iters 30
    done ;;
  sampler)
    # (~500 s) the sampler's top-k / top-p filters: their tests on the GPU (the thresholds kernel, prepared in the
    # thirty-seventh session, against the XLA select at V4.1's vocabulary; the select must keep exactly what the sort
    # keeps with the GPU's reduction order too), the sampler rows (bench_kernels: each filter alone at 1, 16 and 64
    # rows), then flash-slice decode at batch 16 and 64 in one process (the model loaded once): the default (the XLA
    # select from 2 rows, the thresholds kernel from 64 since the fortieth session), the kernel from 2 rows, the XLA
    # select at every size from 2, the sort at every size, alternating over two rounds (the second round's
    # executables from a persistent compilation cache)
    echo "== pytest tests/test_sampler.py tests/gpu/test_sample_filter_gpu.py" | tee -a "$log"
    kernel=(--variant "sampler.MANY_ROWS=2" --variant "sampler.MANY_ROWS=1024")
    timeout 100 python3 -m pytest -q -ra tests/test_sampler.py tests/gpu/test_sample_filter_gpu.py >> "$log" 2>&1 \
      || echo "   (exit $?)" >> "$log"
    run 90 python3 tools/bench_kernels.py --only sampler --timing device --iters 10 --repeats 3
    export JAX_COMPILATION_CACHE_DIR=/tmp/dijax-sampler-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    run 400 python3 tools/bench.py --model flash-slice --decode-batch 16,64 --context 4095 --prefill= --kernels on \
      --engine off --warmup 3 --iters 10 "${kernel[@]}" --variant "sampler.SELECT_MIN_ROWS=1024" --rounds 2 ;;
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
  device-timing)
    variants="--variant matvec_rows=16,matvec_warps=2 --variant matvec_rows=8,matvec_warps=2 --variant matvec_stages=4"
    for timing in device wall; do
      run 200 python3 tools/bench_kernels.py --timing $timing --only routed_experts,fp8_linears --tokens 1,16 \
        $variants --iters 10 --repeats 3
    done ;;
  sinkhorn)
    # the Sinkhorn kernel's two division forms (SinkhornConfig.fast_divide, default on): GPU tests, then both timed
    run 150 python3 -m pytest -q -ra tests/gpu/test_sinkhorn_gpu.py
    run 150 python3 tools/bench_kernels.py --only sinkhorn --iters 20 --repeats 5 ;;
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
  stack-dsf)
    # the stacked step with XLA's dynamic-slice fusion (GEMMs on a layer's slice of a stacked weight, in place: the
    # bf16 weights the step multiplies in XLA are otherwise copied out of their stack every layer) and its graphs
    run 420 python3 tools/bench.py --model flash-stack --decode-batch 1,64 --context 4095 --prefill "" \
      --engine off --warmup 3 --iters 10 --step-xla-option xla_gpu_enable_dynamic_slice_fusion=true \
      --step-xla-option xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL,DYNAMIC_SLICE_FUSION ;;
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
  prefill-moe)
    run 300 python3 tools/bench_kernels.py --only routed_experts --tokens 1024,8192 --iters 5 --repeats 3 \
      --variant gemm_rows_max=128,gemm_warps=8 --variant gemm_rows_max=128,gemm_cols=64
    for setting in "" "gemm_rows_max=128 gemm_warps=8" "gemm_rows_max=128 gemm_cols=64"; do
      settings=()
      for field in $setting; do settings+=(--kernel-setting "routed_experts.CONFIG.$field"); done
      run 120 python3 tools/bench.py --model flash-slice --decode-batch= --prefill 8192 --kernels on --engine off \
        --warmup 2 --iters 5 "${settings[@]}"
    done ;;
  xla-gemms)
    for gemms in True False; do
      run 250 python3 tools/bench.py --model flash-slice --decode-batch 1,16 --context 4095 --prefill= --kernels on \
        --engine off --warmup 3 --iters 10 --step-xla-option xla_gpu_enable_triton_gemm=$gemms
    done ;;
  mgpu-check)
    # (~450 s; the thirty-first session's first form, with copies of the tree per engine, found the row gather's
    # third source misaddressed)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    engine='    engine: str = "mgpu"' triton='    engine: str = "triton"'
    tree_with triton routed_experts '    gemm_engine: str = "mgpu"' '    gemm_engine: str = "triton"' \
      sparse_attn "$engine" "$triton" fp8_linear "$engine" "$triton" indexer "$engine" "$triton"
    check parity-triton $sub/tree-triton 280 python3 -m dijax.cli.main parity --kernels on $PWD/$fixtures/tiny-nodrop &
    parity_checks . 280
    t="python3 -m pytest -q -ra -p no:cacheprovider"
    check tests-fp4 . 280 $t tests/gpu/test_fp4_wgmma_gpu.py tests/gpu/test_routed_experts_gpu.py &
    check tests-fp8 . 280 $t tests/gpu/test_fp8_wgmma_gpu.py tests/gpu/test_fp8_linear_gpu.py &
    check tests-attn . 280 $t tests/gpu/test_attention_gpu.py &
    check tests-indexer . 280 $t tests/gpu/test_indexer_gpu.py &
    if [ -n "${ALL_TESTS:-}" ]; then  # the remaining GPU tests and the engine's GPU-guarded tests, side by side too
      check tests-rest . 400 $t tests/gpu/test_{router,sinkhorn,stacked,topk}_gpu.py &
      check tests-engine . 400 $t tests/test_step_timeline.py "tests/test_engine.py::test_no_new_compilations_after_warm_up" &
    fi
    wait
    checked
    if [ -z "${ALL_TESTS:-}${NO_ROWS:-}" ]; then  # NO_ROWS=1: the checks alone
      run 100 python3 tools/bench_kernels.py --only sparse_attn --iters 10 --repeats 3
      run 100 python3 tools/bench_kernels.py --only indexer --iters 10 --repeats 3
    fi ;;
  mgpu-ab)
    # (~550 s) a sparse-attention / indexer kernel change against ab-base (export it as for `ab`): the two kernels'
    # GPU tests and GPU parity (sparse attention on Mosaic GPU at every step, the default since the forty-seventh
    # session), side by side;
    # then their Mosaic GPU rows by GPU kernel time, ab-base's tree, then this one's
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    rm -rf $sub; mkdir -p $sub
    checks_with . 270 tests/gpu/test_attention_gpu.py tests/gpu/test_indexer_gpu.py
    for tree in ab-base .; do
      (cd $tree && run 140 python3 tools/bench_kernels.py --only sparse_attn,indexer --rows mgpu --sweep --timing device \
        --iters 10 --repeats 3)
    done ;;
  mgpu-rows)
    # (~500 s) the routed experts by GPU kernel time at decode sizes with variants (two runs: a table prints only at
    # the end of its run), then the routed layer at 8192 tokens by wall time
    v="mgpu_min_assignments=0"
    run 200 python3 tools/bench_kernels.py --only routed_experts --tokens 1,16,64 --timing device --iters 10 --repeats 3 \
      --variant "$v" --variant "$v,mgpu_warpgroups=1" --variant "$v,mgpu_stages=8" --variant "$v,mgpu_warpgroups=1,mgpu_stages=8"
    run 160 python3 tools/bench_kernels.py --only routed_experts --tokens 1,16,64 --timing device --iters 10 --repeats 3 \
      --variant "$v,mgpu_overlap=True" --variant "$v,mgpu_overlap=True,mgpu_stages=8"
    run 130 python3 tools/bench_kernels.py --only routed_experts --tokens 8192 --variant "gemm_engine='triton'" \
      --iters 5 --repeats 2 ;;
  mgpu-fp8)
    # (~200 s) the fp8 linears on Mosaic GPU against the Triton kernel at decode sizes (GPU kernel time)
    run 160 python3 tools/bench_kernels.py --only fp8_linear --tokens 1,16,64 --timing device --iters 10 --repeats 3 \
      --variant "engine='triton'" --variant "mgpu_min_tokens=1" --variant "mgpu_min_tokens=1,mgpu_warpgroups=1" ;;
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
  mgpu-attn-time)
    # (~300 s) sparse attention by GPU kernel time (the kernels of a call summed: launches and gaps left out),
    # every variant (the splits), then by wall time: issue 13's 70 % at batch >= 64 needs to know how
    # much of the 41 us wall time at batch 64 (thirty-first session) is launches and gaps
    for timing in device wall; do
      run 140 python3 tools/bench_kernels.py --only sparse_attn --sweep --timing $timing --iters 10 --repeats 3
    done ;;
  mgpu-flash)
    # (~400 s)
    triton="--kernel-setting routed_experts.CONFIG.gemm_engine='triton' --kernel-setting sparse_attn.CONFIG.engine='triton'"
    triton="$triton --kernel-setting fp8_linear.CONFIG.engine='triton' --kernel-setting indexer.CONFIG.engine='triton'"
    for setting in "" "${TRITON_SETTINGS:-$triton}"; do
      run 170 python3 tools/bench.py --model flash-slice --decode-batch 1,64 --context 4095 --prefill 8192 --kernels on \
        --engine off --warmup 2 --iters 5 $setting
    done ;;
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
