"""The adaptive block: each cycle, the block b that maximises E(b) / T(b), plain decoding included.

E(b) comes from the live acceptance estimate (`estimate`, with the drafter's
history as the prior), T(b) from the setup's cost model (`cost`,
`calibration`), which the generation's timed cycles keep true. Among drafting
blocks it takes the largest within BLOCK_RESOLUTION of the best; from b = 1 it
probes a larger block now and then (`ProbeSchedule`), and while drafting it
runs another block now and then to keep that block's time fresh
(`Retiming`); both are shared with `batch.block_choice`. Why each rule:
docs/adaptive.md.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Callable

from .cost import MIN_PAIR_SAMPLES, CostModel, CostTable
from .estimate import PRIOR_RATE, AcceptanceEstimate, learnt_estimate

PROBE_BLOCK = 2
PROBE_GAP = 8
MAX_PROBE_GAP = 64
PROBE_SOFTEN = 0.5
PROBE_BUDGET = 0.005  # what failing probes may add to the plain steps' time: the gap is capped by it
BLOCK_RESOLUTION = 0.05  # rates of drafting blocks closer than this are not told apart: the largest is taken
TIMING_BUDGET = 0.01  # time re-timing other blocks may cost a run (against running its own block)
UNSURE_TIMING_BUDGET = 0.05  # the same while the model doubts a block's time against the run's (`doubtful`)
MIN_TIMING_GAP = 4  # cycles between re-timings at least
STALE_CYCLES = 400  # timed cycles (of the setup's model) after which a block's time is measured again
DOUBT_GAP = 3  # plain cycles between probes while a table no loop has timed yet keeps the policy plain
RECENT_GENERATIONS = 3  # a greedy generation probes at once unless drafting paid in none of this many before it


def block_for(rates: list[float], resolution: float = BLOCK_RESOLUTION) -> int:
    """The block to run given the expected rate (tokens per second) of blocks 1, 2, ...: plain decoding
    where it is the best, else the largest block within `resolution` of the best."""
    top = max(rates)
    if rates[0] >= top:
        return 1
    return max(b for b in range(2, len(rates) + 1) if rates[b - 1] >= top * (1 - resolution))


class ProbeSchedule:
    """When a policy at b = 1 probes a larger block: after PROBE_GAP plain cycles (or `min_gap`),
    twice as long after each probe that did not pay (up to MAX_PROBE_GAP); a cycle that paid
    resets the gap. Shared by this policy and the batch's (`batch.block_choice`)."""

    def __init__(self, gap: int = PROBE_GAP, due: bool = False):
        self.idle = 0  # cycles chosen at b = 1 since the last larger block
        self.gap = gap
        self.probing = False  # a probe was chosen and not judged yet
        self.unrun = False  # a probe was chosen and no cycle at a block > 1 has observed acceptance since
        self.due = due  # the next cycle chosen at b = 1 probes

    def larger(self) -> None:
        """A block > 1 was chosen on its merits."""
        self.idle, self.due = 0, False

    def probe_now(self, min_gap: float = 0, max_gap: float = MAX_PROBE_GAP) -> bool:
        """Another cycle chosen at b = 1: whether to probe instead (the gap bounded by `min_gap` and
        `max_gap`, the state it has earned kept)."""
        self.idle += 1
        if not self.due and self.idle < max(min(self.gap, max_gap), min_gap):
            return False
        self.idle, self.probing, self.unrun, self.due = 0, True, True, False
        return True

    def ran(self) -> None:
        """A cycle at a block > 1 observed acceptance."""
        self.unrun = False

    def observed(self, paid: bool | None) -> None:
        """A cycle at a block > 1 was judged: it `paid` (for this policy: committed at least what plain
        decoding would have in its time; for the batch's: a draft was accepted), or not (None: not known)."""
        if paid:
            self.gap = PROBE_GAP
        elif paid is not None and self.probing:
            self.gap = min(2 * self.gap, MAX_PROBE_GAP)
        self.probing = False


def next_to_time(cost: CostModel, blocks: list[int], run: int, rows: int = 1) -> int | None:
    """Which of `blocks` (grid blocks) to time next against the run's block `run`: one not yet compared
    with it MIN_PAIR_SAMPLES times, the one compared most often first (its first comparisons are
    completed before another's begin, so a curve that is wrong is replaced soon): while drafting, plain
    decoding and then the block nearest the run's (the choice is between those); from plain decoding, the
    largest block (its time alone says whether drafting can pay at all, a good drafter commits most
    there, and a table replaced on it gives the blocks not yet timed its time too). Else the block
    compared least recently."""

    def order(g: int) -> tuple:
        compared = len(cost.comparisons(max(g, run), min(g, run), rows))
        if compared < MIN_PAIR_SAMPLES:
            return (0, -compared, g != 1, -g if run == 1 else abs(g - run))
        return (1, cost.last_timed(g, rows), 0, 0)

    return min(blocks, key=order, default=None)


