"""The OpenAPI schema tells the truth: read in-process against the settings it was built from, then
checked from outside by schemathesis (`--checks all`, a fixed seed) against a real server process on the
tiny-random model, with auth off and on: every route and field, zero failures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_engine
from test_server import client_for

from inferlab.bench.targets import ServerProcess

KEY = "k-schema"
CONFIG = Path(__file__).with_name("schemathesis.toml")
MEDIA_TYPES = {
    "/v1/generate": {"application/json"},
    "/v1/generate/stream": {"text/event-stream"},
    "/v1/completions": {"application/json", "text/event-stream"},
    "/v1/chat/completions": {"application/json", "text/event-stream"},
}  # of each generation route's 200
GENERATION = tuple(MEDIA_TYPES)


def schema_for(tokenizer, **settings) -> dict:
    return client_for(tiny_engine(tokenizer), **settings).get("/openapi.json").json()


def test_schema_states_the_caps_auth_and_statuses_the_server_enforces(tiny_tokenizer):
    schema = schema_for(tiny_tokenizer, max_new_tokens_cap=48, max_prompt_chars=300)
    models = schema["components"]["schemas"]
    for name, field in (
        ("GenerateRequest", "max_new_tokens"),
        ("CompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "max_completion_tokens"),
    ):
        (integer,) = [b for b in models[name]["properties"][field]["anyOf"] if b["type"] == "integer"]
        assert integer["maximum"] == 48 and integer["minimum"] in (0, 1)  # completions: 0 = echo only
    assert models["GenerateRequest"]["properties"]["prompt"]["maxLength"] == 300
    token_ids = [
        b
        for b in models["CompletionRequest"]["properties"]["prompt"]["anyOf"]
        if b["type"] == "array" and b["items"].get("type") == "integer"
    ]
    # the tiny model: 257 token ids, a 256-position context of which a prompt may take 240
    assert token_ids and all(b["maxItems"] == 240 and b["items"]["maximum"] == 256 for b in token_ids)
    assert "securitySchemes" not in schema["components"]  # no keys configured: no auth to declare
    for path in GENERATION:
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "413", "422", "429", "500", "503", "504"}
        assert all(set(responses[s]["content"]) == {"application/json"} for s in responses if s != "200")
        assert set(responses["200"]["content"]) == MEDIA_TYPES[path]
        assert "security" not in schema["paths"][path]["post"]
    assert set(schema["paths"]["/health"]["get"]["responses"]) == {"200", "503"}

    schema = schema_for(tiny_tokenizer, api_keys=["secret"])
    assert schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in schema["paths"].items():
        open_path = path in ("/health", "/metrics")
        assert ("security" in item["get" if "get" in item else "post"]) != open_path, path
    assert "WWW-Authenticate" in schema["paths"]["/v1/generate"]["post"]["responses"]["401"]["headers"]


@pytest.mark.slow
# with keys, a run checks what auth adds (every route but /health and /metrics refuses a request without the key,
# and takes one with it); the request bodies it would generate are those the run without keys covers
@pytest.mark.parametrize(
    "api_keys, examples", [([], 20), pytest.param([KEY], 10, marks=pytest.mark.full)], ids=["auth-off", "auth-on"]
)
def test_schemathesis_all_checks_find_nothing(tmp_path, api_keys, examples):
    # Prompts of at most 1000 characters (4 tokens each at worst) and 256 chat messages' template tokens fit an
    # 8192-token context, so a prompt the schema allows is one the server takes (positive data acceptance).
    overrides = [
        "model=tiny-random",
        "model.architecture.max_seq_len=8192",
        "server.max_prompt_chars=1000",
        "server.max_new_tokens_cap=8",
        "server.rate_limit=1000000/second",
        f"server.api_keys=[{','.join(api_keys)}]",
    ]
    with ServerProcess(
        [sys.executable, "-m", "inferlab.serve"], overrides, "127.0.0.1", 180, tmp_path / "server.log"
    ) as url:
        command = [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(CONFIG),
            "run",
            f"{url}/openapi.json",
            "--checks",
            "all",
            "--seed",
            "1",
            "--max-examples",
            str(examples),
            "--workers",
            "1",
            "--no-color",
            "--generation-database",
            "none",
        ]
        if api_keys:
            command += ["--header", f"Authorization: Bearer {KEY}"]
        hooks = {"SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": str(Path(__file__).parent)}
        run = subprocess.run(
            command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, **hooks}
        )
    assert run.returncode == 0, run.stdout[-6000:]
    selected = re.search(r"Selected: (\d+)/(\d+)", run.stdout)
    tested = re.search(r"Tested: (\d+)", run.stdout)
    assert selected and tested and selected[1] == selected[2] == tested[1], run.stdout[-2000:]
    assert int(tested[1]) >= 11  # every route: native, OpenAI, models, tokenize, health and metrics
