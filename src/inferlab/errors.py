"""Errors a user can cause. Each carries a one-line message fit for a CLI or an HTTP error envelope."""


class InferlabError(Exception):
    code = "internal_error"


class ModelLoadError(InferlabError):
    code = "model_load_error"


class InvalidRequestError(InferlabError):
    code = "invalid_request"


class CapacityError(InferlabError):
    """The KV memory cannot hold the request, now or ever."""

    code = "capacity_exceeded"


class OverloadedError(InferlabError):
    """The KV pool and the wait queue are both full: try again later (HTTP 503). Nothing running is lost."""

    code = "overloaded"
