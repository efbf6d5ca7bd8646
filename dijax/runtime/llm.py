"""``LLM(model=..., **engine_args).generate(prompts, sampling_params)``: offline batch generation."""

from __future__ import annotations

import numbers
import threading

from tqdm import tqdm

from dijax.runtime.llm_engine import LLMEngine
from dijax.runtime.outputs import RequestOutput
from dijax.runtime.sampling_params import SamplingParams


def _is_token_id(item: object) -> bool:
    return isinstance(item, numbers.Integral) and not isinstance(item, bool)


def _prompt_list(prompts: object) -> list:
    """One prompt (a string or a list of token ids) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, a list of int token ids or a list of such prompts, got "
                        f"{type(prompts).__name__} {prompts!r:.60}")
    ids = [_is_token_id(p) for p in prompts]
    if prompts and all(ids):
        return [list(prompts)]
    if any(ids):
        i = ids.index(False)
        raise TypeError(f"prompts mixes token ids with a {type(prompts[i]).__name__} at index {i}: pass one list "
                        f"of int token ids, or a list of prompts (strings or token-id lists)")
    return list(prompts)


def _params_list(sampling_params: object, count: int) -> list:
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams, a list of them (one per prompt) or None, got "
                        f"{type(sampling_params).__name__} {sampling_params!r:.60}")
    if len(sampling_params) != count:
        raise ValueError(f"sampling_params has {len(sampling_params)} entries for {count} prompts")
    return list(sampling_params)


class LLM:
    """Offline generation. ``model``: a dijax or Hugging Face checkpoint, or None for the embedded tiny default.
    ``engine_args`` go to ``LLMEngine`` (max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
    max_model_len, zos, ep, attention_dp: ``LLM(..., ep=N)`` splits the experts over N devices and, by default,
    makes every device an attention rank with its own sequences and pools of the given sizes; trace_steps: a host
    timeline of every engine step, dijax.runtime.step_timeline; warmup: compile every step bucket first;
    small_token_buckets: the token buckets below 8, e.g. (1, 2, 4) for steps of 2-4 sequences at their size).

    ``generate`` names its requests ``req-0``, ``req-1``, ... in prompt order, counting on over the LLM's life;
    ``abort`` takes those ids. One lock guards the engine, so ``abort`` is safe from any thread while another runs
    ``generate`` (only one ``generate`` may run at a time).
    """

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
        self._lock = threading.Lock()
        self._counter = 0
        self._generating = False

    def abort(self, request_id: str) -> bool:
        """Cancel a live request: it finishes with reason 'abort' and ``generate`` returns it as such.

        Returns True when this call aborted it; False, doing nothing, when the id is unknown (including an id a
        later request will get), finished or already finishing.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        with self._lock:
            return self.engine.abort(request_id)

    def generate(self, prompts: list[str | list[int]] | str | list[int],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Every request is validated before any is
        queued, so one bad request rejects the call without touching the others. A request whose step failed comes
        back with finish reason "error" (``RequestOutput.error`` says why); the LLM stays usable."""
        prompts = _prompt_list(prompts)
        params = _params_list(sampling_params, len(prompts))
        self.engine.validate(prompts, params)
        with self._lock:
            if self._generating:
                raise RuntimeError("LLM.generate is already running (in another thread); one call at a time")
            self._generating = True
            ids = [f"req-{self._counter + i}" for i in range(len(prompts))]
            self._counter += len(prompts)
        results: dict[str, RequestOutput] = {}
        try:
            with self._lock:
                for rid, prompt, sp in zip(ids, prompts, params):
                    self.engine.add_request(rid, prompt, sp)
            with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as bar:
                while True:
                    with self._lock:
                        if not self.engine.has_unfinished():
                            break
                        outputs = self.engine.step()
                    for out in outputs:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            # interrupted (or a bug): this call's requests must not linger into the next call
            with self._lock:
                for rid in ids:
                    self.engine.abort(rid)
            raise
        finally:
            self._generating = False
        return [results[rid] for rid in ids]
