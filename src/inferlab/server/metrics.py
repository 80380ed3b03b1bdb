"""What the server observes: one record per request, logged as one line when the response ends, and
folded into the JSON (/v1/metrics) and Prometheus (/metrics) views beside the engine's counters.

TTFT and TPOT are taken server-side with vLLM's serving-benchmark definitions: TTFT = request arrival -> first
token ready to send; TPOT = (E2E - TTFT) / (completion_tokens - 1).

The engine's counters are gauges named inferlab_<counter>. A cluster router reads three of them as the Gateway API
Inference Extension's model-server protocol defines them: inferlab_requests_waiting (TotalQueuedRequests),
inferlab_requests_running (TotalRunningRequests) and inferlab_kv_cache_usage_perc (KVCacheUtilization, the share of
KV blocks requests hold, 0 to 1); inferlab_cache_config_info carries the KV block size and pool size as labels, for
its prefix-cache scorer. Counters that come from a replica (replicas/) carry its name as the `replica` label.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("inferlab.server")

PERCENTILES = (50, 90, 95, 99)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class RequestRecord:
    """Filled in as the request goes: by the log middleware (id, timing, status) and by the routes (tokens)."""

    method: str
    path: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    start: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    error: str | None = None  # the error code of a stream that ended early (timeout, cancelled, ...)
    replica: str | None = None  # the engine replica that answered, when one did (replicas/): a header

    def token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.completion_tokens += 1

    @property
    def ttft_ms(self) -> float | None:
        return (self.first_token_at - self.start) * 1e3 if self.first_token_at is not None else None


class ServerMetrics:
    def __init__(self, window: int) -> None:
        self.recent: dict[str, deque[float]] = {k: deque(maxlen=window) for k in ("ttft_ms", "tpot_ms", "e2e_ms")}
        self.registry = CollectorRegistry()  # one per app, so tests can build many apps in one process
        self.requests = Counter(
            "inferlab_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.tokens = Counter("inferlab_tokens", "Tokens processed", ["kind"], registry=self.registry)
        self.latency = {
            name: Histogram(f"inferlab_{name}_seconds", help, buckets=LATENCY_BUCKETS_S, registry=self.registry)
            for name, help in (
                ("ttft", "Request arrival to first token"),
                ("tpot", "Time per output token"),
                ("e2e", "Request arrival to last token"),
            )
        }
        ProcessCollector(registry=self.registry)
        self.process = psutil.Process()
        self.event_loop_thread: int | None = None  # threading.get_ident() of the thread serving requests (RequestLog)

    def finish(self, record: RequestRecord, status: int, route: str) -> None:
        end = time.perf_counter()
        total_ms = (end - record.start) * 1e3
        self.requests.labels(route, str(status)).inc()
        self.tokens.labels("prompt").inc(record.prompt_tokens)
        self.tokens.labels("completion").inc(record.completion_tokens)
        ttft = record.ttft_ms
        if status == 200 and record.error is None and ttft is not None:
            tpot = (total_ms - ttft) / (record.completion_tokens - 1) if record.completion_tokens > 1 else 0.0
            for name, value in (("ttft", ttft), ("tpot", tpot), ("e2e", total_ms)):
                self.recent[f"{name}_ms"].append(value)
                self.latency[name].observe(value / 1e3)
        fields = {
            "request_id": record.id,
            "method": record.method,
            "path": record.path,
            "status": status,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "ttft_ms": round(ttft, 1) if ttft is not None else None,
            "total_ms": round(total_ms, 1),
            "error": record.error,
        }
        log.info(
            "request %s %s %s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s total_ms=%.1f%s",
            record.id,
            record.method,
            record.path,
            status,
            record.prompt_tokens,
            record.completion_tokens,
            f"{ttft:.1f}" if ttft is not None else "-",
            total_ms,
            f" error={record.error}" if record.error else "",
            extra={"request": fields},
        )

    def snapshot(self, engine_stats: dict[str, Any]) -> dict[str, Any]:
        """/v1/metrics: the engine's counters, latency percentiles over recent requests, server memory."""
        out: dict[str, Any] = dict(engine_stats)
        for name, values in self.recent.items():
            array = np.asarray(values, dtype=np.float64)
            out[name] = {f"p{p}": float(np.percentile(array, p)) if array.size else None for p in PERCENTILES}
        out["requests_completed"] = len(self.recent["e2e_ms"])
        out["server_rss_bytes"] = self.process.memory_info().rss
        out.update(self.cpu_seconds())
        return out

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time the process and its HTTP event-loop thread have used (user + system), beside the engine
        thread's own (engine_cpu_s): how much of the cores serving takes from the engine. From the kernel's CPU
        clocks, to the nanosecond: /proc's 10 ms ticks read the event loop's share of a short load as 0."""
        return {"cpu_s_process": time.process_time(), "cpu_s_event_loop": thread_cpu_seconds(self.event_loop_thread)}

    def prometheus(self, engine_stats: dict[str, Any]) -> bytes:
        """/metrics: the server's own metrics, then the engine's counters of `engine_stats` (one snapshot, so
        they agree with each other and with /v1/metrics)."""
        return generate_latest(self.registry) + generate_latest(_EngineGauges(engine_stats))  # type: ignore[arg-type]


def thread_cpu_seconds(ident: int | None) -> float:
    """CPU seconds a thread of this process (threading.get_ident()) has used, from its own clock; 0 before it is
    known, or where the platform has no per-thread clocks."""
    if ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


@dataclass
class _EngineGauges:
    """One snapshot of the engine's counters as Prometheus gauges (a collector generate_latest reads)."""

    stats: dict[str, Any]

    def collect(self):
        stats = dict(self.stats)
        replica = stats.pop("replica", None)
        labels = {"replica": replica} if replica is not None else {}
        for name, value in stats.items():
            gauge = GaugeMetricFamily(f"inferlab_{name}", name.replace("_", " "), labels=list(labels))
            gauge.add_metric(list(labels.values()), value)
            yield gauge
        if stats.get("kv_block_size"):
            info = {
                **labels,
                "block_size": str(stats["kv_block_size"]),
                "num_gpu_blocks": str(stats["kv_blocks_total"]),
            }
            config = GaugeMetricFamily(
                "inferlab_cache_config_info",
                "KV cache layout (labels); num_gpu_blocks is the pool's size on any device",
                labels=list(info),
            )
            config.add_metric(list(info.values()), 1)
            yield config


REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")  # an incoming X-Request-ID we keep as the request's id


class RequestLog:
    """ASGI middleware: a RequestRecord in `request.state.record`, an `x-request-id` header (the caller's
    own when it sent a well-formed one), and one log line (plus metrics) when the response has ended,
    streamed or not."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = RequestRecord(scope["method"], scope["path"])
        self.metrics.event_loop_thread = threading.get_ident()
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        if REQUEST_ID.fullmatch(given):  # the caller's id (a proxy's, a tracing client's) is kept
            record.id = given.decode()
        scope.setdefault("state", {})["record"] = record
        status = 500  # what the client gets if the app raises before starting a response

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", record.id.encode())]
                if record.replica is not None:
                    headers.append((b"x-inferlab-replica", record.replica.encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.finish(record, status, route)
