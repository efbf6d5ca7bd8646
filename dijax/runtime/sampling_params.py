"""What a request asks of the sampler and of the stopping rules."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# Seeds reach the device as two uint32 halves, both folded into the sampling key (see dijax.runtime.sampler).
_SEED_LIMIT = 2**63
# The step carries top_k as int32 and the temperature as float32: larger values cannot be represented there.
_TOP_K_LIMIT = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38


def _check_int(name: str, value: object) -> int:
    # bool is an Integral in Python; True as a top_k is almost certainly a bug, so refuse it.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SamplingParams.{name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"SamplingParams.{name} must not be NaN")
    return value


def _check_list(name: str, value: object, item_type: type, item_name: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"SamplingParams.{name} must be a list of {item_name}, got {type(value).__name__} {value!r}")
    for item in value:
        bad_bool = item_type is not bool and isinstance(item, bool)
        if bad_bool or not isinstance(item, item_type):
            raise TypeError(f"SamplingParams.{name} must be a list of {item_name}, "
                            f"got an item {type(item).__name__} {item!r}")
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings, validated on construction.

    temperature     float >= 0, finite in float32 (<= 3.4e38); 0 means greedy (argmax, lowest index wins a tie).
    top_k           int in [0, 2**31 - 1] (the step holds it as int32); 0 turns it off, and a value at or beyond
                    the vocabulary size keeps every token.
    top_p           float in (0, 1]; 1 turns it off.
    max_tokens      int >= 1: the most output tokens to generate.
    stop_token_ids  token ids that finish the request with reason "stop" (the token is kept in the output).
    stop            stop strings, matched by the engine on detokenized text (the scheduler never sees text).
    ignore_eos      when True, the model's eos token does not finish the request.
    seed            int in [0, 2**63) or None. Sampling noise is keyed only on (seed, output position), so a seeded
                    request yields the same tokens in any batch and after preemption. None: the Sequence draws one.

    The two lists are stored as tuples so that a params object (carried in every ScheduledChunk) is immutable.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        # The dataclass is frozen, so normalised values go in through object.__setattr__.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        temperature = _check_float("temperature", self.temperature)
        if not (0.0 <= temperature <= _FLOAT32_MAX):
            raise ValueError(f"SamplingParams.temperature must be a float in [0, {_FLOAT32_MAX:.4g}] (0 = greedy; "
                             f"the step holds it as float32), got {temperature}")
        put("temperature", temperature)

        top_k = _check_int("top_k", self.top_k)
        if not 0 <= top_k <= _TOP_K_LIMIT:
            raise ValueError(f"SamplingParams.top_k must be in [0, 2**31 - 1] (0 = off; the step holds it as "
                             f"int32), got {top_k}")
        put("top_k", top_k)

        top_p = _check_float("top_p", self.top_p)
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {top_p}")
        put("top_p", top_p)

        max_tokens = _check_int("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {max_tokens}")
        put("max_tokens", max_tokens)

        stop_token_ids = _check_list("stop_token_ids", self.stop_token_ids, numbers.Integral, "ints")
        for token in stop_token_ids:
            if token < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must hold token ids >= 0, got {token}")
        put("stop_token_ids", tuple(int(t) for t in stop_token_ids))

        stop = _check_list("stop", self.stop, str, "str")
        if any(s == "" for s in stop):
            raise ValueError("SamplingParams.stop must not contain an empty string (it would match at once)")
        put("stop", stop)

        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be a bool, got {type(self.ignore_eos).__name__} "
                            f"{self.ignore_eos!r}")

        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            if not (0 <= seed < _SEED_LIMIT):
                raise ValueError(f"SamplingParams.seed must be None or in [0, 2**63), got {seed}")
            put("seed", seed)

    @property
    def greedy(self) -> bool:
        """True when the sampler should take the argmax (temperature 0)."""
        return self.temperature == 0.0
