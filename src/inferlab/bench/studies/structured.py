"""structured: JSON-schema-constrained chat requests against the same requests free, at each concurrency level.

One engine serves both kinds. Each request's free twin generates as many tokens as the constrained one did in a
pass before the timed rounds (ignore_eos, max_tokens = that length): both runs then feed the same prompts at the
same points, so the prompt steps that fall between a run's decode steps are alike and the difference is the
grammar's. In each round every level runs a closed loop of free requests and one of constrained ones (their order
alternating between rounds, so a shared machine's drift falls on both), and a constrained run's median TPOT is
divided by the free run's of the same round: the mask's cost per decode step, as a ratio measured side by side.
Every output is validated against its schema.
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
from inferlab.engine.sampling import SamplingParams

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
        count = max(requests_per_level(cfg), 2 * max(int(level) for level in study.levels))
        jobs = [Job(*prompts[i % len(prompts)], new_tokens) for i in range(count)]
        lengths = [o.timings.completion_tokens for o in asyncio.run(closed_loop(engine, jobs, 1, constrain=True))]
        for job, length in zip(jobs, lengths):
            job.free_tokens = max(length, 2)  # a TPOT needs two tokens
        for round_ in progress(range(int(m.warmup) + int(m.repeats)), "structured rounds"):
            for level in study.levels:
                level_jobs = jobs[: max(requests_per_level(cfg), 2 * int(level))]
                for mode in [FREE, JSON_SCHEMA] if round_ % 2 == 0 else [JSON_SCHEMA, FREE]:
                    outcomes = asyncio.run(closed_loop(engine, level_jobs, int(level), mode == JSON_SCHEMA))
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


@dataclass
class Job:
    prompt_ids: list[int]
    schema: dict[str, Any]
    new_tokens: int  # the constrained request's max_tokens
    free_tokens: int = 0  # its free twin's: what the constrained one generated (ignore_eos)

    def params(self, engine: InferenceEngine, constrain: bool) -> SamplingParams:
        if constrain:
            constraint = Constraint("json", self.schema, "response_format")
            return engine.sampling_params(max_new_tokens=self.new_tokens, temperature=0.0, constraint=constraint)
        return engine.sampling_params(max_new_tokens=self.free_tokens, temperature=0.0, ignore_eos=True)


async def closed_loop(engine: InferenceEngine, jobs: list[Job], level: int, constrain: bool) -> list[Outcome]:
    """`jobs` through engine.submit, `level` in flight until all are done, in job order."""
    pending = list(reversed(range(len(jobs))))
    outcomes: list[Outcome | None] = [None] * len(jobs)

    async def worker() -> None:
        while pending:
            index = pending.pop()
            job, parts = jobs[index], []
            async for event in engine.submit(GenerationRequest(job.prompt_ids, job.params(engine, constrain))):
                parts.append(event.text)
                if event.finish_reason is not None:
                    outcomes[index] = Outcome("".join(parts), event.finish_reason, event.timings, job.schema)

    await asyncio.gather(*(worker() for _ in range(level)))
    return [o for o in outcomes if o is not None]


def median_tpot(outcomes: list[Outcome]) -> float:
    return statistics.median(o.timings.tpot_ms for o in outcomes if o.timings.completion_tokens > 1)


def valid(outcome: Outcome, jsonschema: Any) -> bool:
    try:
        jsonschema.validate(json.loads(outcome.text), outcome.schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
