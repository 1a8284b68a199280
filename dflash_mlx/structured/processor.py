"""A response format as an mlx-lm logits processor: plain constrained decoding, the reference.

`GrammarLogitsProcessor(tokenizer, response_format)` goes in mlx-lm's
``logits_processors`` (``mlx_lm.generate`` / ``stream_generate`` /
``generate_step``): each call masks the logits to the tokens the grammar
allows after the tokens generated so far (the history mlx-lm passes, prompt
included; the prompt's length is taken at the first call). The history may
also step back (a speculative verify's rows, mlx-lm's draft-model decoding):
the matcher is rolled back to the common prefix. One processor per
generation. DFlash applies the same grammar itself (`stream_generate(...,
response_format=...)`), drafts included; this processor is what its output
equals under greedy decoding.
"""

from __future__ import annotations

import mlx.core as mx

from .grammar import Grammar


class GrammarLogitsProcessor:
    def __init__(self, tokenizer, response_format):
        grammar = Grammar.of(tokenizer, response_format)
        if grammar is None:
            raise ValueError("response_format: free text needs no processor.")
        self.constraint = grammar.constraint()
        self._start: int | None = None  # the prompt's length

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._start is None:
            self._start = tokens.size
        self.constraint.follow(tokens[self._start :].tolist() if tokens.size > self._start else [])
        allowed = self.constraint.masks(1, None, logits.shape[-1])
        return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))
