"""Incremental detokenization with stop strings: text deltas that never show a stop string."""

from __future__ import annotations

from services.common.tokenizer import Tokenizer


class Detokenizer:
    """Turns the growing list of output token ids into safe-to-send text deltas.

    Text is held back while it ends in an incomplete UTF-8 sequence or in a prefix of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._text = ""
        self._sent = 0  # characters of _text already emitted
        self.matched_stop: str | None = None

    def update(self, output_ids: list[int]) -> str:
        """Decode the whole output so far; return the new text that may be emitted now."""
        self._text = self._tokenizer.decode(output_ids)
        if self._stop:
            start = max(0, self._sent - self._max_stop)
            hits = [(i, s) for s in self._stop if (i := self._text.find(s, start)) != -1]
            if hits:
                cut, self.matched_stop = min(hits)
                return self._emit(cut)
        safe = len(self._text)
        if self._text.endswith("\ufffd"):
            safe = len(self._text.rstrip("\ufffd"))
        for s in self._stop:
            for k in range(min(len(s) - 1, safe - self._sent), 0, -1):
                if self._text.endswith(s[:k], 0, safe):
                    safe -= k
                    break
        return self._emit(max(safe, self._sent))

    def flush(self) -> str:
        """Text held back at the end of generation (no stop string can complete any more)."""
        if self.matched_stop is not None:
            return ""
        return self._emit(len(self._text.rstrip("\ufffd")))

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[: self._sent]

    def _emit(self, upto: int) -> str:
        delta = self._text[self._sent : upto] if upto > self._sent else ""
        self._sent = max(self._sent, upto)
        return delta
