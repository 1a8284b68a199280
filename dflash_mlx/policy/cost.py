"""The cost model: seconds per cycle of each source at width b (and rows B), a calibrated curve the loop scales.

`CostTable` is a measured table T(B, b): rows (1 for one request) x grid
blocks, interpolated between them (the calibration's). `CostModel` is one
setup's table as the loop knows it, shared by the setup's generations: each
source (plain decoding, a drafter, a span source: any name) has a *level*,
the log of the mean over its newest WINDOW timed cycles of seconds / T(B, b), so
its cost at width b is T(B, b) times e^level: the table gives the shape, the
loop's own cycles the scale, each source its own (under load a multi-row
verify slows far more than a one-row step). The level's standard error (the
spread of the same cycles' costs over the root of their count, a lone slow
one included, and at least the machine's usual spread) says how sure it is.
A source's newest WINDOW cycles all CHANGE times slower or faster than the
median of the ones before them mean the machine changed: another job started
or stopped. Its older cycles are dropped and every other source's level goes
*stale*, to be measured again (`stale`, with the way the machine went). A
source resuming after others' cycles faster than its level by SURE of its
cycles' robust deviations was timed at a slow moment: its level starts afresh
(a level too dear keeps its source from running, so running never corrects
it). What a source's first cycle after another's takes beyond its level is
what a switch to it costs (`switch`: the mean of the newest WINDOW, where
sure); what a source's probes lost beyond what the rule expected of them is
what its next probes are priced beyond that (`overrun`, alike). A span
source told to rest is not asked for offers for a number of timed cycles
(`rest`: the setup's, as a level is, so each reply does not start afresh).
A model that does not learn (`learns=False`: sharded ranks, a curve a test
injects) is the table alone, whatever the timings.
Why: docs/adaptive.md.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass

WINDOW = 8  # newest timed cycles per source and row count whose mean is its level (4 times as many kept)
CHANGE = 2.0  # a newest window all this many times slower or faster than the cycles before: the machine changed
SURE = 2.0  # standard deviations past which a difference is taken as real (a change; drafting proven)
THIN = 3  # timed cycles a level rests on before it is trusted (fewer: measured again at once)
MAD_TO_SD = 1.4826  # (not tuned: a normal sample's standard deviation over its median absolute deviation)


def _between(xs, ys, x: float) -> float:
    """ys at x: linear between the points, extrapolated from the last two past them (never downwards)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[0] * x / xs[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[-1] + max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])) * (x - xs[-1])


@dataclass(frozen=True)
class CostTable:
    """Seconds of one cycle: seconds[i][j] with rows[i] rows at block blocks[j]."""

    blocks: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    rows: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        blocks, rows = tuple(int(b) for b in self.blocks), tuple(int(n) for n in self.rows)
        seconds = tuple(tuple(float(t) for t in line) for line in self.seconds)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "seconds", seconds)
        if not blocks or blocks[0] != 1 or any(b >= c for b, c in zip(blocks, blocks[1:])):
            raise ValueError(f"The blocks must start at 1 and ascend, got {list(blocks)}.")
        if not rows or any(n < 1 for n in rows) or any(n >= m for n, m in zip(rows, rows[1:])):
            raise ValueError(f"The rows must be positive and ascend, got {list(rows)}.")
        if len(seconds) != len(rows) or any(len(line) != len(blocks) for line in seconds):
            raise ValueError("A cost table needs one time per (rows, block) point.")
        if any(not (t > 0 and math.isfinite(t)) for line in seconds for t in line):
            raise ValueError(f"Cycle times must be positive, got {[list(line) for line in seconds]}.")
        nearest = {b: min(blocks, key=lambda g: (abs(g - b), g)) for b in range(1, blocks[-1] + 1)}
        object.__setattr__(self, "_nearest", nearest)
        object.__setattr__(self, "_values", {})  # (b, rows) -> seconds, and `upto`'s: the policy reads them every cycle

    @classmethod
    def curve(cls, blocks, seconds) -> CostTable:
        """One request's curve T(b)."""
        return cls(tuple(blocks), (tuple(seconds),))

    def __call__(self, b: int, rows: int = 1) -> float:
        value = self._values.get((b, rows))
        if value is None:
            if len(self.rows) == 1:
                value = _between(self.blocks, self.seconds[0], b)
            else:
                value = _between(self.rows, [_between(self.blocks, line, b) for line in self.seconds], rows)
            self._values[b, rows] = value
        return value

    def upto(self, widest: int, rows: int = 1) -> tuple[float, ...]:
        """(T(1), ..., T(widest)) at `rows` rows (the policy reads a source's every width each cycle)."""
        values = self._values.get((widest, rows, "upto"))
        if values is None:
            values = self._values[widest, rows, "upto"] = tuple(self(b, rows) for b in range(1, widest + 1))
        return values

    def line(self, rows: int = 1) -> tuple[float, ...]:
        """The measured seconds at every grid block for this row count (a grid row count)."""
        return self.seconds[self.rows.index(rows)]

    def with_line(self, rows: int, seconds) -> CostTable:
        i = self.rows.index(rows)
        return CostTable(self.blocks, self.seconds[:i] + (tuple(seconds),) + self.seconds[i + 1 :], self.rows)

    def grid_block(self, b: int) -> int:
        """The grid block a cycle at block b is timed as (the nearest, the smaller on a tie)."""
        return self._nearest.get(b) or min(self.blocks, key=lambda g: (abs(g - b), g))


