"""inferlab-generate end to end: a real answer from the default model, and one-line errors on bad input."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def generate(*overrides: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inferlab.generate", *overrides], capture_output=True, text=True, timeout=timeout
    )


def test_default_model_answers_paris():
    # the fp32 reference path; test_first_answer.py asks the same at the defaults, on every kernel build
    result = generate("prompt=What is the capital of France?", "temperature=0", "max_new_tokens=24", "precision=fp32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Paris" not in result.stderr and "TTFT" in result.stderr and "tok/s" in result.stderr  # timings on stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["prompt=hi", "model=no-such-model"], "Could not find 'model/no-such-model'"),
        (["prompt=hi", "model=local"], "Missing mandatory value: model.path"),
        (["prompt=", "max_new_tokens=2"], "prompt must not be empty"),
        (["prompt=" + "word " * 200, "chat=false", "cache.max_seq_len=64"], "the context allows at most 48"),
    ],
)
def test_bad_input_is_one_clear_line(overrides, message):
    # what a model's files can get wrong: test_cli_model_errors.py
    result = generate(*overrides)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
