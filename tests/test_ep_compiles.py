"""At ep > 1 the engine compiles each model-step bucket once, as at ep 1, with attention data parallelism (the
default) and without: the first step's cache and previous-token array are placed as the step returns them (the
cache replicated on the mesh, or split by rank; the tokens replicated), so the second step finds the first one's
executable. Runs in a subprocess with 2 host devices (this file as a script prints the compile counts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cost(60)  # CI seconds, a scheduling hint (tests/conftest.py)

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
RUNS = {"1": (1, None), "2": (2, None), "2 replicated": (2, False)}  # name: (ep, attention_dp)


def _compiles(ep: int, attention_dp: bool | None) -> list[int]:
    """Model-step compiles after each of two identical generates at ``ep`` (a fresh model config per call)."""
    from dijax.runtime.llm import LLM
    from dijax.runtime.sampling_params import SamplingParams

    llm = LLM(max_num_seqs=4, max_num_batched_tokens=64, ep=ep, attention_dp=attention_dp)
    params = [SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.7, seed=1)]
    counts = []
    for _ in range(2):
        before = llm.engine.runner.compiles
        llm.generate(PROMPTS, params, use_tqdm=False)
        counts.append(llm.engine.runner.compiles - before)
    return counts


def test_ep2_compiles_each_bucket_once_like_ep1():
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    # the same buckets compile at ep 2 (attention DP on or off) as at ep 1, and nothing again for the same work
    assert counts["2"] == counts["2 replicated"] == counts["1"], counts
    assert counts["2"][1] == 0, counts


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import dijax  # noqa: F401  (XLA flags before JAX starts)
    from dijax.runtime import model_runner

    # decodes in the 8-token bucket at every ep: with attention DP each rank's decode holds one token (the
    # one-token bucket, one compile more) where ep 1's holds two
    model_runner.SMALL_TOKEN_BUCKETS = ()
    print(json.dumps({name: _compiles(*run) for name, run in RUNS.items()}))