class CostModel:
    """One setup's cost table and the levels its sources' timed cycles give it, shared by the setup's
    generations in this process (under a lock)."""

    def __init__(self, table: CostTable, *, learns: bool = True):
        self.table = table  # the calibrated curve: the shape every level scales
        self.learns = learns
        self.notes: dict = {}  # what its calibration recorded (the cache file's notes)
        self.changes = 0  # changes of the machine seen
        self.cycles = 0  # timed cycles added
        self._lock = threading.Lock()
        self._levels: dict[tuple[int, str], deque] = {}  # (rows, source) -> newest log(seconds / T(rows, b))
        self._deviations: dict[tuple[int, str], deque] = {}  # (rows, source) -> |one of those - the median before|
        self._stale: dict[tuple[int, str], int] = {}  # levels timed before the machine changed -> which way
        self._switches = _SureMeans()  # (rows, source) -> its first cycles' extra seconds (`switch`)
        self._overruns = _SureMeans()  # (rows, source) -> its probes' seconds lost beyond expected (`overrun`)
        self._read: dict[tuple[int, str, str | None], tuple[float, float, int]] = {}  # levels read since the last add
        self._scales: dict[tuple[int, str, str | None], float] = {}  # e to those levels (`scale`)
        # (rows, source) -> its newest WINDOW cycles' seconds over the table's, and their (level, spread, count), as
        # of its last timed cycle (read every cycle, changed only by `add`)
        self._costs: dict[tuple[int, str], deque] = {}
        self._summary: dict[tuple[int, str], tuple[float, float, int]] = {}
        self._mad: dict[tuple[int, str], float | None] = {}  # its robust noise (`_own_noise`), until its next cycle
        self._at: dict[tuple[int, str], int] = {}  # (rows, source) -> `cycles` at its last timed cycle
        self._rests: dict[tuple[int, str], tuple[int, int]] = {}  # (rows, source) -> (cycles, changes) it rests until

    def __call__(self, b: int, rows: int = 1) -> float:
        return self.table(b, rows)

    def level(self, source: str, rows: int = 1, prior: str | None = None) -> tuple[float, float, int]:
        """(level, its standard error, the cycles it rests on) of `source` at `rows`: the log of the mean of its
        newest WINDOW cycles' seconds over the table's (`_mean_level`), and that mean's standard error: the
        spread of those cycles' costs (a lone slow cycle widens it as much as it raises the mean: a level one
        hiccup raised is not sure) and at least the robust spread of its cycles (`_noise`: the machine's usual
        noise, which two or three alike cycles do not disprove). A source with a `prior` (a span source: its
        drafter's cost, an upper bound) takes the prior's level until its own rests on THIN cycles timed since the
        machine last changed (a span runs only where the context matches, so it cannot be measured again at
        once as plain decoding and the drafter are: one slow cycle, or cycles of a load that has stopped, would
        keep it from running for good); a source with neither takes 0 (the table as calibrated); both with no
        error."""
        with self._lock:
            return self._read_level(rows, source, prior)

    def _read_level(self, rows: int, source: str, prior: str | None) -> tuple[float, float, int]:
        """`level` from what was read since the last timed cycle, else computed and kept (under the lock)."""
        read = self._read.get((rows, source, prior))
        if read is None:
            read = self._read[rows, source, prior] = self._level(source, rows, prior)
        return read

    def _level(self, source: str, rows: int, prior: str | None) -> tuple[float, float, int]:
        """`level`, computed (under the lock; kept until the next timed cycle: a choice reads it several times)."""
        summary = self._summary.get((rows, source))
        if summary is None or (prior is not None and (summary[2] < THIN or (rows, source) in self._stale)):
            summary = self._summary.get((rows, prior)) if prior is not None else None
            return (summary[0] if summary else 0.0), 0.0, 0
        level, spread, n = summary
        return level, max(spread, self._noise(rows, source)) / math.sqrt(n), n

    def _noise(self, rows: int, source: str) -> float:
        """The standard deviation of `source`'s cycle times about their level (robust: from the median of
        its last 4 x WINDOW deviations); with fewer than 3, the widest of this row count's sources' (the
        machine's noise as seen), else 0."""
        own = self._own_noise((rows, source))
        if own is not None:
            return own
        known = (self._own_noise(k) for k in self._deviations if k[0] == rows)
        return max((noise for noise in known if noise is not None), default=0.0)

    def _own_noise(self, key: tuple[int, str]) -> float | None:
        """MAD_TO_SD times the median of the source's deviations (None: fewer than 3), kept until its next cycle."""
        if key not in self._mad:
            deviations = self._deviations.get(key, ())
            self._mad[key] = MAD_TO_SD * statistics.median(deviations) if len(deviations) >= 3 else None
        return self._mad[key]

    def scale(self, source: str, rows: int = 1, prior: str | None = None) -> float:
        """What `source`'s cycles cost over the table's: e to its `level` (read every cycle, kept as `level`)."""
        key = (rows, source, prior)
        with self._lock:
            scale = self._scales.get(key)
            if scale is None:
                scale = self._scales[key] = math.exp(self._read_level(rows, source, prior)[0])
            return scale

    def seconds(self, source: str, b: int, rows: int = 1, prior: str | None = None) -> float:
        """`source`'s seconds per cycle at width b: the table's, scaled by its level."""
        return self.table(b, rows) * self.scale(source, rows, prior)

    def age(self, source: str, rows: int = 1) -> int:
        """Timed cycles this process added since `source`'s last at `rows` (all of them: never timed)."""
        with self._lock:
            return self.cycles - self._at.get((rows, source), 0)

    def rest(self, source: str, cycles: int, rows: int = 1) -> None:
        """`source` (a span source) is not asked for its offers for the next `cycles` timed cycles, or until the
        machine changes: a rest is the setup's, as its level is (nothing where the model does not learn, which
        times no cycle)."""
        if self.learns:
            with self._lock:
                self._rests[rows, source] = (self.cycles + cycles, self.changes)

    def resting(self, source: str, rows: int = 1) -> bool:
        """Whether `source` rests (`rest`)."""
        until, changes = self._rests.get((rows, source), (0, -1))
        return until > self.cycles and changes == self.changes

    def add_switch(self, source: str, b: int, seconds: float, rows: int = 1) -> None:
        """The first cycle of `source` after another source's took `seconds` (not timed into its level: a
        drafter's first block takes in the rows that waited, plain decoding's first step is not pipelined):
        what it took beyond its level's cost is what a switch to it costs (nothing where the model does not
        learn)."""
        if not self.learns or not seconds > 0 or rows not in self.table.rows:
            return
        extra = seconds - self.seconds(source, b, rows)
        with self._lock:
            self._switches.add((rows, source), extra)

    def switch(self, source: str, rows: int = 1) -> float:
        """Seconds a switch to `source` costs beyond its cycle's level: the mean of its newest WINDOW first
        cycles' extra seconds where it is SURE standard errors above 0, else 0 (where cycle times scatter, a
        few slow first cycles are not a cost of switching). (Kept as its first cycles come: read every cycle.)"""
        return self._switches.mean((rows, source))

    def add_overrun(self, source: str, seconds: float, rows: int = 1) -> None:
        """A probe of `source` lost `seconds` more than the rule expected it to (its cycles at their levels, the
        switches, the tokens it hoped for; negative: less): what its next probes are priced beyond that (nothing
        where the model does not learn)."""
        if not self.learns or not math.isfinite(seconds) or rows not in self.table.rows:
            return
        with self._lock:
            self._overruns.add((rows, source), seconds)

    def overrun(self, source: str, rows: int = 1) -> float:
        """Seconds a probe of `source` loses beyond what the rule expects: the mean of its newest WINDOW probes'
        overruns where it is SURE standard errors above 0, else 0 (a probe that paid, or a few unlucky ones on a
        machine whose times scatter, does not shorten or stretch the wait)."""
        return self._overruns.mean((rows, source))

    def stale(self, source: str, rows: int = 1) -> int | None:
        """Whether `source`'s level wants measuring: None where it is fresh, 0 where it rests on fewer than
        THIN timed cycles (in this process, or since it started afresh: one slow moment does not decide), else
        the way the machine changed since its last timed cycle (+1: a source that ran got slower, -1: faster).
        A model that does not learn: always None."""
        key = (rows, source)
        with self._lock:
            if not self.learns:
                return None
            return 0 if len(self._costs.get(key, ())) < THIN else self._stale.get(key)

    def _below(self, key: tuple[int, str], y: float) -> bool:
        """Whether a cycle of log cost `y` lies below `key`'s level (of at least THIN cycles) by more than SURE
        of its cycles' robust standard deviations (`_noise`: the spread about the mean would count a stall that
        raised the level as noise; under the lock)."""
        summary = self._summary.get(key)
        return summary is not None and summary[2] >= THIN and summary[0] - y > SURE * self._noise(*key)

    def add(self, source: str, b: int, seconds: float, rows: int = 1, resumed: bool = False) -> None:
        """A timed cycle of `source` at width b with `rows` rows (nothing where the model does not learn);
        `resumed`: its first timed cycle since other sources' cycles (a probe's, a run's first, a generation's)."""
        self.add_many(source, [(b, seconds, resumed)], rows)

    def add_many(self, source: str, cycles: list[tuple[int, float, bool]], rows: int = 1) -> None:
        """Timed cycles of `source` in a row, each (b, seconds, resumed) as for `add`, in order: one call for a
        settled run's cycles (`choice.Choice` adds a plain run's each WINDOW: the per-cycle Python of a
        small model's step is a share of its time)."""
        cycles = [(b, t, r) for b, t, r in cycles if t > 0] if self.learns and rows in self.table.rows else []
        if not cycles:
            return
        key = (rows, source)
        with self._lock:
            self._read.clear()
            self._scales.clear()
            if key not in self._levels:
                self._levels[key], self._deviations[key] = deque(maxlen=4 * WINDOW), deque(maxlen=4 * WINDOW)
                self._costs[key] = deque(maxlen=WINDOW)
            for i, (b, seconds, resumed) in enumerate(cycles):
                if resumed and i:  # (`_below` reads the summary as of the cycle before)
                    self._summarize(key)
                self._add(key, math.log(seconds / self.table(b, rows)), resumed)
            self._summarize(key)

    def _summarize(self, key: tuple[int, str]) -> None:
        newest = list(self._costs[key])
        self._summary[key] = (_mean_level(newest), _mean_spread(newest), len(newest))

    def _add(self, key: tuple[int, str], y: float, resumed: bool) -> None:
        """One timed cycle of log cost `y` into `key`'s cycles (under the lock; its summary is the caller's)."""
        levels, deviations, costs = self._levels[key], self._deviations[key], self._costs[key]
        self.cycles += 1
        self._at[key] = self.cycles
        if self._stale.pop(key, None) is not None:  # measured afresh since the machine changed: its older
            levels.clear()  # cycles are of another machine
            deviations.clear()
            costs.clear()
        elif resumed and self._below(key, y):  # resumed faster than its level by SURE of its robust
            # deviations: a level timed at a slow moment (not corrected by running: it keeps the source from
            # running) starts afresh; its older cycles stay in `levels`, where a change of the machine shows
            costs.clear()
        if levels:
            deviations.append(abs(y - statistics.median(list(levels)[-WINDOW:])))
        levels.append(y)
        costs.append(math.exp(y))
        self._mad.pop(key, None)
        change = _change(levels)
        if change:
            while len(levels) > WINDOW:
                levels.popleft()
            deviations.clear()
            self._stale.update({k: change for k in self._levels if k[0] == key[0] and k != key})
            self.changes += 1


