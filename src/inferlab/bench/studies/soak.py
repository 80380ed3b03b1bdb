"""soak: a real server under N concurrent streaming clients for `study.rounds` x load.num_requests
requests; one row that says whether it passed (see bench/soak.py for what passing means)."""

from __future__ import annotations

import asyncio

from omegaconf import DictConfig, OmegaConf

from inferlab.bench.prompts import load_tokenizer, make_prompts
from inferlab.bench.soak import soak
from inferlab.bench.studies import Rows, register
from inferlab.bench.targets import open_job_target
from inferlab.errors import InvalidRequestError


@register("soak")
def run(cfg: DictConfig) -> Rows:
    if cfg.target.kind != "server":
        raise InvalidRequestError("the soak measures a server: run it with target=server")
    load = OmegaConf.to_container(cfg.load, resolve=True)
    prompts = [
        p.text
        for p in make_prompts(load_tokenizer(OmegaConf.to_container(cfg.model, resolve=True)), load, seed=cfg.seed or 0)
    ]
    clients, requests = int(load["concurrency"]), int(cfg.study.rounds) * int(load["num_requests"])
    with open_job_target(cfg, int(load["output_tokens"])) as target:
        result = asyncio.run(soak(target.base_url, prompts, clients, requests, int(load["output_tokens"])))
    return [result.row(float(cfg.study.max_rss_growth_mib))]
