"""The proposer interface: what drafts tokens for a verify. The engine accepts or rejects them.

A proposer is any object with the `Proposer` shape. The loops
(`dflash_mlx.planner`, one place for single and batched decoding) call it as
follows:

- `start(target, prompt, reused=0)` at each new generation (`reused=n` when
  the caches kept the first n prompt positions from the previous one, see
  `dflash_mlx.session`);
- `add_context(features)` with the target's features of every newly
  committed position, in order, if it asked for any (`reads_features`): the
  outputs of its `layer_ids`, then, where its optional `reads_final` is True,
  the target's final hidden state and the token embedding of each row;
- `state()`: the arrays to evaluate after a prefill chunk (what it has
  ingested; the newest batch of context may stay lazy);
- `propose(anchor, position, count, *, sampling, key)`: drafts to follow an
  anchor at an absolute position. Whether drafts are sampled is the call's
  choice (`sampling`), never the proposer's state. `Proposal.probs` is the
  distribution each draft was drawn from; None means a point mass (one-hot q),
  which keeps rejection sampling exact whatever the drafts are. `key` is an
  MLX random key.

Optional methods, looked up with `getattr`:

- `name`: the source's name in responses, stats and the chat panel
  (`source_name`; default "draft").
- `commit(tokens)`: the tokens each cycle committed, in order, the prompt's
  first token included (a source that drafts from the text itself).
- `offer(count) -> int`: how many drafts it has right now for the token the
  sequence ends with, at most `count`. **0 says it has nothing to offer** this
  cycle (a copy index whose context has no match); the planner then asks
  another source. A proposer without `offer` always offers `count`. A source
  that offers fewer than asked proposes exactly what it offered.
- `expected_tokens(widest) -> [E(1), ..., E(widest)]`: what a cycle verifying
  its offer cut to w - 1 drafts is expected to commit (a span source that
  knows its drafts' odds, as the suffix index does); without it the planner
  estimates that from the source's cycles so far.
- `fork(context=False)`: an independent copy on the same weights, with an
  empty context, or with a copy of this one's context (`Session.copy`: the
  server's prompt cache branches a conversation). Batched decoding gives every
  row its own proposer through `fork()` (a user proposer without it is refused
  there, since one object would serve every row); the block-size calibration
  times a fork on private state.
- `keys_per_row`: True where `propose` draws row i with
  `sampling.row_keys(key, count)[i]` (`sampling.draw_rows` for rows drawn at
  once). A seeded call then passes one key per row ([count, 2], the keys the
  target draws those positions with), so drafts and the target's draws share
  their noise and a draft close to the target is accepted (a seeded verify
  accepts a draft only where it equals the target's draw). Without it a
  seeded call passes one key: exact all the same, its drafts accepted less.
- `draft_logits(anchor, position, count)`: the drafter's logits of the block's
  rows, so a grammar can choose the drafts itself (`structured.constraint`).
- `draft_stepwise(anchor, position, count)`: for a drafter whose row i depends
  on the draft chosen at row i - 1 (DSpark's Markov head): a function giving
  row i's logits [V] from i and the token before row i (the anchor, then the
  draft chosen at row i - 1), rows asked in order (a row the grammar forces may
  be skipped). A grammar uses it in preference to
  `draft_logits`, so q is the distribution each draft was drawn from.
- `batch_key()` and `draft_logits_together(proposers, anchors, positions,
  count)`: proposers with the same non-None key draft all rows of a batch in
  one forward (`batch.drafting`), each row then choosing its drafts from its
  logits; without them a batch's rows draft one by one.

`proposers.dflash` wraps DFlash (v1) and DFlash 2 drafters (`as_proposer`
turns what a caller passes as `draft` into a proposer), `proposers.dspark`
DSpark drafters (their context kept by `proposers.context`); `proposers.lookup`
drafts spans copied from the context; `proposers.suffix` spans from what
earlier generations produced; `proposers.mtp` drafts with a target's own
multi-token-prediction heads; `proposers.oracle` knows the answer (tests,
benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import mlx.core as mx

DEFAULT_NAME = "draft"  # a proposer's source name when it gives none


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


def source_name(proposer) -> str:
    """The name a proposer's drafts are reported under ("target" for none: plain decoding)."""
    if proposer is None:
        return "target"
    return getattr(proposer, "name", None) or DEFAULT_NAME


def offered(proposer, count: int) -> int:
    """How many drafts `proposer` has for the next cycle, at most `count` (0: nothing to offer)."""
    offer = getattr(proposer, "offer", None)
    return count if offer is None else max(0, min(count, int(offer(count))))


def reads_features(proposer) -> bool:
    """Whether `proposer` is handed the target's features (`add_context`): layer outputs, or the final hidden
    state (`reads_final`)."""
    return proposer is not None and (bool(proposer.layer_ids) or bool(getattr(proposer, "reads_final", False)))


def fork_for_row(proposer):
    """An independent proposer for one row of a batch (`fork()`); a proposer without it is refused."""
    fork = getattr(proposer, "fork", None)
    if not callable(fork):
        raise TypeError(
            f"{type(proposer).__name__} has no fork(): batched decoding gives every row its own proposer "
            "(fork() returns an independent copy with an empty context, see dflash_mlx.proposers.base). "
            "Add fork() to it, or decode the prompts one at a time with stream_generate."
        )
    return fork()