class Retiming:
    """While drafting, when to run another grid block for a cycle (two for plain decoding, whose first
    step after a drafting cycle is not timed) to keep its time fresh: the block compared least recently,
    as often as TIMING_BUDGET of the run's time allows (UNSURE_TIMING_BUDGET while the model doubts that
    block's time against the run's block's: `CostModel.doubtful`), and every MIN_TIMING_GAP cycles for
    a few after the model saw the machine change. Shared with `batch.block_choice`."""

    def __init__(self, cost: CostModel, rows: int = 1):
        self.cost, self.rows = cost, rows
        self.since = 0  # drafting cycles since the last re-timing
        self.changes = cost.changes
        self.urgent = 0  # re-timings still due every MIN_TIMING_GAP cycles (the machine changed)
        self._plan: tuple[int, int, float] | None = None  # (block, cycles, gap), planned every MIN_TIMING_GAP

    def block(self, b: int, limit: int, rate: Callable[[int], float]) -> tuple[int, int] | None:
        """(block, cycles) to run instead of block b now, or None. `rate(g)`: the tokens per second
        expected at block g. After the model saw the machine change, MIN_PAIR_SAMPLES re-timings come
        every MIN_TIMING_GAP cycles (plain decoding's first: is drafting still worth it?)."""
        self.since += 1
        if self.changes != self.cost.changes:
            self.changes, self.urgent = self.cost.changes, MIN_PAIR_SAMPLES
        if self.since < MIN_TIMING_GAP:
            return None
        if self._plan is None or self.since % MIN_TIMING_GAP == 0:
            self._plan = self._next(b, limit, rate)
        if self._plan is None or self._plan[0] > limit or (not self.urgent and self.since < self._plan[2]):
            return None
        (g, cycles, _), self._plan = self._plan, None
        self.since, self.urgent = 0, max(0, self.urgent - 1)
        return g, cycles

    def _next(self, b: int, limit: int, rate: Callable[[int], float]) -> tuple[int, int, float] | None:
        """The block to time next, its cycles, and the drafting cycles to wait for it since the last."""
        table, rows = self.cost.table, self.rows
        run = table.grid_block(b)
        g = next_to_time(self.cost, [g for g in table.blocks if g <= limit and g != run], run, rows)
        if g is None:
            return None
        cycles = 2 if g == 1 else 1
        loss = cycles * table(g, rows) * max(0.0, 1 - rate(g) / rate(b)) / table(b, rows)  # run cycles lost
        return g, cycles, loss / (UNSURE_TIMING_BUDGET if self.cost.doubtful(g, run, rows) else TIMING_BUDGET)


