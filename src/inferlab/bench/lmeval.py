"""lm-eval (EleutherAI's harness, `local-completions` model) against a running inferlab server, on tasks
defined by local files only: no hub, no network.

Two tasks over held-out Shakespeare (train/corpus.py's validation documents):
- `inferlab_shakespeare_rolling` (loglikelihood_rolling): each document's total log-likelihood. lm-eval
  windows a document in disjoint spans of `max_length - 2` tokens, each scored with one token of context
  before it (the first after the prefix token), and sends each window as token ids with echo=true,
  max_tokens=1, logprobs=1; it reports bits per byte, from which the total log-likelihood follows.
- `inferlab_shakespeare_next_line` (loglikelihood): the log-likelihood of a line's successor given the line.

Needs `pip install -e '.[eval]'` (lm-eval[api]).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferlab.errors import InvalidRequestError
from inferlab.model.tokenizer import Tokenizer
from inferlab.train.corpus import split_documents

ROLLING, NEXT_LINE = "inferlab_shakespeare_rolling", "inferlab_shakespeare_next_line"
INSTALL = "pip install -e '.[eval]'"


@dataclass
class HeldOut:
    documents: list[str]  # scored whole (rolling)
    pairs: list[tuple[str, str]]  # (a line, a newline and the next line)

    @property
    def total_bytes(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.documents)


def held_out_shakespeare(documents: int, chars: int, pairs: int) -> HeldOut:
    """The first `chars` characters (cut at a line end) of the first `documents` validation plays, and
    `pairs` consecutive non-empty line pairs taken from the following validation play."""
    plays = [text for _, text in split_documents("shakespeare", "val")]
    if len(plays) <= documents:
        raise InvalidRequestError(f"the held-out split has {len(plays)} documents; asked for {documents} + 1")
    texts = [play[: play.rfind("\n", 0, chars) + 1 or chars].strip() for play in plays[:documents]]
    lines = [line.strip() for line in plays[documents].splitlines() if len(line.strip()) > 20]
    return HeldOut(texts, [(lines[i], "\n" + lines[i + 1]) for i in range(0, 2 * pairs, 2)][:pairs])


def write_tasks(folder: Path, held_out: HeldOut) -> Path:
    """The two task YAMLs and their JSON-lines data in `folder` (lm-eval's --include_path)."""
    folder.mkdir(parents=True, exist_ok=True)
    _jsonl(folder / "rolling.jsonl", [{"text": d} for d in held_out.documents])
    # the newline is part of the scored continuation, and the delimiter empty: lm-eval versions differ in
    # where they put `target_delimiter` (0.4.13 drops it from the request), the data does not
    _jsonl(folder / "next_line.jsonl", [{"context": a, "continuation": b} for a, b in held_out.pairs])
    common = "dataset_path: json\ntest_split: test\nshould_decontaminate: false\nmetadata: {version: 1.0}\n"
    (folder / "rolling.yaml").write_text(
        f"task: {ROLLING}\n{common}dataset_kwargs:\n  data_files: {{test: {folder / 'rolling.jsonl'}}}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    (folder / "next_line.yaml").write_text(
        f"task: {NEXT_LINE}\n{common}dataset_kwargs:\n  data_files: {{test: {folder / 'next_line.jsonl'}}}\n"
        "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{continuation}}'\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}\n"
        "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
    )
    return folder


def run_lm_eval(
    completions_url: str,
    model_name: str,
    tokenizer: Tokenizer,
    folder: Path,
    max_length: int,
    prefix_token_id: int,
    batch_size: int,
) -> dict[str, dict[str, Any]]:
    """lm-eval's results per task (metric names without the filter suffix), run in this process offline."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ModuleNotFoundError(f"lm-eval is not installed; run `{INSTALL}`")
    os.environ.update(
        {
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_DATASETS_CACHE": str(folder / "hf-datasets"),
        }
    )
    import lm_eval
    from lm_eval.tasks import TaskManager

    tokenizer_dir = tokenizer.save_hf_dir(folder / "tokenizer", max_length)
    model_args = {
        "model": model_name,
        "base_url": completions_url,
        "tokenizer_backend": "huggingface",
        "tokenizer": str(tokenizer_dir),
        "tokenized_requests": True,
        "max_length": max_length,
        "custom_prefix_token_id": prefix_token_id,
        "num_concurrent": 1,
        "max_retries": 1,
        "batch_size": batch_size,
    }
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[ROLLING, NEXT_LINE],
        task_manager=TaskManager(include_path=str(folder), include_defaults=False),
        log_samples=False,
        bootstrap_iters=0,
        random_seed=0,
    )
    return {
        task: {k.split(",")[0]: v for k, v in metrics.items() if "," in k} for task, metrics in out["results"].items()
    }


def total_loglikelihood(bits_per_byte: float, total_bytes: int) -> float:
    """lm-eval's rolling tasks report bits per byte = -sum(loglikelihood) / (bytes * ln 2): undo it."""
    return -bits_per_byte * total_bytes * math.log(2)


def _jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
