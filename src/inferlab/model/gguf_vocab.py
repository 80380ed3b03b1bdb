"""A GGUF file's vocabulary as a `tokenizers` pipeline: byte-level BPE ('gpt2') or SentencePiece BPE ('llama').

A SentencePiece GGUF (Llama 2, Mistral, TinyLlama, Gemma, Phi-3) stores tokens and scores, no merges:
the merges are the vocabulary's own two-piece splits, best merged piece first (by score; by file order
for Gemma, whose scores do not follow its merge order). Text is spelled with "▁" for spaces, unknown
bytes fall back to the <0xNN> tokens, and a leading "▁" is prepended to the first word, as
transformers rebuilds these files (and as llama.cpp tokenizes them).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from inferlab.errors import ModelLoadError

GGUF_TOKEN_UNKNOWN, GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED = 2, 3, 4
SPACE = "\u2581"
KINDS = ("gpt2", "llama")


def gguf_backend(meta: dict[str, Any]) -> tuple[HFTokenizer, list[int]]:
    """(the pipeline, the ids of its control tokens) for the file's tokenizer.ggml.* fields."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in KINDS:
        raise ModelLoadError(f"unsupported GGUF tokenizer {kind!r}: inferlab reads {list(KINDS)} vocabularies")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if kind == "gpt2":
        backend = _byte_level(tokens, list(meta.get("tokenizer.ggml.merges", [])))
    else:
        backend = _sentencepiece(
            tokens, list(meta.get("tokenizer.ggml.scores", [])), types, meta.get("general.architecture", "llama")
        )
    control = [i for i, t in enumerate(types) if t == GGUF_TOKEN_CONTROL]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    vocab = backend.get_vocab()
    user = [tokens[i] for i, t in enumerate(types) if t == GGUF_TOKEN_USER_DEFINED and tokens[i] in vocab]
    backend.add_tokens([AddedToken(t, normalized=False) for t in user])
    return backend, control


def _byte_level(tokens: list[str], merges: list[str]) -> HFTokenizer:
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def merges_from_vocab(tokens: list[str], priority: list[float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, the highest `priority` of the merged token first (then the
    longer left piece): the merges a SentencePiece BPE model implies."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, index in ids.items():
        score = priority[index]
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((score, cut, len(right), left, right))
    found.sort(key=lambda m: m[:3], reverse=True)  # stable: equal keys keep the vocabulary's order
    return [(left, right) for *_, left, right in found]


def _sentencepiece(tokens: list[str], scores: list[float], types: list[int], arch: str) -> HFTokenizer:
    gemma = arch.startswith("gemma")
    if gemma:  # Gemma stores runs of spaces as spaces; its merges follow the file's order, not the scores
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    if len(scores) != len(tokens):
        raise ModelLoadError("SentencePiece GGUF without tokenizer.ggml.scores: cannot rebuild its merges")
    unknown = next((tokens[i] for i, t in enumerate(types) if t == GGUF_TOKEN_UNKNOWN), None)
    backend = HFTokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges_from_vocab(tokens, scores),
            unk_token=unknown,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:  # spaces spelled by a normalizer, no prefix space
        backend.normalizer = normalizers.Replace(" ", SPACE)
    elif arch == "phi3":  # the prefix space from a normalizer, so leading spaces are not merged into it
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        steps.append(decoders.Strip(content=" ", left=1))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend
