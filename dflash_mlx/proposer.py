"""Proposers: what drafts tokens for a block. The engine accepts or rejects them.

A proposer is any object with the `Proposer` shape: it is told about each new
generation (`start`; with `reused=n` when the caches kept the first n prompt
positions from the previous generation, see `dflash_mlx.session`), fed the target's features of every newly committed
position (`add_context`, in order, only if it asked for `layer_ids`), asked for
the arrays to evaluate after each prefill chunk (`state`), and asked for
`count` tokens to follow an anchor at an absolute position (`propose`).
`DFlashProposer` wraps a DFlash drafter; tests add oracles, later issues add
DFlash 2 and autoregressive drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx

from .draft.model import DFlashDraftModel
from .draft.pairing import check_pair
from .sampling import dense_from_candidates, distribution


@dataclass
class Proposal:
    """Drafted tokens [count] (int32, may still be lazy) and, when they were
    sampled, the distributions [count, V] they were drawn from (None: one-hot)."""

    tokens: mx.array
    probs: mx.array | None = None


@runtime_checkable
class Proposer(Protocol):
    layer_ids: tuple[int, ...]  # target layers whose outputs it reads (may be empty)
    block_size: int  # preferred block size, anchor included

    def start(self, target, prompt: mx.array, reused: int = 0) -> None: ...

    def add_context(self, features: mx.array) -> None: ...

    def state(self) -> list: ...  # arrays to evaluate after a prefill chunk

    def propose(
        self, anchor: mx.array, position: int, count: int, *, sampling=None, key=None
    ) -> Proposal: ...  # sampling: SamplingSettings to sample drafts with (None: greedy)


class DFlashProposer:
    """Drafts a block in one forward of a DFlash (v1 or v2) drafter.

    v1 rows are chosen independently (argmax, or samples of the processed q);
    v2 walks its candidate selector (greedy, or sampling at the temperature with
    q living on each row's candidates)."""

    def __init__(self, drafter: DFlashDraftModel, max_context: int | None = None, sample_drafts: bool = True):
        self.drafter = drafter
        self.sample_drafts = sample_drafts  # under sampling: draw from q, or argmax with one-hot q
        self.layer_ids = tuple(drafter.config.target_layer_ids)
        self.block_size = drafter.config.block_size
        self.max_context = max_context
        self._mask_id = drafter.config.mask_token_id
        self.target = None
        self.cache = None

    def start(self, target, prompt: mx.array, reused: int = 0) -> None:
        self.target = target
        if reused and self.cache is not None and self._rewind(reused):
            return
        self.cache = self.drafter.make_cache(self.max_context)
        for c in self.cache:
            c.skip(reused)  # context the drafter never saw: drafts get worse, output does not change

    def _rewind(self, position: int) -> bool:
        drop = self.context_end - position
        if drop < 0 or any(drop > c.held_rows for c in self.cache):
            return False
        for c in self.cache:
            c.trim(drop)
        return True

    def add_context(self, features: mx.array) -> None:
        self.drafter.extend_context(features, self.cache)

    def state(self) -> list:
        return [c.state for c in self.cache]

    @property
    def context_end(self) -> int:
        """Absolute position right after the last context row the drafter has seen."""
        return self.cache[0].end if self.cache else 0

    def propose(self, anchor: mx.array, position: int, count: int, *, sampling=None, key=None) -> Proposal:
        if self.context_end != position:
            raise RuntimeError(
                f"Drafter context ends at {self.context_end} but the anchor sits at {position}."
            )
        masks = mx.full((count,), self._mask_id, dtype=mx.int32)
        block = mx.concatenate([anchor.reshape(1).astype(mx.int32), masks])[None]
        sample = sampling is not None and self.sample_drafts
        if self.drafter.config.is_dflash2:
            hidden = self.drafter.hidden_states(block, self.cache, self.target)[0]
            logits = self.drafter.logits(hidden, self.target)
            path, candidates, q = self.drafter.candidate_selector.select(
                hidden, logits, anchor, sampling.temperature if sample else 0.0, key
            )
            probs = dense_from_candidates(candidates, q, logits.shape[-1]) if q is not None else None
            return Proposal(tokens=path, probs=probs)
        logits = self.drafter(block, self.cache, self.target)[0]
        if not sample:
            return Proposal(tokens=mx.argmax(logits, axis=-1).astype(mx.int32))
        probs = distribution(logits, sampling)
        tokens = mx.random.categorical(mx.log(probs), axis=-1, key=key).astype(mx.int32)
        return Proposal(tokens=tokens, probs=probs)


def as_proposer(
    draft, target_model, max_context: int | None = None, sample_drafts: bool = True
) -> Proposer | None:
    """Accept None, a DFlash drafter (checked against the target), or a `Proposer`."""
    if draft is None or isinstance(draft, Proposer):
        return draft
    if isinstance(draft, DFlashDraftModel):
        check_pair(draft, target_model, draft_name=getattr(draft, "source", "the drafter"))
        return DFlashProposer(draft, max_context, sample_drafts)
    raise TypeError(
        f"draft must be a DFlash drafter (from dflash_mlx.load_draft), a Proposer or None, "
        f"not {type(draft).__name__}."
    )
