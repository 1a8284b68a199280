"""The cost model: seconds per cycle at block b (and rows B), a calibrated prior the loop keeps true.

`CostTable` is a measured table T(B, b): rows (1 for one request) x grid
blocks, interpolated between them. `CostModel` is one setup's table as the
loop knows it: the calibration (or the last table a loop wrote) is its
prior, and `CycleTimer`s (one per generation or batch decoder) compare the
cycles the engine times at different blocks a few cycles apart; the pairs'
log-ratios (windowed medians) give the shape T(b) / T(1) of each row count's
line by a small least-squares fit. Comparing nearby cycles, a machine
uniformly slower for a while does not look like a steeper curve; a level
that jumps (another job starts or stops) drops the older comparisons, so the
next few decide. A line most of a pair's comparisons miss by more than
REPLACE_TOLERANCE on the same side is replaced (`on_replace`: the calibration
rewrites its file). A proposer without a drafter forward (verify-only cycles,
T_v(b)) is another setup's table: the key tells proposers apart. Why:
docs/adaptive.md.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

PAIR_WINDOW = 9  # newest log-ratios kept per pair of blocks (their median is the pair's value)
MIN_PAIR_SAMPLES = 3  # a pair corrects the curve once it has this many
NEAR_CYCLES = 8  # cycles apart within which two cycles' times are compared
LEVEL_WINDOW = 32  # newest cycles that set the replaced line's level (seconds of T(1))
CHANGE_CYCLES = 8  # the newest of those, whose level against the older ones' tells a change of machine
CHANGE = 0.5  # a level that moved by more: the machine changed (another job, or none any more)
REPLACE_TOLERANCE = 0.10  # comparisons missing the table's ratio by more contradict it
CONTRADICTING = 0.75  # share of a pair's comparisons that must miss on one side for the line to be replaced
NEWEST = 4  # ... or its newest comparisons, all of them
SMOOTHNESS = 0.5  # weight tying neighbouring drafting blocks' times (a block not measured follows its neighbours)
RIDGE = 0.02  # weight pulling the shape to the table's (where nothing measures it, and nothing tied to it)


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

    @classmethod
    def curve(cls, blocks, seconds) -> CostTable:
        """One request's curve T(b)."""
        return cls(tuple(blocks), (tuple(seconds),))

    def __call__(self, b: int, rows: int = 1) -> float:
        if len(self.rows) == 1:
            return _between(self.blocks, self.seconds[0], b)
        return _between(self.rows, [_between(self.blocks, line, b) for line in self.seconds], rows)

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
    """One setup's cost table, corrected by the cycles the loop times (`timer`), shared by the setup's
    generations in this process (under a lock). `learns=False`: the table as given, always (a curve a
    test injects, sharded ranks, seeded requests: `frozen`)."""

    def __init__(
        self,
        table: CostTable,
        *,
        learns: bool = True,
        on_replace: Callable[[CostTable, dict], None] | None = None,
        confirmed: bool = False,
    ):
        """`on_replace(table, notes)`: told of every line replaced, and of the table as it is the first time
        the loop's comparisons agree with it, unless `confirmed` (by an earlier process's loop)."""
        self.table = table  # what every choice reads; replaced whole, never changed in place
        self.initial = table  # the table this process started from (seeded requests keep to it)
        self.learns = learns
        self.notes: dict = {}  # what its calibration recorded (the cache file's notes)
        self.replaced = 0  # lines replaced since the model was made
        self.cycles = 0  # timed cycles observed
        self.changes = 0  # changes of the machine's level seen (`_change`)
        self._on_replace = on_replace
        self.suspect = learns and not confirmed  # no loop has timed this table yet (nor since it got faster)
        self._lock = threading.Lock()
        self._pairs: dict[tuple[int, int, int], deque] = {}  # (rows, b, d) with b > d -> log T(b) - log T(d)
        self._last: dict[tuple[int, int], int] = {}  # (rows, block) -> `cycles` at its last pair
        self._recent: dict[int, deque] = {}  # rows -> (grid block, log seconds) of recent timed cycles
        self._levels: dict[int, deque] = {}  # rows -> theirs over the table's shape (their log T(1))
        self._settled: set = set()  # pairs that contradict the table where no better table fits them all

    def __call__(self, b: int, rows: int = 1) -> float:
        return self.table(b, rows)

    def frozen(self, initial: bool = False) -> CostModel:
        """A model that never learns, on the current table (`initial`: the one this process started from)."""
        return CostModel(self.initial if initial else self.table, learns=False)

    def timer(self) -> CycleTimer | None:
        """A generation's (or a batch decoder's) timer feeding this model, or None when it does not learn."""
        return CycleTimer(self) if self.learns else None

    def comparisons(self, b: int, d: int, rows: int = 1) -> list[float]:
        """The model's recent comparisons of grid blocks b > d, log T(b) - log T(d), oldest first."""
        with self._lock:
            return list(self._pairs.get((rows, b, d), ()))

    def doubtful(self, b: int, d: int, rows: int = 1) -> bool:
        """Whether blocks b and d (grid blocks) want comparing soon: compared fewer than MIN_PAIR_SAMPLES
        times, or the last two comparisons missed the table's ratio on the same side (it may be wrong)."""
        b, d = max(b, d), min(b, d)
        window = self.comparisons(b, d, rows)
        if len(window) < MIN_PAIR_SAMPLES:
            return True
        if (rows, b, d) in self._settled:  # (timing it more often would not change the table)
            return False
        table, tolerance = self.table, math.log1p(REPLACE_TOLERANCE)
        predicted = math.log(table(b, rows)) - math.log(table(d, rows))
        misses = [x - predicted for x in window[-2:]]
        return all(m > tolerance for m in misses) or all(m < -tolerance for m in misses)

    def last_timed(self, b: int, rows: int = 1) -> int:
        """`cycles` when block b (a grid block) was last compared with another (-1: never)."""
        return self._last.get((rows, b), -1)

    def add(self, rows: int, block: int, log_seconds: float, pairs: list[tuple[int, float]]) -> None:
        """A timed cycle at grid block `block` with `rows` rows, and its log-ratios to the nearby cycles at
        other blocks d, [(d, log T(block) - log T(d))]; refits the line when they are new."""
        if rows not in self.table.rows:
            return
        replaced = None
        with self._lock:
            self.cycles += 1
            table = self.table
            recent = self._recent.setdefault(rows, deque(maxlen=LEVEL_WINDOW))
            levels = self._levels.setdefault(rows, deque(maxlen=LEVEL_WINDOW))
            recent.append((block, log_seconds))
            levels.append(log_seconds - math.log(table(block, rows) / table(1, rows)))
            change = self._change(levels)
            if change:  # the comparisons made before are of another machine: made afresh
                for key in [k for k in self._pairs if k[0] == rows]:
                    del self._pairs[key]
                self._settled.clear()
                while len(recent) > CHANGE_CYCLES:
                    recent.popleft()
                    levels.popleft()
                self.suspect |= change < 0  # faster: the blocks the table makes dear may not be any more
                self.changes += 1
            for d, delta in pairs:
                key = (rows, block, d) if block > d else (rows, d, block)
                window = self._pairs.setdefault(key, deque(maxlen=PAIR_WINDOW))
                window.append(delta if block > d else -delta)
                self._last[(rows, block)] = self._last[(rows, d)] = self.cycles
            if pairs:
                fitted = self._refit(rows)
                if fitted is not None:
                    replaced = self.table = table.with_line(rows, fitted)
                    self.replaced += 1
                    levels.clear()
                    levels.extend(y - math.log(replaced(b, rows) / replaced(1, rows)) for b, y in recent)
                elif self.suspect and any(len(w) >= MIN_PAIR_SAMPLES for w in self._pairs.values()):
                    replaced = table  # confirmed as it is
                self.suspect = self.suspect and replaced is None
        if replaced is not None and self._on_replace is not None:
            self._on_replace(replaced, {"cycles": self.cycles, "replaced": self.replaced})

    @staticmethod
    def _change(levels) -> int:
        """1 where the newest CHANGE_CYCLES timed cycles run at a level (their time over the table's shape)
        more than CHANGE above the older ones' in the window (slower: re-timing plain decoding is cheap,
        and staying at a block gone dear is not); -1 where those and the CHANGE_CYCLES before them both
        run more than CHANGE below (faster, and lasting: the probes it calls for are of blocks the table
        makes dear); else 0. `levels`: the window's log T(1) implied by each cycle and the table's shape."""
        if len(levels) < LEVEL_WINDOW:
            return 0
        levels = list(levels)
        old = statistics.median(levels[: -2 * CHANGE_CYCLES])
        newest = statistics.median(levels[-CHANGE_CYCLES:]) - old
        if newest > math.log1p(CHANGE):
            return 1
        before = statistics.median(levels[-2 * CHANGE_CYCLES : -CHANGE_CYCLES]) - old
        return -1 if max(newest, before) < -math.log1p(CHANGE) else 0

    def _refit(self, rows: int) -> list[float] | None:
        """The line's new seconds when the pairs contradict its shape, else None (under the lock).

        A pair contradicts the line when its NEWEST comparisons (all of a window of MIN_PAIR_SAMPLES to
        NEWEST) miss the line's ratio by more than REPLACE_TOLERANCE on the same side, its older ones then
        dropped (the machine changed), or when CONTRADICTING of its window do: noise puts a few there on
        either side, a curve that is wrong puts them all on one. The new line is the least-squares fit of every pair's
        median, at the level of the recent cycles (none where that fit moves no block by half the
        tolerance: pairs that disagree among themselves)."""
        blocks = self.table.blocks
        prior = [math.log(t) for t in self.table.line(rows)]
        index = {b: i for i, b in enumerate(blocks)}
        windows = [
            (index[b], index[d], w) for (n, b, d), w in self._pairs.items() if n == rows and len(w) >= MIN_PAIR_SAMPLES
        ]
        tolerance = math.log1p(REPLACE_TOLERANCE)

        def contradicts(i: int, j: int, window) -> bool:
            misses = [x - (prior[i] - prior[j]) for x in window]
            newest = misses[-NEWEST:]
            if all(m > tolerance for m in newest) or all(m < -tolerance for m in newest):
                while len(window) > len(newest):  # a change: the older comparisons are of another machine
                    window.popleft()
                return True
            side = max(sum(m > tolerance for m in misses), sum(m < -tolerance for m in misses))
            return side >= math.ceil(CONTRADICTING * len(window))

        contradicting = {(rows, blocks[i], blocks[j]) for i, j, w in windows if contradicts(i, j, w)}
        if not contradicting:
            return None
        fitted = _fit_shape(prior, [(i, j, statistics.median(w), len(w)) for i, j, w in windows])
        shape = [math.log(t) for t in _non_decreasing([math.exp(f) for f in fitted])]
        if max(abs(s - p + prior[0]) for s, p in zip(shape, prior)) < tolerance / 2:  # pairs that disagree
            self._settled |= contradicting  # among themselves (or with a non-decreasing curve): no news
            return None
        self._settled.clear()
        level = statistics.median(y - shape[index[b]] for b, y in self._recent[rows])
        return [math.exp(level + s) for s in shape]


