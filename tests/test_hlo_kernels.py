"""tools/hlo_kernels.py's GEMM-tiling report, on HLO lines of both of XLA's backend_config forms, and the kernel
count of a step (tools/bench.py's ``kernel_launches``, the ``launches`` column of docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from tools.bench import kernel_launches
from tools.hlo_kernels import attribute, gemm_tilings, opcode

NESTED = ('  %gemm_fusion_dot.3 = bf16[64,1280]{1,0} fusion(%p0, %p1), kind=kCustom, calls=%fused_dot, '
          'backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion",'
          '"block_level_fusion_config":{"output_tiles":[{"sizes":["16","8"]}],"num_warps":"2","num_ctas":"1",'
          '"num_stages":"1"}}}')
LEGACY = ('  %fusion.7 = bf16[8192,512]{1,0} fusion(%a, %b), kind=kCustom, calls=%triton_gemm, '
          'backend_config={"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"128",'
          '"block_n":"64","block_k":"64","split_k":"1","num_stages":"4","num_warps":"8","num_ctas":"1"}}}')
OTHER = '  %loop_convert_fusion = bf16[512,5120]{1,0} fusion(%w), kind=kLoop, calls=%fused_convert'


def test_gemm_tilings_reads_both_forms_and_skips_other_fusions():
    counts = gemm_tilings("\n".join([NESTED, NESTED.replace("dot.3", "dot.4"), LEGACY, OTHER]))
    assert counts == {"output tiles 16x8, 2 warps, 1 stages": 2,
                      "blocks 128x64x64, split_k 1, 8 warps, 4 stages": 1}


def test_a_gemm_fusion_without_a_tiling_is_listed_as_such():
    line = NESTED[:NESTED.index('"block_level_fusion_config"')] + '"x":"y"}}'
    assert gemm_tilings(line) == {"(no tiling in its backend_config)": 1}


@pytest.mark.parametrize("line, want", [
    ("%f = f32[8,24]{1,0} fusion(%a), kind=kLoop, calls=%c", "fusion"),
    # a tuple shape (a library call with its workspace): the twentieth session's counts missed these
    ("%cc = (f32[8,24]{1,0}, s8[33554432]{0}) custom-call(%a, %b), custom_call_target=\"__cublas$lt$matmul\"",
     "custom-call"),
    ("ROOT %t = ((f32[2]{0}, u32[2]{0}), s32[]) tuple(%x, %y)", "tuple"),
    ("%p = bf16[4,8]{1,0:S(1)} parameter(0)", "parameter"),  # a memory space in the layout
    ("no instruction here", ""),
])
def test_opcode_reads_plain_tuple_and_memory_space_shapes(line, want):
    assert opcode(line) == want


STEP = """HloModule jit_step

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %f = f32[8]{0} fusion(%p), kind=kLoop, calls=%fused
  %s = (f32[8]{0}, s32[8]{0}) sort(%f, %i), dimensions={0}, to_apply=%less
  ROOT %r = (s32[], f32[8]{0}) tuple(%c, %f)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %mo = (f32[8]{0}, f32[8]{0}) fusion(%a), kind=kInput, calls=%multi_output
  %cc = (f32[8,24]{1,0}, s8[1024]{0}) custom-call(%a), custom_call_target="__cublas$lt$matmul"
  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8]{0} fusion(%w), kind=kLoop, calls=%last
}
"""


def test_kernel_launches_counts_tuple_shaped_kernels_and_loop_trips():
    # entry: the multi-output fusion, the library call, the last fusion; the loop: 3 trips of a fusion and a sort
    assert kernel_launches(STEP) == 3 + 3 * 2
    assert sum(attribute(STEP).values()) == 3  # the entry's kernels only (a loop's body is not attributed)
