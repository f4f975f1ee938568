"""Incremental detokenization with stop strings: text deltas that never show a stop string."""

from __future__ import annotations

from services.common.tokenizer import Tokenizer


class Detokenizer:
    """Turns the growing list of output token ids into safe-to-send text deltas.

    Each update decodes a few tokens only (constant work per token, not the whole output): the tokens
    since the last commit, behind the tokens of that commit as context (a leading-space or byte-level
    token decodes differently alone). Text is committed once it no longer ends in an incomplete
    UTF-8 sequence; it is held back while it ends in one or in a prefix of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self._committed = ""  # the text of output ids [0, _read)
        self._prefix = 0  # the window [_prefix, _read) is decoded again as context for the new tokens
        self._read = 0
        self._text = ""  # committed text + the new tokens' text (may end in an incomplete character)
        self._sent = 0  # characters of _text already emitted
        self.matched_stop: str | None = None

    def update(self, output_ids: list[int], end: int | None = None) -> str:
        """Take the output so far, ids [0, end) (the previous call's ids and more; `end` defaults to all: ids
        past it are not chosen yet); return the text that may be emitted now."""
        pending = self._decode_new(output_ids, len(output_ids) if end is None else end)
        self._text = self._committed + pending
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
    def has_stops(self) -> bool:
        """Whether a stop string may end the output (each token's text must then be looked at)."""
        return bool(self._stop)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[: self._sent]

    def _decode_new(self, output_ids: list[int], end: int) -> str:
        """The text of output ids [_read, end); committed (window moved on) when it ends in a whole character."""
        decode = self._tokenizer.decode
        context = decode(output_ids[self._prefix : self._read]) if self._read > self._prefix else ""
        full = decode(output_ids[self._prefix : end])
        if full.startswith(context):
            new = full[len(context) :]
        else:  # the context decodes differently with what follows it: decode the whole output once
            new = decode(output_ids[:end])[len(self._committed) :]
        if new and not new.endswith("\ufffd"):
            self._committed += new
            self._prefix, self._read = self._read, end
            return ""
        return new

    def _emit(self, upto: int) -> str:
        delta = self._text[self._sent : upto] if upto > self._sent else ""
        self._sent = max(self._sent, upto)
        return delta
