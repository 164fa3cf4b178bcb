"""Errors a caller can act on: bad requests are rejected up front, never crash the engine."""


class InvalidRequestError(ValueError):
    """The request cannot be served as given (empty prompt, too long, bad ids or params)."""


class EngineConfigError(ValueError):
    """The engine configuration cannot work (pools too small for one request, bad sizes)."""
