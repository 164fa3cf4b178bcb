"""Errors a caller can act on: bad requests are rejected up front, never crash the engine."""


class InvalidRequestError(ValueError):
    """The request cannot be served as given (empty prompt, too long, bad ids or params)."""


class EngineConfigError(ValueError):
    """The engine configuration cannot work (pools too small for one request, bad sizes)."""


class HandoffError(ValueError):
    """A request cannot be handed from one engine to another (`workers/engine/handoff.py`): the
    engines differ (model, block sizes, EAGLE mode, spec tokens), the request has not finished its
    prefill, or the receiving engine has no room for it now."""


class ServerOverloadedError(RuntimeError):
    """Queues are full: retry after `retry_after_s` seconds (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def validate_prompt(prompt: list, vocab_size: int, max_model_len: int) -> None:
    """Raise `InvalidRequestError` unless `prompt` is a non-empty list of in-vocabulary token ids
    shorter than `max_model_len` (room for at least one output token). One check for the engine
    and for the cluster front door, so both refuse the same requests with the same words."""
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
        raise InvalidRequestError("prompt token ids must be integers")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is out of the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt)} tokens; max_model_len is {max_model_len} (prompt + at least 1 output)"
        )


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or it stalled): this engine serves nothing more;
    its requests are to be retried elsewhere (vLLM's EngineDeadError)."""


class EngineTimeoutError(TimeoutError):
    """A call into the engine loop did not complete within its deadline."""
