"""spec_decode: spec=off beside every drafter (ngram, self, draft) on one target, per temperature and prompt kind.

One engine holds the target; each drafter is swapped in beside it, so every speedup is a ratio measured in
the same job. In rounds (each round runs every drafter once per temperature and prompt kind, the same
seed for all), the decode rate of each run is divided by spec=off's of the same round: the speedup is the
median of those ratios, robust to a shared machine's drift. At temperature 0 each drafter's tokens are
checked against spec=off's (speculation is lossless). A drafter that cannot be built here (spec=draft
before `make draft`) gets a row saying why.
"""

from __future__ import annotations

import functools
import statistics
from collections import defaultdict

from omegaconf import DictConfig, OmegaConf
from torch import nn

from inferlab.api import CONF_DIR, engine_from_config
from inferlab.bench.progress import progress
from inferlab.bench.prompts import corpus_ids
from inferlab.bench.studies import Rows, register
from inferlab.engine.engine import InferenceEngine
from inferlab.engine.runtime.threads import on_own_thread
from inferlab.engine.spec.build import build_speculation
from inferlab.engine.spec.session import Speculation
from inferlab.errors import ModelLoadError
from inferlab.kernels.select import select_kernels

OFF = "off"
COUNTERS = ("spec_target_calls", "spec_draft_calls", "spec_proposed", "spec_accepted", "spec_generated")


@register("spec_decode")
def run(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)  # the job's spec group is built with the target (spec=self shares its tensors)
    study, m = cfg.study, cfg.measure
    drafters: dict[str, Speculation | None] = {OFF: None}
    rows: Rows = []
    for name in study.drafters:
        try:
            # built off this thread, as the engine was (engine/runtime/threads.py on_own_thread): no OpenMP team left here
            build = functools.partial(speculation_for, engine, cfg, name)
            drafters[name] = engine.speculation if name == cfg.spec.name else on_own_thread(build)
        except ModelLoadError as e:
            rows.append({"spec": name, "decode_tok_s": None, "note": str(e)})
    prompts = study_prompts(cfg, engine)
    new_tokens = min(int(study.new_tokens), int(m.new_tokens))
    cells = [(t, kind, name) for t in study.temperatures for kind in prompts for name in drafters]
    rates, counts, matches = defaultdict(list), defaultdict(lambda: dict.fromkeys(COUNTERS, 0)), defaultdict(list)
    for round_ in progress(range(int(m.warmup) + int(m.repeats)), "spec_decode rounds"):
        outputs = {}
        for temperature, kind, name in cells:
            engine.speculation = speculation = drafters[name]
            before = speculation.counters() if speculation else {}
            done = engine.generate(
                prompts[kind], max_new_tokens=new_tokens, temperature=float(temperature), seed=(cfg.seed or 0) + round_
            )
            outputs[temperature, kind, name] = done.token_ids
            if round_ < int(m.warmup):
                continue
            rates[temperature, kind, name].append(done.timings.tokens_per_sec)
            for key, value in (speculation.counters() if speculation else {}).items():
                counts[temperature, kind, name][key] += value - before[key]
            if float(temperature) == 0.0 and name != OFF:
                matches[temperature, kind, name].append(done.token_ids == outputs[temperature, kind, OFF])
    for temperature, kind, name in cells:
        cell, c = (temperature, kind, name), counts[temperature, kind, name]
        speedups = [rate / base for rate, base in zip(rates[cell], rates[temperature, kind, OFF])]
        speculation = drafters[name]
        rows.append(
            {
                "spec": name,
                "temperature": float(temperature),
                "prompts": kind,
                "k": speculation.k if speculation else None,
                "adaptive": speculation.adaptive if speculation else None,
                "decode_tok_s": statistics.median(rates[cell]),
                "speedup": statistics.median(speedups),
                "acceptance_rate": c["spec_accepted"] / c["spec_proposed"] if c["spec_proposed"] else None,
                "tokens_per_target_call": c["spec_generated"] / c["spec_target_calls"]
                if c["spec_target_calls"]
                else None,
                "draft_calls_per_token": c["spec_draft_calls"] / c["spec_generated"] if c["spec_generated"] else None,
                "matches_off": all(matches[cell]) if matches[cell] else None,
                "new_tokens": new_tokens,
                "prompt_tokens": len(prompts[kind]),
                "note": None,
            }
        )
    return rows


def speculation_for(engine: InferenceEngine, cfg: DictConfig, name: str) -> Speculation:
    """The drafter of conf/spec/NAME.yaml beside the engine's target, its models on the engine's kernels."""
    spec = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "spec" / f"{name}.yaml"), resolve=True)
    c = engine.config
    speculation = build_speculation(spec, cfg.model.name, engine.model, c.dtype, c.device, engine.loaded.gguf_path)
    assert speculation is not None, f"spec={name} builds no drafter"
    select_kernels(nn.ModuleList(speculation.drafter.models()), c.device, c.dtype, c.kernels)
    speculation.drafter.build_fused(c.device, c.dtype, c.kernels)
    # timed against this target, as a server times its drafter at load (api.engine_from_config): adaptive K's prior
    speculation.drafter.measure_cost(engine.model, engine.fused, speculation.k + 1)
    return speculation


def study_prompts(cfg: DictConfig, engine: InferenceEngine) -> dict[str, list[int]]:
    """Chat prompt ids: a free-text request, and an extractive one (quote a corpus excerpt back)."""
    tokenizer, study = engine.tokenizer, cfg.study
    excerpt = corpus_ids(tokenizer, cfg.load.text, int(cfg.measure.prompt_tokens))[: int(cfg.measure.prompt_tokens)]
    texts = {"chat": study.chat_prompt, "extractive": f"{tokenizer.decode(excerpt)}\n\n{study.extractive_prompt}"}
    return {
        kind: tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": text}]))
        for kind, text in texts.items()
    }
