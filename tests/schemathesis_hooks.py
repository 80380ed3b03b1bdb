"""schemathesis' own check for tests/test_server_schema.py (loaded through SCHEMATHESIS_HOOKS): on the two OpenAI
routes, which take a schema-valid body's 422 as a fair answer (tests/schemathesis.toml), that 422 must be one only a
request's constraint can cause, its envelope naming a constraint field: every other refusal of a schema-valid body
still fails the run."""

from __future__ import annotations

import re

import schemathesis

CONSTRAINT_FIELDS = ("guided_", "structured_outputs", "response_format", "tools", "tool_choice")


@schemathesis.check
def a_valid_bodys_422_names_a_constraint(ctx, response, case) -> None:  # noqa: ANN001 (schemathesis' signature)
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 422:
        return
    if not re.fullmatch(r"/v1/(chat/)?completions", case.operation.path):
        return
    param = (response.json().get("error") or {}).get("param") or ""
    if not param.startswith(CONSTRAINT_FIELDS):
        raise AssertionError(f"a schema-valid body was refused for {param!r}, not a constraint: {response.text[:300]}")
