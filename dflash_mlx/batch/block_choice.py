"""The block a batch verifies next: one b for all rows, weighed against plain batched decoding.

Every row of a batched verify has the same width, so the choice is the b
that maximises the batch's expected tokens per second, sum over rows of
E_i(min(b, cap_i)) / T(B, b), b = 1 included: each row's E_i from its own
estimate, T(B, b) from the batch's cost model (`calibration`), scaled by the
levels the steps' own times show at each row count. The rule, the margin by
which drafting must beat plain decoding and the probes are one request's
(`policy.choice.Choice`), over two sources: plain batched decoding and the
rows' drafters. Why: docs/adaptive.md.
"""

from __future__ import annotations

from ..policy.choice import Choice, Source
from ..policy.cost import CostModel, CostTable


class RowsEstimate:
    """The batch's drafts as one source's acceptance: its rows' own estimates, each up to its own block."""

    def __init__(self):
        self.rows: list = []

    def expected_tokens(self, b: int, floor: float = 0.0, hoped: bool = False) -> list[float]:
        expected = [r.estimate.expected_tokens(min(b, r.max_block), floor, hoped) for r in self.rows]
        return [sum(e[min(w, len(e)) - 1] for e in expected) for w in range(1, b + 1)]

    def soften(self, factor: float) -> None:
        for r in self.rows:
            r.estimate.soften(factor)


class BatchBlockChoice:
    """Chooses each step's block for rows with `estimate` (AcceptanceEstimate) and `max_block`;
    `cost(b, rows)` is T(B, b) (a `CostModel`; a table: one that does not learn)."""

    def __init__(self, cost: CostModel | CostTable, max_block: int):
        if max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block}.")
        self.cost = cost if isinstance(cost, CostModel) else CostModel(cost, learns=False)
        self.max_block = max_block
        self.reset()

    def reset(self) -> None:
        """Forget the probe schedule (a new batch: its rows' histories start afresh too)."""
        self.drafts = RowsEstimate()
        self.plain = _PlainRows("target")
        self.drafter = Source("drafter", self.drafts)
        self.choice = Choice(self.cost, self.plain)
        self._rows: tuple[int, ...] = ()  # the rows of the last step (ids)

    def _offers(self, rows: list) -> list:
        self.drafts.rows, self.plain.count, self.choice.rows = rows, len(rows), len(rows)
        ids = tuple(map(id, rows))
        if ids != self._rows:  # (other rows: other estimates and levels)
            self._rows = ids
            self.choice.reconsider()
        limit = min(self.max_block, max(r.max_block for r in rows))
        return [(self.plain, 1)] + ([(self.drafter, limit)] if limit > 1 else [])

    def best(self, rows: list) -> int:
        return self.choice.best(self._offers(rows))[1]

    def choose(self, rows: list) -> int:
        if not rows:
            return 1
        return self.choice.choose(self._offers(rows))[1]

    def observe(self, rows: list, b: int, accepted: list, seconds: float | None = None) -> None:
        """A step at block b that took `seconds` (None: not timed): row i accepted `accepted[i]` of its
        drafts (None: they were not its drafter's, a lookup span)."""
        self._offers(rows)
        if b > 1:
            for r, n in zip(rows, accepted):
                drafted = min(b, r.max_block) - 1
                if drafted > 0 and n is not None:
                    r.estimate.observe(drafted, n)
        committed = sum(1 + (n or 0) for n in accepted)  # (a span's drafts counted as none)
        self.choice.observe(self.plain if b == 1 else self.drafter, b, committed, seconds)


class _PlainRows(Source):
    """Plain batched decoding: one token per row."""

    count: int = 1

    def expected(self, b: int, floor: float = 0.0) -> float:
        return float(self.count)