def _fit_shape(prior: list[float], pairs: list[tuple[int, int, float, int]]) -> list[float]:
    """The line's log-shape S (log T(b) - log T(1) at each grid block; 0 at b = 1) that best explains the
    pairs' medians (i, j, median of log T_i - log T_j, count) in least squares, each weighted by its
    count; neighbouring drafting blocks are tied by SMOOTHNESS towards equal times (a block nothing
    measures takes its measured neighbours' time: the table's own shape may be the one that is wrong)
    and every block is pulled to the table's shape `prior` by RIDGE."""
    n = len(prior) - 1  # unknowns: the shape at blocks[1:]
    if n == 0:
        return [0.0]
    a = [[RIDGE if i == j else 0.0 for j in range(n)] for i in range(n)]
    r = [RIDGE * (p - prior[0]) for p in prior[1:]]

    def tie(i: int, j: int, weight: float, target: float) -> None:  # weight * (S_i - S_j - target)^2
        for k, sign in ((i, 1.0), (j, -1.0)):
            if k == 0:
                continue
            r[k - 1] += sign * weight * target
            for m, other in ((i, 1.0), (j, -1.0)):
                if m:
                    a[k - 1][m - 1] += sign * other * weight

    for i, j, median, count in pairs:
        tie(i, j, float(count), median)
    for i in range(1, n):  # blocks[i] and blocks[i + 1], both drafting
        tie(i + 1, i, SMOOTHNESS, 0.0)
    return [0.0] + _solve(a, r)


