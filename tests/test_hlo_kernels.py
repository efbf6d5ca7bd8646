"""tools/hlo_kernels.py's GEMM-tiling report, on HLO lines of both of XLA's backend_config forms."""

from __future__ import annotations

from tools.hlo_kernels import gemm_tilings

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
