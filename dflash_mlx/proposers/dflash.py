"""DFlash drafters as proposers: one drafter forward drafts a whole block.

`DFlashProposer` (v1) and `DFlash2Proposer` keep the drafter's context cache
(`proposers.context`) and draft `count` tokens after an anchor. Whether drafts
are sampled is the call's choice (`sampling`), never state. `as_proposer` turns
what a caller passes as `draft` (a DFlash or DSpark drafter, a proposer) into a
proposer.
"""

from __future__ import annotations

import mlx.core as mx

from ..draft.batch_context import BatchContext
from ..draft.dspark import DSparkDraftModel
from ..draft.model import DFlashDraftModel
from ..draft.pairing import check_pair
from ..sampling import dense_from_candidates, distribution, draw_rows
from .base import Proposal, Proposer
from .context import ContextProposer
from .dspark import DSparkProposer


class DFlashProposer(ContextProposer):
    """Drafts a block in one forward of a DFlash (v1) drafter: rows chosen independently
    (argmax, or samples of the processed q)."""

    name = "dflash"

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

    def _choose(self, block: mx.array, anchor: mx.array, features, sampling, key) -> Proposal:
        logits = self.drafter(block, self._cache, self.target, features)[0]
        if sampling is None:
            return Proposal(tokens=mx.argmax(logits, axis=-1).astype(mx.int32))
        return Proposal(tokens=draw_rows(logits, sampling, key), probs=distribution(logits, sampling))


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


def proposer_for(drafter, max_context: int | None = None) -> ContextProposer:
    """The proposer for a DSpark drafter, or a DFlash drafter of either generation (its config says which)."""
    if isinstance(drafter, DSparkDraftModel):
        return DSparkProposer(drafter, max_context)
    return (DFlash2Proposer if drafter.config.is_dflash2 else DFlashProposer)(drafter, max_context)


def as_proposer(draft, target_model, max_context: int | None = None) -> Proposer | None:
    """Accept None, a DFlash or DSpark drafter (checked against the target), or a `Proposer`."""
    if draft is None or isinstance(draft, Proposer):
        return draft
    if isinstance(draft, (DFlashDraftModel, DSparkDraftModel)):
        check_pair(draft, target_model, draft_name=getattr(draft, "source", "the drafter"))
        return proposer_for(draft, max_context)
    raise TypeError(
        f"draft must be a DFlash or DSpark drafter (from dflash_mlx.load_draft), a Proposer or None, "
        f"not {type(draft).__name__}."
    )
