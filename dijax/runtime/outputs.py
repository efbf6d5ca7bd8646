"""What ``LLM.generate`` returns for one request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """The finished result of one request.

    request_id     the id the request was added with.
    prompt         the prompt as the caller gave it: a string, or a list of token ids.
    text           the detokenized output (stop strings already cut by the engine).
    token_ids      the output token ids (not including the prompt).
    finish_reason  "stop" (eos, a stop token id or a stop string), "length" (max_tokens or max_model_len), "abort"
                   (``LLM.abort``) or "error" (a step containing it failed to launch or run).
    error          with finish reason "error": the failure, as ``"ExceptionType: message"``; otherwise None.
    """

    request_id: str
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
