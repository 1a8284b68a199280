"""DSpark drafters as proposers: one backbone forward, then the block drafted left to right.

The backbone gives every row's base logits at once (`draft.dspark`); the
Markov head then adds the previous token's bias row by row: the anchor's to
the first row, the draft chosen at row i - 1 to row i. Greedy drafts take
each row's argmax; sampled drafts draw each row from its processed
distribution (mlx-lm's filters and temperature, `sampling.distribution`),
which is then that draft's q. Under a grammar the constraint chooses each
draft before the next row exists (`draft_stepwise`), so q is again the
distribution each draft was drawn from. A reduced draft vocabulary is mapped
to target ids (`d2t`) before a draft is emitted or fed back, and q is widened
to the target's vocabulary. A batch's rows draft one by one (no `batch_key`):
the Markov walk is per row.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..draft.dspark import DSparkDraftModel
from ..sampling import distribution, draw_keyed, row_keys
from .base import Proposal
from .context import ContextProposer


class DSparkProposer(ContextProposer):
    name = "dspark"

    def __init__(self, drafter: DSparkDraftModel, max_context: int | None = None):
        super().__init__(drafter, max_context)
        self.block_size = drafter.block_size  # this package's block: the anchor and the drafts

    def propose(self, anchor: mx.array, position: int, count: int, *, sampling=None, key=None) -> Proposal:
        base = self._base_logits(anchor, position, count)
        keys = row_keys(None if sampling is None else key, count)
        drafter = self.drafter
        previous = anchor.reshape(1).astype(mx.int32)
        tokens, probs = [], []
        for i in range(count):
            row = base[i : i + 1] + drafter.markov_bias(previous)
            if sampling is None:
                previous = drafter.to_target(mx.argmax(row, axis=-1)).astype(mx.int32)
            else:  # drawn over the target's vocabulary: with a seeded call's key, the target's noise there
                q = drafter.widen(distribution(row, sampling), 0.0)
                previous = draw_keyed(mx.log(q), keys[i]).astype(mx.int32)
                probs.append(q)
            tokens.append(previous)
        return Proposal(mx.concatenate(tokens), mx.concatenate(probs) if probs else None)

    def draft_stepwise(self, anchor: mx.array, position: int, count: int) -> Callable[[int, int], mx.array]:
        """The rows' logits one at a time, for a caller that chooses each draft before the next row (a
        grammar): the function returned gives row i's logits [V] (target vocabulary, -inf where the head
        cannot draft) from i and the token before row i (the anchor, then the draft chosen at row i - 1)."""
        base = self._base_logits(anchor, position, count)

        def row(i: int, previous: int) -> mx.array:
            bias = self.drafter.markov_bias(mx.array([previous], mx.int32))
            return self.drafter.widen(base[i : i + 1] + bias, -mx.inf)[0]

        return row

    def batch_key(self):
        return None

    def _base_logits(self, anchor: mx.array, position: int, count: int) -> mx.array:
        """The head's logits [count, draft vocabulary] of the rows that draft, before the Markov bias."""
        drafter = self.drafter
        if not 1 <= count <= drafter.config.max_drafts:
            raise ValueError(f"A DSpark drafter drafts 1 to {drafter.config.max_drafts} tokens per block, not {count}.")
        block, features = self._block(anchor, position, drafter.block_width(count) - 1)
        hidden = drafter.hidden_states(block, self._cache, self.target, features)[0]
        start = drafter.config.logits_start
        return drafter.head_logits(hidden[start : start + count], self.target)
