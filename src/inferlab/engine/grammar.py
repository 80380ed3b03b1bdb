"""Constrained decoding: a request's grammar (a JSON schema, a regular expression, a choice of strings, a Lark or
GBNF grammar) as a mask over its next token's logits, advanced with every token it accepts.

llguidance does the grammar work: an Earley parser over the tokenizer's own vocabulary, one bit per token of the
logits' row. A `Constraint` is what a request asks (checked and compiled before anything runs, the field at fault
named); a `TokenGrammar` is that request's matcher while it generates. Requests without one never reach this file.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch
from torch import Tensor

from inferlab.errors import InvalidRequestError
from inferlab.model.tokenizer import Tokenizer

# JSON as people write it (", " and ": "), with no other whitespace: a small model given free whitespace may spend
# its whole budget on newlines between two keys
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match; `param` is the request field it came from (errors name it)."""

    kind: str  # "json" (spec: a JSON schema, a dict) | "regex" | "grammar" (Lark or GBNF text) | "choice" (strings)
    spec: Any
    param: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")

    def grammar(self) -> str:
        """llguidance's grammar text for it (not yet checked: `GrammarCompiler.check` does)."""
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(self.spec), overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(self.spec))
        return llguidance.grammar_from("grammar", self.spec)


class GrammarCompiler:
    """The engine's: the vocabulary as llguidance reads it (built on the first constrained request, once), and the
    matchers of the requests that ask for a constraint."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def vocabulary(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=sorted(self.tokenizer.eos_ids)
                )
            return self._vocabulary

    def check(self, constraint: Constraint) -> str:
        """The constraint's grammar, or InvalidRequestError naming its field (an invalid schema, regex, grammar)."""
        try:
            grammar = constraint.grammar()
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(f"{constraint.param}: {_first_line(error)}", param=constraint.param) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.vocabulary)
        if failed:
            raise InvalidRequestError(f"{constraint.param}: {_first_line(messages[0])}", param=constraint.param)
        return grammar

    def start(self, constraint: Constraint) -> TokenGrammar:
        """A fresh matcher for one request (InvalidRequestError if the constraint is invalid)."""
        matcher = llguidance.LLMatcher(self.vocabulary, self.check(constraint), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{constraint.param}: {_first_line(matcher.get_error())}", param=constraint.param)
        return TokenGrammar(matcher, self.vocab_size)


class TokenGrammar:
    """One request's grammar state: which tokens may come next, advanced by each token accepted."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.bitmask = mask_words(vocab_size)
        self.words = self.bitmask.numpy()
        self.masked = torch.empty(vocab_size)  # the last masked row, reused: a fresh 200 kB array each token costs more
        self.current = False  # `bitmask` holds the mask of the grammar's present state

    def _compute(self) -> None:
        if not self.current:
            self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.nbytes)
            self.current = True

    def allows(self, token: int) -> bool:
        """Whether the mask lets `token` come next: its bit alone. A greedy request whose grammar allows its logits'
        argmax takes that token as it is (the masked row's argmax), which spares the whole row's masking and second
        argmax for most tokens of a model that follows its prompt. (The mask, not llguidance's one-token check: that
        one accepts a token the mask leaves out for a longer one, ' {' where the grammar's next bytes are ' {"'.)"""
        self._compute()
        return bool(int(self.words[token >> 5]) >> (token & 31) & 1)

    def forbidden(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar does not allow next (all but EOS once it is complete); bit i of
        the mask's word w is token 32 * w + i."""
        self._compute()
        bits = np.unpackbits((~self.words).view(np.uint8), bitorder="little")
        return bits.view(np.bool_)[: self.vocab_size]

    def mask(self, logits: Tensor) -> Tensor:
        """(vocab,) logits -> fp32 logits with every token the grammar forbids at -inf, valid until the next call."""
        forbidden = self.forbidden()[: logits.shape[-1]]
        if logits.device.type != "cpu":
            return logits.float().masked_fill(torch.from_numpy(forbidden).to(logits.device), float("-inf"))
        out = self.masked[: logits.shape[-1]].numpy()
        np.copyto(out, logits.float().numpy())
        np.copyto(out, np.float32(-np.inf), where=forbidden)
        return self.masked[: logits.shape[-1]]

    def advance(self, token: int) -> None:
        """The request accepted `token` (one the mask allowed)."""
        self.current = False
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Nothing but EOS may follow: the output matches the whole grammar."""
        return self.matcher.is_stopped()

    def mask_drafts(self, rows: Tensor, drafts: list[int]) -> Tensor:
        """A speculative round's (k+1, vocab) target logits, row i masked by the grammar after drafts[:i]; rows past
        the first draft the grammar refuses stay as they are (that draft's zero probability rejects it, and the
        round ends there). The grammar's own state is left as it was."""
        masked, consumed = rows.float().clone(), 0
        for i in range(rows.shape[0]):
            masked[i] = self.mask(rows[i])
            if i == len(drafts) or not torch.isfinite(masked[i, drafts[i]]) or self.complete:
                break
            self.advance(drafts[i])
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
            self.current = False
        return masked


def mask_words(vocab_size: int) -> Tensor:
    """(ceil(vocab / 32),) int32 words for llguidance to write a token mask into. (Its own torch helpers are
    not imported: their module compiles a kernel with torch.compile on import, which loads the compiler stack into
    every process that imports the engine.)"""
    return torch.full((-(-vocab_size // 32),), -1, dtype=torch.int32)


def _first_line(error: object) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else "invalid"
