"""ServerSettings: the `server:` block of conf/serve.yaml, checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from limits import parse

from inferlab.errors import InvalidRequestError

LOG_FORMATS = ("text", "json")
LIMITS = ("guard", "context")
MAX_NEW_TOKENS_CEILING = 1024  # with limits=guard the cap is configurable, never above this
CHARS_PER_TOKEN = 16  # limits=context: a prompt's characters allowed per token of context (the token count decides)
JSON_BYTES_PER_CHAR = 6  # a character written as a \uXXXX escape


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
    limits: str = "guard"  # "guard": the caps above | "context": raised to what the model's context allows

    def __post_init__(self) -> None:
        if self.limits not in LIMITS:
            raise InvalidRequestError(f"server.limits must be one of {', '.join(LIMITS)}, got {self.limits!r}")
        ceiling = MAX_NEW_TOKENS_CEILING if self.limits == "guard" else self.max_new_tokens_cap
        if not 1 <= self.max_new_tokens_cap <= ceiling:
            raise InvalidRequestError(
                f"server.max_new_tokens_cap must be in [1, {ceiling}], got {self.max_new_tokens_cap}"
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

    def for_context(self, max_seq_len: int) -> ServerSettings:
        """With limits=context, the caps raised to a context of `max_seq_len` tokens: new tokens up to the context,
        a prompt of up to CHARS_PER_TOKEN characters a token (its tokens are then held to the context, with the
        limit named), and a body that can carry it; with limits=guard, unchanged."""
        if self.limits == "guard":
            return self
        chars = max(self.max_prompt_chars, max_seq_len * CHARS_PER_TOKEN)
        return replace(
            self,
            max_new_tokens_cap=max(self.max_new_tokens_cap, max_seq_len),
            max_prompt_chars=chars,
            max_body_bytes=max(self.max_body_bytes, chars * JSON_BYTES_PER_CHAR + self.max_body_bytes),
        )

    @classmethod
    def from_config(cls, server: Any, **overrides: Any) -> ServerSettings:
        """From the composed `cfg.server` (a DictConfig or dict); keyword overrides win (tests)."""
        values = {f.name: server[f.name] for f in fields(cls) if f.name in server}
        values.update(overrides)
        values["api_keys"] = tuple(str(k) for k in values["api_keys"] or ())
        return cls(**values)
