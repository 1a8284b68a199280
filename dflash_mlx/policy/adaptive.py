"""The adaptive block: each cycle, the block b that maximises E(b) / T(b), plain decoding included.

E(b) comes from the live acceptance estimate (`estimate`, with the drafter's
long-run history as the prior), T(b) from the calibrated cost curve (`cost`,
`calibration`). Among drafting blocks it takes the largest within
BLOCK_RESOLUTION of the best; from b = 1 it probes a small block now and then
(`ProbeSchedule`, shared with `batch.block_choice`). The loop's own cycle
times refine the curve only with `refine` (the library leaves it off). Why
each rule: docs/adaptive.md.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

from .cost import CostCurve
from .estimate import PRIOR_RATE, AcceptanceEstimate, learnt_estimate

PROBE_BLOCK = 2
PROBE_GAP = 8
MAX_PROBE_GAP = 64
PROBE_SOFTEN = 0.5
PROBE_BUDGET = 0.005  # what failing probes may add to the plain steps' time: the gap is capped by it
BLOCK_RESOLUTION = 0.05  # rates of drafting blocks closer than this are not told apart: the largest is taken


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

    def __init__(self):
        self.idle = 0  # cycles chosen at b = 1 since the last larger block
        self.gap = PROBE_GAP
        self.probing = False  # a probe was chosen and not judged yet
        self.unrun = False  # a probe was chosen and no cycle at a block > 1 has observed acceptance since
        self.due = False  # the next cycle chosen at b = 1 probes (`resume`)

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

    def resume(self) -> None:
        """A new generation takes the schedule over. A probe the last one chose but that observed
        nothing (a pipelined engine chooses the next cycle's block before it sees the reply end; a
        stop token in its first row ends the reply with no verdict on the drafts) is due at the first
        plain cycle: the gap it waited for is not waited for again. A probe whose excursion the last
        generation did not judge stays unjudged."""
        self.due, self.probing, self.unrun = self.unrun, False, False

    def observed(self, paid: bool | None) -> None:
        """A cycle at a block > 1 was judged: it `paid` (for this policy: committed at least what plain
        decoding would have in its time; for the batch's: a draft was accepted), or not (None: not known)."""
        if paid:
            self.gap = PROBE_GAP
        elif paid is not None and self.probing:
            self.gap = min(2 * self.gap, MAX_PROBE_GAP)
        self.probing = False


class AdaptiveBlock:
    def __init__(self, curve: CostCurve, max_block: int, estimate: AcceptanceEstimate | None = None,
                 refine: bool = True):  # fmt: skip
        if max_block < 1:
            raise ValueError(f"max_block must be >= 1, got {max_block}.")
        self.curve = curve
        self.refine = refine
        self.max_block = max_block
        self.estimate = estimate or AcceptanceEstimate(max_block - 1)
        self.probes = ProbeSchedule()
        self.resolution = BLOCK_RESOLUTION  # (0: the plain argmax)
        self._excursion: list[float] | None = None  # [tokens, calibrated seconds] since the last probe
        self._hoping = False  # in an excursion that has not had a draft accepted yet
        self._refined = 0  # cycles that refined the curve
        self._costs: tuple[int, object, list[float]] | None = None  # (_refined, curve, T(1..max_block))
        self._memo: dict[tuple, object] = {}  # answers while the estimate and the curve stand still
        self._memo_state: tuple | None = None

    def _remembered(self, what: str, limit: int, compute):
        """`compute()`, computed again only once the estimate (its version), the curve (refined or
        replaced), the hope or the resolution changed: plain steps observe nothing, so a policy at
        b = 1 asks the same questions every cycle."""
        state = (id(self.estimate), self.estimate.version, id(self.curve), self._refined, self._hoping,
                 self.resolution)  # fmt: skip
        if state != self._memo_state:
            self._memo.clear()
            self._memo_state = state
        key = (what, limit)
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def best(self, limit: int) -> int:
        """The block of b <= limit by E(b) / T(b) (`block_for`)."""
        return self._remembered("best", limit, lambda: self._best(limit))

    def _best(self, limit: int) -> int:
        expected = self.estimate.expected_tokens(min(limit, self.max_block))
        rates = [e / t for e, t in zip(expected, self.costs())]
        return block_for(rates, 0.0 if self._hoping else self.resolution)

    def costs(self) -> list[float]:
        """[T(1), ..., T(max_block)], worked out again only when the curve was refined or replaced."""
        if self._costs is None or self._costs[0] != self._refined or self._costs[1] is not self.curve:
            self._costs = (self._refined, self.curve, [self.curve(b) for b in range(1, self.max_block + 1)])
        return self._costs[2]

    def choose(self, limit: int) -> int:
        limit = min(limit, self.max_block)
        if limit <= 1:
            return 1
        b = self.best(limit)
        if b > 1:
            self.probes.larger()
            return b
        if self._excursion is not None:  # back at plain decoding after a probe: did the excursion pay?
            tokens, seconds = self._excursion
            self.probes.observed(tokens * self.curve(1) >= seconds)
            self._excursion, self._hoping = None, False
        probe, max_gap = self._remembered("probe", limit, lambda: self._probe_and_gap(limit))
        if probe is None or not self.probes.probe_now(max_gap=max_gap):
            return 1
        self.estimate.soften(PROBE_SOFTEN)
        self._excursion, self._hoping = [0.0, 0.0], True
        return probe

    def _probe_and_gap(self, limit: int) -> tuple[int | None, float]:
        """The probe block, and the longest gap between probes (where failing probes cost the budget)."""
        probe = self.probe_block(limit)
        if probe is None:
            return None, math.inf
        affordable = (self.curve(probe) / self.curve(1) - 1) / PROBE_BUDGET
        return probe, max(PROBE_GAP, affordable)

    def probe_block(self, limit: int) -> int | None:
        """The smallest block from PROBE_BLOCK up to `limit` that would beat plain decoding if the drafts
        were accepted as a good drafter's are (each position at least PRIOR_RATE), or None."""
        plain = 1.0 / self.curve(1)
        hoped = [max(PRIOR_RATE, r) for r in self.estimate.rates()]
        expected, reach = 1.0, 1.0
        for b in range(2, limit + 1):
            reach *= hoped[b - 2] if b - 2 < len(hoped) else 0.0
            expected += reach
            if b >= PROBE_BLOCK and expected / self.curve(b) > plain:
                return b
        return None

    def observe(self, block_size: int, accepted: int | None, seconds: float) -> None:
        if self.refine and seconds > 0:
            self.curve.observe(block_size, seconds)
            self._refined += 1
        if block_size > 1 and accepted is not None:  # (b = 1 cycles are observed late when pipelined)
            self.probes.ran()
            self.estimate.observe(block_size - 1, accepted)
            if self._excursion is not None:  # the probe and the larger blocks it led to, judged together
                self._excursion[0] += accepted + 1
                self._excursion[1] += self.curve(block_size)
                self._hoping = self._hoping and not accepted
            elif accepted:
                self.probes.observed(True)  # drafting on its merits: a fresh gap when it next stops


@dataclass
class DrafterHistory:
    """What a drafter's greedy generations pass on to the next: its long-run acceptance (the prior of
    each generation's estimate) and its probe schedule (the gap a useless drafter has earned)."""

    learnt: AcceptanceEstimate
    probes: ProbeSchedule


_histories: dict[int, DrafterHistory] = {}  # id(drafter) -> its history, while the drafter lives
_histories_lock = threading.Lock()


def adaptive_policy(target, proposer, max_block: int, refine: bool = False, carry: bool = False,
                    curve: CostCurve | None = None) -> AdaptiveBlock:  # fmt: skip
    """An adaptive policy for one generation, on this machine's (cached) cost curve.

    `carry`: the generation continues the drafter's history (`DrafterHistory`):
    its estimate starts from the drafter's long-run acceptance (every earlier
    carried generation's cycles) instead of the fixed prior and adds its own
    cycles to it, so a poor drafter starts at b = 1 and a good one at a large
    block, and its probes keep the drafter's schedule (a drafter that failed
    its probes is not probed afresh at every request). The library carries
    only for greedy decoding, whose output no block choice can change.
    `curve`: the setup's curve when the caller has it (else looked up:
    `calibration.cost_curve`).
    """
    from .calibration import cost_curve

    curve = curve if curve is not None else cost_curve(target, proposer, max_block)
    history = drafter_history(getattr(proposer, "drafter", proposer), max_block - 1) if carry else None
    estimate = AcceptanceEstimate(max_block - 1, learnt=history.learnt) if history is not None else None
    # (a curve the policy does not refine is shared, not copied)
    policy = AdaptiveBlock(curve.fresh() if refine else curve, max_block, estimate, refine=refine)
    if history is not None:
        policy.probes = history.probes
        policy.probes.resume()
    return policy


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
            _histories[key] = DrafterHistory(learnt_estimate(positions), ProbeSchedule())
        return _histories[key]
