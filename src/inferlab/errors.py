"""Errors a user can cause. Each carries a one-line message fit for a CLI or an HTTP error envelope."""


class InferlabError(Exception):
    code = "internal_error"

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, when there is one (the HTTP envelope's `param`)


class ModelLoadError(InferlabError):
    code = "model_load_error"


class InvalidRequestError(InferlabError):
    code = "invalid_request"


class CapacityError(InferlabError):
    """The KV memory cannot hold the request, now or ever."""

    code = "capacity_exceeded"


class QuantizationError(InferlabError):
    """A model or layer that cannot be quantized as asked (group size, shape, already quantized)."""

    code = "quantization_error"


class OverloadedError(InferlabError):
    """The KV pool and the wait queue are both full: try again later (HTTP 503). Nothing running is lost."""

    code = "overloaded"


class GenerationError(InferlabError):
    """One request's own work failed inside the engine (its forward row, sampling, stop check, text);
    that request ends with this error, the others in its batch continue unchanged."""

    code = "generation_failed"


class EngineFailedError(InferlabError):
    """The engine loop itself stopped: no request can run until the process is restarted (HTTP 503)."""

    code = "engine_failed"


# ---- raised at the HTTP edge (server/guards.py maps each code to its status) ----------------------


class UnauthorizedError(InferlabError):
    code = "unauthorized"


class RateLimitedError(InferlabError):
    code = "rate_limited"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeoutError(InferlabError):
    code = "timeout"


class NotFoundError(InferlabError):
    code = "not_found"


class PayloadTooLargeError(InferlabError):
    code = "payload_too_large"


class ShuttingDownError(InferlabError):
    code = "shutting_down"
