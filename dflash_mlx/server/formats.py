"""Structured outputs on the server: each dialect's response format, compiled for the served tokenizer.

`response_format` reads chat completions' ``response_format``, the Responses
API's ``text.format`` and Anthropic's ``output_config.format`` (``{"type":
"json_schema", "schema": ...}``) into llguidance grammar text (None: free
text), which the request carries (it stays picklable for a sharded server's
followers). The grammar is compiled while the request is parsed, in the
handler's thread, into the worker's `Grammars` (the most recent ones kept,
shared by the handler threads and the worker), so what llguidance cannot
compile is a 400 naming the field before anything is queued, and the worker
finds it compiled.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..structured.grammar import Grammar, GrammarError, grammar_text, schema_place
from .errors import RequestError

KEPT = 64  # compiled grammars kept


class Grammars:
    """Grammars compiled for one tokenizer, by their text; the `size` most recently used are kept."""

    def __init__(self, tokenizer, size: int = KEPT):
        self.tokenizer, self.size = tokenizer, size
        self._kept: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, text: str) -> Grammar:
        with self._lock:
            if text in self._kept:
                self._kept.move_to_end(text)
                return self._kept[text]
        grammar = Grammar(self.tokenizer, text)  # (outside the lock: a large grammar takes a while)
        with self._lock:
            self._kept[text] = grammar
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return grammar


def response_format(value, grammars: Grammars | None, field: str) -> str | None:
    """The grammar text of a dialect's response format `value` (None: free text), compiled into `grammars`;
    a `RequestError` naming `field` (and the place inside it) when it cannot be."""
    try:
        text = grammar_text(value, check=False)
        if text is not None:
            if grammars is None:
                raise RequestError(field, "structured outputs are not available on this server")
            grammars.get(text)
    except GrammarError as e:
        where = e.where or schema_place(value)  # (the compiler's errors are the schema's)
        raise RequestError(f"{field}.{where}" if where else field, e.reason) from None
    except ValueError as e:  # (a tokenizer llguidance cannot take)
        raise RequestError(field, str(e)) from None
    return text
