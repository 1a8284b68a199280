"""Live acceptance: per-position conditional acceptance rates and the expected tokens per cycle.

Draft position k is accepted with probability a_k given that drafts 0..k-1
were; each position keeps exponentially discounted counts plus a prior, weak
and optimistic without a history (PRIOR_RATE), else the drafter's long-run
rates (`priors`, from `adaptive.DrafterHistory`). E(b) = 1 + sum_{k=1}^{b-1}
prod_{j<k} a_j is what a cycle at block b is expected to commit. Why the
priors are what they are: docs/adaptive.md.
"""

from __future__ import annotations

from typing import Callable

PRIOR_RATE = 0.8  # DFlash drafters accept ~5 of 15 drafts in distribution: optimistic, quickly corrected
PRIOR_WEIGHT = 0.5  # pseudo-observations behind the prior (a useless drafter's floor: 0.4 / 20.5, 2%)
DISCOUNT = 0.95  # weight of older observations per new one (about 20 cycles of memory)
LEARNT_DISCOUNT = 0.99  # the drafter's long-run history (about 100 cycles, across generations)
LEARNT_WEIGHT = 2.0  # pseudo-observations behind a generation's prior taken from that history (and its own)


class AcceptanceEstimate:
    def __init__(
        self,
        positions: int,
        prior: float = PRIOR_RATE,
        weight: float = PRIOR_WEIGHT,
        discount: float = DISCOUNT,
        priors: list[float] | None = None,
        record: Callable[[int, int], None] | None = None,
        hopes: list[float] | None = None,
    ):
        """`priors`: per position, the drafter's long-run rates (`DrafterHistory`), each weighing
        LEARNT_WEIGHT cycles, instead of the fixed prior; `record(drafted, accepted)` is told every
        observation (the history's); `hopes`: rates a probe may hope for (the history's, where it has
        observed any: a drafter usually right is probed again soon after an unlucky stretch)."""
        if positions < 0:
            raise ValueError(f"positions must be >= 0, got {positions}.")
        self.prior, self.weight, self.discount = prior, weight, discount
        self.accepted = [0.0] * positions  # discounted successes per position
        self.seen = [0.0] * positions  # discounted observations per position
        self.record = record
        self._priors = list(priors[:positions]) + [prior] * (positions - len(priors)) if priors is not None else None
        self.hopes = list(hopes[:positions]) if hopes is not None else None
        self._prior_weights = [LEARNT_WEIGHT] * positions if priors is not None else []
        self._expected: dict[tuple, list[float]] = {}  # expected_tokens' answers since the last observation

    @property
    def positions(self) -> int:
        return len(self.seen)

    def observe(self, drafted: int, accepted: int) -> None:
        """A cycle offered `drafted` drafts and the target accepted the first `accepted`."""
        self._expected.clear()
        for k in range(min(drafted, accepted + 1, self.positions)):
            self.seen[k] = self.seen[k] * self.discount + 1.0
            self.accepted[k] = self.accepted[k] * self.discount + (1.0 if k < accepted else 0.0)
            if self._priors is not None:
                self._prior_weights[k] *= self.discount
        if self.record is not None:
            self.record(drafted, accepted)

    def grow(self, positions: int) -> None:
        """Make room for `positions` positions (new ones unobserved)."""
        self._expected.clear()
        extra = positions - self.positions
        if extra > 0:
            self.accepted += [0.0] * extra
            self.seen += [0.0] * extra
            if self._priors is not None:
                self._priors += [self.prior] * extra
                self._prior_weights += [LEARNT_WEIGHT] * extra

    def soften(self, factor: float) -> None:
        """Weigh the whole history by `factor` (before a probe, after a long pause): the observed
        positions' priors from the drafter's history too, so the rates stand and only their weight
        falls (the next observations count more; a rate does not drift back to its prior)."""
        self._expected.clear()
        for k in range(self.positions):
            self.seen[k] *= factor
            self.accepted[k] *= factor
            if self._priors is not None and self.seen[k] > 0:
                self._prior_weights[k] *= factor

    def rates(self) -> list[float]:
        """The estimated a_k of every position."""
        out = []
        for k in range(self.positions):
            if self._priors is None:  # the bare prior: a deeper position's never above position 0's rate
                prior, w = (self.prior if k == 0 else min(self.prior, out[0])), self.weight
            else:  # the history: what the drafter did at this depth
                prior, w = self._priors[k], self._prior_weights[k]
            total = self.seen[k] + w  # (0 only once weights underflow after thousands of probes)
            out.append((self.accepted[k] + w * prior) / total if total > 0 else prior)
        return out

    def rate(self, k: int) -> float:
        return self.rates()[k]

    def expected_tokens(self, max_block: int, floor: float = 0.0, hoped: bool = False) -> list[float]:
        """[E(1), E(2), ..., E(max_block)] (`floor`: with every rate at least that, what a probe hopes;
        `hoped`: at the better of these rates and `hopes`, where given: what a probe after an unlucky
        stretch may commit)."""
        key = (max_block, floor, hoped)
        if key in self._expected:
            return self._expected[key]
        rates = self.rates()
        if hoped and self.hopes is not None:
            rates = [max(r, h) for r, h in zip(rates, self.hopes + rates[len(self.hopes) :])]
        rates = [max(floor, r) for r in rates]
        out, reach, total = [], 1.0, 1.0
        for b in range(1, max_block + 1):
            out.append(total)
            reach = reach * rates[b - 1] if b - 1 < len(rates) else 0.0
            total += reach
        self._expected[key] = out
        return out


class SpanOdds:
    """A span source's own odds as its entry's estimate (`expected_tokens(widest)`, e.g. the suffix index's
    probabilities, which it learns from its spans itself: observing and softening here change nothing)."""

    def __init__(self, expected: Callable[[int], list[float]]):
        self._expected = expected

    def expected_tokens(self, max_block: int, floor: float = 0.0, hoped: bool = False) -> list[float]:
        """[E(1), ..., E(max_block)], each position's conditional rate at least `floor` (`hoped`: the odds
        are the source's best guess already)."""
        own = self._expected(max_block)
        out, before, reach, total = [1.0], 1.0, 1.0, 1.0
        for b in range(2, max_block + 1):
            step = own[b - 1] - own[b - 2] if b - 1 < len(own) else 0.0  # P(the first b - 1 drafts accepted)
            rate = step / before if before > 0 else 0.0  # (position b - 1's, given those before it were)
            before = step
            reach *= min(1.0, max(floor, rate))
            total += reach
            out.append(total)
        return out

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    def soften(self, factor: float) -> None:
        pass


def learnt_estimate(positions: int) -> AcceptanceEstimate:
    """A drafter's long-run acceptance (the `priors` of its generations' estimates)."""
    return AcceptanceEstimate(positions, weight=LEARNT_WEIGHT, discount=LEARNT_DISCOUNT)
