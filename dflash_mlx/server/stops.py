"""Stop sequences matched on the decoded text, for streamed and whole replies alike.

`StopText.feed` takes each new piece of text and returns what may be sent now:
text that cannot be the start of a stop sequence is released at once, a tail
that could still grow into one is held back, and when a stop sequence appears
the text before it is released and `stopped` becomes true (the sequence itself
is never sent, as in OpenAI's API; `matched` names it, for Anthropic's
``stop_sequence``). Matching on text rather than token ids
finds a stop sequence however the model happens to tokenize it.
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the text

    def feed(self, text: str) -> str:
        """The text that can be released after `text` arrives ("" once stopped)."""
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            out, self.pending = self.pending[:at], ""
            return out
        keep = self._held_tail()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out

    def flush(self) -> str:
        """What is still held back (the reply ended without completing a stop sequence)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held_tail(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self.stops:
            tail = self.pending[max(len(self.pending) - len(stop) + 1, 0) :] if len(stop) > 1 else ""
            start = tail.find(stop[0])  # only where the stop's first character stands can a prefix begin
            while 0 <= start and len(tail) - start > best:
                if stop.startswith(tail[start:]):
                    best = len(tail) - start
                    break
                start = tail.find(stop[0], start + 1)
        return best
