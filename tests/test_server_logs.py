"""Server logs: one JSON object per request line with server.log_format=json, the caller's X-Request-ID kept."""

from __future__ import annotations

import json
import logging

from conftest import tiny_engine
from test_server import PROMPT, client_for

from inferlab.server.logs import JsonFormatter


def test_request_line_as_json_keeps_the_callers_request_id(tiny_tokenizer, caplog):
    client = client_for(tiny_engine(tiny_tokenizer))
    with caplog.at_level(logging.INFO, logger="inferlab.server"):
        r = client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3}, headers={"X-Request-ID": "trace-42"}
        )
        bad = client.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 3},
            headers={"X-Request-ID": "no spaces or newlines\tplease"},
        )
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    assert bad.headers["x-request-id"] != "no spaces or newlines\tplease"  # an id we cannot log safely is replaced
    lines = [json.loads(JsonFormatter().format(rec)) for rec in caplog.records if getattr(rec, "request", None)]
    line = next(line for line in lines if line["request_id"] == "trace-42")
    assert line["status"] == 200 and line["path"] == "/v1/completions" and line["completion_tokens"] == 3
    assert line["level"] == "info" and line["message"].startswith("request trace-42") and line["total_ms"] > 0
    assert {entry["request_id"] for entry in lines} >= {"trace-42", bad.headers["x-request-id"]}
