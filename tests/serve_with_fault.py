"""`python tests/serve_with_fault.py OVERRIDES...`: inferlab-serve whose engine loop is stopped (SystemExit
raised inside a step, through the engine's fault hook) by the first request whose prompt is STOP_PROMPT;
the process tests/test_server_overload.py overloads, then watches die and exit."""

from __future__ import annotations

import sys

from inferlab.api import compose, engine_from_config
from inferlab.serve import run

STOP_PROMPT = "stop the engine"


def main(overrides: list[str]) -> int:
    cfg = compose("serve", overrides)
    engine = engine_from_config(cfg)
    stop_ids = engine.encode_prompt(STOP_PROMPT)

    def fault(stage: str, requests: list) -> None:
        if any(r.prompt_ids == stop_ids for r in requests):
            raise SystemExit("stopped by the test's fault hook")

    engine.fault_hook = fault
    return run(cfg, engine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
