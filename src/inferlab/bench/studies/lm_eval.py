"""lm_eval: lm-eval's `local-completions` model against this job's inferlab-serve (target=server), on
held-out Shakespeare defined by local files only, next to the project's own evaluation of the same text
with the same weights and precision (bench/perplexity.py, in this process, one full forward per window).

Rolling (perplexity) row: lm-eval scores each document in disjoint windows of `max_length - 2` tokens with
one token of context each (bench/lmeval.py); `own_ppl` windows the same way (window `max_length - 1`,
stride `max_length - 2`, the same prefix token first), so the two must agree to rounding; `own_ppl_own_windows`
is the project's usual overlapping windows (measure.perplexity_window / stride), where most tokens see more
context. Next-line row: exp(-mean log-likelihood per line) of each line's successor, both sides.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from inferlab.api import engine_from_config
from inferlab.bench.lmeval import (
    NEXT_LINE,
    ROLLING,
    held_out_shakespeare,
    run_lm_eval,
    total_loglikelihood,
    write_tasks,
)
from inferlab.bench.perplexity import evaluate_perplexity
from inferlab.bench.studies import Rows, StudyUnavailable, register
from inferlab.bench.targets import ServedTarget, open_target
from inferlab.engine.engine import InferenceEngine


@register("lm_eval")
def run(cfg: DictConfig) -> Rows:
    m, study = cfg.measure, cfg.study
    held_out = held_out_shakespeare(int(study.documents), int(m.lm_eval_chars), int(study.pairs))
    max_length = int(m.lm_eval_max_length)
    engine = engine_from_config(cfg)
    prefix = min(engine.tokenizer.eos_ids)  # what each document is scored after: the corpus' separator
    hydra = HydraConfig.get()
    folder = write_tasks(Path(hydra.runtime.output_dir) / "lm_eval", held_out)
    with open_target(
        cfg, dict(hydra.runtime.choices), list(hydra.overrides.task), Path(hydra.runtime.output_dir), 1
    ) as target:
        if not isinstance(target, ServedTarget):
            raise StudyUnavailable("the lm_eval study drives a server: run it with target=server")
        try:
            results = run_lm_eval(
                f"{target.base_url}/v1/completions",
                str(cfg.model.name),
                engine.tokenizer,
                folder,
                max_length,
                prefix,
                int(study.batch_size),
            )
        except ModuleNotFoundError as e:
            raise StudyUnavailable(str(e)) from e

    docs = [[prefix, *engine.tokenizer.encode(d)] for d in held_out.documents]
    tokens = sum(len(ids) - 1 for ids in docs)
    rolling = results[ROLLING]
    lm_ppl = math.exp(-total_loglikelihood(rolling["bits_per_byte"], held_out.total_bytes) / tokens)
    own = perplexity(engine, docs, max_length - 1, max_length - 2)
    own_windows = perplexity(engine, docs, int(m.perplexity_window), int(m.perplexity_stride))
    lines = [next_line_loglikelihood(engine, a, b) for a, b in held_out.pairs]
    own_lines = math.exp(-sum(ll for ll, _ in lines) / len(lines))
    nl = results[NEXT_LINE]
    return [
        {
            "task": "rolling",
            "window": max_length,
            "tokens": tokens,
            "lm_eval_ppl": lm_ppl,
            "own_ppl": own,
            "diff_pct": 100 * (lm_ppl / own - 1),
            "own_ppl_own_windows": own_windows,
            "lm_eval_word_ppl": rolling["word_perplexity"],
            "lm_eval_bits_per_byte": rolling["bits_per_byte"],
        },
        {
            "task": "next_line",
            "window": max_length,
            "tokens": len(lines),
            "lm_eval_ppl": nl["perplexity"],
            "own_ppl": own_lines,
            "diff_pct": 100 * (nl["perplexity"] / own_lines - 1),
            "lm_eval_acc": nl["acc"],
            "own_acc": sum(greedy for _, greedy in lines) / len(lines),
        },
    ]


def perplexity(engine: InferenceEngine, docs: list[list[int]], window: int, stride: int) -> float:
    """Token perplexity over every document (each scored after its first token), per document windows."""
    nll = sum(math.log(evaluate_perplexity(engine.model, ids, window, stride)) * (len(ids) - 1) for ids in docs)
    return math.exp(nll / sum(len(ids) - 1 for ids in docs))


@torch.inference_mode()
def next_line_loglikelihood(engine: InferenceEngine, context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | context) and whether it is the greedy continuation, tokenized as lm-eval does:
    the whole text encoded once, the continuation being what follows the context's own tokens."""
    tokenizer = engine.tokenizer
    whole = tokenizer.encode(context + continuation)
    start = len(tokenizer.encode(context))
    ids = torch.tensor([whole])
    logits = engine.model(ids, torch.arange(len(whole))[None])[0].float()  # (T, vocab)
    logprobs = torch.log_softmax(logits[start - 1 : -1], dim=-1)
    targets = ids[0, start:]
    picked = logprobs.gather(1, targets[:, None])[:, 0]
    return float(picked.sum()), bool((logprobs.argmax(dim=-1) == targets).all())