def _solve(a: list[list[float]], r: list[float]) -> list[float]:
    """x with a x = r (a symmetric positive definite: Gaussian elimination without pivoting)."""
    n = len(r)
    a, r = [row[:] for row in a], r[:]
    for k in range(n):
        for i in range(k + 1, n):
            f = a[i][k] / a[k][k]
            for j in range(k, n):
                a[i][j] -= f * a[k][j]
            r[i] -= f * r[k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (r[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


def _non_decreasing(values: list[float]) -> list[float]:
    out = []
    for v in values:
        out.append(max(v, out[-1]) if out else v)
    return out


class CycleTimer:
    """One generation's (or batch decoder's) timed cycles, paired for its `CostModel`.

    A cycle's time counts only when the cycle before it ran the same way: at the same block with the
    same rows, or both drafting. A plain step after a drafting cycle is launched without the pipelining
    that consecutive plain steps have, and a drafting cycle after plain steps also takes their rows into
    the drafter, so a cycle changing to or from plain decoding does not cost what a run of it does.
    A counted cycle at block b is compared with each smaller block that ran since b's own last counted
    cycle: the median of b's counted cycles within NEAR_CYCLES (this one included) against the median of
    that block's. Every change between two blocks is compared once (a probe among a run, or a run after
    a probe), whatever the cadence, and a run's cycles on both sides of a probe enter its comparison."""

    def __init__(self, model: CostModel):
        self.model = model
        self._cycle = 0
        self._previous: tuple[int, int] | None = None  # (rows, block) of the last cycle
        self._recent: deque = deque()  # (cycle, rows, grid block, log seconds) of recent counted cycles

    def break_run(self) -> None:
        """A cycle this timer does not time ran (a lookup span, `policy.source`): the next one is not
        counted (it takes in that cycle's context rows)."""
        self._cycle += 1
        self._previous = None

    def observe(self, b: int, seconds: float | None, rows: int = 1) -> None:
        self._cycle += 1
        previous, self._previous = self._previous, (rows, b)
        if seconds is None or not seconds > 0 or previous is None or previous[0] != rows:
            return
        if previous[1] != b and (previous[1] == 1 or b == 1):
            return
        table = self.model.table
        if rows not in table.rows:
            return
        block = table.grid_block(b)
        y = math.log(seconds) + (math.log(table(block, rows)) - math.log(table(b, rows)) if block != b else 0.0)
        recent = self._recent
        while recent and recent[0][0] < self._cycle - NEAR_CYCLES:
            recent.popleft()
        seen: dict[int, list[float]] = {}
        newest: dict[int, int] = {}
        for c, n, g, v in recent:
            if n == rows:
                seen.setdefault(g, []).append(v)
                newest[g] = c
        own = newest.get(block, -1)
        mine = statistics.median(seen.get(block, []) + [y])  # (a run's cycles around a probe: less noise)
        pairs = [(d, mine - statistics.median(v)) for d, v in seen.items() if d < block and newest[d] > own]
        recent.append((self._cycle, rows, block, y))
        self.model.add(rows, block, y, pairs)
