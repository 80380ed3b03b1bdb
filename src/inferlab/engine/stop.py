"""Streaming text with stop strings: emit text as soon as it cannot be the start of a stop string."""

from __future__ import annotations

from inferlab.model.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of `text` already handed out

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; return (new text safe to show, whether a stop string was reached)."""
        self.text += self.detokenizer.push(token_id)
        hits = [i for i in (self.text.find(s, max(0, self.emitted - len(s))) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return self._emit(len(self.text)), True
        held = max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if self.text.endswith(s[:n])), default=0)
        return self._emit(len(self.text) - held), False

    def flush(self) -> str:
        """At the end, text held back for a stop string that never completed."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta, self.emitted = self.text[self.emitted : upto], max(self.emitted, upto)
        return delta
