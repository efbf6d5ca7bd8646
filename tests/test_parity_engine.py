"""``dijax parity --engine`` (``run_engine``): every prompt of a fixture through the full engine (scheduler, runner,
greedy sampler) at once, compared with DeepSeek's reference logits under tiny-nodrop's tier-1 bounds.

A file of its own (not tests/test_parity.py) so that its compiles, the engine's step buckets, run on another
pytest-xdist worker than the teacher-forced parity runs.
"""

from __future__ import annotations

import io

import pytest

from tests.test_parity import _one_case_fixture, manifest_check

pytestmark = pytest.mark.cost(45)  # CI seconds, a scheduling hint (tests/conftest.py)

ENGINE_CHECK = manifest_check("tiny-nodrop", "tier1")


def _engine_figures(text: str) -> tuple[int, int]:
    """(preemptions, token mismatches) from run_engine's summary, after checking it passed."""
    assert text.strip().endswith("parity: 1/1 checks passed"), text
    summary = [line for line in text.splitlines() if line.strip().startswith("engine:")][0]
    mismatches = sum(int(line.split("token mismatches ")[1]) for line in text.splitlines()
                     if "token mismatches" in line)
    return int(summary.split("preemptions ")[1].split()[0]), mismatches


@pytest.mark.parametrize("zos, max_num_batched_tokens, num_blocks", [(True, 8, 4), (False, 7, None)])
def test_engine_parity_zos_chunks_and_preemption(tmp_path, zos, max_num_batched_tokens, num_blocks):
    """Six prompts (lengths 5 and 23) and the prefix check's one-token requests in one engine, prefills in chunks
    of 8 tokens (some ending on a block's end) or 7 next to running decodes: ZOS on with a pool of 4 blocks of 16
    (an L23 request alone takes 3), which forces preemption and recomputation; ZOS off with a pool that holds
    everything, so no preemption. Every compared step within tolerance, every token equal. Both token budgets are
    one bucket (8 tokens): each run compiles its two block-table widths only."""
    from dijax.cli.parity import run_engine

    folder = _one_case_fixture(tmp_path, "tiny-nodrop", ("case_L5", "case_L23"), [ENGINE_CHECK])
    out = io.StringIO()
    assert run_engine(folder, zos=zos, max_num_batched_tokens=max_num_batched_tokens, block_size=16,
                      num_blocks=num_blocks, out=out)
    text = out.getvalue()
    preemptions, mismatches = _engine_figures(text)
    assert mismatches == 0
    assert preemptions > 0 if num_blocks else preemptions == 0, preemptions
    assert f"zos {'on' if zos else 'off'}" in text
    assert "engine case_L5" in text and "engine case_L23" in text
