"""The OpenAPI schema, stated from what the server enforces: the caps from the settings, bearer auth only
when keys are configured, each route's statuses with their media types (errors are JSON, streams are
server-sent events). Routes name their error statuses with `errors(...)`; `install` finishes the schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from inferlab.server.guards import OPEN_PATHS
from inferlab.server.schemas import ErrorEnvelope
from inferlab.server.settings import ServerSettings

ERRORS = {
    400: "the body could not be read (not UTF-8 text)",
    401: "missing or wrong API key (`Authorization: Bearer KEY`)",
    404: "no such model here",
    413: "body over server.max_body_bytes",
    422: "invalid input: `field: what is wrong`",
    429: "rate limit exceeded; Retry-After says when to retry",
    500: "this request failed inside the engine; the server log has the details",
    503: "no work taken now: the wait queue is full, the server is shutting down, or the engine stopped (the message says which)",
    504: "the request did not finish within server.timeout_s",
}
HEADERS = {
    401: {"WWW-Authenticate": {"description": "the scheme to use", "required": True, "schema": {"type": "string"}}},
    429: {"Retry-After": {"description": "seconds", "required": True, "schema": {"type": "integer"}}},
}
TOKEN_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "min_tokens")
PROMPT_FIELDS = (
    ("GenerateRequest", "prompt"),
    ("CompletionRequest", "prompt"),
    ("ChatMessage", "content"),
    ("TextPart", "text"),
)
TOKEN_ID_FIELDS = (("CompletionRequest", "prompt"), ("DetokenizeRequest", "tokens"))
TOKEN_PROMPT_FIELDS = (("CompletionRequest", "prompt"),)
SSE_EVENT = {  # one event of a stream: a JSON chunk, an error envelope, or [DONE] last
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (or an error envelope), then [DONE]"}},
}


def errors(settings: ServerSettings, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error responses of a route, 401 only when keys are configured."""
    return {s: {"model": ErrorEnvelope, "description": ERRORS[s]} for s in statuses if s != 401 or settings.api_keys}


def install(app: FastAPI, settings: ServerSettings, vocab_size: int, max_prompt_tokens: int) -> None:
    """Serve the finished schema at /openapi.json (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            app.openapi_schema = finish(schema, settings, vocab_size, max_prompt_tokens)
        return app.openapi_schema

    app.openapi = openapi


def finish(schema: dict[str, Any], settings: ServerSettings, vocab_size: int, max_prompt_tokens: int) -> dict[str, Any]:
    models = schema.get("components", {}).get("schemas", {})
    for name, field in TOKEN_ID_FIELDS:  # token ids: in the vocabulary, a prompt's within the context
        if name in models:
            bound(models[name]["properties"][field], "integer", "maximum", vocab_size - 1)
    for name, field in TOKEN_PROMPT_FIELDS:
        if name in models:
            for array in token_arrays(models[name]["properties"][field]):
                array["maxItems"] = min(array.get("maxItems", max_prompt_tokens), max_prompt_tokens)
    for model in models.values():
        for field in TOKEN_FIELDS:
            if field in model.get("properties", {}):
                bound(model["properties"][field], "integer", "maximum", settings.max_new_tokens_cap)
    for name, field in PROMPT_FIELDS:
        if name in models:
            bound(models[name]["properties"][field], "string", "maxLength", settings.max_prompt_chars)
            models[name]["properties"][field]["description"] = (
                f"at most {settings.max_prompt_chars} characters in all, and its tokens must leave 16 positions "
                "of the model's context"
            )
    for path, item in schema["paths"].items():
        for operation in item.values():
            for status, response in operation["responses"].items():
                describe(int(status), response)
            if settings.api_keys and path not in OPEN_PATHS:
                operation["security"] = [{"bearer": []}]
    if settings.api_keys:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return schema


def describe(status: int, response: dict[str, Any]) -> None:
    """Errors are JSON (FastAPI files them under the route's media type); an event stream is its events."""
    content = response.setdefault("content", {})
    if status >= 400:
        response["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}}
        if status in HEADERS:
            response["headers"] = HEADERS[status]
    elif "text/event-stream" in content:
        content["text/event-stream"] = {"schema": SSE_EVENT}


def bound(schema: dict[str, Any], kind: str, key: str, value: int) -> None:
    """Set `key` on every `kind` branch of a (union or array) schema."""
    if schema.get("type") == kind:
        schema[key] = min(schema.get(key, value), value)
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []):
        bound(branch, kind, key, value)
    if isinstance(schema.get("items"), dict):
        bound(schema["items"], kind, key, value)


def token_arrays(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The arrays of integers (token ids) in a (union or array) schema."""
    if schema.get("type") == "array" and schema.get("items", {}).get("type") == "integer":
        yield schema
    items = [schema["items"]] if isinstance(schema.get("items"), dict) else []
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []) + items:
        yield from token_arrays(branch)
