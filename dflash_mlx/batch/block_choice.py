"""The block a batch verifies next: one b for all rows, weighed against plain batched decoding.

Every row of a batched verify has the same width, so the choice is the b
that maximises the batch's expected tokens per second, sum over rows of
E_i(min(b, cap_i)) / T(B, b), b = 1 included: each row's E_i from its own
estimate, T(B, b) from the batch's cost model (`calibration`), which the
steps' own times keep true as one request's curve is kept (`CycleTimer`,
`Retiming`). At b = 1 it probes PROBE_BLOCK on the single-request schedule,
the gap stretched so probes add at most PROBE_TAX. Why: docs/adaptive.md.
"""

from __future__ import annotations

import math

from ..policy.adaptive import PROBE_BLOCK, PROBE_SOFTEN, ProbeSchedule, Retiming
from ..policy.cost import CostModel, CostTable

PROBE_TAX = 0.05  # what probing may add to the time of the b = 1 steps between probes


class BatchBlockChoice:
    """Chooses each step's block for rows with `estimate` (AcceptanceEstimate) and `max_block`;
    `cost(b, rows)` is T(B, b) (a `CostModel`; a table: one that does not learn)."""

    def __init__(self, cost: CostModel | CostTable, max_block: int):
        if max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block}.")
        self.cost = cost if isinstance(cost, CostModel) else CostModel(cost, learns=False)
        self.max_block = max_block
        self.timer = self.cost.timer()
        self.reset()

    def reset(self) -> None:
        """Forget the probe schedule (a new batch: its rows' histories start afresh too)."""
        self.probes = ProbeSchedule()
        self.retiming = {}  # rows -> Retiming
        self._stretch: list[int] = []

    def _limit(self, rows: list) -> int:
        return min(self.max_block, max(r.max_block for r in rows))

    def _rate(self, rows: list, limit: int):
        expected = [r.estimate.expected_tokens(min(limit, r.max_block)) for r in rows]
        return lambda b: sum(e[min(b, len(e)) - 1] for e in expected) / self.cost(b, len(rows))

    def best(self, rows: list) -> int:
        limit = self._limit(rows)
        rate = self._rate(rows, limit)
        return max(range(1, limit + 1), key=lambda b: (rate(b), -b))

    def choose(self, rows: list) -> int:
        if not rows:
            return 1
        limit = self._limit(rows)
        if self._stretch:
            return min(self._stretch.pop(), limit)
        b = self.best(rows)
        if b > 1:
            self.probes.larger()
            retiming = self.retiming.get(len(rows))
            if retiming is None and self.timer is not None and len(rows) in self.cost.table.rows:
                retiming = self.retiming[len(rows)] = Retiming(self.cost, len(rows))
            other = retiming.block(b, limit, self._rate(rows, limit)) if retiming is not None else None
            if other is None:
                return b
            self._stretch = [other[0]] * (other[1] - 1)
            return other[0]
        if not self.probes.probe_now(self._probe_gap(len(rows)) if limit >= 2 else math.inf):
            return 1
        for r in rows:
            r.estimate.soften(PROBE_SOFTEN)
        return min(limit, PROBE_BLOCK)

    def _probe_gap(self, rows: int) -> int:
        """The least steps at b = 1 between probes (the schedule's own gap, when longer, holds):
        enough that a probe costs at most PROBE_TAX of the steps it follows (a probe of many rows
        verifies them all)."""
        extra = self.cost(PROBE_BLOCK, rows) / self.cost(1, rows) - 1.0
        return math.ceil(extra / PROBE_TAX)

    def observe(self, rows: list, b: int, accepted: list[int], seconds: float | None = None) -> None:
        """A step at block b that took `seconds` (None: not timed): row i accepted `accepted[i]` of its
        drafts (None: they were not its drafter's, a lookup span)."""
        if self.timer is not None:
            self.timer.observe(b, seconds, len(rows))
        if b < 2:
            return
        any_accepted = False
        for r, n in zip(rows, accepted):
            drafted = min(b, r.max_block) - 1
            if drafted > 0 and n is not None:
                r.estimate.observe(drafted, n)
                any_accepted |= n > 0
        self.probes.observed(any_accepted)
