"""One request's host-side state: its tokens, how many of them are cached or in flight, and what it owns."""

from __future__ import annotations

import enum
import numbers
import random

from dijax.runtime.sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")
"""Why a request finished; "error": a step containing it could not be launched or run (see LLMEngine.step)."""


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # in the scheduler's waiting queue; owns no blocks and no slot
    RUNNING = enum.auto()   # prefilling or decoding; owns a slot and the blocks covering its cached tokens
    FINISHED = enum.auto()  # done; owns nothing, finish_reason is set


class Sequence:
    """A request as the scheduler sees it.

    Token accounting (``L = len(seq)`` = prompt + output tokens known on the host):

    num_cached    tokens whose KV (and slot state) the cache holds once every already-scheduled step has run.
                  The scheduler advances it when it *schedules* a chunk, not when the result comes back, so that
                  the next step can be planned before the previous one finishes (zero-overhead scheduling).
    num_inflight  tokens that scheduled steps will sample but whose values the host has not seen yet.
    reserved_len  L + num_inflight: the length the device will have reached after all scheduled steps.

    A running sequence always has ``num_cached < reserved_len``; the tokens in between (``num_uncached``) still
    have to be fed. When exactly one is left the sequence is decoding: its next step feeds one token, which is
    either known (``token_ids[-1]``) or still in flight (then the step gathers it on device from the previous
    step's output).

    epoch         bumped (to a scheduler-wide fresh value) on preemption and cancellation. Every scheduled chunk
                  and every sampled result carries the epoch it was made under; a result with an older epoch is
                  dropped.
    seed          the request's sampling seed (from the params, or drawn here once so that a recomputed request
                  still reproduces its tokens).
    block_table   KV block ids, in position order (block i holds positions [i * block_size, (i + 1) * block_size)).
    slot          the state slot (window ring, compressor tail, Engram history), or None when not running.
    rank          the attention rank whose pools hold its blocks and slot, or None when it holds none.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None):
        if not isinstance(request_id, str):
            raise TypeError(f"Sequence.request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        if not isinstance(prompt_token_ids, (list, tuple)):
            raise TypeError(f"Sequence.prompt_token_ids must be a list of ints, "
                            f"got {type(prompt_token_ids).__name__}")
        for token in prompt_token_ids:
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
                raise TypeError(f"Sequence.prompt_token_ids must hold ints >= 0, got {token!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Sequence.params must be a SamplingParams, got {type(params).__name__}")

        self.request_id = request_id
        self.prompt_token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_cached = 0
        self.num_inflight = 0
        self.epoch = 0
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.block_table: list[int] = []
        self.slot: int | None = None
        self.rank: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None  # with finish reason "error": what failed

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_token_ids)}, cached={self.num_cached}, inflight={self.num_inflight}, "
                f"epoch={self.epoch}, rank={self.rank}, slot={self.slot}, blocks={self.block_table}, "
                f"finish={self.finish_reason})")

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens known on the host (a new list: O(len), for callers outside the step loop)."""
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens [start, stop) of prompt + output, without building the whole sequence: O(stop - start)."""
        prompt = self.prompt_token_ids
        head = prompt[start:stop]
        tail = self.output_token_ids[max(start - len(prompt), 0):max(stop - len(prompt), 0)]
        return tuple(head + tail)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def reserved_len(self) -> int:
        """Length on the device once every scheduled step has run: host tokens plus in-flight tokens."""
        return len(self) + self.num_inflight

    @property
    def num_uncached(self) -> int:
        """Tokens (known or in flight) that later steps still have to feed through the model."""
        return self.reserved_len - self.num_cached

    @property
    def is_prefill_done(self) -> bool:
        """True when at most one token is left to feed, i.e. the sequence advances by one decode token per step.

        A sequence recomputing after preemption is prefilling again (over prompt and generated tokens).
        """
        return self.num_uncached <= 1

    @property
    def output_position(self) -> int:
        """Index (within the output) of the next token to be sampled; keys the sampling noise with ``seed``."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
