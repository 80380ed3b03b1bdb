"""Serving metrics with the definitions of vLLM's serving benchmark, so numbers compare across tools.

Per request: TTFT = sent -> first token; E2E = sent -> last chunk; TPOT = (E2E - TTFT) / (output_tokens - 1)
(only for requests with more than one token); ITL = every gap between consecutive token chunks, pooled over
all requests. Throughputs divide by the wall time of the whole run. Percentiles use numpy's linear
interpolation, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """One request's timeline, in seconds from an arbitrary clock origin."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token-bearing chunk
    end: float | None = None  # stream closed
    prompt_tokens: int = 0
    output_tokens: int | None = None  # from the server's usage; None = one token per chunk
    error: str | None = None
    timed_out: bool = False  # the server's deadline ended it (HTTP 504, or an SSE error event with code "timeout")

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def n_output(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return (self.end if self.end is not None else self.chunk_times[-1]) - self.sent

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.chunk_times)) if len(self.chunk_times) > 1 else []

    @property
    def tpot(self) -> float | None:
        n = self.n_output
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None


@dataclass
class SLO:
    """Goodput thresholds in ms; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, r.tpot or 0.0), (self.e2e_ms, r.e2e))  # 1 token: TPOT 0
        return all(limit is None or value * 1e3 <= limit for limit, value in checks)


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO | None = None) -> dict[str, float]:
    """The run's metrics as a flat dict: counts, throughputs, and mean/median/std/pXX of ttft, tpot, itl, e2e (ms)."""
    done = [r for r in records if r.success]
    out_tokens = sum(r.n_output for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2e": [r.e2e for r in done],
    }
    metrics: dict[str, float] = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "timed_out": sum(r.timed_out for r in records),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    if slo is not None:
        metrics["request_goodput"] = sum(slo.met_by(r) for r in done) / duration_s
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1e3
        metrics[f"mean_{name}_ms"] = float(ms.mean())
        metrics[f"median_{name}_ms"] = float(np.median(ms))
        metrics[f"std_{name}_ms"] = float(ms.std())
        for p in PERCENTILES:
            metrics[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return metrics
