"""Structured outputs: a grammar (llguidance) constraining the target's tokens and the drafts.

`grammar` compiles response formats (JSON schemas, JSON mode, llguidance grammar text) for a tokenizer;
`constraint` is one generation's state in it (the masks of a verify's rows, the drafts chosen under them);
`processor` is the same grammar as an mlx-lm logits processor (plain constrained decoding, the reference).
"""

from .constraint import GrammarFault
from .grammar import Grammar, GrammarError, grammar_text
from .processor import GrammarLogitsProcessor

__all__ = ["Grammar", "GrammarError", "GrammarFault", "GrammarLogitsProcessor", "grammar_text"]
