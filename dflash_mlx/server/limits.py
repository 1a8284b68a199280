"""The memory a request needs, known before it runs: the server's budget, the caches' footprint, the body.

A request is refused (HTTP 400 naming ``max_tokens`` or the prompt, `prompts`)
when its caches could not fit even alone: the weights plus the caches of its
prompt and ``max_tokens`` generated tokens must stay under the budget (by
default 3/4 of the device's memory: Metal's recommended working set, else the
RAM). The caches' bytes per token are those of the model's own cache layout
(`Footprint.measure`: a scratch session holding a short synthetic prompt at
two lengths, so every cache type, sliding window and drafter context counts
as it grows, and the lookup index of copy-aware drafting at its largest: no
n-gram repeats), computed when the server starts, on every rank of a sharded
one. A request body larger than what a prompt filling the model's context can
take (`body_limit`) is refused (413) before it is read.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from ..proposers.lookup import LookupIndex
from .request import MAX_STOP_CHARS, MAX_STOPS

STEP = 512  # the caches allocate rows in steps dividing this many (mlx-lm's KV caches: 256)
PROBE_TOKENS = (STEP - 1, 3 * STEP - 1)  # each ends a step (one more token for the drafter's ingestion fills it)
ESCAPED = 6  # the most characters JSON writes one byte of text as (\u00XX)


def memory_budget() -> int:
    """Three quarters of the device's memory (Metal's recommended working set, else the RAM)."""
    info = mx.device_info()
    size = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if not size:
        try:
            size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            size = 16 << 30
    return int(size) * 3 // 4


def weight_bytes(*models) -> int:
    """Bytes of the models' parameters (a proposer's drafter's, every member's of a `RatedChoice`; None and
    parameter-less drafters count nothing)."""
    modules = [getattr(p, "drafter", p) for m in models for p in getattr(m, "members", [m])]
    return sum(a.nbytes for m in modules if hasattr(m, "parameters") for _, a in tree_flatten(m.parameters()))


@dataclass(frozen=True)
class Footprint:
    """A session's bytes as a function of the tokens its caches hold: `base + per_token * tokens`,
    the tokens rounded up to whole allocation steps."""

    base: int
    per_token: float

    def bytes(self, tokens: int) -> int:
        """The bytes of caches holding `tokens` tokens, whole allocation steps counted."""
        return int(self.base + self.per_token * -(-max(tokens, 0) // STEP) * STEP)

    def tokens_within(self, budget: int) -> int:
        """The most tokens whose caches fit in `budget` bytes (0: not even one)."""
        if budget < self.bytes(1):
            return 0
        if self.per_token <= 0:
            return 2**62
        return int((budget - self.base) / self.per_token) // STEP * STEP

    @classmethod
    def measure(cls, make_session, lookup: bool = False) -> Footprint:
        """Hold a synthetic prompt of each `PROBE_TOKENS` length in a fresh session; the growth between
        them is the bytes per token. (A drafter ingests its newest context rows with the next ones, so
        each length is held, then one more token.) `lookup`: sessions also keep a lookup index (copy-aware
        drafting), counted at its largest (ids that never repeat, beyond Python's cached small integers)."""
        sizes = []
        for n in PROBE_TOKENS:
            session = make_session()
            session.hold([0] * n)  # any id is a token of every vocabulary
            session.hold([0] * (n + 1))
            index = LookupIndex(list(range(n + 1, 2 * n + 2))).nbytes if lookup else 0
            sizes.append(session.nbytes + index)
        short, long = PROBE_TOKENS
        per_token = max(sizes[1] - sizes[0], 0) / (long - short)
        return cls(base=max(int(sizes[0] - STEP * per_token), 0), per_token=per_token)


def longest_token_bytes(tokenizer) -> int | None:
    """The most bytes any token's text takes (its vocabulary string in UTF-8, which is never shorter: a
    byte-level BPE writes a byte as one or two, SentencePiece a space as three); None without a vocabulary."""
    vocab = getattr(tokenizer, "vocab", None)
    if not vocab:
        return None
    return max(len(token.encode("utf-8", "surrogatepass")) for token in vocab)


def body_limit(context_tokens: int | None, longest_token: int | None, vocab_size: int, room: int) -> int:
    """The largest request body worth reading (bytes): the text of a prompt filling the model's context
    (`context_tokens`, each token at most `longest_token` bytes) and the most stop sequences, every byte as
    JSON escapes it at the most, plus a logit bias on every token of the vocabulary. Without a context or a
    vocabulary to bound the prompt: `room`, the memory the budget leaves beside the weights."""
    if context_tokens is None or longest_token is None:
        return max(room, 0)
    text = context_tokens * longest_token + MAX_STOPS * MAX_STOP_CHARS
    bias = len(f'"{vocab_size - 1}": {-sys.float_info.max!r}, ')  # one entry, its number as long as a float's
    return ESCAPED * text + vocab_size * bias
