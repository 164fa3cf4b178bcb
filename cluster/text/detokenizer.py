"""Token ids -> text while a request streams: incremental decoding and stop strings.

`IncrementalDecoder`: chunks of ids in, text chunks out, whose concatenation equals
`tokenizer.decode(all_ids)`; never a split character. A byte tokenizer (`decode_bytes`) is
decoded exactly through an incremental UTF-8 decoder; any other tokenizer the way vLLM does it:
re-decode a short window `ids[prefix:]` and emit what it adds beyond `ids[prefix:read]`, holding
everything back while the window ends in U+FFFD (an incomplete character). What is still
incomplete when the request ends becomes U+FFFD, as one-shot `decode` renders it.

`TextStream`: an `IncrementalDecoder` plus OpenAI `stop` strings matched on the text (a stop
string may span many tokens). Text that could still be the start of a stop string is held back
(at most the longest stop's length - 1 characters); on a match the text ends just before the stop
string (or after it with `include_stop`), and the stream reports how many of the fed tokens it
consumed, so the caller can stop the request there and count exactly those tokens.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from cluster.text.tokenizer import Tokenizer


class IncrementalDecoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes = hasattr(tokenizer, "decode_bytes")
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids[:read] are emitted

    def feed(self, new_ids: Sequence[int], final: bool = False) -> str:
        if self._bytes:
            return self._utf8.decode(self.tokenizer.decode_bytes(list(new_ids)), final=final)
        self._ids += new_ids
        if self._read == len(self._ids):
            return ""
        done = self.tokenizer.decode(self._ids[self._prefix:self._read])
        window = self.tokenizer.decode(self._ids[self._prefix:])
        if len(window) > len(done) and (final or not window.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return window[len(done):]
        return ""


class TextStream:
    """Detokenizes one request's output ids and watches for stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), include_stop: bool = False) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # decoded so far (emitted or held back)
        self.num_emitted_chars = 0
        self.stopped = False  # a stop string matched: the caller stops the request
        self.matched_stop: str | None = None

    def feed(self, new_ids: Sequence[int], final: bool = False) -> tuple[str, int]:
        """(text to emit now, how many of `new_ids` were consumed: all, unless a stop string
        matched inside them). After a match, feeding more returns ("", 0)."""
        if self.stopped:
            return "", 0
        if not self.stop:
            self.text += self.decoder.feed(new_ids, final)
            return self._emit(len(self.text)), len(new_ids)
        for n, token in enumerate(new_ids):
            last = final and n == len(new_ids) - 1
            start = max(0, len(self.text) - self._hold)
            self.text += self.decoder.feed([token], last)
            if self._match(start):
                return self._emit(len(self.text)), n + 1
        if final and not new_ids:
            self.text += self.decoder.feed([], True)
            if self._match(max(0, len(self.text) - self._hold)):
                return self._emit(len(self.text)), 0
        return self._emit(len(self.text) if final else len(self.text) - self._hold), len(new_ids)

    def _match(self, start: int) -> bool:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[: i + len(s) if self.include_stop else i]
        self.stopped, self.matched_stop = True, s
        return True

    def _emit(self, end: int) -> str:
        end = max(end, self.num_emitted_chars)
        out = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return out
