"""structured: JSON-schema-constrained chat requests against the same requests free, at each concurrency level.

One engine serves both kinds; in each round every level runs a closed loop of free requests and one of constrained
ones (their order alternating between rounds, so a shared machine's drift falls on both), and a constrained run's
median TPOT is divided by the free run's of the same round: the mask's cost per decode step, as a ratio measured
side by side. Every constrained output is validated against its schema.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from inferlab.api import engine_from_config
from inferlab.bench.progress import progress
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import require
from inferlab.engine.engine import GenerationRequest, InferenceEngine
from inferlab.engine.grammar import Constraint
from inferlab.engine.request import Timings

FREE, JSON_SCHEMA = "free", "json_schema"


@dataclass
class Outcome:
    text: str
    finish_reason: str
    timings: Timings
    schema: dict[str, Any]


@register("structured")
def run(cfg: DictConfig) -> Rows:
    jsonschema = require("jsonschema", "the structured study's validation")
    engine = engine_from_config(cfg)
    study, m = cfg.study, cfg.measure
    schemas = OmegaConf.to_container(study.schemas, resolve=True)
    assert isinstance(schemas, list)
    prompts = [
        (engine.encode_prompt("", messages=[{"role": "user", "content": s["prompt"]}]), s["schema"]) for s in schemas
    ]
    new_tokens = min(int(study.new_tokens), int(m.new_tokens))
    runs: dict[tuple[int, str], list[list[Outcome]]] = defaultdict(list)
    try:
        for round_ in progress(range(int(m.warmup) + int(m.repeats)), "structured rounds"):
            for level in study.levels:
                count = max(requests_per_level(cfg), 2 * int(level))
                modes = [FREE, JSON_SCHEMA] if round_ % 2 == 0 else [JSON_SCHEMA, FREE]
                for mode in modes:
                    jobs = [prompts[i % len(prompts)] for i in range(count)]
                    outcomes = asyncio.run(closed_loop(engine, jobs, int(level), new_tokens, mode == JSON_SCHEMA))
                    if round_ >= int(m.warmup):
                        runs[int(level), mode].append(outcomes)
    finally:
        engine.close()
    rows: Rows = []
    for (level, mode), rounds in sorted(runs.items()):
        outcomes = [o for r in rounds for o in r]
        ratios = [median_tpot(r) / median_tpot(f) for r, f in zip(rounds, runs[level, FREE])]
        rows.append(
            {
                "concurrency": level,
                "mode": mode,
                "median_tpot_ms": statistics.median(median_tpot(r) for r in rounds),
                "tpot_vs_free": statistics.median(ratios),
                "median_ttft_ms": statistics.median(o.timings.ttft_ms for o in outcomes),
                "output_tokens_per_request": statistics.mean(o.timings.completion_tokens for o in outcomes),
                "valid_pct": 100 * sum(valid(o, jsonschema) for o in outcomes) / len(outcomes),
                "length_pct": 100 * sum(o.finish_reason == "length" for o in outcomes) / len(outcomes),
                "completed": len(outcomes),
                "new_tokens": new_tokens,
            }
        )
    return rows


def requests_per_level(cfg: DictConfig) -> int:
    per_level = int(cfg.study.requests_per_level)
    return min(per_level, int(cfg.load.num_requests)) if cfg.measure.size == "smoke" else per_level


async def closed_loop(
    engine: InferenceEngine, jobs: list[tuple[list[int], dict[str, Any]]], level: int, new_tokens: int, constrain: bool
) -> list[Outcome]:
    """`jobs` (prompt ids, schema) through engine.submit, `level` in flight until all are done; greedy."""
    pending = list(reversed(jobs))
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while pending:
            ids, schema = pending.pop()
            constraint = Constraint("json", schema, "response_format") if constrain else None
            params = engine.sampling_params(max_new_tokens=new_tokens, temperature=0.0, constraint=constraint)
            parts = []
            async for event in engine.submit(GenerationRequest(ids, params)):
                parts.append(event.text)
                if event.finish_reason is not None:
                    outcomes.append(Outcome("".join(parts), event.finish_reason, event.timings, schema))

    await asyncio.gather(*(worker() for _ in range(level)))
    return outcomes


def median_tpot(outcomes: list[Outcome]) -> float:
    return statistics.median(o.timings.tpot_ms for o in outcomes if o.timings.completion_tokens > 1)


def valid(outcome: Outcome, jsonschema: Any) -> bool:
    try:
        jsonschema.validate(json.loads(outcome.text), outcome.schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
