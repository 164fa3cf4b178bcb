"""Errors a caller can act on: bad requests are rejected up front, never crash the engine."""


class InvalidRequestError(ValueError):
    """The request cannot be served as given (empty prompt, too long, bad ids or params)."""


class EngineConfigError(ValueError):
    """The engine configuration cannot work (pools too small for one request, bad sizes)."""


class ServerOverloadedError(RuntimeError):
    """Queues are full: retry after `retry_after_s` seconds (HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
