"""Which source drafts each cycle: a span source's span (a copy from the context), the block policy's choice.

`SpanDrafting` wraps a generation's block policy and a span source (a
proposer that offers drafts only where it has them, `proposers.base.offered`:
today `proposers.lookup.LookupProposer`, what followed the longest earlier
occurrence of the sequence's suffix, a point-mass draft, exact under sampling
too; or `proposers.suffix.SuffixProposer`, what earlier generations produced
after the same suffix). `SpanChoice` holds one per span source; each cycle the
planner (`dflash_mlx.planner`) asks it for (block, source): a source means a
cycle verifying that source's span without a drafter forward; None means the
policy's block as usual (the drafter, or b = 1). With an adaptive policy the
choice is by expected tokens per second (the best source's span, where it
beats the policy's block):

- the lookup's rate at width w is E_l(w) / T_v(w), E_l from the acceptance its
  own cycles have shown (an `AcceptanceEstimate` of its own; a source that
  knows better gives its own, `expected_tokens`: the suffix index's
  probabilities, learnt across generations), T_v(w) the cost
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

    def offer(self, limit: int) -> int:
        """The drafts its source offers for a cycle of at most `limit` rows (0: none)."""
        return offered(self.source, min(limit, self.max_width) - 1) if limit > 1 else 0

    def bid(self, span: int, floor: float) -> tuple[int, float] | None:
        """Its best width for a span of `span` drafts and that width's rate, where the rate beats `floor`
        (the policy's best); else None (a loss, towards its next probe), or once a probe is due the width
        and rate 0 (it runs where no source beats the policy)."""
        width, rate = self._best_width(span + 1)
        if rate > floor:
            return width, rate
        self._lost += 1
        return (width, 0.0) if self._lost >= self.gap else None

    def take(self, span: int, probe: bool) -> int:
        """Its span of `span` drafts runs next: the width (`probe`: a probe, its estimate softened first,
        as it may be stale: the reply began copying)."""
        self._lost = 0
        if probe:
            self._probing = True
            self.estimate.soften(PROBE_SOFTEN)
        return self._best_width(span + 1)[0]

    def expected_tokens(self, widest: int) -> list[float]:
        """[E(1), ..., E(widest)] of its span: the source's own (`expected_tokens`: the suffix index's
        probabilities, learnt across generations) where it gives one, else its cycles' acceptance so far."""
        own = getattr(self.source, "expected_tokens", None)
        return own(widest) if own is not None else self.estimate.expected_tokens(widest)

    def _best_width(self, widest: int) -> tuple[int, float]:
        """The lookup width in 2..widest with the best expected rate (the widest within RESOLUTION of it)."""
        expected = self.expected_tokens(widest)
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


class SpanChoice:
    """Several span sources against the block policy (one `SpanDrafting` each: its estimate, probes).

    Each cycle, among the sources offering a span, the span with the best rate where it beats the policy's
    best block (a source due a probe runs where none does), else the policy's block; with a fixed block the
    first source offering a span fills it. A batch row (`span_at`) takes the span expected to commit the
    most tokens at its width where that beats its drafter's block at the same width (the step's cost is the
    same for both)."""

    def __init__(self, policy, sources: list, *, learns: bool = False, shared: bool = True):
        self.policy = policy
        self.drafting = [SpanDrafting(policy, s, learns=learns, shared=shared) for s in sources]

    def may_fire(self) -> bool:
        """Whether some source may run a span after the next token (`SpanDrafting.may_fire`, asked of each)."""
        return any([d.may_fire() for d in self.drafting])

    def choose(self, limit: int) -> tuple[int, object | None]:
        """(block, the span source drafting it, or None for the policy's block) for at most `limit` rows."""
        offers = [(d, n) for d in self.drafting if (n := d.offer(limit))]
        if not offers:
            return self.policy.choose(limit), None
        if not self.drafting[0].adaptive:  # a fixed block: the first span fills it
            b = self.policy.choose(limit)
            return (min(b, offers[0][1] + 1), offers[0][0].source) if b > 1 else (1, None)
        floor = self.policy.rate(self.policy.best(limit))
        bids = [(bid[1], k) for k, (d, n) in enumerate(offers) if (bid := d.bid(n, floor)) is not None]
        if not bids:
            return self.policy.choose(limit), None
        rate, k = max(bids, key=lambda bid: (bid[0], -bid[1]))  # (a tie: the first source)
        d, n = offers[k]
        return d.take(n, probe=rate <= floor), d.source

    def span_at(self, cap: int, drafter_tokens: float | None) -> tuple[int, object] | None:
        """(width, source) of a batch row's span at its width `cap`, or None for its drafter's block:
        `drafter_tokens`, what that block is expected to commit (None: any span is taken)."""
        best = None
        for d in self.drafting:
            n = offered(d.source, cap - 1)
            if n and (expected := d.expected_tokens(n + 1)[-1]) > (best[0] if best else -1.0):
                best = (expected, n, d.source)
        if best is None or (drafter_tokens is not None and best[0] < drafter_tokens):
            return None
        return best[1] + 1, best[2]

    def observe(self, source, width: int, accepted: int | None, seconds: float | None) -> None:
        """A cycle verifying `source`'s span (`SpanDrafting.observe`)."""
        next(d for d in self.drafting if d.source is source).observe(width, accepted, seconds)
