"""Structured outputs on the server: each dialect's response format, compiled for the served tokenizer.

`response_format` reads chat completions' ``response_format``, the Responses
API's ``text.format`` and Anthropic's ``output_config.format`` (``{"type":
"json_schema", "schema": ...}``) into llguidance grammar text (None: free
text), which the request carries (it stays picklable for a sharded server's
followers). The grammar is compiled while the request is parsed, in the
handler's thread, into the worker's `Grammars` (the most recent ones kept,
shared by the handler threads and the worker, within the server's byte
budget), so what llguidance cannot compile or start (its first mask, under
`structured.grammar.LIMITS`) is a 400 naming the field before anything is
queued, and the job carries the compiled grammar to the worker
(`prompts.Prepared`). The request names its format field (`grammar_field`)
for a grammar that fails later, mid-output (also a 400).
"""

from __future__ import annotations

from ..structured.grammar import Grammar, GrammarError, grammar_text, schema_place
from .budget import Kept
from .errors import RequestError

KEPT = 64  # compiled grammars kept


class Grammars(Kept):
    """Grammars compiled for one tokenizer, by their text: the `size` most recently used are kept, and
    fewer when the server's byte budget (`budget`) needs their room (each counted at `Grammar.nbytes`)."""

    def __init__(self, tokenizer, size: int = KEPT, budget=None):
        super().__init__(size, budget)
        self.tokenizer = tokenizer

    def get(self, text: str) -> Grammar:
        grammar = super().get(text)
        if grammar is None:
            grammar = Grammar(self.tokenizer, text)  # (not under the lock: a large grammar takes a while)
            self.put(text, grammar, grammar.nbytes)
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
