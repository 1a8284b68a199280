"""One place where a cycle is planned: which source drafts, how wide, and the drafts the verify checks.

A `CyclePlanner` holds one generation's sources (for one request, or for one
row of a batch): the drafter (the session's proposer: a DFlash drafter or any
`proposers.base.Proposer`) and span sources (the session's copy index,
`proposers.lookup.LookupProposer`; a suffix index shared across requests,
`proposers.suffix.SuffixProposer`; any other proposer that offers drafts
only where it has them), its block policy, its `Acceptor` (sampling, and the
grammar that may widen a block to a run it forces and chooses drafts under it)
and its limits (max_tokens; the rows a quantized KV cache allows
unquantized). Both decode loops (`engine` for one request, `batch.engine` for
many) ask it the same questions:

- `plan(committed, position)`: the next cycle's source and width, as the
  policy decides (an adaptive policy chooses among plain decoding, the
  drafter and each span source offering a span, `policy.adaptive`; with a
  fixed block a span fills the block where one is offered; single decoding);
- `plan_at(width, cap, drafter_tokens)`: this row's source at the width the
  batch chose (the span expected to commit the most, where it beats the
  drafter's block; else the drafter);
- `draft(plan, anchor, position)`: the drafts and their q (None: point masses);
- `feed(features)` and `commit(tokens)`: what a cycle committed, to every
  source; `observe(plan, accepted, seconds)`: to the policy that chose it.

The decision itself stays the policy's (`policy/`: each source one entry with
its acceptance estimate and its cost); the planner turns it into drafts. A
source is added by giving the planner another proposer.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .acceptance import Acceptor
from .proposers.base import Proposal, offered, reads_features, source_name
from .targets.quantized_kv import KVQuantization

CONTEXT_BATCH = 64  # rows of b = 1 features the drafter receives at once


@dataclass
class Plan:
    """One cycle of one row: `width` rows verified (the anchor and width - 1 drafts; 1: a plain step)."""

    width: int
    source: object | None = None  # the proposer drafting (None: plain decoding)
    name: str = "target"  # its source name (`proposers.base.source_name`)
    chosen: bool = True  # the policy chose this width (not widened to a run the grammar forces)
    spans: bool = False  # a span source drafts (its rows' features wait)
    entry: object | None = None  # the policy's entry of the span source (`policy.choice.Source`) that observes it


PLAIN = Plan(1)


class DrafterContext:
    """Target features of committed positions on their way to the drafter, in order.

    Rows are handed over at once, except those of plain and span cycles,
    which wait (lazily) until a drafted block needs the context or
    CONTEXT_BATCH gathered: one batched context update instead of one per token.
    """

    def __init__(self, proposer):
        self.proposer = proposer if reads_features(proposer) else None
        self._waiting: list[mx.array] = []
        self._rows = 0

    def add(self, features: mx.array | None, wait: bool = False) -> None:
        if self.proposer is None or features is None:
            return
        self._waiting.append(features)
        self._rows += features.shape[1]
        if not wait or self._rows >= CONTEXT_BATCH:
            self.flush()

    def flush(self) -> None:
        if self._waiting:
            w = self._waiting
            self.proposer.add_context(w[0] if len(w) == 1 else mx.concatenate(w, axis=1))
            self._waiting, self._rows = [], 0

    def state(self) -> list:
        return self.proposer.state() if self.proposer is not None else []


class CyclePlanner:
    """One generation's sources, policy and limits (see the module docstring)."""

    def __init__(
        self,
        policy,
        drafter,
        acceptor: Acceptor,
        *,
        max_tokens: int = -1,
        kv: KVQuantization | None = None,
        spans=None,
    ):
        """`policy`: a block policy (`policy.base`); `drafter`: the drafting proposer or None (plain
        decoding); `spans`: a span source or a list of them (drafts only where they offer them; with a
        drafter and no grammar), each an entry of an adaptive policy (`policy.adaptive`)."""
        self.policy = policy
        self.drafter = drafter
        self.acceptor = acceptor
        self.max_tokens = max_tokens
        self.kv = kv
        self.context = DrafterContext(drafter)
        if drafter is None or acceptor.constraint is not None or spans is None:
            spans = []
        self.spans = list(spans) if isinstance(spans, (list, tuple)) else [spans]
        adaptive = callable(getattr(policy, "span_source", None))
        self.entries = [
            policy.span_source(source_name(s), getattr(s, "expected_tokens", None)) if adaptive else None
            for s in self.spans
        ]
        self._rests = getattr(policy, "resting", None)
        self.drafter_name = source_name(drafter)
        self.sources = [s for s in [drafter, *self.spans] if s is not None]
        self._committers = [c for c in (getattr(s, "commit", None) for s in self.sources) if c is not None]
        # a drafter that follows the text (`commit`, `offer`) plans on the committed tokens: its anchor is read
        # first; so are span sources', where a span may follow
        self.follows_text = hasattr(drafter, "commit") or hasattr(drafter, "offer")
        self.reads_text = self.follows_text or bool(self.spans)

    # -- what the next cycle is -------------------------------------------------------------------

    def room(self, committed: int, position: int) -> int:
        """The widest block the next cycle may verify."""
        policy, max_tokens = self.policy, self.max_tokens
        limit = policy.max_block if max_tokens < 0 else min(policy.max_block, max_tokens - committed)
        if self.kv is not None and (rows := self.kv.rows_allowed(position)) is not None:
            limit = min(limit, rows)
        return limit

    def plan_unread(self, committed: int, position: int) -> Plan:
        """The next cycle when its anchor is not on the host yet: the policy's block (no span source)."""
        if self.drafter is None:
            return PLAIN
        return self._drafted(self.policy.choose(self.room(committed, position)))

    def plan(self, committed: int, position: int) -> Plan:
        """The next cycle, its anchor read: a span, the policy's block or a plain step."""
        if not self.spans:
            return self.plan_unread(committed, position)
        room = self.room(committed, position)
        offers = [
            offered(s, room - 1) if room > 1 and not self._resting(e) else 0 for s, e in zip(self.spans, self.entries)
        ]
        if self.entries[0] is None:  # a fixed block (or a policy of the caller's): the first span fills it
            b = self.policy.choose(room)
            i = next((i for i, n in enumerate(offers) if n), None)
            return self._span(i, min(b, offers[i] + 1)) if b > 1 and i is not None else self._drafted(b)
        src, width = self.policy.choose_from(room, [(e, n + 1) for e, n in zip(self.entries, offers) if n])
        return self._span(self.entries.index(src), width) if src in self.entries else self._drafted(width)

    def _span(self, i: int, width: int) -> Plan:
        source = self.spans[i]
        return Plan(width, source, source_name(source), spans=True, entry=self.entries[i])

    def reads_anchor(self) -> bool:
        """Whether the cycle after the next token needs that token read first (a drafter that follows the
        text) or is worth reading it for (a span offered now would run: with a fixed block, any): otherwise
        plain steps are built on their token unread, pipelined."""
        if self.follows_text:
            return True
        widest = self.policy.max_block
        for source, entry in zip(self.spans, self.entries):
            n = offered(source, widest - 1) if widest > 1 and not self._resting(entry) else 0
            if n and (entry is None or self.policy.wants(entry, n + 1)):
                return True
        return False

    def _resting(self, entry) -> bool:
        """Whether the policy rests this span source's entry (its offer is not asked: a span it could not run)."""
        return entry is not None and self._rests is not None and self._rests(entry)

    def plan_at(self, width: int, cap: int, drafter_tokens: float | None = None) -> Plan:
        """This row's cycle in a batch verifying `width` rows (its own block `cap`): a span source's span
        where one is expected to commit more than `drafter_tokens` (the drafter's block's expectation;
        None: any span), a point mass with the slots past it ignored; else the drafter's drafts."""
        cap = min(width, cap)
        if cap <= 1 or self.drafter is None:
            return PLAIN
        offers = [(self._expected(i, n + 1), i, n) for i, s in enumerate(self.spans) if (n := offered(s, cap - 1))]
        best = max(offers, key=lambda offer: offer[0], default=None)  # (expected tokens, span source, drafts)
        if best is not None and (drafter_tokens is None or best[0] >= drafter_tokens):
            return self._span(best[1], best[2] + 1)
        return self._drafted(cap)

    def _expected(self, i: int, width: int) -> float:
        """What span source i's span of `width` rows is expected to commit: its entry's estimate, else the
        source's own odds (`expected_tokens`), else all of it (a fixed block: any span fills it)."""
        if self.entries[i] is not None:
            return self.entries[i].expected(width)
        own = getattr(self.spans[i], "expected_tokens", None)
        return own(width)[-1] if own is not None else float(width)

    def forced(self, limit: int) -> int:
        """The block a run the grammar forces next needs (1: none), with a drafter to draft it."""
        constraint = self.acceptor.constraint
        if constraint is None or self.drafter is None:
            return 1
        return constraint.forced_block(limit)

    def widened(self, plan: Plan, committed: int, position: int) -> Plan:
        """`plan`, widened to draft the run of tokens the grammar forces next (free drafts): asked when
        the cycle is built, the grammar holding every token committed before its anchor."""
        forced = self.forced(self.room(committed, position))
        if forced <= plan.width:
            return plan
        return Plan(forced, self.drafter, self.drafter_name, chosen=False)

    def _drafted(self, width: int) -> Plan:
        """The drafter's cycle of `width` rows, narrower where it offers fewer drafts (0: a plain step)."""
        if width > 1 and self.follows_text:
            width = 1 + offered(self.drafter, width - 1)
        return Plan(width, self.drafter, self.drafter_name) if width > 1 else PLAIN

    # -- the drafts -------------------------------------------------------------------------------

    def draft(self, plan: Plan, anchor: mx.array, position: int, count: int | None = None) -> Proposal | None:
        """The plan's drafts after `anchor` (None for a plain step): width - 1 of them, or `count` (a batch's
        width); through the acceptor for the drafter (its sampling settings and keys, its grammar)."""
        if plan.width <= 1:
            return None
        count = plan.width - 1 if count is None else count
        if plan.spans:
            return plan.source.propose(anchor, position, count)
        self.context.flush()
        return self.acceptor.propose(plan.source, anchor, position, count)

    def drafts_from_logits(self, logits: mx.array, position: int) -> Proposal:
        """The drafts for this row's drafter logits [count, V] computed with other rows' (`batch.drafting`),
        its anchor at `position`: chosen as its own `propose` would (argmax, a sample of q, or under its
        grammar)."""
        return self.acceptor.choose_drafts(logits, position)

    # -- what a cycle committed -------------------------------------------------------------------

    def feed(self, features: mx.array | None, wait: bool = False) -> None:
        """Target features of committed positions, for the drafter (`wait`: may be batched with later ones)."""
        self.context.add(features, wait)

    def commit(self, tokens: list[int]) -> None:
        """Committed tokens: to the acceptor (processors' history, the grammar) and the sources that read them."""
        self.acceptor.commit(tokens)
        for commit in self._committers:
            commit(tokens)

    def observe(self, plan: Plan, accepted: int | None, seconds: float | None) -> None:
        """A cycle of `plan` accepted `accepted` drafts (None: a stop token cut it) in `seconds` on the
        loop's side (None: not its own cost): to whichever policy chose it."""
        if plan.spans:
            if plan.entry is not None:
                self.policy.observe_source(plan.entry, plan.width, accepted, seconds)
        elif plan.chosen:
            self.policy.observe(plan.width, accepted, seconds)
