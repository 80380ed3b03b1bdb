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
