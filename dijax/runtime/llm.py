"""``LLM(model=..., **engine_args).generate(prompts, sampling_params)``: offline batch generation."""

from __future__ import annotations

import threading

from tqdm import tqdm

from dijax.runtime.llm_engine import LLMEngine
from dijax.runtime.outputs import RequestOutput
from dijax.runtime.sampling_params import SamplingParams


class LLM:
    """Offline generation. ``model``: a dijax or Hugging Face checkpoint, or None for the embedded tiny default.
    ``engine_args`` go to ``LLMEngine`` (max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
    max_model_len, zos)."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
        self._lock = threading.Lock()
        self._aborts: list[str] = []
        self._counter = 0

    def abort(self, request_id: str) -> None:
        """Cancel a request (safe from a callback or another thread); it finishes with reason 'abort'."""
        with self._lock:
            self._aborts.append(request_id)

    def generate(self, prompts: list[str | list[int]] | str, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Every request is validated before any is
        queued, so one bad request rejects the call without touching the others."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        ids = [f"req-{self._counter + i}" for i in range(len(prompts))]
        self._counter += len(prompts)
        self.engine.validate(prompts, params)
        for rid, prompt, sp in zip(ids, prompts, params):
            self.engine.add_request(rid, prompt, sp)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                with self._lock:
                    aborts, self._aborts = self._aborts, []
                for rid in aborts:
                    out = self.engine.abort(rid)
                    if out is not None:
                        results[rid] = out
                        bar.update(1)
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[rid] for rid in ids]
