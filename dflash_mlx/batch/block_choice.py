"""The block a batch verifies next: one b for all rows, weighed against plain batched decoding.

Every row of a batched verify has the same width, so the choice is the b
that maximises the batch's expected tokens per second, sum over rows of
E_i(min(b, cap_i)) / T(B, b), b = 1 included: each row's E_i from its own
estimate, T(B, b) from the batch calibration (`calibration`), so a seeded
request served alone reproduces. At b = 1 it probes PROBE_BLOCK on the
single-request schedule, the gap stretched so probes add at most PROBE_TAX.
Why: docs/adaptive.md.
"""

from __future__ import annotations

import math
from typing import Callable

from ..policy.adaptive import PROBE_BLOCK, PROBE_SOFTEN, ProbeSchedule

PROBE_TAX = 0.05  # what probing may add to the time of the b = 1 steps between probes


class BatchBlockChoice:
    """Chooses each step's block for rows with `estimate` (AcceptanceEstimate) and `max_block`;
    `cost(rows, b)` is T(B, b) (`calibration.BatchCost`)."""

    def __init__(self, cost: Callable[[int, int], float], max_block: int):
        if max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block}.")
        self.cost, self.max_block = cost, max_block
        self.reset()

    def reset(self) -> None:
        """Forget the probe schedule (a new batch: its rows' histories start afresh too)."""
        self.probes = ProbeSchedule()

    def _limit(self, rows: list) -> int:
        return min(self.max_block, max(r.max_block for r in rows))

    def best(self, rows: list) -> int:
        limit = self._limit(rows)
        expected = [r.estimate.expected_tokens(min(limit, r.max_block)) for r in rows]
        best, best_rate = 1, 0.0
        for b in range(1, limit + 1):
            tokens = sum(e[min(b, len(e)) - 1] for e in expected)
            rate = tokens / self.cost(len(rows), b)
            if rate > best_rate:
                best, best_rate = b, rate
        return best

    def choose(self, rows: list) -> int:
        if not rows:
            return 1
        b = self.best(rows)
        if b > 1:
            self.probes.larger()
            return b
        limit = self._limit(rows)
        if not self.probes.probe_now(self._probe_gap(len(rows)) if limit >= 2 else math.inf):
            return 1
        for r in rows:
            r.estimate.soften(PROBE_SOFTEN)
        return min(limit, PROBE_BLOCK)

    def _probe_gap(self, rows: int) -> int:
        """The least steps at b = 1 between probes (the schedule's own gap, when longer, holds):
        enough that a probe costs at most PROBE_TAX of the steps it follows (a probe of many rows
        verifies them all)."""
        extra = self.cost(rows, PROBE_BLOCK) / self.cost(rows, 1) - 1.0
        return math.ceil(extra / PROBE_TAX)

    def observe(self, rows: list, b: int, accepted: list[int]) -> None:
        """A step at block b: row i accepted `accepted[i]` of its drafts."""
        if b < 2:
            return
        any_accepted = False
        for r, n in zip(rows, accepted):
            drafted = min(b, r.max_block) - 1
            if drafted > 0:
                r.estimate.observe(drafted, n)
                any_accepted |= n > 0
        self.probes.observed(any_accepted)
