"""ServerSettings: the `server:` block of conf/serve.yaml, checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from limits import parse

from inferlab.errors import InvalidRequestError

LOG_FORMATS = ("text", "json")
MAX_NEW_TOKENS_CEILING = 1024  # the cap is configurable, never above this


@dataclass(frozen=True)
class ServerSettings:
    host: str
    port: int
    rate_limit: str  # a `limits` string, e.g. "120/minute"
    timeout_s: float
    api_keys: tuple[str, ...]
    max_new_tokens_cap: int
    max_prompt_chars: int
    max_body_bytes: int
    shutdown_grace_s: float
    metrics_window: int
    log_level: str
    log_format: str  # "text" | "json" (one JSON object per line; each request's line carries its fields)

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens_cap <= MAX_NEW_TOKENS_CEILING:
            raise InvalidRequestError(
                f"server.max_new_tokens_cap must be in [1, {MAX_NEW_TOKENS_CEILING}], got {self.max_new_tokens_cap}"
            )
        if self.log_format not in LOG_FORMATS:
            raise InvalidRequestError(
                f"server.log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        if self.timeout_s <= 0:
            raise InvalidRequestError(f"server.timeout_s must be > 0, got {self.timeout_s}")
        try:
            parse(self.rate_limit)
        except ValueError as e:
            raise InvalidRequestError(
                f"server.rate_limit {self.rate_limit!r} is not a limits string like '120/minute'"
            ) from e

    @classmethod
    def from_config(cls, server: Any, **overrides: Any) -> ServerSettings:
        """From the composed `cfg.server` (a DictConfig or dict); keyword overrides win (tests)."""
        values = {f.name: server[f.name] for f in fields(cls)}
        values.update(overrides)
        values["api_keys"] = tuple(str(k) for k in values["api_keys"] or ())
        return cls(**values)
