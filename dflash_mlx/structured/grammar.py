"""Response formats compiled into grammars by llguidance, for one tokenizer.

`grammar_text` turns what a caller asks for into llguidance's grammar text
(None: free text): OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema`` with its ``schema`` and ``strict``, nested as chat
completions sends it or flat as the Responses API's ``text.format``), a
pydantic model class, or llguidance's own grammar text (from
``llguidance.grammar_from``: Lark, regex, ...). `Grammar` is that text
compiled for a tokenizer; each generation follows it with a fresh
`constraint.Constraint`. What llguidance cannot compile, or cannot start (its
first masks, computed while compiling), is a `GrammarError` (a ValueError)
naming the place in the format. It compiles under explicit limits (`LIMITS`,
llguidance's `ParserLimits`); a grammar that meets one later, mid-output, is a
`constraint.GrammarFault` there. `Grammar.nbytes` is what a compiled grammar
may grow to under them.

JSON is compiled compact (``", "`` and ``": "`` separators, no free
whitespace: a small model may otherwise pad with whitespace until its token
limit); a schema's own ``x-guidance`` options override that. ``strict: false``
compiles leniently (keywords llguidance cannot enforce are ignored); a strict
schema using them is refused.

llguidance (MIT, a Rust wheel without torch) rather than xgrammar, whose
0.2 releases need torch and triton: a mask over the bundled tokenizer costs
microseconds on the CPU.
"""

from __future__ import annotations

import json
import threading
import weakref

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer
from llguidance.numpy import fill_next_token_bitmask

from .constraint import Constraint, library_error

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORMATS = ("text", "json_object", "json_schema")
SCHEMA_KEYS = {"name", "description", "schema", "strict"}
LEXER_STATE_BYTES = 2048  # llguidance's estimate of one lexer state's memory (1-2 kB), at its top
# llguidance's limits, explicit (its 1.9 defaults but for the lexer's states and verbose errors, which would echo
# the grammar and the parser's state): a grammar past them fails, whether at compiling or at a mask, as that
# grammar's error
LIMITS = {
    "max_items_in_row": 2000,  # Earley items in one row (a branching factor: anyOf of 5,000 objects exceeds it)
    "initial_lexer_fuel": 1_000_000,  # building the lexer's regexes (by llguidance's figures, about 20 ms)
    "step_lexer_fuel": 200_000,  # the lexer's work for one mask (about 14 ms)
    "step_max_items": 50_000,  # the parser's items for one mask (about 2.5 ms)
    # lexer states built as masks are computed (1-2 kB each): a tenth of llguidance's default, so that what a kept
    # grammar may grow to (`Grammar.nbytes`, counted in a server's memory budget) is 40 MB, not 0.5 GB; a JSON
    # schema's lexer takes hundreds to a few thousand
    "max_lexer_states": 20_000,
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
    "precompute_large_lexemes": True,
    "verbose_errors": False,
}


