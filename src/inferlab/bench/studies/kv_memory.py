"""kv_memory: KV bytes one request holds, from the calculator and as the engine actually holds them; and what int8
KV costs in the model's output.

A contiguous slot is reserved for the longest sequence; paged blocks grow with the tokens written, so
the measured figure is what the block manager has handed out while the request is alive. How many such
requests the whole pool holds at once shows what a smaller KV element buys in the same budget (int8 KV:
codes plus one fp32 scale per row).

What it costs is measured teacher-forced, not on free-running greedy text (where one near tie sends the rest of the
text elsewhere, so a share of equal tokens says little): held-out text is fed through the engine with the full-
precision KV and with int8 KV, and the logits before each token are compared position by position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import Tensor

from inferlab.api import engine_from_config, precision_config
from inferlab.bench.studies import Rows, register
from inferlab.bench.studies.common import prompt_ids
from inferlab.engine.engine import InferenceEngine
from inferlab.engine.kv.contiguous import compute_kv_cache_bytes
from inferlab.train.corpus import load_tokens

MIB = 2**20


@register("kv_memory")
def run(cfg: DictConfig) -> Rows:
    engine = engine_from_config(cfg)
    try:
        rows = memory_rows(cfg, engine)
        int8_kv = engine.config.kv_dtype is not None
    finally:
        engine.close()  # before the agreement's engines: an idle loop's OpenMP team beside theirs slows every step
    if int8_kv:  # the int8 job also compares int8 KV's logits with the full-precision KV's
        rows += agreement_rows(cfg)
    return rows


def memory_rows(cfg: DictConfig, engine: InferenceEngine) -> Rows:
    kv_dtype = str(engine.config.cache_dtype).removeprefix("torch.")
    rows = []
    for tokens in sorted(int(n) for n in cfg.study.request_tokens):
        ids = prompt_ids(cfg, engine, tokens)
        _, sequence = engine.prefill(ids)
        try:
            stats = engine.stats()
        finally:
            sequence.release()
        held = stats["kv_blocks_used"] * stats["kv_bytes_per_block"]
        calculated = compute_kv_cache_bytes(engine.loaded.config, 1, tokens, engine.config.cache_dtype)
        rows.append(
            {
                "kv_dtype": kv_dtype,
                "request_tokens": tokens,
                "calculated_mb": calculated / MIB,
                "held_mb": held / MIB,
                "held_over_calculated": held / calculated,
                "pool_mb": stats["kv_blocks_total"] * stats["kv_bytes_per_block"] / MIB,
                "pool_blocks": stats["kv_blocks_total"],
                "requests_in_pool": stats["kv_blocks_total"] // stats["kv_blocks_used"],
            }
        )
    return rows


def agreement_rows(cfg: DictConfig) -> Rows:
    """Per precision of study.agreement_precisions: int8 KV's teacher-forced logits against the full-precision KV's
    on the same passages of held-out Shakespeare (measure.kv_agreement: top-1 agreement, mean KL)."""
    spec = cfg.measure.kv_agreement
    prompt, forced = int(spec.prompt_tokens), int(spec.forced_tokens)
    rows = []
    for precision in cfg.study.agreement_precisions:
        full, cache_dtype = forced_logits(cfg, str(precision), "auto", int(spec.passages), prompt, forced)
        int8, _ = forced_logits(cfg, str(precision), "int8", int(spec.passages), prompt, forced)
        top1, kl = agreement(full, int8)
        rows.append(
            {
                "precision": str(precision),
                "kv_reference": cache_dtype,
                "positions": len(full),
                "top1_agreement_pct": 100 * top1,
                "mean_kl": kl,
            }
        )
    return rows


def forced_logits(
    cfg: DictConfig, precision: str, kv_dtype: str, passages: int, prompt: int, forced: int
) -> tuple[Tensor, str]:
    """An engine of this job's model at `precision` on a paged cache of `kv_dtype`: its logits before each forced
    token of every passage, stacked, and its KV dtype's name."""
    engine = engine_from_config(_variant(cfg, precision, kv_dtype))
    try:
        text = load_tokens(engine.tokenizer, "shakespeare", "val", max_tokens=passages * (prompt + forced)).tolist()
        if len(text) < passages * (prompt + forced):
            raise ValueError(f"held-out Shakespeare has {len(text)} tokens, fewer than the passages need")
        length = prompt + forced
        logits = [teacher_forced(engine, text[i * length : (i + 1) * length], prompt) for i in range(passages)]
        return torch.cat(logits), str(engine.config.cache_dtype).removeprefix("torch.")
    finally:
        engine.close()


def _variant(cfg: DictConfig, precision: str, kv_dtype: str) -> DictConfig:
    variant = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(variant, DictConfig)
    with open_dict(variant):
        variant.precision = precision_config(precision)
        variant.cache.mode = "paged"
        variant.cache.kv_dtype = kv_dtype
        variant.cache.prefix = False  # every passage's KV written by its own prefill, none read from another's
        variant.cache.kv_budget_mb = 64  # one passage at a time
    return variant


@torch.inference_mode()
def teacher_forced(engine: InferenceEngine, ids: list[int], prompt: int) -> Tensor:
    """Prefill the first `prompt` ids, then feed the rest one decode step each, as serving decodes: the logits
    before each id after the prompt (len(ids) - prompt, vocab), in fp32, whatever the engine would have picked."""
    logits, sequence = engine.prefill(ids[:prompt], reserve_tokens=len(ids) - prompt)
    try:
        out = [logits.float()]
        for token in ids[prompt:-1]:
            out.append(engine.decode_step(token, sequence).float())
    finally:
        sequence.release()
    return torch.stack(out)


def agreement(reference: Tensor, other: Tensor) -> tuple[float, float]:
    """Rows of logits (positions, vocab) against the reference's: the share of positions whose argmax is the
    reference's, and the mean over positions of KL(reference || other), in nats, from fp32 softmaxes."""
    p_log, q_log = F.log_softmax(reference.float(), -1), F.log_softmax(other.float(), -1)
    top1 = (reference.argmax(-1) == other.argmax(-1)).float().mean().item()
    kl = (p_log.exp() * (p_log - q_log)).sum(-1).clamp_min(0).mean().item()
    return top1, kl
