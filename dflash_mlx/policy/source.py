"""Which source drafts each cycle: a span source's span (a copy from the context), the block policy's choice.

`SpanDrafting` wraps a generation's block policy and a span source (a
proposer that offers drafts only where it has them, `proposers.base.offered`:
today `proposers.lookup.LookupProposer`, what followed the longest earlier
occurrence of the sequence's suffix, a point-mass draft, exact under sampling
too). Each cycle the planner (`dflash_mlx.planner`) asks it for (block,
spans): `spans` True means a cycle verifying the source's span without a
drafter forward; False means the policy's block as usual (the drafter, or
b = 1). With an adaptive policy the choice is by expected tokens per second:

- the lookup's rate at width w is E_l(w) / T_v(w), E_l from the acceptance its
  own cycles have shown (an `AcceptanceEstimate` of its own), T_v(w) the cost
  of a verify of w rows with no drafter forward: T_v(w) = ratio * T(w), T the
  policy's cost model (which prices a DFlash cycle of w rows, drafter forward
  included) and `ratio` learned online from the lookup cycles the engine times
  (their seconds over T(w), a discounted mean of the logs), starting at 1 (a
  lookup cycle cannot cost more than a DFlash one of its width: an upper bound,
  corrected by the first timed lookup cycles). No calibration of its own: the
  ratio is kept beside the cost model (`VerifyRatio`, one per model, shared by
  its generations); greedy generations learn it (their choices cannot change
  their output), sampled ones read it as it is when they start, seeded ones
  keep to the prior (their choices decide their random draws, as the policy's
  frozen curve does).
- the policy's is E(b) / T(b) at its best block (`AdaptiveBlock.best`, plain
  decoding included); the lookup runs where its best width beats it, the
  policy is not asked that cycle (its probes and re-timings wait), and its
  timer does not pair the next cycle with the one before the lookup's.
- a lookup estimate gone low is probed again after PROBE_GAP spans it lost
  (twice as long after each probe that committed no draft, up to MAX_PROBE_GAP):
  a reply that starts copying late still finds out.

With a fixed block (the user's `block_size=N`, a calibration's schedule) there
is no rate to compare: a lookup span fills the block the policy chose (width
<= N) whenever the context has a match, the drafter drafts otherwise. The
width is bounded by the
policy's largest block: the widest verify its cost model prices.
"""

from __future__ import annotations

import math
import threading
import weakref

from ..proposers.base import offered
from .estimate import AcceptanceEstimate

RATIO_DISCOUNT = 0.9  # weight of older lookup cycles' times per new one (about 10 cycles of memory)
RATIO_PRIOR_WEIGHT = 1.0  # pseudo-cycles behind the prior ratio (1: a DFlash cycle's cost)
MIN_RATIO, MAX_RATIO = 0.05, 2.0  # a timing glitch moves the ratio at most this far
PROBE_GAP = 8
MAX_PROBE_GAP = 64
PROBE_SOFTEN = 0.5
RESOLUTION = 0.05  # widths whose rates are this close are not told apart: the widest is taken


class VerifyRatio:
    """T_v(w) / T(w) for one cost model: a discounted mean of timed lookup cycles' log(seconds / T(w))."""

    def __init__(self):
        self._lock = threading.Lock()
        self._log_sum, self._weight = 0.0, RATIO_PRIOR_WEIGHT

    @property
    def value(self) -> float:
        with self._lock:
            return min(MAX_RATIO, max(MIN_RATIO, math.exp(self._log_sum / self._weight)))

    def observe(self, log_ratio: float) -> None:
        with self._lock:
            self._log_sum = RATIO_DISCOUNT * self._log_sum + log_ratio
            self._weight = RATIO_DISCOUNT * self._weight + 1.0


_ratios: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cost model -> its VerifyRatio
_ratios_lock = threading.Lock()


def verify_ratio(cost) -> VerifyRatio:
    """The ratio kept beside `cost` (a cost model), made at first use and dropped with it."""
    with _ratios_lock:
        if cost not in _ratios:
            _ratios[cost] = VerifyRatio()
        return _ratios[cost]