class DrafterHistory:
    """What a drafter's greedy generations pass on to the next: its long-run acceptance (the priors of
    each generation's estimate), its probe gap, and when drafting last paid. Generations may run at once
    (threads): each takes a copy when it begins and records into the history under its lock."""

    def __init__(self, positions: int):
        self._lock = threading.Lock()
        self.learnt = learnt_estimate(positions)
        self.gap, self.unrun = PROBE_GAP, False
        self.generations = 0
        self.unpaid = 0  # generations in a row, before the latest, in which drafting did not pay
        self.paid = False  # drafting paid in the latest generation

    def begin(self, positions: int) -> tuple[list[float], ProbeSchedule]:
        """A new generation: the rates it starts from and its probe schedule (the gap earned so far; a
        probe at its first plain cycle when the last one chose a probe it never ran, or unless drafting
        paid in none of the last RECENT_GENERATIONS generations: one reply the drafter did not fit does
        not keep the next one at b = 1 for a gap)."""
        with self._lock:
            self.learnt.grow(positions)
            if self.generations:
                self.unpaid = 0 if self.paid else self.unpaid + 1
            self.generations, self.paid = self.generations + 1, False
            due = self.unrun or self.unpaid < RECENT_GENERATIONS
            return self.learnt.rates(), ProbeSchedule(self.gap, due=due)

    def record(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.learnt.observe(drafted, accepted)

    def keep(self, probes: ProbeSchedule, paid: bool = False) -> None:
        """The generation's probe state (and whether drafting paid in it), for the next."""
        with self._lock:
            self.gap, self.unrun = probes.gap, probes.unrun
            self.paid |= paid


class AdaptiveBlock:
    def __init__(
        self,
        cost: CostModel | CostTable,
        max_block: int,
        estimate: AcceptanceEstimate | None = None,
        history: DrafterHistory | None = None,
    ):
        """`cost`: the setup's model (a table: a model of it that does not learn); `history`: the drafter's,
        which the estimate's priors and the probe schedule came from and which this generation keeps."""
        if max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block}.")
        self.cost = cost if isinstance(cost, CostModel) else CostModel(cost, learns=False)
        self.timer = self.cost.timer()  # None: the curve is frozen
        self.max_block = max_block
        self.estimate = estimate or AcceptanceEstimate(max_block - 1)
        self.history = history
        self.probes = ProbeSchedule()
        self.retiming = Retiming(self.cost) if self.timer is not None else None
        self._stretch: list[int] = []  # blocks still to run for a probe or a re-timing
        self._excursion: list | None = None  # [tokens, seconds by the curve, the probe's block] since the probe
        self._hoping = False  # in an excursion that has not had a draft accepted yet
        self._table: CostTable | None = None
        self._costs: list[float] = []

    def costs(self) -> list[float]:
        """[T(1), ..., T(max_block)] on the model's current table. A table the loop replaced resets the probe
        gap, earned on the old one, and the next plain cycle probes."""
        table = self.cost.table
        if table is not self._table:
            if self._table is not None:
                self.probes.gap, self.probes.due = PROBE_GAP, True
            self._table, self._costs = table, [table(b) for b in range(1, self.max_block + 1)]
        return self._costs

    def best(self, limit: int) -> int:
        """The block of b <= limit by E(b) / T(b) (`block_for`)."""
        expected = self.estimate.expected_tokens(min(limit, self.max_block))
        rates = [e / t for e, t in zip(expected, self.costs())]
        return block_for(rates, 0.0 if self._hoping else BLOCK_RESOLUTION)

    def choose(self, limit: int) -> int:
        limit = min(limit, self.max_block)
        if limit <= 1:
            return 1
        if self._stretch:
            return min(self._stretch.pop(), limit)
        b = self.best(limit)
        if b > 1:
            self.probes.larger()
            other = self.retiming.block(b, limit, self.rate) if self.retiming is not None else None
            if other is None:
                return b
            self._stretch = [other[0]] * (other[1] - 1)
            return other[0]
        if self._excursion is not None:  # back at plain decoding after a probe: did the excursion pay?
            tokens, seconds, probe = self._excursion
            paid = tokens * self.cost(1) >= seconds
            # (judged on a time the model doubts, a probe that did not pay does not lengthen the gap)
            self.probes.observed(paid if paid or not self._doubtful(probe) else None)
            self.probes.due = paid  # one that paid is followed by another at once: the estimate is catching up
            self._keep(paid)
            self._excursion, self._hoping = None, False
        probe, max_gap = self._probe_and_gap(limit)
        if probe is None or not self.probes.probe_now(max_gap=max_gap):
            return 1
        self._keep()
        self.estimate.soften(PROBE_SOFTEN)
        self._excursion, self._hoping = [0.0, 0.0, probe], True
        if self._stale(probe):  # its first cycle after plain steps is not timed: a second one is
            self._stretch = [probe]
        return probe

    def rate(self, b: int) -> float:
        """Tokens per second expected at block b (1: plain decoding's)."""
        return self.estimate.expected_tokens(b)[-1] / self.costs()[b - 1]

    def _probe_and_gap(self, limit: int) -> tuple[int | None, float]:
        """The probe block and the longest gap between probes: where a block could pay, the smallest such
        (failing probes cost at most PROBE_BUDGET of the plain steps); where none could by the curve, the
        drafting block timed least recently, as TIMING_BUDGET allows (a curve that says no block pays is
        corrected only by timing a block; a frozen curve is not). Every DOUBT_GAP cycles while the curve
        is suspect (`_suspect`)."""
        probe = self.probe_block(limit)
        if probe is not None:
            gap = max(PROBE_GAP, (self.cost(probe) / self.cost(1) - 1) / PROBE_BUDGET)
        elif self.timer is None:
            return None, math.inf
        else:
            probe = next_to_time(self.cost, [g for g in self.cost.table.blocks if 1 < g <= limit], 1)
            if probe is None:
                return None, math.inf
            gap = max(MAX_PROBE_GAP, (1 + self._stale(probe)) * (self.cost(probe) / self.cost(1) - 1) / TIMING_BUDGET)
        if self._suspect(probe):  # the curve that keeps the policy plain may be wrong: a few probes soon
            gap = DOUBT_GAP
        return probe, gap

    def _suspect(self, b: int) -> bool:
        """Whether block b's time is in a table no loop has timed (nor since the machine got faster), with
        fewer than MIN_PAIR_SAMPLES comparisons with plain decoding's: a cached curve measured on a busy
        machine, or a busy curve after the other jobs stopped."""
        g = self.cost.table.grid_block(b)
        return self.timer is not None and self.cost.suspect and len(self.cost.comparisons(g, 1)) < MIN_PAIR_SAMPLES

    def _stale(self, b: int) -> bool:
        """Whether block b's time wants a fresh comparison with plain decoding's."""
        if self.timer is None:
            return False
        age = self.cost.cycles - self.cost.last_timed(self.cost.table.grid_block(b))
        return self._doubtful(b) or age > STALE_CYCLES

    def _doubtful(self, b: int) -> bool:
        return self.timer is not None and self.cost.doubtful(self.cost.table.grid_block(b), 1)

    def probe_block(self, limit: int) -> int | None:
        """The smallest block from PROBE_BLOCK up to `limit` that would beat plain decoding if the drafts
        were accepted as a good drafter's are (each position at least PRIOR_RATE), or None."""
        plain = 1.0 / self.cost(1)
        hoped = [max(PRIOR_RATE, r) for r in self.estimate.rates()]
        expected, reach = 1.0, 1.0
        for b in range(2, limit + 1):
            reach *= hoped[b - 2] if b - 2 < len(hoped) else 0.0
            expected += reach
            if b >= PROBE_BLOCK and expected / self.cost(b) > plain:
                return b
        return None

    def observe(self, block_size: int, accepted: int | None, seconds: float | None) -> None:
        if self.timer is not None:
            self.timer.observe(block_size, seconds)
        if block_size > 1 and accepted is not None:  # (b = 1 cycles are observed late when pipelined)
            self.probes.ran()
            self.estimate.observe(block_size - 1, accepted)
            if self._excursion is not None:  # the probe and the larger blocks it led to, judged together
                self._excursion[0] += accepted + 1
                self._excursion[1] += self.cost(block_size)
                self._hoping = self._hoping and not accepted
                self._keep()
            elif accepted:
                self.probes.observed(True)  # drafting on its merits: a fresh gap when it next stops
                self._keep((accepted + 1) * self.cost(1) >= self.cost(block_size))

    def _keep(self, paid: bool = False) -> None:
        if self.history is not None:
            self.history.keep(self.probes, paid)


