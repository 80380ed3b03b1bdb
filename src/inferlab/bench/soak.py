"""Soak: `clients` concurrent streaming clients send `requests` requests to a running server.

Pass means: every request completed (summary then `data: [DONE]`) or got a documented refusal (a status
and code from server/guards.py's table that a client is told to retry: 429, 503, 504); nothing else (no
5xx, no stream cut short, no transport error); afterwards no request running and no KV block held; and
the server's RSS after the run within `max_rss_growth_mib` of its RSS after a warm-up round.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from inferlab.bench.progress import progress
from inferlab.server.guards import STATUS

RETRYABLE = ("rate_limited", "overloaded", "capacity_exceeded", "timeout", "shutting_down")


@dataclass
class SoakResult:
    requests: int
    clients: int
    completed: int = 0
    refused: Counter = field(default_factory=Counter)  # documented error code -> count
    undocumented: list[str] = field(default_factory=list)  # what must never happen, one line each
    requests_running_end: int = -1
    kv_blocks_used_end: int = -1
    rss_start_mib: float = 0.0
    rss_end_mib: float = 0.0
    wall_s: float = 0.0

    def problems(self, max_rss_growth_mib: float) -> list[str]:
        found = list(self.undocumented)
        if self.completed + sum(self.refused.values()) + len(self.undocumented) != self.requests:
            found.append("some requests were never answered")
        if self.requests_running_end or self.kv_blocks_used_end:
            found.append(
                f"leak: {self.requests_running_end} requests running, {self.kv_blocks_used_end} KV blocks "
                "held after the run"
            )
        if self.rss_end_mib - self.rss_start_mib > max_rss_growth_mib:
            found.append(f"server RSS grew {self.rss_end_mib - self.rss_start_mib:.0f} MiB (> {max_rss_growth_mib:g})")
        return found

    def row(self, max_rss_growth_mib: float) -> dict[str, Any]:
        problems = self.problems(max_rss_growth_mib)
        row = {k: v for k, v in asdict(self).items() if k not in ("refused", "undocumented")}
        row |= {f"refused_{code}": self.refused.get(code, 0) for code in RETRYABLE}
        return row | {"undocumented": len(self.undocumented), "passed": not problems, "problems": "; ".join(problems)}


async def soak(
    url: str,
    prompts: list[str],
    clients: int,
    requests: int,
    max_new_tokens: int,
    api_key: str | None = None,
    request_timeout_s: float = 120.0,
) -> SoakResult:
    """Run the soak against `url`; prompts are used round-robin. A warm-up round of `clients` requests first."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = SoakResult(requests, clients)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=request_timeout_s) as client:
        await asyncio.gather(*(_one(client, prompts[i % len(prompts)], max_new_tokens) for i in range(clients)))
        await _wait_idle(client)
        result.rss_start_mib = (await _metrics(client))["server_rss_bytes"] / 2**20
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)

        bar = progress(desc=f"soak, {clients} clients", total=requests)

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                outcome = await _one(client, prompts[i % len(prompts)], max_new_tokens)
                bar.update()
                if outcome == "completed":
                    result.completed += 1
                elif outcome in RETRYABLE:
                    result.refused[outcome] += 1
                else:
                    result.undocumented.append(f"request {i}: {outcome}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        bar.close()
        result.wall_s = time.perf_counter() - start
        stats = await _wait_idle(client)
        result.requests_running_end, result.kv_blocks_used_end = stats["requests_running"], stats["kv_blocks_used"]
        result.rss_end_mib = stats["server_rss_bytes"] / 2**20
    return result


async def _one(client: httpx.AsyncClient, prompt: str, max_new_tokens: int) -> str:
    """ "completed", a documented refusal's code, or a one-line description of what went wrong."""
    body = {"prompt": prompt, "max_new_tokens": max_new_tokens}
    try:
        async with client.stream("POST", "/v1/generate/stream", json=body) as response:
            if response.status_code != 200:
                return _refusal(response.status_code, await response.aread())
            summary, done = False, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    continue
                payload = json.loads(data)
                if "error" in payload:
                    code = payload["error"].get("code")
                    return code if code in RETRYABLE else f"stream error event {code}"
                summary = summary or payload.get("finish_reason") is not None
            return "completed" if summary and done else f"stream ended without {'summary' if done else '[DONE]'}"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


def _refusal(status: int, body: bytes) -> str:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status} without the error envelope"
    return code if code in RETRYABLE and STATUS[code] == status else f"HTTP {status} {code}"


async def _metrics(client: httpx.AsyncClient) -> dict[str, Any]:
    response = await client.get("/v1/metrics")
    response.raise_for_status()
    return response.json()


async def _wait_idle(client: httpx.AsyncClient, within_s: float = 10.0) -> dict[str, Any]:
    """The server's metrics once nothing runs or waits (cancelled requests leave at the engine's next step)."""
    deadline = time.perf_counter() + within_s
    while True:
        stats = await _metrics(client)
        idle = not (stats["requests_running"] or stats["requests_waiting"] or stats["kv_blocks_used"])
        if idle or time.perf_counter() > deadline:
            return stats
        await asyncio.sleep(0.05)
