"""Response formats compiled into grammars by llguidance, for one tokenizer.

`grammar_text` turns what a caller asks for into llguidance's grammar text
(None: free text): OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema`` with its ``schema`` and ``strict``, nested as chat
completions sends it or flat as the Responses API's ``text.format``), a
pydantic model class, or llguidance's own grammar text (from
``llguidance.grammar_from``: Lark, regex, ...). `Grammar` is that text
compiled for a tokenizer; each generation follows it with a fresh
`constraint.Constraint`. What llguidance cannot compile is a `GrammarError`
(a ValueError) naming the place in the format.

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

from llguidance import LLMatcher, LLTokenizer

from .constraint import Constraint

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORMATS = ("text", "json_object", "json_schema")
SCHEMA_KEYS = {"name", "description", "schema", "strict"}


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
    failed, messages = LLMatcher.validate_grammar_with_warnings(text)
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
    """A grammar compiled for one tokenizer. `constraint()` starts a generation's own state."""

    def __init__(self, tokenizer, response_format):
        """`response_format`: anything `grammar_text` takes (not free text)."""
        text = grammar_text(response_format, check=False)  # (the matcher reports what it cannot compile)
        if text is None:
            raise ValueError("a Grammar needs a format that constrains the output (not 'text').")
        self.text = text
        self.tokenizer = ll_tokenizer(tokenizer)
        self._matcher = LLMatcher(self.tokenizer, text, log_level=0)
        if self._matcher.is_error():
            raise GrammarError("", f"the grammar library (llguidance) cannot compile it: {self._matcher.get_error()}")
        self.eos = frozenset(self.tokenizer.eos_tokens)

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