def _mean_level(newest: list[float]) -> float:
    """The log of the mean of the newest WINDOW cycles' seconds over the table's (e to their levels): what the
    cycles cost on average, a rare very slow one included (under load a multi-row verify may take 60 times
    its usual time now and then: a median would not see what those cycles cost)."""
    return math.log(sum(newest) / len(newest))


def _mean_spread(newest: list[float]) -> float:
    """The standard deviation of the newest WINDOW cycles' costs (e to their levels) relative to their mean (the
    log level's, to first order; 0 for fewer than two). (Floats: `statistics.stdev` sums exact fractions, 50 us
    a call.)"""
    n = len(newest)
    if n < 2:
        return 0.0
    mean = sum(newest) / n
    return math.sqrt(sum((x - mean) ** 2 for x in newest) / (n - 1)) / mean


class _SureMeans:
    """Per key, the newest WINDOW values and their mean where sure (`_sure_mean`), kept as they come (read
    every cycle; added under the model's lock)."""

    def __init__(self):
        self._newest: dict[tuple[int, str], deque] = {}
        self._means: dict[tuple[int, str], float] = {}

    def add(self, key: tuple[int, str], value: float) -> None:
        newest = self._newest.setdefault(key, deque(maxlen=WINDOW))
        newest.append(value)
        self._means[key] = _sure_mean(newest)

    def mean(self, key: tuple[int, str]) -> float:
        return self._means.get(key, 0.0)


