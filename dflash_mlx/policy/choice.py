"""Which source runs the next cycle, and how wide: the rule, and the one probe schedule every source goes through.

A *source* is anything a cycle can verify: plain decoding (one row), a
drafter's block, a span source's span (a copy from the context), a batch's
rows. Each is one `Source` entry: its name (its cost's key in the `CostModel`),
its acceptance estimate (what a cycle of width b is expected to commit, E(b))
and how its cost is timed. `Choice` runs the rule for one request's policy
(`adaptive`) and the batch's (`batch.block_choice`):

- **The rate.** A source at width b commits E(b) tokens in T(b) seconds: its
  rate is E(b) / T(b), T from the cost model (the calibrated curve scaled by
  the level the source's own timed cycles show). Of a source's widths the
  widest within RESOLUTION of its best rate is taken.
- **Proven.** A source that drafts takes over from plain decoding only where
  its rate beats plain decoding's by SURE standard errors of the two
  levels (the timings' spread over the root of their count): on a quiet
  machine a few percent, on a busy one, where cycle times scatter, a wide
  margin. The source running needs none (its own cycles keep its level
  fresh: it yields as soon as another's rate beats it). Between drafting
  sources, the better rate. A width slower than plain decoding is never
  taken for RESOLUTION's sake.
- **Probes.** A source not chosen is run now and then: at once while its
  cost wants measuring (`CostModel.stale`: timed fewer than THIN times in
  this process, or not since the machine changed: either way for plain
  decoding, faster for the others) or after a probe of it paid; else once
  it has waited (in this generation, or since its level was timed: levels
  outlive generations) as many cycles as keep a probe's expected loss (its
  seconds beyond the time the chosen source takes for the tokens it is
  expected to commit, at the better of its estimate and its drafter's
  history, the switches to it and back: `CostModel.switch`, and what its
  recent probes lost beyond all that: `CostModel.overrun`, measured as each
  probe ends) to BUDGET of the time, and at least WINDOW. A
  probe is the narrowest width that would beat the chosen source were its
  drafts accepted as a good drafter's are (`PRIOR_RATE`), else (a probe for
  its time alone: never where the model does not learn) its narrowest.
  After a probe that paid (committed what plain decoding would have in its
  time) the source's acceptance counts are weighed by SOFTEN, so that
  acceptance that recovered shows at once, and another probe is due.
- **A settled plain run.** Where plain decoding is the clear choice (every
  other rate more than RESOLUTION below it) the rule runs again at the first
  probe due (its own Python is a share of a small model's step): the others'
  rates do not move while they do not run, and the run's timings, added to
  the cost model together once per WINDOW, end it where plain decoding's
  rate comes within RESOLUTION of the best other's. So do another source's
  cycle, another source offered (or a wider block), a change of the machine,
  and another generation's timed cycle.
- **A resting span source.** A span offered that could not have won at any
  width, its probe not due, rests: it is not asked for offers until the
  cycles timed since reach its probe's wait or the machine changes (an offer
  asked is Python on every cycle; its wait counts every cycle). So does one
  whose probe the loop read the anchor for (giving up that cycle's
  pipelining) when the anchor did not go on with its span. A rest is the
  setup's (`CostModel.rest`), as a level is. Whether a span's probe is due
  is decided alike where the loop asks whether to read the anchor for it
  (`due`) and where the rule runs it (`probe`).
- **Timing.** A cycle's seconds go to its source's level unless it is the
  first after another source's and the source `settles` (plain decoding's
  first step after a block is not pipelined; a drafter's first block takes
  in the rows that waited): a probe that wants timing runs that cycle and as
  many more as bring its level to THIN timed cycles.

Why each rule: docs/adaptive.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cost import SURE, THIN, WINDOW, CostModel
from .estimate import PRIOR_RATE

BUDGET = 0.01  # time failed probes may cost, against running the chosen source
RESOLUTION = 0.05  # a source's widths whose rates are this close are not told apart: the widest is taken
SOFTEN = 0.5  # weight a source's acceptance counts keep after a probe that paid (the next ones count more)


def beyond_odds(gain: float, variance: float) -> bool:
    """Whether tokens committed beyond plain decoding's (`gain`) exceed SURE standard deviations of what the
    cycles commit at their odds (`variance`): pay, not luck (a sampled draft is accepted with odds)."""
    return gain > SURE * math.sqrt(variance)


@dataclass(eq=False)
class Source:
    """One source as the policy sees it. `estimate` (an `estimate.AcceptanceEstimate`, or anything with
    its `expected_tokens`, `observe` and `soften`; None: plain decoding, one token a cycle); `prior`: the
    source whose level its cost takes until its own rests on THIN cycles timed since the machine changed (a
    span source verifies without a drafter forward: its drafter's cycle is an upper bound); `settles`: its
    first cycle after another source's is not its cost. `idle`, `due`, `probing`: its probe state."""

    name: str
    estimate: object | None = None
    prior: str | None = None
    settles: bool = True
    idle: int = 0  # chances to run it passed since it last ran
    due: bool = False  # run at its next chance where it could pay (a probe that paid; a generation's start)
    probing: bool = False  # a probe of it was chosen and has observed no acceptance yet
    rests: bool = False  # a span source whose odds are its entry's own, not each offer's: it may rest
    gain: float = field(default=0.0, repr=False)  # tokens its cycles committed beyond plain decoding's in their time
    spread: float = field(default=0.0, repr=False)  # the variance of those tokens at its estimate's odds

    @property
    def paid(self) -> bool:
        """Whether its cycles together committed more than plain decoding would have in their time, by SURE
        standard deviations of what they commit at its odds (sampled drafts are accepted with odds: a few
        lucky cycles of a drafter that loses are not pay)."""
        return beyond_odds(self.gain, self.spread)

    def expected(self, b: int, floor: float = 0.0, hoped: bool = False) -> float:
        """E(b): the tokens a cycle of width b commits (`floor`: at every position's rate at least that;
        `hoped`: at the better of its rates and its estimate's hopes, its drafter's history)."""
        return 1.0 if self.estimate is None else self.estimate.expected_tokens(b, floor, hoped)[-1]

    def variance(self, b: int) -> float:
        """The variance of the tokens a cycle of width b commits: 1 plus the number of drafts reached, each
        position k (1..b - 1) reached with odds r_k, so E[S^2] = sum (2k - 1) r_k."""
        if self.estimate is None or b < 2:
            return 0.0
        tokens = self.estimate.expected_tokens(b)
        reach = [tokens[k] - tokens[k - 1] for k in range(1, b)]
        return max(0.0, sum((2 * k - 1) * r for k, r in enumerate(reach, 1)) - sum(reach) ** 2)


@dataclass(eq=False)
class QuietRun:
    """A settled plain run (`Choice._choose`): the offers it holds for (the same sources, each as wide or
    narrower), plain decoding's width, the chances left before the first probe is due, the machine's changes
    and the cost model's timed cycles as of its last look (a change, or another generation's timed cycle, ends
    it), and the rate plain decoding keeps it above (the best other's over 1 - RESOLUTION)."""

    offers: list[tuple[Source, int]]
    width: int
    left: float
    changes: int
    cycles: int
    bar: float

    def holds(self, offers: list[tuple[Source, int]], changes: int) -> bool:
        return (
            self.left > 0
            and changes == self.changes
            and len(offers) == len(self.offers)
            and all(s is t and w <= v for (s, w), (t, v) in zip(offers, self.offers))
        )


@dataclass(eq=False)
class ProbeRun:
    """A probe under way, measured as it ends (`Choice._measure`): its source, the seconds the rule expected it
    to lose, the chosen source's rate, and what its cycles took and committed so far."""

    source: Source
    expected: float
    rate: float
    seconds: float = 0.0
    tokens: float = 0.0
    grace: int = 1  # other sources' cycles observed before its first (the one queued before it, pipelined)


class Choice:
    """The rule over sources for one policy (see the module docstring). `plain` is plain decoding's entry;
    `rows` the batch rows its cycles verify (1: one request)."""

    def __init__(self, cost: CostModel, plain: Source, rows: int = 1):
        self.cost, self.plain, self.rows = cost, plain, rows
        self.last: tuple[int, str] | None = None  # (rows, source) of the last observed cycle
        self._timed = False  # whether a cycle of the last one's run (its cycles in a row) was timed
        self.running: Source = plain  # the source the rule chose last (a probe is not a choice)
        self._stretch: list[tuple[Source, int]] = []  # a probe's cycles still to run
        self._quiet: QuietRun | None = None  # a settled plain run
        self._wait: float = 0  # chances left before the first probe of the last choice's others is due
        # a settled plain run's timed cycles (b, seconds, resumed), added each WINDOW or at the rule's run (`flush`)
        self._pending: list[tuple[int, float, bool]] = []
        self._measuring: ProbeRun | None = None  # the probe under way
        self._read_for: tuple[Source, int] | None = None  # a span source whose probe the anchor was read for, its wait

    def seconds(self, src: Source, b: int) -> float:
        return self.cost.seconds(src.name, b, self.rows, src.prior)

    def rate(self, src: Source, b: int) -> float:
        """Tokens per second of `src` at width b."""
        return src.expected(b) / self.seconds(src, b)

    def rates(self, src: Source, widest: int, floor: float = 0.0) -> dict[int, float]:
        """{b: tokens per second} of `src` at widths 2..widest (`floor`: as for `Source.expected`), its
        estimate and level read once."""
        tokens = src.estimate.expected_tokens(widest, floor) if src.estimate is not None else [1.0] * widest
        scale = self.cost.scale(src.name, self.rows, src.prior)
        line = self.cost.table.upto(widest, self.rows)
        return {b: tokens[b - 1] / (line[b - 1] * scale) for b in range(2, widest + 1)}

    def best_width(self, src: Source, widest: int, floor: float = 0.0) -> tuple[int, float]:
        """`src`'s width (1 for plain decoding, else 2..widest): the widest within RESOLUTION of its best rate
        and above `floor` (plain decoding's: a width slower than plain decoding is never taken for the
        resolution's sake), and that best rate."""
        if src is self.plain:
            return 1, self.rate(src, 1)
        rates = self.rates(src, widest)
        top = max(rates.values())
        return max(b for b, r in rates.items() if r >= min(top, max(floor, top * (1 - RESOLUTION)))), top

    def margin(self, src: Source) -> float:
        """What `src`'s rate is divided by against plain decoding's: 1 for plain decoding and for the source
        running (its own cycles keep its level fresh), else e to SURE standard errors of the difference of
        their levels (`cost.SURE`): drafting takes over from plain decoding only once proven."""
        if src is self.plain or src is self.running:
            return 1.0
        errors = (self.cost.level(s.name, self.rows, s.prior)[1] for s in (src, self.plain))
        return math.exp(SURE * math.hypot(*errors))

    def best(self, offers: list[tuple[Source, int]]) -> tuple[Source, int, float]:
        """The chosen (source, width, rate) among `offers`, (source, widest) of each that can run now.
        Ties go to plain decoding, then to a source whose cost is its prior's (an upper bound)."""
        scored, plain = [], self.rate(self.plain, 1)
        for src, widest in offers:
            b, rate = self.best_width(src, widest, plain)
            scored.append((rate / self.margin(src), src is self.plain, src.prior is not None, src, b, rate))
        *_, src, b, rate = max(scored, key=lambda s: s[:3])
        return src, b, rate

    def choose(self, offers: list[tuple[Source, int]]) -> tuple[Source, int]:
        """The next cycle's (source, width): a probe's next cycle, a probe due, or the best. Where the loop read
        the anchor for a span source's probe (`due`) and plain decoding runs all the same (the anchor did not go
        on with the span), the source rests a probe's wait: the read cost what pipelining saves, and bought
        nothing."""
        read_for, self._read_for = self._read_for, None
        src, b = self._choose(offers)
        if read_for is not None and src is self.plain:
            self.cost.rest(read_for[0].name, read_for[1], self.rows)
        return src, b

    def _choose(self, offers: list[tuple[Source, int]]) -> tuple[Source, int]:
        while self._stretch:
            src, b = self._stretch.pop()
            widest = next((w for s, w in offers if s is src), 0)
            if widest >= b:
                return src, b
        quiet = self._quiet
        if quiet is not None and quiet.holds(offers, self.cost.changes):
            quiet.left -= 1
            for other, _ in offers:
                other.idle += other is not self.plain
            return self.plain, quiet.width
        self._quiet = None
        self.flush()
        src, b, rate = self.best(offers)
        src.idle, src.due, self.running, self._wait = 0, False, src, math.inf  # (chosen, it runs: no probe due)
        for other, widest in offers:
            if other is not src:
                other.idle += 1
                probe = self.probe(other, widest, src, b, rate)
                if probe is not None:
                    self._quiet = None
                    return probe
        # plain decoding chosen clearly: the same for the next cycles, up to the first probe due (its cycles move
        # only its level, checked as their timings are added, `flush`; where another is within RESOLUTION of it,
        # every cycle decides)
        if src is self.plain:
            tops = [self.best_width(o, w, rate)[1] for o, w in offers if o is not src]
            if all(top < rate * (1 - RESOLUTION) for top in tops):
                bar = max(tops, default=0.0) / (1 - RESOLUTION)
                self._quiet = QuietRun(offers, b, self._wait - 1, self.cost.changes, self.cost.cycles, bar)
        return src, b

    def probe(self, src: Source, widest: int, chosen: Source, b: int, rate: float) -> tuple[Source, int] | None:
        """`src`'s probe (its first cycle; the rest wait in the stretch) if one is due, else None."""
        due, width, cycles, loss = self.probe_due(src, widest, chosen, b, rate)
        if not due:
            if cycles:
                self._wait = min(self._wait, self._left(src, chosen, b, loss))
            return None
        src.idle, src.due, src.probing = 0, False, True
        self._stretch = [(src, width)] * (cycles - 1)
        self._measuring = ProbeRun(src, loss - self.cost.overrun(src.name, self.rows), rate)
        return src, width

    def probe_due(self, src: Source, widest: int, chosen: Source, b: int, rate: float) -> tuple[bool, int, int, float]:
        """(whether `src`'s probe is due, its width, its cycles (0: none where no time is learnt), the seconds it
        is expected to lose): at once where its cost wants timing or a probe of it paid, else once it has
        waited (`_waited`)."""
        width, hopeful = self.probe_width(src, widest, rate)
        timing = self.wants_timing(src)
        if not (hopeful or self.cost.learns):
            return False, width, 0, 0.0  # (a probe for its time alone, where no time is learnt)
        cycles = self.cycles(src, timing or not hopeful)
        loss = cycles * self.loss(src, width, rate, hopeful) + self.switches(src, chosen)
        loss += self.cost.overrun(src.name, self.rows)  # (what its probes lost beyond that lately)
        return timing or (src.due and hopeful) or self._waited(src, chosen, b, loss), width, cycles, loss

    def cycles(self, src: Source, timing: bool) -> int:
        """A probe's cycles where the model learns: its first after a switch, not timed where it `settles`,
        then one timed (a probe measures the source's cost with its acceptance: a level timed long ago, on
        another machine's load, would misjudge every later probe's loss), or for its time as many as bring
        its level to THIN timed cycles. Where the model does not learn: one."""
        if not self.cost.learns:
            return 1
        timed = max(1, THIN - self.cost.level(src.name, self.rows, src.prior)[2]) if timing else 1
        return int(src.settles) + timed

    def wants_timing(self, src: Source) -> bool:
        """Whether `src`'s cost wants measuring at once (`CostModel.stale`): timed fewer than THIN times in this
        process, or not since the machine changed: either way for plain decoding (every other source is judged
        against its rate, and a probe of it is priced at its level: one timed under a load that has stopped would
        keep it from running for hundreds of cycles), faster for the others (the job that made their rows dear may
        have stopped; one timed before the machine got slower looks cheap, so it runs and is timed where it
        matters). A span source takes its drafter's cost meanwhile."""
        stale = self.cost.stale(src.name, self.rows)
        return src.prior is None and stale is not None and (src is self.plain or stale != 1)

    def probe_width(self, src: Source, widest: int, rate: float) -> tuple[int, bool]:
        """(width, hopeful): the narrowest width whose rate would beat `rate` at a good drafter's acceptance,
        else `src`'s narrowest (1 for plain decoding, which hopes for nothing)."""
        if src is self.plain:
            return 1, False
        hoped = self.rates(src, widest, PRIOR_RATE)
        return next(((w, True) for w in range(2, widest + 1) if hoped[w] > rate), (2, False))

    def due(self, src: Source, widest: int, others: list[tuple[Source, int]]) -> bool:
        """Whether `src` would run next were it offered (the best, or its probe due), without choosing; a
        chance passed by counts towards its probe."""
        # where src is not the best, this is the best of the others (of equals the first is kept; src is last)
        self.flush()
        chosen, b, rate = self.best(others + [(src, widest)])
        if chosen is src:
            return True
        src.idle += 1
        due, _, _, loss = self.probe_due(src, widest, chosen, b, rate)  # (as `probe` will decide it)
        if due:
            self._read_for = (src, self._wait_for(chosen, b, loss)) if src.rests else None
            return True
        widest_any = max(w for _, w in others)  # (a longer span offered later may beat what this one did not)
        if (
            src.rests
            and self.cost.learns
            and not src.due
            and self.best_width(src, widest_any)[1] / self.margin(src) < rate
        ):
            self.cost.rest(src.name, self._left(src, chosen, b, loss), self.rows)
        return False

    def resting(self, src: Source) -> bool:
        """Whether span source `src` rests: the last time it was offered it could not have won at any width, nor
        was its probe due, and the cycles timed since are fewer than its probe's wait (`_left`: `_idle` counts
        them) and the machine has not changed. Its offers are not asked meanwhile (each is Python on a small
        model's step: a copy index that loses, under sampling say, would cost every cycle, not just its
        probes). Only a source whose acceptance is its entry's rests (`rests`): one with each offer's own odds
        (the suffix index: a deeper match is likelier) is asked every time."""
        return self.cost.resting(src.name, self.rows)

    def loss(self, src: Source, width: int, rate: float, hopeful: bool = True) -> float:
        """Seconds a cycle of `src` at `width` is expected to lose against the chosen source's `rate`: its
        time beyond what the chosen takes for the tokens it is expected to commit (at the better of its
        estimate and its drafter's history: a drafter usually right is probed again soon after an unlucky
        stretch, one near the chosen source often, a useless one rarely; for a probe of its time alone,
        plain decoding's tokens: its drafts all rejected)."""
        tokens = src.expected(width, hoped=True) if hopeful else self.plain.expected(1)
        return max(0.0, self.seconds(src, width) - tokens / rate)

    def switches(self, src: Source, chosen: Source) -> float:
        """Seconds a probe of `src` costs in switching, beyond its cycles' and the chosen source's levels: to
        `src` and back to `chosen`, for each that `settles` (`CostModel.switch`: what their first cycles after
        another's took beyond their level; a drafter's first block takes in the rows that waited)."""
        return sum(self.cost.switch(s.name, self.rows) for s in (src, chosen) if s.settles)

    def _idle(self, src: Source) -> int:
        """How long `src` has waited: its chances passed since it last ran in this generation, or the cycles
        timed since its level was (`CostModel.age`: a level is shared by the setup's generations, so one
        priced dear stays so across generations shorter than its wait), whichever is more."""
        return max(src.idle, self.cost.age(src.name, self.rows)) if self.cost.learns else src.idle

    def _wait_for(self, chosen: Source, b: int, loss: float) -> int:
        """The chances a probe losing `loss` seconds waits for against `chosen` at width b: as many as keep it
        to BUDGET of the time, and at least WINDOW."""
        per = BUDGET * self.seconds(chosen, b)
        return max(WINDOW, math.ceil(loss / per) if per > 0 else WINDOW)

    def _left(self, src: Source, chosen: Source, b: int, loss: float) -> int:
        """The chances `src` waits yet before `_waited` holds (its costs as they are now)."""
        return max(0, self._wait_for(chosen, b, loss) - self._idle(src))

    def _waited(self, src: Source, chosen: Source, b: int, loss: float) -> bool:
        """Whether `src` has waited (`_idle`) long enough for a probe losing `loss` seconds to cost BUDGET of
        the time (and at least WINDOW chances: a run's level rests on WINDOW of its cycles, and a switch costs
        what no timed cycle shows)."""
        idle = self._idle(src)
        return idle >= WINDOW and idle * BUDGET * self.seconds(chosen, b) >= loss

    def _measure(self, src: Source, b: int, committed: float | None, seconds: float | None) -> None:
        """What the probe under way lost, to the cost model (`CostModel.add_overrun`) beyond what it was expected
        to: its cycles' seconds, and what the first cycle of another source after them took beyond its level (the
        switch back), less what the chosen source would have taken for the tokens they committed. A probe cut by
        a stop token, or with a cycle not its own cost, is not measured."""
        run = self._measuring
        if src is run.source:
            if seconds is None or committed is None:
                self._measuring = None
            else:
                run.seconds, run.tokens = run.seconds + seconds, run.tokens + committed
        elif not run.tokens:  # (not run yet: the cycle queued before it, or the probe did not run)
            run.grace -= 1
            if run.grace < 0:
                self._measuring = None
        else:
            self._measuring = None
            if seconds is not None:
                lost = run.seconds + seconds - self.seconds(src, b) - run.tokens / run.rate
                self.cost.add_overrun(run.source.name, lost - run.expected, self.rows)

    def flush(self) -> None:
        """Add a settled plain run's waiting timings to the cost model (`CostModel.add_many`): at the rule's next
        run, or once WINDOW of them wait (a settled run's cycles are timed as any others, in one call: a small
        model's step is short, and its Python is a share of it). The run ends where plain decoding's rate comes
        within RESOLUTION of another's, or another generation timed a cycle meanwhile."""
        if self._pending:
            pending, self._pending = self._pending, []
            quiet = self._quiet
            others = quiet is not None and self.cost.cycles != quiet.cycles
            self.cost.add_many(self.plain.name, pending, self.rows)
            if quiet is not None:
                quiet.cycles = self.cost.cycles
                if others or self.rate(self.plain, 1) <= quiet.bar:
                    self._quiet = None

    def reconsider(self) -> None:
        """End a settled run: what the others' rates rest on changed (a batch's rows)."""
        self._quiet = None

    def observe(self, src: Source, b: int, committed: float | None, seconds: float | None) -> None:
        """A cycle of `src` at width b committed `committed` tokens (None: a stop token cut it) in `seconds`
        (None: not its own cost); its acceptance is its owner's to observe."""
        if self._measuring is not None:
            self._measure(src, b, committed, seconds)
        key, self.last = self.last, (self.rows, src.name)
        if src is not self.plain:
            self._quiet = None
        if key != self.last:
            self._timed = False
        if seconds is not None and (key == self.last or not src.settles):
            if src is self.plain and self._quiet is not None:  # a settled plain run: its timings wait for the rule
                self._pending.append((b, seconds, not self._timed))
                if len(self._pending) >= WINDOW:
                    self.flush()
            else:
                self.flush()
                self.cost.add(src.name, b, seconds, self.rows, resumed=not self._timed)
            self._timed = True
        elif seconds is not None and key is not None:  # its first cycle after another source's: a switch
            self.cost.add_switch(src.name, b, seconds, self.rows)
        if src is self.plain or committed is None:
            return
        # beyond what plain decoding would have committed, by the margin that proves a source (a hiccup that
        # made plain decoding's level look dear does not make every probe look paid)
        gain = committed - self.rate(self.plain, 1) * self.margin(src) * self.seconds(src, b)
        odds = src.variance(b)  # (the odds before this cycle: its owner observes its acceptance after)
        src.gain += gain
        src.spread += odds
        if src.probing:  # a probe that paid, by more than its odds explain (a sampled draft is accepted with odds: a
            # lucky cycle of a drafter that loses is not pay): its acceptance may have recovered, so the next cycles
            # count more, and another probe comes at once while the estimate catches up
            paid = beyond_odds(gain, odds)
            src.probing, src.due = False, paid
            if paid and src.estimate is not None:
                src.estimate.soften(SOFTEN)
