"""DFlash drafters as proposers: one drafter forward drafts a whole block.

`DFlashProposer` (v1) and `DFlash2Proposer` keep the drafter's context cache
(the target's features of every committed position, see `draft.model`), rewind
it when a session reuses a prefix, and draft `count` tokens after an anchor.
Whether drafts are sampled is the call's choice (`sampling`), never state.
The last context handed over is held back and ingested by the next block's
own forward (one K/V projection per layer for both, see `draft.model`);
anything that reads the cache (`cache`, a save) ingests it first; `state`
(what a prefill evaluates) leaves it lazy.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from ..draft.batch_context import BatchContext
from ..draft.model import DFlashDraftModel, DraftContextCache
from ..draft.pairing import check_pair
from ..sampling import dense_from_candidates, distribution, draw
from .base import Proposal, Proposer


class DFlashProposer:
    """Drafts a block in one forward of a DFlash (v1) drafter: rows chosen independently
    (argmax, or samples of the processed q)."""

    name = "dflash"

    def __init__(self, drafter: DFlashDraftModel, max_context: int | None = None):
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

    def fork(self, context: bool = False) -> DFlashProposer:
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

    def propose(self, anchor: mx.array, position: int, count: int, *, sampling=None, key=None) -> Proposal:
        block, features = self._block(anchor, position, count)
        return self._choose(block, anchor, features, sampling, key)

    def draft_logits(self, anchor: mx.array, position: int, count: int) -> mx.array:
        """The drafter's logits [count, V] of the block's rows after the anchor, for a caller that
        chooses the drafts itself (a grammar, `structured.constraint`; DFlash 2's selector is not used)."""
        block, features = self._block(anchor, position, count)
        return self.drafter(block, self._cache, self.target, features)[0]

    def batch_key(self):
        """Proposers with the same key draft a batch's rows in one forward (`draft_logits_together`):
        DFlash (v1) proposers of one drafter, whose rows' drafts are chosen independently."""
        return ("dflash", id(self.drafter))

    def draft_logits_together(self, proposers: list, anchors: list[int], positions: list[int], count: int):
        """The drafter's logits [B, count, V] of every row's block (proposers of this one's `batch_key`,
        each at its row's anchor and position), in one forward over their contexts read as one batch."""
        for p, position in zip(proposers, positions):
            if p.context_end != position:
                raise RuntimeError(f"Drafter context ends at {p.context_end} but the anchor sits at {position}.")
        masks = mx.full((len(proposers), count), self._mask_id, mx.int32)
        block = mx.concatenate([mx.array([[a] for a in anchors], mx.int32), masks], axis=1)
        contexts = [BatchContext([p.cache[layer] for p in proposers]) for layer in range(len(self.drafter.layers))]
        return self.drafter(block, contexts, self.target)

    def _block(self, anchor: mx.array, position: int, count: int) -> tuple[mx.array, mx.array | None]:
        """The block's ids (the anchor, then mask tokens) and the context features its forward ingests."""
        if self.context_end != position:
            raise RuntimeError(f"Drafter context ends at {self.context_end} but the anchor sits at {position}.")
        masks = mx.full((count,), self._mask_id, dtype=mx.int32)
        block = mx.concatenate([anchor.reshape(1).astype(mx.int32), masks])[None]
        features, self._pending = self._pending, None
        return block, features

    def _choose(self, block: mx.array, anchor: mx.array, features, sampling, key) -> Proposal:
        logits = self.drafter(block, self._cache, self.target, features)[0]
        if sampling is None:
            return Proposal(tokens=mx.argmax(logits, axis=-1).astype(mx.int32))
        tokens, _ = draw(logits, sampling, key)
        return Proposal(tokens=tokens, probs=distribution(logits, sampling))


class DFlash2Proposer(DFlashProposer):
    """A DFlash 2 drafter: its candidate selector walks the block (greedy, or sampling at the
    temperature with q living on each row's candidates); a batch's rows draft one by one."""

    def batch_key(self):
        return None

    def _choose(self, block: mx.array, anchor: mx.array, features, sampling, key) -> Proposal:
        hidden = self.drafter.hidden_states(block, self._cache, self.target, features)[0]
        logits = self.drafter.logits(hidden, self.target)
        temperature = sampling.temperature if sampling is not None else 0.0
        path, candidates, q = self.drafter.candidate_selector.select(hidden, logits, anchor, temperature, key)
        probs = dense_from_candidates(candidates, q, logits.shape[-1]) if q is not None else None
        return Proposal(tokens=path, probs=probs)


def proposer_for(drafter: DFlashDraftModel, max_context: int | None = None) -> DFlashProposer:
    """The proposer for a drafter of either generation (its config says which)."""
    return (DFlash2Proposer if drafter.config.is_dflash2 else DFlashProposer)(drafter, max_context)


def as_proposer(draft, target_model, max_context: int | None = None) -> Proposer | None:
    """Accept None, a DFlash drafter (checked against the target), or a `Proposer`."""
    if draft is None or isinstance(draft, Proposer):
        return draft
    if isinstance(draft, DFlashDraftModel):
        check_pair(draft, target_model, draft_name=getattr(draft, "source", "the drafter"))
        return proposer_for(draft, max_context)
    raise TypeError(
        f"draft must be a DFlash drafter (from dflash_mlx.load_draft), a Proposer or None, not {type(draft).__name__}."
    )
