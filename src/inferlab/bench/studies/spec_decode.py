"""spec_decode: for this job's drafter (spec=off|ngram|draft), generation tokens/s and the engine's speculation
counters over the study's draft lengths K and temperatures."""
from __future__ import annotations

import time

from omegaconf import DictConfig, OmegaConf, open_dict

from inferlab.api import engine_from_config
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import prompt_ids, require

SPEC_STATS = ("spec_proposed", "spec_accepted", "spec_target_calls")


@register("spec_decode")
def run(cfg: DictConfig) -> Rows:
    require("inferlab.engine.speculative", "speculative decoding")
    speculating = cfg.spec.name != "off"
    rows = []
    for k in cfg.study.ks if speculating else [None]:
        job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        if k is not None:
            with open_dict(job):
                job.spec.k = int(k)
        engine = engine_from_config(job)
        ids = prompt_ids(cfg, engine, int(cfg.measure.prompt_tokens))
        for temperature in cfg.study.temperatures:
            before = engine.stats()
            start = time.perf_counter()
            done = engine.generate(ids, max_new_tokens=int(cfg.measure.new_tokens), temperature=float(temperature),
                                   seed=cfg.seed or 0)
            elapsed = time.perf_counter() - start
            after = engine.stats()
            delta = {key: after[key] - before[key] for key in SPEC_STATS if key in after}
            proposed, calls = delta.get("spec_proposed"), delta.get("spec_target_calls")
            rows.append({"k": k, "temperature": float(temperature), "gen_tok_s": len(done.token_ids) / elapsed,
                         "decode_tok_s": done.timings.tokens_per_sec, **delta,
                         "acceptance_rate": delta["spec_accepted"] / proposed if proposed else None,
                         "tokens_per_target_call": len(done.token_ids) / calls if calls else None})
    return rows
