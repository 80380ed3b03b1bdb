"""long_context: a prompt of thousands of tokens served at the defaults, and the limits a server names.

inferlab-serve starts with its defaults on the job's model, once with the seed's request guards (server.limits=guard)
and once with them lifted to the model's context (server.limits=context); each gets the same long excerpt of
Hamlet as text over /v1/completions (greedy, a few new tokens), and the context-limited server also one longer than
its context. Each row is a request: its HTTP status, the prompt tokens the server counted, the seconds to the
answer, and the error message where refused (which names the limit).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from inferlab.bench.peer_servers import model_args
from inferlab.bench.prompts import load_tokenizer, make_prompts
from inferlab.bench.studies import Rows, register
from inferlab.bench.targets import LaunchedServer, free_port

HOST = "127.0.0.1"


@register("long_context")
def run(cfg: DictConfig) -> Rows:
    model = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(model, dict)
    tokenizer = load_tokenizer(model)
    load = {**OmegaConf.to_container(cfg.load, resolve=True), "num_requests": 1}
    text = {
        n: tokenizer.decode(make_prompts(tokenizer, {**load, "prompt_tokens": n})[0].token_ids)
        for n in (int(cfg.study.prompt_tokens), int(cfg.study.beyond_context_tokens))
    }
    log_dir = Path(HydraConfig.get().runtime.output_dir)
    rows = []
    for limits in ("guard", "context"):
        port = free_port(HOST)
        argv = [
            sys.executable,
            "-m",
            "inferlab.serve",
            *model_args(model),
            f"server.limits={limits}",
            f"server.timeout_s={cfg.study.timeout_s}",
            f"server.host={HOST}",
            f"server.port={port}",
        ]
        with LaunchedServer(
            argv, HOST, port, float(cfg.study.startup_timeout_s), log_dir / f"serve_{limits}.log"
        ) as server:
            asked = [int(cfg.study.prompt_tokens)] + (
                [int(cfg.study.beyond_context_tokens)] if limits == "context" else []
            )
            for n in asked:
                rows.append({"limits": limits, "prompt_tokens_sent": n, **complete(server.url, text[n], cfg)})
    return rows


def complete(url: str, prompt: str, cfg: DictConfig) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": int(cfg.study.new_tokens), "temperature": 0}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=float(cfg.study.timeout_s) + 60)
    seconds = time.perf_counter() - start
    payload = response.json()
    if response.status_code != 200:
        return {"status": response.status_code, "seconds": seconds, "message": payload["error"]["message"]}
    return {
        "status": 200,
        "seconds": seconds,
        "prompt_tokens": payload["usage"]["prompt_tokens"],
        "completion_tokens": payload["usage"]["completion_tokens"],
        "prefill_tok_s": payload["usage"]["prompt_tokens"] / seconds,
        "message": None,
    }
