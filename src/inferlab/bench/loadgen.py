"""The load generator: concurrent streaming requests (a concurrency cap, or Poisson arrivals) against a target.

A target is anything with `async send(prompt, record)` that fills the record's chunk times as tokens arrive:
`HTTPTarget` speaks SSE to an OpenAI-compatible (or inferlab) server over httpx; the harness also drives the
in-process engine the same way (bench/targets.py), so both are measured by the same clock and metrics.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
from omegaconf import DictConfig, OmegaConf

from inferlab.bench.metrics import SLO, RequestRecord, summarize
from inferlab.bench.progress import progress
from inferlab.bench.prompts import Prompt, load_tokenizer, make_prompts
from inferlab.cli import hydra_app
from inferlab.errors import InvalidRequestError

clock = time.perf_counter


class Target(Protocol):
    async def send(self, prompt: Prompt, record: RequestRecord) -> None: ...


@dataclass
class LoadSpec:
    concurrency: int  # requests in flight at most
    rate: float = math.inf  # requests per second (Poisson arrivals); inf = all at once, capped by concurrency
    seed: int = 0
    progress: bool = False


async def run_load(target: Target, prompts: list[Prompt], spec: LoadSpec) -> tuple[list[RequestRecord], float]:
    """Send every prompt; return each request's record (in prompt order) and the run's wall time in seconds."""
    gate = asyncio.Semaphore(spec.concurrency)
    rng = random.Random(spec.seed)
    bar = progress(desc="requests", total=len(prompts), enabled=spec.progress)

    async def one(prompt: Prompt) -> RequestRecord:
        async with gate:
            record = RequestRecord(sent=clock(), prompt_tokens=len(prompt.token_ids))
            try:
                await target.send(prompt, record)
            except (httpx.HTTPError, OSError, ValueError, RuntimeError) as e:
                record.error = f"{type(e).__name__}: {e}"
            if record.end is None:
                record.end = clock()
            bar.update()
            return record

    start = clock()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if math.isfinite(spec.rate):
            await asyncio.sleep(rng.expovariate(spec.rate))
    records = await asyncio.gather(*tasks)
    duration = clock() - start
    bar.close()
    return list(records), duration


@dataclass
class HTTPTarget:
    """Streams `/v1/completions` (api="completions") or `/v1/chat/completions` (api="chat") with SSE."""

    base_url: str
    api: str = "completions"
    model: str | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    api_key: str | None = None
    timeout_s: float = 300.0
    ignore_eos: bool = False  # every request runs to max_tokens (vLLM's and llama-server's field, and inferlab's)
    client: httpx.AsyncClient = field(init=False, repr=False)

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.client = httpx.AsyncClient(
            base_url=self.base_url.rstrip("/"), headers=headers, limits=limits, timeout=httpx.Timeout(self.timeout_s)
        )

    def body(self, prompt: Prompt) -> tuple[str, dict[str, Any]]:
        common = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"model": self.model} if self.model else {}),
            **({"ignore_eos": True} if self.ignore_eos else {}),
        }
        if self.api == "chat":
            messages = prompt.messages or [{"role": "user", "content": prompt.text}]
            return "/v1/chat/completions", {"messages": messages, **common}
        return "/v1/completions", {"prompt": prompt.text, **common}

    async def send(self, prompt: Prompt, record: RequestRecord) -> None:
        path, body = self.body(prompt)
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                record.error = f"HTTP {response.status_code}: {detail}"
                record.timed_out = response.status_code == 504
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                read_chunk(json.loads(data), record)
                if record.error:
                    return
        record.end = clock()

    async def aclose(self) -> None:
        await self.client.aclose()


def read_chunk(chunk: dict[str, Any], record: RequestRecord) -> None:
    """Account one SSE chunk: a token chunk (OpenAI `choices`, or inferlab's `token_id`), usage, or an error."""
    if "error" in chunk:
        error = chunk["error"]
        record.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        record.timed_out = isinstance(error, dict) and error.get("code") == "timeout"
        return
    if chunk.get("choices") or chunk.get("token_id") is not None:
        record.chunk_times.append(clock())
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
        record.prompt_tokens = int(usage.get("prompt_tokens", record.prompt_tokens))


def write_outputs(metrics: dict[str, float], path: Path) -> None:
    """The metrics as JSON at `path` and as a Markdown table beside it (same name, .md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    path.with_suffix(".md").write_text(metrics_table(metrics) + "\n")


def metrics_table(metrics: dict[str, float]) -> str:
    """Percentile table: one row per metric (TTFT, TPOT, ITL, E2E), columns mean/median/p90/p95/p99 in ms."""
    stats = ("mean", "median", "p90", "p95", "p99")
    lines = ["| metric (ms) | " + " | ".join(stats) + " |", "|---|" + "---:|" * len(stats)]
    for name in ("ttft", "tpot", "itl", "e2e"):
        lines.append(f"| {name.upper()} | " + " | ".join(f"{metrics[f'{s}_{name}_ms']:.1f}" for s in stats) + " |")
    lines.append("")
    lines.append(
        f"{metrics['completed']:.0f} completed, {metrics['failed']:.0f} failed in {metrics['duration_s']:.2f} s: "
        f"{metrics['request_throughput']:.2f} req/s, {metrics['output_throughput']:.1f} output tok/s"
        + (f", goodput {metrics['request_goodput']:.2f} req/s" if "request_goodput" in metrics else "")
    )
    return "\n".join(lines)


def slo_from(cfg: dict[str, Any] | None) -> SLO | None:
    values = {k: v for k, v in (cfg or {}).items() if v is not None}
    return SLO(**values) if values else None


def measure(
    target: Target, prompts: list[Prompt], spec: LoadSpec, slo: SLO | None = None, warmup: int = 0
) -> dict[str, float]:
    """Run the load (after `warmup` untimed requests, one at a time) and summarize it; blocking. Raises where every
    request failed, unless the server's deadline ended each (a server too slow is a result: `timed_out`)."""

    async def go() -> tuple[list[RequestRecord], float]:
        try:
            await run_load(target, prompts[:warmup], LoadSpec(1))
            return await run_load(target, prompts, spec)
        finally:
            if isinstance(target, HTTPTarget):
                await target.aclose()

    records, duration = asyncio.run(go())
    metrics = summarize(records, duration, slo)
    errors = [r.error for r in records if r.error]
    if errors and not metrics["completed"] and metrics["timed_out"] < len(errors):
        raise RuntimeError(f"every request failed, e.g. {errors[0]}")
    return metrics


@hydra_app("loadgen")
def main(cfg: DictConfig) -> None:
    """inferlab-loadgen url=http://HOST:PORT: drive any OpenAI-compatible server, print and save the metrics."""
    load = OmegaConf.to_container(cfg.load, resolve=True)
    prompts = make_prompts(load_tokenizer(OmegaConf.to_container(cfg.model, resolve=True)), load, seed=cfg.seed or 0)
    target = HTTPTarget(
        cfg.url,
        cfg.api,
        cfg.served_model,
        int(load["output_tokens"]),
        float(cfg.temperature),
        cfg.api_key,
        float(cfg.timeout_s),
    )
    spec = LoadSpec(int(load["concurrency"]), float(load["rate"]), cfg.seed or 0, progress=True)
    try:
        metrics = measure(target, prompts, spec, slo_from(OmegaConf.to_container(cfg.slo)))
    except RuntimeError as e:
        raise InvalidRequestError(str(e)) from e
    write_outputs(metrics, Path(cfg.output))
    print(metrics_table(metrics))
    print(f"wrote {cfg.output} and {Path(cfg.output).with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()
