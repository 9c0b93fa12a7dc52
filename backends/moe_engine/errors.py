"""Typed engine errors; the Triton backend maps them to Triton error codes."""


class EngineError(Exception):
    """Base class of errors the engine reports to a caller."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (bad ids, too long, invalid sampling values)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloadedError(EngineError):
    """The waiting queue is full; the caller should retry later."""


class EngineStoppedError(EngineError):
    """The engine is shutting down or its loop died."""
