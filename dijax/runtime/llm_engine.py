"""``LLMEngine``: the engine loop. One ``step()`` schedules, launches and processes; ``LLM`` wraps it for batches.

With zero-overhead scheduling (default) step N is scheduled and launched before step N-1's results are processed,
so the host plans while the device computes; without it each step is processed right after its launch. Both
produce the same tokens.

The engine owns every request's lifetime: a request added with ``add_request`` leaves it exactly once, as a
``RequestOutput`` returned by ``step()`` (finished, stopped, aborted, or failed with reason "error"). ``abort`` of an
id that is not live is a no-op that returns False. A step that fails to launch or run finishes the requests it
computed for with reason "error" and frees their blocks and slots; the engine stays usable.
"""

from __future__ import annotations

import numbers
from collections import deque

from dijax.parallel.mesh import make_mesh, params_mesh, place_params
from dijax.parallel.ranks import num_ranks
from dijax.runtime.block_manager import BlockManager
from dijax.runtime.compile_cache import enable_compile_cache
from dijax.runtime.model_runner import ModelRunner, StepHandle, small_buckets
from dijax.runtime.outputs import RequestOutput
from dijax.runtime.sampling_params import SamplingParams
from dijax.runtime.scheduler import Scheduler, SchedulerOutput
from dijax.runtime.sequence import Sequence
from dijax.runtime.state_manager import StateManager
from dijax.runtime.step_timeline import StepTimeline


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value}")
    return int(value)


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


