"""``LLMEngine``: the engine loop. One ``step()`` schedules, launches and processes; ``LLM`` wraps it for batches.

With zero-overhead scheduling (default) step N is scheduled and launched before step N-1's results are processed,
so the host plans while the device computes; without it each step is processed right after its launch. Both
produce the same tokens.
"""

from __future__ import annotations

from collections import deque

from dijax.runtime.block_manager import BlockManager
from dijax.runtime.model_runner import ModelRunner, StepHandle
from dijax.runtime.outputs import RequestOutput
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.scheduler import Scheduler, SchedulerOutput
from dijax.runtime.sequence import Sequence
from dijax.runtime.state_manager import StateManager


class LLMEngine:
    """Engine over a loaded model. ``model``: a checkpoint path, or None for the embedded tiny default."""

    def __init__(self, model: str | None = None, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 128,
                 block_size: int = 16, num_blocks: int | None = None, max_model_len: int | None = None,
                 zos: bool = True, weights_seed: int = 0, loaded: tuple | None = None, debug_logits: bool = False):
        from dijax.io.loader import load

        # ``loaded``: an already loaded (config, params, Engram constants, tokenizer), e.g. a parity fixture
        self.cfg, params, consts, self.tokenizer = loaded or load(model, weights_seed)
        max_model_len = max_model_len or self.cfg.max_seq_len
        if num_blocks is None:
            num_blocks = max_num_seqs * -(-max_model_len // block_size)
        self.scheduler = Scheduler(BlockManager(num_blocks, block_size), StateManager(max_num_seqs), max_num_seqs,
                                   max_num_batched_tokens, max_model_len, eos_token_id=self.cfg.eos_token_id)
        self.runner = ModelRunner(self.cfg, params, consts, num_blocks, max_num_seqs, block_size, max_model_len,
                                  max_num_seqs, max_num_batched_tokens, debug_logits)
        # debug: request id -> {output position: logits row that sampled it} (the last computation wins, so a
        # preempted-and-recomputed position keeps the recomputed row)
        self.step_logits: dict[str, dict[int, object]] = {}
        self.zos = zos
        self._unprocessed: deque[tuple[SchedulerOutput, StepHandle | None]] = deque()
        self._prompts: dict[str, str | list[int]] = {}
        self.num_preemptions = 0

    def validate(self, prompts: list, params: list) -> None:
        """Check every request (prompt type, token ids, lengths, params) without queueing anything."""
        for prompt, sp in zip(prompts, params):
            self._token_ids(prompt, sp)

    def _token_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = [self.cfg.bos_token_id] + self.tokenizer.encode(prompt, add_special_tokens=False).ids
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size}), got {bad[:5]}")
        else:
            raise TypeError(f"prompt must be a string or a list of int token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must not be empty")
        limit = self.scheduler.max_model_len
        if len(ids) > limit:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={limit}")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request. Bad input raises before anything is queued."""
        ids = self._token_ids(prompt, params)
        if request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.add(Sequence(request_id, ids, params))
        self._prompts[request_id] = prompt

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its output (finish reason 'abort') comes back now or from a later ``step()``."""
        seq = self.scheduler.abort(request_id)
        return None if seq is None else self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._unprocessed)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, process what is due; return the requests that finished."""
        output = self.scheduler.schedule()
        self.num_preemptions += len(output.preempted)
        previous = next((h for _, h in reversed(self._unprocessed) if h is not None), None)
        handle = None if output.is_empty else self.runner.execute(output, previous)
        self._unprocessed.append((output, handle))
        finished: list[Sequence] = []
        keep = 1 if self.zos and handle is not None else 0  # ZOS: leave the newest step in flight
        while len(self._unprocessed) > keep:
            done, done_handle = self._unprocessed.popleft()
            sampled = done_handle.wait() if done_handle else {}
            if done_handle is not None and done_handle.logits:
                for chunk in done.chunks:
                    if chunk.sample:
                        rows = self.step_logits.setdefault(chunk.request_id, {})
                        rows[chunk.output_position] = done_handle.logits[chunk.request_id]
            finished += self.scheduler.process(done, sampled)
            finished += self._match_stop_strings(done)
        return [self._output(seq) for seq in finished]

    def _match_stop_strings(self, done: SchedulerOutput) -> list[Sequence]:
        """Finish (reason 'stop') every sequence of ``done`` whose detokenized output now contains a stop string."""
        finished = []
        for chunk in done.chunks:
            seq = self.scheduler.get(chunk.request_id)
            if not chunk.sample or seq is None or seq.is_finished or not seq.params.stop:
                continue
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if any(stop in text for stop in seq.params.stop):
                aborted = self.scheduler.abort(seq.request_id, reason="stop")
                if aborted is not None:
                    finished.append(aborted)
        return finished

    def _output(self, seq: Sequence) -> RequestOutput:
        prompt = self._prompts.pop(seq.request_id)
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        cuts = [text.find(stop) for stop in seq.params.stop if stop in text]
        if cuts:
            text = text[:min(cuts)]  # stop strings are not part of the returned text
        return RequestOutput(request_id=seq.request_id, prompt=prompt, text=text,
                             token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason)