_histories: dict[int, DrafterHistory] = {}  # id(drafter) -> its history, while the drafter lives
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
    frozen: bool = False,
) -> AdaptiveBlock:
    """An adaptive policy for one generation, on this machine's cost model (`calibration.cost_model`).

    `carry`: the generation continues the drafter's history (`DrafterHistory`): its estimate starts from
    the drafter's long-run acceptance instead of the fixed prior and adds its own cycles to it, so a poor
    drafter starts at b = 1 and a good one at a large block, and its probes keep the drafter's gap (a
    drafter that failed its probes is not probed afresh at every request). The library carries only for
    greedy decoding, whose output no block choice can change. `cost`: the setup's model (or a table)
    when the caller has it, else the one for `kv` and greedy or `sampled` cycles. `frozen`: the curve this
    process started with, which no timing changes (a seeded sampled request: its blocks decide its random
    draws).
    """
    if cost is None:
        from .calibration import cost_model

        max_block = choose_source(target, proposer, max_block, kv=kv, sampled=sampled)
        cost = cost_model(target, proposer, max_block, kv=kv, sampled=sampled)
    if frozen and isinstance(cost, CostModel):
        cost = cost.frozen(initial=True)
    history = drafter_history(getattr(proposer, "drafter", proposer), max_block - 1) if carry else None
    if history is None:
        return AdaptiveBlock(cost, max_block)
    priors, probes = history.begin(max_block - 1)
    estimate = AcceptanceEstimate(max_block - 1, priors=priors, record=history.record)
    policy = AdaptiveBlock(cost, max_block, estimate, history)
    policy.probes = probes
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
        return max(estimate.expected_tokens(b)[-1] / cost(b) for b in range(1, widest + 1))

    rates = [expected_rate(i) for i in range(len(members))]
    best = max(range(len(members)), key=lambda i: (rates[i], i == proposer.active))
    proposer.activate(best)
    return min(max_block, members[best].block_size)


def drafter_history(drafter, positions: int) -> DrafterHistory | None:
    """The history of `drafter`'s greedy generations (made at first use, dropped with the drafter),
    or None for a drafter that cannot be weakly referenced."""
    key = id(drafter)  # (modules are dicts: not hashable, keyed by id)
    with _histories_lock:
        if key not in _histories:
            try:
                weakref.finalize(drafter, _histories.pop, key, None)
            except TypeError:  # not weakly referenceable: nothing is carried
                return None
            _histories[key] = DrafterHistory(positions)
        return _histories[key]