def _sure_mean(values) -> float:
    """The mean of `values` where it is SURE standard errors above 0, else 0 (fewer than two: 0)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    error = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1) / n)
    return mean if mean > SURE * error else 0.0


def _change(levels) -> int:
    """+1 (slower) or -1 (faster) where the newest WINDOW cycles lie all above, or all below, the median of
    the (at least WINDOW) cycles before them by more than CHANGE times: noise, and a burst of a few slow
    cycles (another job's time slice), put a few on either side; another job starting or stopping puts them
    all on one. (Even where cycle times scatter by a factor of 2.5, a standard deviation of 0.9 in their log,
    WINDOW cycles all beyond CHANGE come once in 1e5 cycles, and a false change costs a few cycles timed
    again; asking SURE standard deviations too hid a load stopping where it had made cycles scatter.) Else 0."""
    if len(levels) < 2 * WINDOW:
        return 0
    values = list(levels)
    before, newest = values[:-WINDOW], values[-WINDOW:]
    lowest, highest, limit = min(newest), max(newest), math.log(CHANGE)
    if lowest - min(before) <= limit and max(before) - highest <= limit:  # (within CHANGE of the median, surely)
        return 0
    older = statistics.median(before)
    return 1 if lowest - older > limit else -1 if older - highest > limit else 0
