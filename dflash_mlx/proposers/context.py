"""What every drafter conditioned on the target's hidden states keeps: its context cache.

`ContextProposer` holds a drafter's context caches (the target's features of
every committed position, `draft.model.DraftContextCache`), rewinds them when
a session reuses a prefix, saves and restores them, forks them for a batch row
or a copied session, and builds a block [anchor, mask, ...] at the position
the context ends. The last context handed over is held back and ingested by
the next block's own forward (one K/V projection per layer for both); anything
that reads the cache (`cache`, a save) ingests it first; `state` (what a
prefill evaluates) leaves it lazy. The drafting itself is its subclasses'
(`proposers.dflash`, `proposers.dspark`).
"""

from __future__ import annotations

import copy

import mlx.core as mx

from ..draft.model import DraftContextCache


class ContextProposer:
    """A drafter's context, in step with the target's caches (see the module docstring)."""

    keys_per_row = True  # its proposers draw row i with key i (`proposers.base`)

    def __init__(self, drafter, max_context: int | None = None):
        self.drafter = drafter
        self.layer_ids = tuple(drafter.config.target_layer_ids)
        self.block_size = drafter.config.block_size
        self.max_context = max_context
        self._mask_id = drafter.config.mask_token_id
        self.target = None
        self._cache = None
        self._pending: mx.array | None = None  # features of the newest context rows, not yet ingested

    @property
    def cache(self) -> list[DraftContextCache] | None:
        """The drafter's context caches, holding every context row handed over."""
        self._ingest()
        return self._cache

    @cache.setter
    def cache(self, cache: list[DraftContextCache] | None) -> None:
        self._cache, self._pending = cache, None

    def _ingest(self) -> None:
        if self._pending is not None:
            features, self._pending = self._pending, None
            self.drafter.extend_context(features, self._cache)

    def fork(self, context: bool = False):
        """An independent proposer on the same drafter: an empty context (the calibration's), or
        with `context` a copy of this one's (a copied session's)."""
        other = type(self)(self.drafter, self.max_context)
        if context and self.cache is not None:
            other.target, other.cache = self.target, copy.deepcopy(self.cache)
        return other

    def start(self, target, prompt: mx.array, reused: int = 0) -> None:
        self.target = target
        if reused and self.cache is not None and self._rewind(reused):
            return
        self.cache = self.drafter.make_cache(self.max_context)
        for c in self.cache:
            c.skip(reused)  # context the drafter never saw: drafts get worse, output does not change

    def saved_context(self) -> list[tuple[list, dict]] | None:
        """The context per drafter layer, for saving a session (None before the first start)."""
        return None if self.cache is None else [c.saved() for c in self.cache]

    def restore_context(self, target, saved: list[tuple[list, dict]]) -> None:
        """Take back a `saved_context` (the session's target adapter is `target`)."""
        if len(saved) != len(self.drafter.layers):
            raise ValueError(f"a saved drafter context has {len(saved)} layers, this drafter has another count")
        self.target, self.cache = target, [DraftContextCache.restored(a, m) for a, m in saved]

    def _rewind(self, position: int) -> bool:
        drop = self.context_end - position
        if drop < 0 or any(drop > c.held_rows for c in self.cache):
            return False
        for c in self.cache:
            c.trim(drop)
        return True

    def add_context(self, features: mx.array) -> None:
        self._ingest()  # at most one batch of rows waits
        self._pending = features

    def state(self) -> list:
        """The ingested context's arrays. The batch held back stays lazy: evaluating after a prefill
        chunk must not run the drafter's projections of rows a plain step may never draft after (an
        untrained drafter, a reply that ends before a probe); the next block's forward ingests them."""
        return [c.state for c in self._cache or []]

    @property
    def context_end(self) -> int:
        """Absolute position right after the last context row handed over."""
        if not self._cache:
            return 0
        return self._cache[0].end + (0 if self._pending is None else self._pending.shape[1])

    def _block(self, anchor: mx.array, position: int, count: int) -> tuple[mx.array, mx.array | None]:
        """The block's ids (the anchor, then `count` mask tokens) and the context features its forward ingests."""
        if self.context_end != position:
            raise RuntimeError(f"Drafter context ends at {self.context_end} but the anchor sits at {position}.")
        masks = mx.full((count,), self._mask_id, dtype=mx.int32)
        block = mx.concatenate([anchor.reshape(1).astype(mx.int32), masks])[None]
        features, self._pending = self._pending, None
        return block, features
