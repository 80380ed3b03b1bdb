"""schemathesis fuzzes the server's own OpenAPI schema (in-process, tiny engine, bounded examples):
no 5xx, and every error in the envelope {"error": {"code", "message", "type", "param"}} with no trace or file path."""

from __future__ import annotations

import schemathesis
from conftest import tiny_engine
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from test_server import make_settings

from inferlab.server import create_app


def test_fuzz_no_5xx_and_errors_in_the_envelope(tiny_tokenizer):
    engine = tiny_engine(tiny_tokenizer, slots=4, max_new_tokens=4)
    app = create_app(engine, make_settings(max_new_tokens_cap=4), "tiny")
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/generate",
        "POST /v1/generate/stream",
        "POST /v1/completions",
        "POST /v1/chat/completions",
    }
    runs = [
        (op, mode)
        for op in operations  # valid inputs everywhere; broken bodies where there is a body
        for mode in (GenerationMode if op.method.upper() == "POST" else [GenerationMode.POSITIVE])
    ]
    for operation, mode in runs:

        @given(case=operation.as_strategy(mode))
        @settings(
            max_examples=15, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
        )
        def check(case):
            response = case.call()
            assert response.status_code < 500, f"{operation.label} {mode.value}: {response.text}"
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"code", "message", "type", "param"} and error["code"] and error["message"]
                assert "Traceback" not in response.text and ".py" not in response.text

        check()