class GrammarError(ValueError):
    """A response format llguidance cannot compile; `where` is the place in it ("" for the whole)."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}" if where else message)
        self.where, self.reason = where, message


def grammar_text(response_format, check: bool = True) -> str | None:
    """llguidance's grammar text for a response format (see the module docstring); None: free text.
    `check=False` leaves finding what llguidance cannot compile to the compiler (`Grammar`)."""
    if response_format is None:
        return None
    if isinstance(response_format, str):  # llguidance's grammar text already
        return _checked(response_format, "") if check else response_format
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):  # a pydantic model
        return _json(response_format.model_json_schema(), strict=True, where="", check=check)
    if not isinstance(response_format, dict):
        raise GrammarError("", f"expected an object with a 'type' ({', '.join(FORMATS)}), got {response_format!r}")
    kind = response_format.get("type")
    if kind not in FORMATS:
        raise GrammarError("type", f"expected one of {', '.join(FORMATS)}, got {kind!r}")
    if kind != "json_schema":
        _known(response_format, {"type"}, "")
        return None if kind == "text" else _json({"type": "object"}, strict=True, where="", check=check)
    nested = "json_schema" in response_format
    _known(response_format, {"type", "json_schema"} if nested else {"type"} | SCHEMA_KEYS, "")
    spec, where = (response_format["json_schema"], "json_schema.") if nested else (response_format, "")
    if not isinstance(spec, dict):
        raise GrammarError("json_schema", f"expected an object with 'name' and 'schema', got {spec!r}")
    _known(spec, SCHEMA_KEYS | ({"type"} if spec is response_format else set()), where)
    for key in ("name", "description"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise GrammarError(where + key, f"expected a string, got {spec[key]!r}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise GrammarError(where + "strict", f"expected true or false, got {strict!r}")
    schema = spec.get("schema", {})  # (none: any JSON value)
    if not isinstance(schema, dict):
        raise GrammarError(where + "schema", f"expected a JSON Schema object, got {schema!r}")
    return _json(schema, strict=bool(strict), where=where + "schema", check=check)


def schema_place(response_format) -> str:
    """Where a response format holds its JSON schema ("json_schema.schema", "schema"; "" for the whole)."""
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        return "json_schema.schema" if "json_schema" in response_format else "schema"
    return ""


def _known(value: dict, keys: set, where: str) -> None:
    extra = sorted(set(value) - keys)
    if extra:
        raise GrammarError(where + str(extra[0]), f"unknown field (expected some of {', '.join(sorted(keys))})")


def _json(schema: dict, *, strict: bool, where: str, check: bool) -> str:
    try:
        text = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={**JSON_OPTIONS, "lenient": not strict})
    except (TypeError, ValueError) as e:
        raise GrammarError(where, f"not a usable JSON Schema: {e}") from None
    return _checked(text, where) if check else text


def _checked(text: str, where: str) -> str:
    failed, messages = LLMatcher.validate_grammar_with_warnings(text, limits=LLParserLimits(**LIMITS))
    if failed:
        raise GrammarError(where, f"the grammar library (llguidance) cannot compile it: {messages[0]}")
    return text


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer) -> LLTokenizer:
    """llguidance's view of a tokenizer (an mlx-lm `TokenizerWrapper` or a Hugging Face fast tokenizer),
    its EOS ids those of the wrapper; built once per tokenizer and EOS set (~1 s for a 150k vocabulary)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = tuple(sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id]))
    with _LOCK:
        built = _TOKENIZERS.setdefault(hf, {})
        if eos not in built:
            from llguidance.hf import from_tokenizer

            try:
                built[eos] = from_tokenizer(hf, eos_token=list(eos))
            except (ValueError, TypeError) as e:
                raise ValueError(f"structured outputs need a fast (tokenizers) tokenizer: {e}") from None
        return built[eos]


class Grammar:
    """A grammar compiled for one tokenizer. `constraint()` starts a generation's own state.

    Compiling also computes the first mask, and the one after the tokens the grammar forces at the start:
    a grammar llguidance compiles but cannot start (past its `LIMITS`: too many alternatives in one row,
    a reference loop that never reaches a token) is a `GrammarError` here, before any generation, not a
    fault at the output's first token."""

    def __init__(self, tokenizer, response_format):
        """`response_format`: anything `grammar_text` takes (not free text)."""
        text = grammar_text(response_format, check=False)  # (the matcher reports what it cannot compile)
        if text is None:
            raise ValueError("a Grammar needs a format that constrains the output (not 'text').")
        self.text = text
        self.tokenizer = ll_tokenizer(tokenizer)
        self._matcher = LLMatcher(self.tokenizer, text, log_level=0, limits=LLParserLimits(**LIMITS))
        if self._matcher.is_error():
            raise GrammarError(
                "", f"the grammar library (llguidance) cannot compile it: {library_error(self._matcher)}"
            )
        self.eos = frozenset(self.tokenizer.eos_tokens)
        self._check_start()

    def _check_start(self) -> None:
        """Compute, on a copy of the matcher, the first mask and the one after the tokens the grammar forces
        at the start (its first token, when it has one choice): a failure there is this grammar's."""
        matcher, words = self._matcher.deep_copy(), np.zeros((1, (self.tokenizer.vocab_size + 31) // 32), np.int32)
        fill_next_token_bitmask(matcher, words, 0)
        forced = [] if matcher.is_error() else matcher.compute_ff_tokens()
        if forced and matcher.consume_tokens(forced):
            fill_next_token_bitmask(matcher, words, 0)
        if matcher.is_error():
            raise GrammarError("", f"the grammar library (llguidance) cannot start it: {library_error(matcher)}")

    @classmethod
    def of(cls, tokenizer, response_format) -> Grammar | None:
        """The grammar of a response format (a `Grammar` as it is; None for free text)."""
        if response_format is None or isinstance(response_format, Grammar):
            return response_format
        text = grammar_text(response_format, check=False)
        return None if text is None else cls(tokenizer, text)

    def constraint(self) -> Constraint:
        """A fresh state at the start of the output."""
        return Constraint(self._matcher.deep_copy(), self.eos, self.tokenizer.vocab_size)

    @property
    def nbytes(self) -> int:
        """What the compiled grammar may grow to (a server's byte budget counts it so): its text, and the lexer
        states masks build (shared by every constraint made from it, kept while it is), at most `LIMITS`'
        max_lexer_states of `LEXER_STATE_BYTES` each."""
        return len(self.text) + LIMITS["max_lexer_states"] * LEXER_STATE_BYTES
