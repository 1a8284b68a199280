"""Drafting every row of a batch in one drafter forward (DFlash v1 drafters).

Each row's proposer keeps its own context cache (the target features of its
committed positions); `BatchContext` shows one drafter layer the rows'
contexts as one batch: left-padded to the longest, with per-row positions
(RoPE offsets) and a mask that hides each row's padding. The drafter's own
layers then run on [B, b] blocks unchanged. Drafts only decide how many
tokens a verify accepts, never which: a proposer this module cannot batch
(DFlash 2, a custom one) drafts row by row instead. A row under a grammar
chooses its drafts from its logits under its own grammar state.
"""

from __future__ import annotations

import mlx.core as mx

from ..proposers.base import Proposal
from ..proposers.dflash import DFlashProposer
from ..sampling import distribution


class BatchContext:
    """One drafter layer's context caches of B rows, read as one (nothing is written)."""

    def __init__(self, caches: list):
        fetched = [c.fetch() for c in caches]
        self.rows = [0 if k is None else k.shape[2] for k, _ in fetched]
        self.width = max(self.rows)
        self.end = mx.array([c.end for c in caches], dtype=mx.int32)  # each row's block position
        self._kv = None
        if self.width:
            like_k, like_v = next((k, v) for k, v in fetched if k is not None)
            keys, values = [], []
            for (k, v), n in zip(fetched, self.rows):
                pad = self.width - n
                if n == 0:
                    k = mx.zeros(like_k.shape[:2] + (self.width, like_k.shape[3]), like_k.dtype)
                    v = mx.zeros(like_v.shape[:2] + (self.width, like_v.shape[3]), like_v.dtype)
                elif pad:
                    k = mx.concatenate([mx.zeros(k.shape[:2] + (pad, k.shape[3]), k.dtype), k], axis=2)
                    v = mx.concatenate([mx.zeros(v.shape[:2] + (pad, v.shape[3]), v.dtype), v], axis=2)
                keys.append(k)
                values.append(v)
            self._kv = (mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0))

    def fetch(self):
        return self._kv if self._kv is not None else (None, None)

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, int]:
        """The padded contexts followed by the rows' block keys / values, and the context width."""
        if self._kv is None:
            return keys, values, 0
        return mx.concatenate([self._kv[0], keys], axis=2), mx.concatenate([self._kv[1], values], axis=2), self.width

    def block_mask(self, block: int, ctx_len: int, causal: bool, window: int | None) -> mx.array:
        """[B, 1, block, width + block]: a row's own context (right-aligned) and the block."""
        k = mx.arange(self.width + block)[None, None, None, :]
        q = mx.arange(block)[None, None, :, None] + self.width  # the queries' padded positions
        first = self.width - mx.array(self.rows)[:, None, None, None]  # each row's first context key
        in_block = k >= self.width
        visible = (in_block & (k <= q)) if causal else in_block
        context = (k >= first) & ~in_block
        if window is not None:
            context = context & (q - k < window)
        return visible | context


def propose_rows(rows: list, count: int) -> list[Proposal]:
    """Every row's proposal of `count` tokens after its anchor (rows: `engine.BatchRow`)."""
    proposers = [r.session.proposer for r in rows]
    batchable = all(type(p) is DFlashProposer for p in proposers) and len({id(p.drafter) for p in proposers}) == 1
    if not batchable or len(rows) == 1:
        return [r.acceptor.propose(r.session.proposer, mx.array([r.anchor], mx.int32), r.position, count) for r in rows]
    for r, p in zip(rows, proposers):
        if p.context_end != r.position:
            raise RuntimeError(f"Drafter context ends at {p.context_end} but the anchor sits at {r.position}.")
    drafter = proposers[0].drafter
    anchors = mx.array([[r.anchor] for r in rows], mx.int32)
    block = mx.concatenate([anchors, mx.full((len(rows), count), drafter.config.mask_token_id, mx.int32)], axis=1)
    contexts = [BatchContext([p.cache[layer] for p in proposers]) for layer in range(len(drafter.layers))]
    logits = drafter(block, contexts, proposers[0].target)
    if all(r.acceptor.draft_settings is None and r.acceptor.constraint is None for r in rows):
        # greedy drafts: one argmax for all rows
        for r in rows:
            r.acceptor.next_key()  # (the keys a row draws stay those of its own proposer calls)
        best = mx.argmax(logits, axis=-1).astype(mx.int32)
        return [Proposal(tokens=best[i]) for i in range(len(rows))]
    out = []
    for i, r in enumerate(rows):
        sampling, key = r.acceptor.draft_settings, r.acceptor.next_key()
        if r.acceptor.constraint is not None:  # chosen under the row's grammar
            out.append(r.acceptor.constraint.choose(logits[i], sampling, key))
        elif sampling is None:
            out.append(Proposal(tokens=mx.argmax(logits[i], axis=-1).astype(mx.int32)))
        else:
            probs = distribution(logits[i], sampling)
            tokens = mx.random.categorical(mx.log(probs), axis=-1, key=key).astype(mx.int32)
            out.append(Proposal(tokens=tokens, probs=probs))
    return out
