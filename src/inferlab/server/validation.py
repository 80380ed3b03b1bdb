"""Pydantic's validation errors as one line a user can act on: `field: what is wrong`, no internals.

Pydantic names a union's members in the error location (`function-after[...]`, `list[...]`, `str`),
and its messages say how it validated; a user only needs the field (`messages[0].role`) and the rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

SOURCES = {"body", "query", "path", "header", "cookie"}
TYPE_TAGS = {"str", "int", "float", "bool", "bytes", "none", "dict", "list", "tuple", "set"}
FIELD = re.compile(r"[a-z_][a-z0-9_]*")
MESSAGES = {
    "missing": "required",
    "extra_forbidden": "not a field this route accepts",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
    "dict_type": "must be a JSON object",
}
MAX_PROBLEMS = 3


def describe(errors: Iterable[dict[str, Any]]) -> str:
    """`field: problem; field: problem`; for a union, the members' problems joined by `or`, type
    mismatches dropped where a member of the right type said what is wrong with the value."""
    by_field: dict[str, list[dict[str, Any]]] = {}
    for error in errors:
        by_field.setdefault(field_path(error["loc"]), []).append(error)
    problems = []
    for field, found in list(by_field.items())[:MAX_PROBLEMS]:
        specific = [e for e in found if not (e["type"].endswith("_type") or e["type"] == "none_required")] or found
        messages = list(dict.fromkeys(message(e) for e in specific))
        if all(m.startswith("should be ") for m in messages):  # should be a string or a list
            messages[1:] = [m.removeprefix("should be ") for m in messages[1:]]
        problems.append(f"{field}: {' or '.join(messages)}")
    return "; ".join(problems) or "invalid request"


def param(errors: list[dict[str, Any]]) -> str | None:
    """The top-level request field of the first problem (OpenAI's `param`); None for the body as a whole."""
    path = field_path(errors[0]["loc"]) if errors else "body"
    return None if path == "body" else re.split(r"[.\[]", path, maxsplit=1)[0]


def field_path(loc: Iterable[Any]) -> str:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'; the whole body -> 'body'."""
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif not (i == 0 and part in SOURCES) and FIELD.fullmatch(part) and part not in TYPE_TAGS:
            path += f".{part}" if path else part
    return path or "body"


def message(error: dict[str, Any]) -> str:
    if error["type"] == "json_invalid":
        return f"not valid JSON ({error.get('ctx', {}).get('error', 'syntax error')})"
    if error["type"] in MESSAGES:
        return MESSAGES[error["type"]]
    text = error["msg"].removeprefix("Value error, ").removeprefix("Input ").replace(" after validation", "")
    return text[:1].lower() + text[1:]
