"""The adaptive block of one generation: plain decoding, the drafter's block or a span source's span, by rate.

`AdaptiveBlock` is the engine's `BlockPolicy` over two sources, plain
decoding and the drafter (`choose(limit)`, `observe`), and the planner's
choice among more (`choose_from`, `observe_source`): each span source joins
as one more entry (`span_source(name)`). The rule and the one probe schedule
are `choice.Choice`'s; the costs the setup's `CostModel`'s (`calibration`).
A drafter's generations carry its history (`DrafterHistory`, one for
greedy generations and one for sampled ones): its long-run
acceptance as the next generation's prior, its probe wait, and whether
drafting paid lately; each span source of its generations carries its own
long-run acceptance the same way. Why: docs/adaptive.md.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

from .choice import Choice, Source
from .cost import CostModel, CostTable
from .estimate import AcceptanceEstimate, SpanOdds, learnt_estimate

RECENT_GENERATIONS = 3  # a generation probes at once unless drafting paid in none of this many before it


class DrafterHistory:
    """What a drafter's generations of one kind pass on to the next: its long-run acceptance (the priors of
    each generation's estimate), its probe wait, and when drafting last paid. Generations may run at once
    (threads): each takes a copy when it begins and records into the history under its lock."""

    def __init__(self, positions: int):
        self._lock = threading.Lock()
        self.learnt = learnt_estimate(positions)
        self.generations = 0
        self.unpaid = 0  # generations in a row, before the latest, in which drafting did not pay
        # the drafter entry of each generation that kept its state since the latest began (read when asked: a
        # generation's every cycle keeps it, so keeping is two stores), and of the one that kept it last
        self._kept: set[Source] = set()
        self._latest: Source | None = None

    def learnt_rates(self, positions: int) -> tuple[list[float], bool]:
        """The long-run rates a generation starts from, and whether they rest on observations (else they are
        the prior)."""
        with self._lock:
            self.learnt.grow(positions)
            return self.learnt.rates(), self.learnt.seen[0] > 0

    def begin(self, positions: int) -> tuple[list[float], bool, int, bool]:
        """A new generation: the rates it starts from, whether they rest on observations (else they are the
        prior), the drafter's probe wait, and whether its probe is due at once: a probe it never ran, or
        drafting paid in one of the last RECENT_GENERATIONS (one reply the drafter did not fit does not keep
        the next one plain for a probe's wait). Drafting paid in a generation when its cycles together
        committed more than plain decoding would have in their time, by more than their odds explain
        (`choice.Source.paid`): a few lucky cycles (a sampled draft is accepted with odds, not surely) do not
        make a generation that paid."""
        rates, observed = self.learnt_rates(positions)
        with self._lock:
            if self.generations:
                self.unpaid = 0 if self._paid() else self.unpaid + 1
            self.generations += 1
            latest, self._kept = self._latest, set()
            idle, unrun = (latest.idle, latest.probing) if latest is not None else (0, False)
            return rates, observed, idle, unrun or self.unpaid < RECENT_GENERATIONS

    @property
    def paid(self) -> bool:
        """Whether drafting paid (its cycles together) in a generation that ran since the latest began (generations
        may run at once: any of them)."""
        with self._lock:
            return self._paid()

    def _paid(self) -> bool:
        return any(drafter.paid for drafter in list(self._kept))

    def record(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.learnt.observe(drafted, accepted)

    def keep(self, drafter: Source) -> None:
        """The generation's drafter entry, whose probe state (its wait, a probe unrun) and whether drafting paid in
        it the next generation reads when it begins. (Every cycle: two stores, atomic under the GIL, no lock.)"""
        self._latest = drafter
        self._kept.add(drafter)


class AdaptiveBlock:
    def __init__(
        self,
        cost: CostModel | CostTable,
        max_block: int,
        estimate: AcceptanceEstimate | None = None,
        history: DrafterHistory | None = None,
        span_history: Callable[[str], DrafterHistory | None] | None = None,
    ):
        """`cost`: the setup's model (a table: a model of it that does not learn); `history`: the drafter's,
        which the estimate's priors came from and which this generation keeps; `span_history(name)`: the
        history a span source of that name carries (None: each generation's span sources start afresh)."""
        if max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block}.")
        self.cost = cost if isinstance(cost, CostModel) else CostModel(cost, learns=False)
        self.max_block = max_block
        self.estimate = estimate or AcceptanceEstimate(max_block - 1)
        self.history = history
        self.span_history = span_history
        self.plain = Source("target")  # (the names of their costs in the setup's model)
        self.drafter = Source("drafter", self.estimate)
        self.spans: list[Source] = []
        self.choice = Choice(self.cost, self.plain)

    def span_source(self, name: str, odds=None) -> Source:
        """A span source's entry: its acceptance (learnt from its cycles, from its history's long-run rates
        where the policy carries one, or `odds`, the source's own `expected_tokens`: the suffix index's
        probabilities) and, until its cycles are timed, the drafter's cost (a verify without a drafter forward
        costs no more)."""
        positions = max(0, self.max_block - 1)
        carries = odds is None and self.span_history is not None  # (a source with its own odds carries nothing)
        history = self.span_history(name) if carries else None
        if odds is not None:
            estimate = SpanOdds(odds)
        elif history is None:
            estimate = AcceptanceEstimate(positions)
        else:
            priors, observed = history.learnt_rates(positions)
            learnt = priors if observed else None  # (a history with nothing observed: the bare prior)
            estimate = AcceptanceEstimate(positions, priors=learnt, record=history.record, hopes=learnt)
        src = Source(name, estimate, prior=self.drafter.name, settles=False, rests=odds is None)
        self.spans.append(src)
        return src

    def offers(self, limit: int, spans=()) -> list[tuple[Source, int]]:
        """(source, widest) of every source that can run with at most `limit` rows; `spans`: (span source,
        widest) of those offering a span now."""
        limit = min(limit, self.max_block)
        offers = [(self.plain, 1)] + ([(self.drafter, limit)] if limit > 1 else [])
        return offers + [(s, min(w, limit)) for s, w in spans if min(w, limit) > 1]

    def choose(self, limit: int) -> int:
        return self.choose_from(limit)[1]

    def choose_from(self, limit: int, spans=()) -> tuple[Source, int]:
        """The next cycle's (source, width) with at most `limit` rows (`spans`: as for `offers`)."""
        src, b = self.choice.choose(self.offers(limit, spans))
        self._keep()
        return src, b

    def wants(self, span: Source, widest: int) -> bool:
        """Whether a span of `widest` rows offered next would run (`choice.Choice.due`): worth reading the
        token it follows before building the cycle."""
        return min(widest, self.max_block) > 1 and self.choice.due(span, widest, self.offers(self.max_block))

    def resting(self, span: Source) -> bool:
        """Whether a span source need not be asked for its offer this cycle (`choice.Choice.resting`)."""
        return self.choice.resting(span)

    def best(self, limit: int) -> int:
        """The width the rule takes among plain decoding and the drafter (no probe)."""
        return self.choice.best(self.offers(limit))[1]

    def rate(self, b: int) -> float:
        """Tokens per second expected at block b (1: plain decoding's)."""
        return self.choice.rate(self.plain if b == 1 else self.drafter, b)

    def observe(self, block_size: int, accepted: int | None, seconds: float | None) -> None:
        self.observe_source(self.plain if block_size == 1 else self.drafter, block_size, accepted, seconds)

    def observe_source(self, src: Source, b: int, accepted: int | None, seconds: float | None) -> None:
        """A cycle of `src` at width b: `accepted` drafts (None: a stop token cut it) in `seconds`."""
        self.choice.observe(src, b, None if accepted is None else accepted + 1, seconds)  # (at the odds before it)
        if src.estimate is not None and accepted is not None and b > 1:
            src.estimate.observe(b - 1, accepted)
        self._keep()

    def _keep(self) -> None:
        if self.history is not None:
            self.history.keep(self.drafter)


_histories: dict[tuple[int, bool, str | None], DrafterHistory] = {}  # (id(drafter), sampled, source) -> a history
_histories_lock = threading.Lock()


def adaptive_policy(
    target,
    proposer,
    max_block: int,
    *,
    carry: bool = False,
    cost: CostModel | CostTable | None = None,
    kv=None,
    sampled: bool = False,
) -> AdaptiveBlock:
    """An adaptive policy for one generation, on this machine's cost model (`calibration.cost_model`).

    `carry`: the generation continues the drafter's history of its kind (`DrafterHistory`, greedy or
    `sampled`): its estimate starts from the drafter's long-run acceptance instead of the fixed prior and
    adds its own cycles to it, so a poor drafter starts at b = 1 and a good one at a large block, and its
    probe wait goes on. The library always carries: no block choice changes greedy text, an unseeded
    sampled call's distribution or a seeded one's draws (keyed by position, `dflash_mlx.acceptance`).
    `cost`: the setup's model (or a table) when the caller has it, else the one for `kv` and greedy or
    `sampled` cycles.
    """
    if cost is None:
        from .calibration import cost_model

        max_block = choose_source(target, proposer, max_block, kv=kv, sampled=sampled)
        cost = cost_model(target, proposer, max_block, kv=kv, sampled=sampled)
    drafter = getattr(proposer, "drafter", proposer)
    history = drafter_history(drafter, max_block - 1, sampled=sampled) if carry else None
    if history is None:
        return AdaptiveBlock(cost, max_block)
    priors, observed, idle, due = history.begin(max_block - 1)
    hopes = priors if observed else None
    estimate = AcceptanceEstimate(max_block - 1, priors=priors, record=history.record, hopes=hopes)

    def span_history(name: str) -> DrafterHistory | None:
        return drafter_history(drafter, max_block - 1, sampled=sampled, source=name)

    policy = AdaptiveBlock(cost, max_block, estimate, history, span_history)
    policy.drafter.idle, policy.drafter.due = idle, due
    return policy


def choose_source(target, proposer, max_block: int, *, kv=None, sampled: bool = False) -> int:
    """For a proposer of several drafters (`proposers.choice.RatedChoice`): activate, for this generation, the
    one expected to commit the most tokens per second (its greedy generations' acceptance over its cost curve,
    at its best block, plain decoding included; ties keep the active one), and return the widest block it
    drafts (within `max_block`). Any other proposer: nothing to choose, `max_block` as it is."""
    members = getattr(proposer, "members", None)
    if not members:
        return max_block
    from .calibration import cost_model

    def expected_rate(i: int) -> float:
        trial = proposer.with_active(i)
        widest = min(max_block, members[i].block_size)
        cost = cost_model(target, trial, widest, kv=kv, sampled=sampled)
        history = drafter_history(trial.drafter, widest - 1)
        estimate = AcceptanceEstimate(widest - 1, priors=history.learnt.rates() if history else None)
        policy = AdaptiveBlock(cost, widest, estimate)  # (its costs as the loop's cycles scaled them)
        return max(policy.rate(b) for b in range(1, widest + 1))

    rates = [expected_rate(i) for i in range(len(members))]
    best = max(range(len(members)), key=lambda i: (rates[i], i == proposer.active))
    proposer.activate(best)
    return min(max_block, members[best].block_size)


def drafter_history(drafter, positions: int, sampled: bool = False, source: str | None = None) -> DrafterHistory | None:
    """The history of `drafter`'s greedy generations, or with `sampled` its sampled ones (made at first use,
    dropped with the drafter), or None for a drafter that cannot be weakly referenced; `source`: the history
    of the span source of that name in the drafter's generations (the copy index's spans are accepted as
    often as the target follows its context, which depends on the target and the sampling, not the call)."""
    key = (id(drafter), sampled, source)  # (modules are dicts: not hashable, keyed by id)
    with _histories_lock:
        if key not in _histories:
            try:
                weakref.finalize(drafter, _histories.pop, key, None)
            except TypeError:  # not weakly referenceable: nothing is carried
                return None
            _histories[key] = DrafterHistory(positions)
        return _histories[key]
