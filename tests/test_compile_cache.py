"""The persistent compilation cache (dijax.runtime.compile_cache): a second process loads the engine's compiled
steps instead of compiling them, and generates the same tokens with them. On a GPU host (tools/gpu_validate.sh
cache) the processes run on the GPU, with the Pallas kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dijax.runtime.llm_engine import LLMEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One small generation in a fresh process; prints its tokens and JAX's cache hits and misses. Every compile is
# cached (the minimum compile time set to 0), so the second process should compile nothing.
SCRIPT = """
import json, sys
import dijax
import jax
from jax import monitoring
counts = {"hits": 0, "misses": 0}
def count(event, **kwargs):
    for name in counts:
        if event == "/jax/compilation_cache/cache_" + name:
            counts[name] += 1
monitoring.register_event_listener(count)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from dijax.runtime.llm import LLM
from dijax.runtime.sampling_params import SamplingParams
llm = LLM(None, max_num_seqs=2, max_num_batched_tokens=8, compile_cache_dir=sys.argv[1])
outs = llm.generate([[5, 6, 7], "The license"], SamplingParams(max_tokens=3, seed=7, temperature=0.8),
                    use_tqdm=False)
print(json.dumps({"tokens": [out.token_ids for out in outs], **counts}))
"""


def _generate(cache_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)  # the parent's platform: on the GPU, Pallas executables from disk
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, cache_dir], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_compiled_steps(tmp_path):
    cache = str(tmp_path / "cache")
    first = _generate(cache)
    assert first["misses"] > 0 and first["hits"] == 0, first
    entries = os.listdir(cache)
    assert any(name.startswith("jit_step-") for name in entries), entries
    second = _generate(cache)
    assert second["misses"] == 0 and second["hits"] == first["misses"], (first, second)
    assert second["tokens"] == first["tokens"]
    assert all(len(tokens) == 3 for tokens in first["tokens"])


@pytest.mark.parametrize("bad", ["", 7])
def test_a_bad_cache_directory_is_refused_before_loading(bad):
    with pytest.raises(ValueError, match="compile_cache_dir"):
        LLMEngine(compile_cache_dir=bad, loaded=("not", "a", "model", "!"))


def test_a_cache_path_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ValueError, match="compile_cache_dir .* cannot be created"):
        LLMEngine(compile_cache_dir=str(path), loaded=("not", "a", "model", "!"))