class SpanDrafting:
    def __init__(self, policy, source, *, learns: bool = False, shared: bool = True):
        """`policy`: the generation's block policy; `source`: the span source, in step with the committed
        tokens (the planner commits them to it); `learns`: the timed span cycles teach the cost model's
        ratio (greedy generations); `shared`: start from that ratio (else from the prior, which stays)."""
        self.policy = policy
        self.source = source
        self.max_width = policy.max_block
        self.adaptive = callable(getattr(policy, "best", None)) and callable(getattr(policy, "rate", None))
        timer = getattr(policy, "timer", None) if self.adaptive else None
        self._timer = timer
        self._shared = verify_ratio(policy.cost) if self.adaptive and shared else None
        self.learns = learns and timer is not None and self._shared is not None
        self.ratio = self._shared.value if self._shared is not None else 1.0  # T_v(w) / T(w)
        self.estimate = AcceptanceEstimate(max(0, self.max_width - 1))
        self.gap, self._lost, self._probing = PROBE_GAP, 0, False

    def may_fire(self) -> bool:
        """Whether the cycle after the next token is worth reading that token first for (plain steps are
        otherwise built on the token unread, pipelined): the sequence's end matches earlier context (a
        copy may be under way), and a span would be run (the lookup's best rate beats the policy's, or a
        probe is due). Outside a match, a copy starting is found at most two tokens late."""
        if self.max_width < 2 or not offered(self.source, self.max_width - 1):
            return False
        widest = self.max_width
        if not self.adaptive or self._best_width(widest)[1] > self.policy.rate(self.policy.best(widest)):
            return True
        self._lost += 1  # (a match passed by: towards the next probe, which reads the token)
        return self._lost + 1 >= self.gap

    def choose(self, limit: int) -> tuple[int, bool]:
        """(block, spans) for the next cycle with at most `limit` rows: True, a span of block - 1 tokens
        from the source, or False and the policy's block."""
        span = offered(self.source, min(limit, self.max_width) - 1) if limit > 1 else 0
        if not span:
            return self.policy.choose(limit), False
        if not self.adaptive:  # a fixed block: the span fills it
            b = self.policy.choose(limit)
            return (min(b, span + 1), True) if b > 1 else (1, False)
        width, rate = self._best_width(span + 1)
        if rate > self.policy.rate(self.policy.best(limit)):
            self._lost = 0
            return width, True
        self._lost += 1
        if self._lost < self.gap:
            return self.policy.choose(limit), False
        self._lost, self._probing = 0, True  # a probe: the estimate may be stale (the reply began copying)
        self.estimate.soften(PROBE_SOFTEN)
        width, _ = self._best_width(span + 1)
        return width, True

    def _best_width(self, widest: int) -> tuple[int, float]:
        """The lookup width in 2..widest with the best expected rate (the widest within RESOLUTION of it)."""
        expected = self.estimate.expected_tokens(widest)
        cost, ratio = self.policy.cost, self.ratio
        rates = [expected[w - 1] / (ratio * cost(w)) for w in range(2, widest + 1)]
        top = max(rates)
        width = max(w for w in range(2, widest + 1) if rates[w - 2] >= top * (1 - RESOLUTION))
        return width, top

    def observe(self, width: int, accepted: int | None, seconds: float | None) -> None:
        """A lookup cycle of `width` rows committed `accepted` drafts (None: cut by a stop token) in
        `seconds` on the engine's side (None: not its own)."""
        if self._timer is not None:
            self._timer.break_run()  # the next policy cycle takes in this one's context rows: not a run's
        if accepted is not None:
            self.estimate.observe(width - 1, accepted)
            if self._probing:
                self.gap = PROBE_GAP if accepted else min(2 * self.gap, MAX_PROBE_GAP)
            elif accepted:
                self.gap = PROBE_GAP
            self._probing = False
        if self.learns and seconds is not None and seconds > 0:
            self._shared.observe(math.log(seconds / self.policy.cost(width)))
            self.ratio = self._shared.value
