"""Several rows' drafter context caches read as one batch, so one drafter forward drafts every row.

Each row's proposer keeps its own context cache (the target features of its
committed positions); `BatchContext` shows one drafter layer the rows'
contexts as one batch: left-padded to the longest, with per-row positions
(RoPE offsets) and a mask that hides each row's padding. The drafter's own
layers then run on [B, b] blocks unchanged (`proposers.dflash`,
`DFlashProposer.draft_logits_together`).
"""

from __future__ import annotations

import mlx.core as mx


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
