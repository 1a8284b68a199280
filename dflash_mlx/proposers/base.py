"""The proposer interface: what drafts tokens for a block. The engine accepts or rejects them.

A proposer is any object with the `Proposer` shape: it is told about each new
generation (`start`; with `reused=n` when the caches kept the first n prompt
positions from the previous generation, see `dflash_mlx.session`), fed the target's features of every newly committed
position (`add_context`, in order, only if it asked for `layer_ids`), asked for
the arrays to evaluate after each prefill chunk (`state`: what it has
ingested, which may leave the newest batch of context lazy), and asked for
`count` tokens to follow an anchor at an absolute position (`propose`).
Optionally `fork(context=False)` returns an independent copy on the same
weights, with an empty context (the block-size calibration times it on
private state; without one it times the verify alone) or with a copy of the
context (`Session.copy`: the server's prompt cache branches a conversation).
Optionally `draft_logits(anchor, position, count)` gives the drafter's logits
of the block's rows, so a grammar can choose the drafts itself
(`structured.constraint`). `proposers.dflash` wraps DFlash (v1) and DFlash 2 drafters (and `as_proposer`
turns what a caller passes as `draft` into a proposer); `proposers.oracle`
knows the answer (tests, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx


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