class LLMEngine:
    """Engine over a loaded model. ``model``: a checkpoint path, or None for the embedded tiny default.

    max_num_seqs            requests running at once (state slots), >= 1; per attention rank.
    max_num_batched_tokens  query tokens per step, >= max_num_seqs; per attention rank.
    block_size              tokens per KV block, >= 1.
    num_blocks              KV blocks in the pool (default: enough for max_num_seqs requests of max_model_len);
                            per attention rank.
    max_model_len           longest request (prompt + output), 1 .. the config's max_seq_len (default: that).
    zos                     zero-overhead scheduling (plan step N while step N-1 runs).
    ep                      expert-parallel ranks: the routed experts split over ep devices (dijax.parallel;
                            1: one device, no mesh).
    attention_dp            attention data parallelism (dijax.parallel.ranks): with ep > 1 every device of the
                            mesh is an attention rank with its own pools of the sizes above, holding and computing
                            only the sequences the scheduler assigns it. None (default): on when ep > 1. False
                            keeps every device running the whole batch on one replicated cache. Without a mesh
                            (ep = 1) there is one rank either way.
    kernels                 'auto' (the Pallas kernels on a GPU, the jnp references elsewhere), 'on' or 'off',
                            optionally followed by overrides such as ',sparse_attn_impl=pallas'
                            (dijax.kernels.options.kernel_options).
    trace_steps             keep a host timeline of every ``step()`` in ``timeline`` (a ``StepTimeline``:
                            dijax.runtime.step_timeline); off (``timeline`` None, no stamp taken) by default.
    warmup                  compile every step bucket before the first request (``ModelRunner.warmup``: in
                            parallel threads, with a progress bar), so that no step waits for a compile; off by
                            default (each bucket then compiles on its first use).
    small_token_buckets     token buckets below 8 (any of 1, 2, 4): a step of at most that many tokens runs at
                            that size instead of padding to 8; each is one executable more per block-table width.
                            None (default): (1,), one sequence's decode at T = 1. (1, 2, 4) also speeds up
                            steps of 2-4 sequences (flash-slice decode B=2 9 % on an H100); () keeps a token's
                            bits independent of its step's size (the EP equality tests).
                            (dijax.runtime.model_runner.SMALL_TOKEN_BUCKETS)
    compile_cache_dir       keep compiled steps in this directory and load them from there in later processes
                            (JAX's persistent compilation cache, process-wide: dijax.runtime.compile_cache); None
                            (default) leaves JAX's own setting (JAX_COMPILATION_CACHE_DIR) as it is.
    """

    def __init__(self, model: str | None = None, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 128,
                 block_size: int = 16, num_blocks: int | None = None, max_model_len: int | None = None, ep: int = 1,
                 zos: bool = True, weights_seed: int = 0, loaded: tuple | None = None, debug_logits: bool = False,
                 kernels: str = "auto", attention_dp: bool | None = None, trace_steps: bool = False,
                 warmup: bool = False, compile_cache_dir: str | None = None,
                 small_token_buckets: tuple[int, ...] | None = None):
        from dijax.io.loader import load

        # checked before the model is loaded: a bad size fails at once, naming itself
        max_num_seqs = _check_size("max_num_seqs", max_num_seqs)
        max_num_batched_tokens = _check_size("max_num_batched_tokens", max_num_batched_tokens)
        block_size = _check_size("block_size", block_size)
        if num_blocks is not None:
            num_blocks = _check_size("num_blocks", num_blocks)
        if max_model_len is not None:
            max_model_len = _check_size("max_model_len", max_model_len)
        ep = _check_size("ep", ep)
        small_token_buckets = small_buckets(small_token_buckets)
        if not isinstance(zos, bool):
            raise TypeError(f"zos must be a bool, got {type(zos).__name__} {zos!r}")
        for name, flag in (("trace_steps", trace_steps), ("warmup", warmup)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
        if attention_dp is not None and not isinstance(attention_dp, bool):
            raise TypeError(f"attention_dp must be a bool or None, got {type(attention_dp).__name__} "
                            f"{attention_dp!r}")
        attention_dp = ep > 1 and attention_dp is not False
        if compile_cache_dir is not None:  # before anything compiles, the loading included
            enable_compile_cache(compile_cache_dir)
        # ``loaded``: an already loaded (config, params, Engram constants, tokenizer), e.g. a parity fixture, placed
        # on the mesh below; a model loaded here goes straight onto the mesh, each device reading only its share
        self.cfg, params, consts, self.tokenizer = loaded or load(model, weights_seed, ep)
        if loaded is not None and ep > 1:
            params = place_params(params, make_mesh(ep, self.cfg.n_routed_experts))
        if max_model_len is not None and max_model_len > self.cfg.max_seq_len:
            raise ValueError(f"max_model_len must be <= the model's max_seq_len ({self.cfg.max_seq_len}), "
                             f"got {max_model_len}")
        max_model_len = max_model_len or self.cfg.max_seq_len
        if num_blocks is None:
            num_blocks = max_num_seqs * -(-max_model_len // block_size)
        ranks = range(num_ranks(params_mesh(params) if attention_dp else None))
        self.scheduler = Scheduler([BlockManager(num_blocks, block_size) for _ in ranks],
                                   [StateManager(max_num_seqs) for _ in ranks], max_num_seqs,
                                   max_num_batched_tokens, max_model_len, eos_token_id=self.cfg.eos_token_id)
        self.runner = ModelRunner(self.cfg, params, consts, num_blocks, max_num_seqs, block_size, max_model_len,
                                  max_num_seqs, max_num_batched_tokens, debug_logits, kernels, attention_dp,
                                  small_token_buckets)
        # debug: request id -> {output position: logits row that sampled it} (the last computation wins, so a
        # preempted-and-recomputed position keeps the recomputed row)
        self.step_logits: dict[str, dict[int, object]] = {}
        self.zos = zos
        self._unprocessed: deque[tuple[SchedulerOutput, StepHandle | None]] = deque()
        self._prompts: dict[str, str | list[int]] = {}  # every request not yet returned by step()
        self._released: list[Sequence] = []  # finished outside step() (abort, failures): returned by the next step
        self.num_preemptions = 0
        self.timeline = StepTimeline() if trace_steps else None
        if warmup:
            self.runner.warmup(progress=True)

    def validate(self, prompts: list, params: list) -> None:
        """Check every request (prompt type, token ids, lengths, params) without queueing anything."""
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                self._token_ids(prompt, sp)
            except (TypeError, ValueError) as error:
                raise type(error)(f"request {i}: {error}") from None

    def _token_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__} {params!r}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:
                # a lone surrogate: bytes that were not UTF-8 (e.g. a command-line argument in another encoding)
                raise ValueError(f"prompt is not valid UTF-8 text (undecodable byte at character {error.start}: "
                                 f"{prompt[error.start:error.end]!r})") from None
            ids = [self.cfg.bos_token_id] + self.tokenizer.encode(prompt, add_special_tokens=False).ids
        elif isinstance(prompt, (list, tuple)):
            for i, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                    raise TypeError(f"a token-id prompt must hold only ints, got {type(t).__name__} {t!r} "
                                    f"at index {i}")
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size}), got {bad[:5]}")
        else:
            raise TypeError(f"prompt must be a string or a list of int token ids, got {type(prompt).__name__} "
                            f"{prompt!r:.60}")
        if not ids:
            raise ValueError("prompt must not be empty")
        limit = self.scheduler.max_model_len
        if len(ids) > limit:
            raise ValueError(f"prompt has {len(ids)} tokens, more than max_model_len={limit}")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request. Bad input raises before anything is queued."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        ids = self._token_ids(prompt, params)
        if request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.add(Sequence(request_id, ids, params))
        self._prompts[request_id] = prompt

    def is_live(self, request_id: str) -> bool:
        """Whether the request is queued or running and not already finishing."""
        return self.scheduler.get(request_id) is not None and not self.scheduler.is_aborting(request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a live request; its output (finish reason 'abort') comes back from a later ``step()``.

        Returns True when this call aborted it, False (and does nothing) when the id is unknown, already finished
        or already finishing.
        """
        if not self.is_live(request_id):
            return False
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._released.append(seq)
        return True

    def has_unfinished(self) -> bool:
        """Whether some request has not been returned by ``step()`` yet."""
        return self.scheduler.has_unfinished() or bool(self._unprocessed) or bool(self._released)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, process what is due; return the requests that finished."""
        record = None if self.timeline is None else self.timeline.begin()
        output = self.scheduler.schedule()
        if record is not None:
            record.lap("schedule", output.step)
            record.launched = None if output.is_empty else output.step
            record.decode_only = not output.is_empty and all(c.num_tokens == 1 for c in output.chunks)
        self.num_preemptions += len(output.preempted)
        previous = next((h for _, h in reversed(self._unprocessed) if h is not None), None)
        finished, self._released = self._released, []
        handle = None
        try:
            handle = None if output.is_empty else self.runner.execute(output, previous, record)
        except Exception as error:  # noqa: BLE001  (whatever broke the launch, the step's requests end with it)
            finished += self.scheduler.fail(output, _describe(error))
        else:
            self._unprocessed.append((output, handle))
        keep = 1 if self.zos and handle is not None else 0  # ZOS: leave the newest step in flight
        while len(self._unprocessed) > keep:
            done, done_handle = self._unprocessed.popleft()
            try:
                sampled = done_handle.wait() if done_handle else {}
            except Exception as error:  # noqa: BLE001  (the step failed while running)
                finished += self.scheduler.fail(done, _describe(error))
                continue
            finally:
                if record is not None:
                    record.lap("wait", done.step)
            if done_handle is not None and done_handle.logits:
                for chunk in done.chunks:
                    if chunk.sample:
                        rows = self.step_logits.setdefault(chunk.request_id, {})
                        rows[chunk.output_position] = done_handle.logits[chunk.request_id]
            finished += self.scheduler.process(done, sampled)
            finished += self._match_stop_strings(done)
            if record is not None:
                record.lap("process", done.step)
        outputs = [self._output(seq) for seq in finished]
        if record is not None:
            record.lap("output", None)
        return outputs

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
                             token_ids=list(seq.output_token_ids), finish_reason=seq.finish_reason,
                             error=seq.error)
