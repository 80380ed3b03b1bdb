"""A request's structured-output fields (OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`) as
the one constraint its output must match (engine/grammar.py), or None for free text."""

from __future__ import annotations

import json
from typing import Any

from inferlab.engine.grammar import Constraint
from inferlab.errors import InvalidRequestError
from inferlab.server.schemas import JsonSchemaText, OpenAIRequest

ANY_OBJECT = {"type": "object"}


def requested_constraint(body: OpenAIRequest) -> Constraint | None:
    """The body's constraint; asking for more than one is refused, naming them."""
    found = [c for c in _constraints(body) if c is not None]
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise InvalidRequestError(f"{names}: ask for one structured output at a time", param=found[1].param)
    return found[0] if found else None


def _constraints(body: OpenAIRequest) -> list[Constraint | None]:
    format_, outputs = body.response_format, body.structured_outputs
    found = [
        _json("guided_json", body.guided_json),
        Constraint("regex", body.guided_regex, "guided_regex") if body.guided_regex is not None else None,
        Constraint("choice", body.guided_choice, "guided_choice") if body.guided_choice is not None else None,
        Constraint("grammar", body.guided_grammar, "guided_grammar") if body.guided_grammar is not None else None,
    ]
    if format_ is not None and format_.type == "json_object":
        found.append(Constraint("json", ANY_OBJECT, "response_format"))
    if format_ is not None and format_.type == "json_schema":
        if format_.json_schema is None:
            raise InvalidRequestError(
                "response_format: json_schema needs its json_schema object", param="response_format"
            )
        found.append(Constraint("json", format_.json_schema.schema_ or ANY_OBJECT, "response_format"))
    if outputs is not None:
        param = "structured_outputs"
        asked = [
            _json(param, outputs.json_),
            Constraint("regex", outputs.regex, param) if outputs.regex is not None else None,
            Constraint("choice", outputs.choice, param) if outputs.choice is not None else None,
            Constraint("grammar", outputs.grammar, param) if outputs.grammar is not None else None,
            Constraint("json", ANY_OBJECT, param) if outputs.json_object else None,
        ]
        if sum(c is not None for c in asked) != 1:
            raise InvalidRequestError(
                "structured_outputs: set exactly one of json, regex, choice, grammar, json_object", param=param
            )
        found += asked
    return found


def _json(param: str, schema: JsonSchemaText | None) -> Constraint | None:
    """A schema given as an object or as its JSON text."""
    if schema is None:
        return None
    value: Any = schema
    if isinstance(schema, str):
        try:
            value = json.loads(schema)
        except ValueError as error:
            raise InvalidRequestError(f"{param}: not valid JSON ({error})", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param}: a JSON schema must be an object", param=param)
    return Constraint("json", value, param)
