"""The block-size policy on its own: acceptance estimates, the cost table, the adaptive choice.

No model runs here: cycles are simulated by telling the policy what a cycle
at block b would have accepted (a fixed per-position acceptance pattern) and
how long it took (a cost table, or none: the policy's own curve frozen).
"""

from __future__ import annotations

import math
import random

import pytest

from dflash_mlx.policy import FixedBlock
from dflash_mlx.policy.adaptive import RECENT_GENERATIONS, AdaptiveBlock, DrafterHistory, adaptive_policy
from dflash_mlx.policy.base import BlockPolicy, ScheduledBlocks
from dflash_mlx.policy.choice import BUDGET, RESOLUTION, Choice, Source
from dflash_mlx.policy.cost import WINDOW, CostModel, CostTable
from dflash_mlx.policy.estimate import PRIOR_RATE, AcceptanceEstimate, learnt_estimate

FLAT = CostTable.curve([1, 2, 4, 8, 16], [0.010, 0.0105, 0.011, 0.012, 0.014])  # memory-bound: rows are cheap
MODERATE = CostTable.curve([1, 2, 4, 8, 16], [0.010, 0.0125, 0.0175, 0.0275, 0.0475])  # each row: a quarter forward
STEEP = CostTable.curve([1, 2, 4, 8, 16], [0.010, 0.019, 0.037, 0.073, 0.145])  # compute-bound: rows cost ~linearly
# A small target on a CPU: drafting costs a forward of its own, rows beyond it little (the synthetic pair).
DRAFTING_COSTS = CostTable.curve([1, 2, 3, 4, 6, 8], [0.0063, 0.0117, 0.0118, 0.0118, 0.0126, 0.0136])
# Rows cost as much as forwards (4-bit matmuls on a CPU): no block can beat plain decoding.
NO_BLOCK_PAYS = CostTable.curve([1, 2, 3, 4, 5], [0.0080, 0.0171, 0.0267, 0.0346, 0.0405])


def simulate(policy, rates, cycles: int, seed: int = 0, limit: int = 10**9, times=None):
    """Run `cycles` simulated cycles where draft k is accepted with probability rates[k] (given the
    earlier ones were), each taking times(b) seconds (None: not timed); return the blocks chosen."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(cycles):
        b = policy.choose(limit)
        accepted = 0
        while accepted < b - 1 and rng.random() < rates[min(accepted, len(rates) - 1)]:
            accepted += 1
        policy.observe(b, accepted, times(b) if times is not None else None)
        chosen.append(b)
    return chosen


def test_policies_have_the_engine_interface():
    for policy in (FixedBlock(4), ScheduledBlocks([1, 2]), AdaptiveBlock(FLAT, 16)):
        assert isinstance(policy, BlockPolicy)


def test_fixed_block_is_capped_by_the_limit_and_checks_its_value():
    assert FixedBlock(8).choose(100) == 8 and FixedBlock(8).choose(3) == 3 and FixedBlock(8).choose(0) == 1
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="block_size must be >= 1"):
            FixedBlock(bad)


def test_expected_tokens_follow_the_product_formula():
    est = AcceptanceEstimate(3, prior=0.5, weight=1.0)
    assert est.expected_tokens(4) == pytest.approx([1, 1.5, 1.75, 1.875])
    for _ in range(200):  # position 0 always accepted, position 1 never
        est.observe(drafted=3, accepted=1)
    e = est.expected_tokens(4)
    assert est.rate(0) > 0.95 and est.rate(1) < 0.05
    assert est.rate(2) == pytest.approx(0.5)  # never observed: its prior (position 1's rejections are its own)
    assert e[1] == pytest.approx(1 + est.rate(0)) and e[3] - e[2] < 0.02
    assert est.expected_tokens(10)[4:] == [e[3]] * 6  # no positions past the drafter's block


def test_deeper_priors_are_capped_by_the_first_position():
    est = AcceptanceEstimate(4)
    est.observe(drafted=4, accepted=1)  # one early cycle: the first draft kept, the second rejected
    assert est.rate(1) < 0.3 and est.rate(2) == pytest.approx(PRIOR_RATE)  # one rejection lowers its position only
    for _ in range(30):
        est.observe(drafted=4, accepted=0)
    assert est.rate(0) < 0.05 and est.rate(3) == pytest.approx(est.rate(0))  # rejected first: no deep runs credited


def test_recent_cycles_weigh_most():
    est = AcceptanceEstimate(1)
    for _ in range(50):
        est.observe(1, 1)
    for _ in range(40):
        est.observe(1, 0)
    assert est.rate(0) < 0.2  # forty recent rejections outweigh fifty older acceptances


def test_a_perfect_drafter_gets_a_large_block():
    assert set(simulate(AdaptiveBlock(FLAT, 16), [1.0], 100)[10:]) == {16}
    assert min(simulate(AdaptiveBlock(MODERATE, 16), [1.0], 100)[10:]) >= 8


def test_plain_decoding_wins_when_rows_cost_a_forward_each():
    chosen = simulate(AdaptiveBlock(STEEP, 16), [0.6], 300)
    assert chosen[-100:].count(1) > 90


def gap(curve: CostTable, probe: int, tokens: float = 1.0) -> float:
    """Plain cycles between probes of block `probe` on a frozen curve, each expected to commit `tokens`
    (its estimate's E; a useless drafter's, about 1): their expected loss is BUDGET of the time."""
    return max(WINDOW, (curve(probe) - tokens * curve(1)) / (BUDGET * curve(1)))


def test_a_useless_drafter_falls_back_to_plain_decoding_and_probes_rarely():
    policy = AdaptiveBlock(FLAT, 16)
    chosen = simulate(policy, [0.0], 2000)
    first_plain = chosen.index(1)
    assert first_plain <= 16  # a handful of cycles to learn it (rows are almost free on this curve)
    later = chosen[first_plain:]
    probes = [b for a, b in zip(later, later[1:]) if a == 1 and b > 1]  # leaving plain decoding
    assert set(probes) == {2}  # the narrowest block that would pay at a good drafter's acceptance
    assert len(probes) <= len(later) / gap(FLAT, 2) + 2
    extra = sum(FLAT(b) - FLAT(1) for b in later) / (len(later) * FLAT(1))
    assert extra < 2 * BUDGET  # (a probe that accepts a draft is followed by the block it then earns)


def test_recovered_acceptance_is_noticed_from_plain_decoding():
    policy = AdaptiveBlock(FLAT, 16)
    simulate(policy, [0.0], 500)
    chosen = simulate(policy, [0.95], 200, seed=1)
    switch = next(i for i, b in enumerate(chosen) if b > 2)
    assert switch <= gap(FLAT, 2) + 2  # at most one probe's wait
    assert sum(b == 16 for b in chosen[switch + 20 :]) > 0.8 * len(chosen[switch + 20 :])


def test_medium_acceptance_picks_a_medium_block_when_rows_cost():
    policy = AdaptiveBlock(MODERATE, 16)
    chosen = simulate(policy, [0.7], 400)
    middle = sorted(chosen[50:])[len(chosen[50:]) // 2]
    assert 2 <= middle <= 6  # E(b)/T(b) peaks early when each row costs almost a full forward


def test_the_widest_width_near_the_best_rate_is_taken_and_plain_decoding_wins_ties():
    choice = Choice(CostModel(FLAT, learns=False), Source("target"))
    drafter = Source("drafter", AcceptanceEstimate(15, weight=0.0))
    drafter.estimate.seen, drafter.estimate.accepted = [100.0] * 15, [100.0] * 2 + [0.0] * 13
    rates = {b: choice.rate(drafter, b) for b in range(2, 17)}  # E(b) = 3 from b = 3 on, rows cost a little
    b, top = choice.best_width(drafter, 16)
    assert top == max(rates.values()) == rates[3]
    assert b == max(w for w, r in rates.items() if r >= (1 - RESOLUTION) * top) > 3
    tie = Choice(CostModel(CostTable.curve([1, 2], [0.01, 0.02]), learns=False), Source("target"))
    even = Source("drafter", AcceptanceEstimate(1, weight=0.0))
    even.estimate.seen, even.estimate.accepted = [100.0], [100.0]  # 2 tokens in twice the time
    assert tie.best([(tie.plain, 1), (even, 2)])[0] is tie.plain


def test_a_deep_draft_accepted_less_often_does_not_shorten_the_block_for_a_saving_the_curve_cannot_resolve():
    # the demo pair's calibration on the project's CPU: b = 6 and 7 look 6% and 3% cheaper than b = 8
    demo = CostTable.curve([1, 2, 3, 4, 6, 8], [0.00489, 0.00736, 0.00764, 0.00792, 0.00848, 0.00904])

    def policy_with(rates):
        policy = AdaptiveBlock(demo, 8, estimate=AcceptanceEstimate(7, weight=0.0))
        policy.estimate.seen = [100.0] * 7
        policy.estimate.accepted = [100.0 * r for r in rates]
        return policy

    policy = policy_with([0.95] * 6 + [0.15])  # the last draft is seldom right: b = 7 looks 1% better
    rate = [e / demo(b) for b, e in enumerate(policy.estimate.expected_tokens(8), 1)]
    assert max(range(8), key=rate.__getitem__) == 6 and rate[7] > (1 - RESOLUTION) * rate[6]
    assert policy.choose(8) == 8
    # the last two drafts never right: E(6) = E(7) = E(8), so b = 6 is the best, b = 7 (3.3% dearer) is
    # within the resolution and taken, b = 8 (6.6% dearer) is not
    assert policy_with([0.95] * 5 + [0.0, 0.0]).choose(8) == 7


def test_the_limit_and_the_maximum_bound_every_choice():
    policy = AdaptiveBlock(FLAT, 6)
    assert max(simulate(policy, [1.0], 50)) == 6
    assert max(simulate(policy, [1.0], 50, limit=3)) == 3
    assert AdaptiveBlock(FLAT, 6).choose(1) == 1


def test_the_prior_is_optimistic():
    assert AdaptiveBlock(FLAT, 16).choose(100) > 8 and PRIOR_RATE >= 0.5


def generation(curve, history: DrafterHistory | None, max_block=8):
    """The policy of one greedy generation carrying the drafter's `history` (or none), on a frozen curve."""
    if history is None:
        return AdaptiveBlock(curve, max_block)
    priors, observed, idle, due = history.begin(max_block - 1)
    estimate = AcceptanceEstimate(
        max_block - 1, priors=priors, record=history.record, hopes=priors if observed else None
    )
    policy = AdaptiveBlock(curve, max_block, estimate, history)
    policy.drafter.idle, policy.drafter.due = idle, due
    return policy


def test_a_drafters_history_is_the_next_generations_prior():
    history = DrafterHistory(7)
    simulate(generation(DRAFTING_COSTS, history), [0.9], 40)  # usually right
    assert history.learnt.rate(0) > 0.8
    for h in (history, None):  # a short reply whose first cycle rejects every draft
        policy = generation(DRAFTING_COSTS, h)
        assert policy.choose(100) == 8
        policy.observe(8, 0, None)
        # with the history one rejection is one cycle among many; from the bare prior it is all there is
        assert policy.choose(100) == (8 if h is not None else 1)


def test_one_unlucky_first_cycle_does_not_turn_a_fresh_history():
    """A process's first reply with a trained drafter whose first cycle rejects every draft (the synthetic
    pair's weakest prompt: 1, 2, 2, 3 tokens per cycle at b = 8) keeps drafting, and so does the next reply:
    the generation's own cycles count once, not also through the history's live rates."""
    history = DrafterHistory(7)
    first = generation(DRAFTING_COSTS, history)
    chosen = []
    for accepted in (0, 1, 1, 2):
        chosen.append(first.choose(100))
        first.observe(chosen[-1], accepted, None)
    assert chosen[0] == 8 and min(chosen) > 1
    assert generation(DRAFTING_COSTS, history).choose(100) > 1


def test_a_failed_probe_is_not_followed_by_a_larger_block():
    """A process's first reply with a drafter that is always wrong (`dflash-mlx generate` off distribution):
    once at b = 1, only its probes draft, each at the narrowest block that would pay, and each alone."""
    policy = generation(DRAFTING_COSTS, DrafterHistory(7))
    chosen = simulate(policy, [0.0], 400)
    plain = chosen.index(1)
    probes = [b for b in chosen[plain:] if b > 1]
    assert plain <= 5 and probes and set(probes) == {3}
    assert all(b == 1 for a, b in zip(chosen[plain:], chosen[plain + 1 :]) if a > 1)
    assert len(probes) <= (400 - plain) / gap(DRAFTING_COSTS, 3, policy.drafter.expected(3)) + 1


def test_softening_keeps_the_rates_and_lowers_their_weight():
    priors = learnt_estimate(7).rates()
    softened, kept = (AcceptanceEstimate(7, priors=priors) for _ in range(2))
    for est in (softened, kept):
        for accepted in (0, 2, 0):
            est.observe(7, accepted)
    softened.soften(0.5)
    assert softened.rates() == pytest.approx(kept.rates())  # the observed positions and the unobserved ones
    for est in (softened, kept):
        est.observe(7, 0)
    assert softened.rate(0) < kept.rate(0) - 0.02  # the next observation counts more


def test_a_drafter_usually_wrong_starts_the_next_generation_plainly():
    history = DrafterHistory(7)
    simulate(generation(DRAFTING_COSTS, history), [0.0], 40)
    policy = generation(DRAFTING_COSTS, history)
    assert policy.best(100) == 1
    # (one probe first: the last reply may have been one the drafter does not fit, see below)
    assert policy.choose(100) == 3 and policy.observe(3, 0, None) is None and policy.choose(100) == 1
    assert generation(DRAFTING_COSTS, None).choose(100) == 8  # the bare prior is optimistic
    # the history learnt from the cycles it took to give up (a fresh history starts at the prior)
    assert history.learnt.seen[0] >= 2 and learnt_estimate(7).rate(0) == pytest.approx(PRIOR_RATE)


def test_one_reply_off_distribution_does_not_keep_the_next_one_plain():
    """After a reply the drafter does not fit (a story), the next reply it fits (GSM8K) probes at its first
    plain cycle and drafts soon after, where it would have waited a probe's wait at b = 1; a drafter that has
    not paid for RECENT_GENERATIONS generations keeps its wait (it is not probed afresh at every request)."""
    history = DrafterHistory(7)
    simulate(generation(DRAFTING_COSTS, history), [0.0], 128)  # a process's first reply is a story: plain
    chosen = simulate(generation(DRAFTING_COSTS, history), [0.95], 30)
    assert chosen[0] > 1  # a probe at the first plain cycle (then another: the first paid)
    assert all(b >= 6 for b in chosen[4:])
    useless = DrafterHistory(7)
    for _ in range(RECENT_GENERATIONS + 1):
        simulate(generation(DRAFTING_COSTS, useless), [0.0], 200)
    assert simulate(generation(DRAFTING_COSTS, useless), [0.0], WINDOW) == [1] * WINDOW


def test_one_lucky_cycle_does_not_make_a_generation_in_which_drafting_paid():
    """Sampled drafts are accepted with odds: a drafter that loses in every generation, yet has one cycle in
    each that committed more than plain decoding would have, starts a generation with its probe wait once
    RECENT_GENERATIONS generations lost (drafting paid in a generation when its cycles together did)."""
    history = DrafterHistory(7)
    for _ in range(RECENT_GENERATIONS + 1):
        policy = generation(DRAFTING_COSTS, history)
        for accepted in (7, 0, 0, 0, 0, 0, 0):  # one cycle of 8 tokens (plain: 2.2 in its time), six of 1
            policy.observe(8, accepted, None)
        assert policy.drafter.gain < 0 < 8 - DRAFTING_COSTS(8) / DRAFTING_COSTS(1)
        simulate(policy, [0.0], 40)
    assert not history.paid and history.unpaid >= RECENT_GENERATIONS - 1
    assert simulate(generation(DRAFTING_COSTS, history), [0.0], WINDOW) == [1] * WINDOW
    # a generation whose drafting paid in sum, by more than its odds explain, starts the next with a probe
    policy = generation(DRAFTING_COSTS, history)
    for accepted in (7, 7, 0):
        policy.observe(8, accepted, None)
    assert policy.drafter.paid and history.paid and generation(DRAFTING_COSTS, history).choose(100) > 1


def test_a_lucky_probe_at_odds_that_lose_is_not_pay():
    """A sampled drafter accepting about half its drafts loses to plain decoding at every width; a probe of
    two cycles that commit all their tokens (odds of 1 in 20) is ahead of plain decoding, yet not pay: what
    its cycles commit varies by more than that at those odds."""
    policy = AdaptiveBlock(DRAFTING_COSTS, 8, estimate=AcceptanceEstimate(7, weight=0.0))
    policy.estimate.seen = [100.0] * 7
    policy.estimate.accepted = [45.0] * 7
    assert policy.best(8) == 1
    for _ in range(2):
        policy.observe(3, 2, None)
    assert policy.drafter.gain > 0 and not policy.drafter.paid
    for _ in range(8):  # as many more: no longer luck at these odds
        policy.observe(3, 2, None)
    assert policy.drafter.paid


def test_a_lucky_probe_is_not_followed_by_another_at_once():
    """A probe that paid makes its source due again at once (its acceptance may have recovered): paid by more
    than its odds explain, as a generation's drafting is. At odds that lose (about half its drafts accepted),
    a probe at b = 3 that commits all three tokens is luck, and the next probe waits; a drafter that recovered
    (every draft of a wide probe accepted where its estimate expected almost none) is probed again at once."""
    for rate, width, accepted, due in ((45.0, 3, 2, False), (2.0, 8, 7, True)):
        policy = AdaptiveBlock(CostModel(DRAFTING_COSTS), 8, estimate=AcceptanceEstimate(7, weight=0.0))
        policy.estimate.seen, policy.estimate.accepted = [100.0] * 7, [rate] * 7
        policy.drafter.probing = True  # (a probe of it was chosen)
        policy.observe(width, accepted, None)
        assert policy.drafter.due is due and (policy.drafter.gain > 0)


def test_generations_at_once_each_count_with_their_own_sum():
    """Generations may run at once (a server's rows): drafting paid if it paid, in sum, in any generation that
    ran since the latest began, whichever kept its state last; a lead taken early and lost later is no pay."""
    history = DrafterHistory(7)
    for _ in range(RECENT_GENERATIONS + 1):  # a drafter that has not paid for a while: no probe at once
        simulate(generation(DRAFTING_COSTS, history), [0.0], 40)
    paying, idle = generation(DRAFTING_COSTS, history), generation(DRAFTING_COSTS, history)
    for accepted in (7, 7, 0):
        paying.observe(8, accepted, None)
    idle.observe(1, 0, None)  # kept last, having drafted nothing
    assert history.paid and generation(DRAFTING_COSTS, history).choose(100) > 1
    lost = generation(DRAFTING_COSTS, history)
    lost.observe(8, 7, None)  # ahead after one cycle,
    assert history.paid
    for _ in range(6):
        lost.observe(8, 0, None)  # behind after seven
    assert not history.paid


def test_no_probes_where_no_block_can_pay_on_a_frozen_curve():
    policy = AdaptiveBlock(NO_BLOCK_PAYS, 5)
    probe_width = policy.choice.probe_width
    assert probe_width(policy.drafter, 5, policy.rate(1)) == (2, False)  # hopeless: a probe for its time alone
    assert set(simulate(policy, [1.0], 300)) == {1}  # even a perfect drafter: b / T(b) < 1 / T(1), never timed
    # the probe is the smallest block that would pay at a good drafter's acceptance
    jump = AdaptiveBlock(CostTable.curve([1, 2, 4], [0.010, 0.021, 0.022]), 4)  # drafting costs a forward
    assert jump.choice.probe_width(jump.drafter, 4, jump.rate(1)) == (3, True)
    assert jump.choice.probe_width(jump.drafter, 2, jump.rate(1)) == (2, False)


def test_greedy_generations_continue_the_drafters_probe_schedule():
    class Drafter:  # any weakly referenceable drafter
        pass

    drafter = Drafter()
    first = adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS)
    simulate(first, [0.0], 600)  # useless: its probes fail
    for _ in range(RECENT_GENERATIONS):  # (the next few probe at their first plain cycle)
        simulate(adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS), [0.0], 100)
    wait = gap(DRAFTING_COSTS, 3)
    replies = [
        simulate(adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS), [0.0], 16) for _ in range(40)
    ]
    assert adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS).history is first.history
    probes = sum(b > 1 for reply in replies for b in reply)  # short replies: the wait goes on across them
    assert 640 / wait - 2 <= probes <= 640 / wait + 1
    # where a probe costs little more than a plain step, the wait is short: a drafter turning good is found
    cheap = [adaptive_policy(None, drafter, 8, carry=True, cost=FLAT) for _ in range(2)]
    assert sum(b > 1 for b in simulate(cheap[0], [0.0], 64)) >= 64 // gap(FLAT, 2) - 1
    assert min(simulate(cheap[1], [0.95], 40)[-10:]) > 1
    fresh = adaptive_policy(None, drafter, 16, cost=FLAT)  # not carried: afresh
    assert fresh.history is None and fresh.drafter.idle == 0
    assert adaptive_policy(None, Drafter(), 16, carry=True, cost=FLAT).choose(100) > 8  # another drafter


def test_a_probe_times_its_source_where_the_model_learns():
    """A drafter's first block after plain steps is not timed (it takes in their rows): a probe runs one more
    cycle, so each probe measures the drafter's cost with its acceptance (a level timed before another job
    started would misjudge every later probe's loss). A frozen curve times nothing: a probe is one cycle."""
    for model, length in ((CostModel(DRAFTING_COSTS), 2), (DRAFTING_COSTS, 1)):
        policy = AdaptiveBlock(model, 8)
        chosen = simulate(policy, [0.0], 3000, times=DRAFTING_COSTS)[200:]
        runs = "".join("d" if b > 1 else "." for b in chosen).split(".")
        assert {len(r) for r in runs if r} == {length}


def test_a_span_sources_acceptance_is_carried_as_its_drafters_is():
    """The copy index's spans are accepted as often as the target follows its context (a sampled reply
    seldom repeats one): carried generations start a span source from its long-run rates, per kind (greedy,
    sampled); a generation that carries nothing (seeded), and another source, from the prior."""

    class Drafter:
        pass

    drafter = Drafter()
    first = adaptive_policy(None, drafter, 8, carry=True, cost=FLAT, sampled=True)
    spans = first.span_source("lookup")
    for _ in range(30):
        first.observe_source(spans, 8, 0, None)
    carried = adaptive_policy(None, drafter, 8, carry=True, cost=FLAT, sampled=True).span_source("lookup")
    assert carried.estimate.rate(0) < 0.2 and carried.expected(8, hoped=True) < 1.3
    for fresh in (
        adaptive_policy(None, drafter, 8, carry=True, cost=FLAT).span_source("lookup"),  # greedy
        adaptive_policy(None, drafter, 8, cost=FLAT, sampled=True).span_source("lookup"),  # not carried
        adaptive_policy(None, drafter, 8, carry=True, cost=FLAT, sampled=True).span_source("suffix"),
    ):
        assert fresh.estimate.rate(0) == pytest.approx(PRIOR_RATE)


def test_a_probe_that_observed_nothing_runs_at_the_next_generations_first_plain_cycle():
    class Drafter:
        pass

    drafter = Drafter()
    for _ in range(RECENT_GENERATIONS + 1):  # useless for long enough that a generation starts with its wait
        simulate(adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS), [0.0], 40)
    first = adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS)
    plain = 0
    while first.choose(100) == 1:  # the reply ends; the pipelined engine has chosen a probe it never runs
        plain += 1
    assert plain >= WINDOW - 1
    second = adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS)
    probe = second.choose(100)
    assert probe > 1  # the probe, at once: the wait was waited for already
    second.observe(probe, None, None)  # a stop token in its first row: no verdict
    second = adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS)
    assert second.choose(100) == probe  # so it is still due
    # a probe that ran (and failed) before its generation ended is not run again at the next one's start
    second.observe(probe, 0, None)
    third = adaptive_policy(None, drafter, 8, carry=True, cost=DRAFTING_COSTS)
    assert [third.choose(100) for _ in range(WINDOW)] == [1] * WINDOW


def test_a_probe_that_does_not_pay_waits_for_its_expected_loss_to_keep_to_the_budget():
    # drafting costs half a forward, rows are cheap: a drafter accepting 30% of first drafts does not pay
    demo_like = CostTable.curve([1, 2, 3, 4, 6, 8], [0.0070, 0.0106, 0.0110, 0.0113, 0.0120, 0.0128])
    policy = AdaptiveBlock(demo_like, 8)
    chosen = simulate(policy, [0.3, 0.0], 1000)  # its probes often accept a draft, yet plain decoding is better
    probes = sum(b > 1 for b in chosen[100:])
    expected = policy.drafter.expected(2)  # (above 1: a probe closer to paying is worth running more often)
    # (a probe that paid, 30% of them, is followed by another at once)
    assert gap(demo_like, 2, expected) < gap(demo_like, 2) and probes <= 900 / gap(demo_like, 2, expected) / 0.7 + 4
    # 4-bit rows on a CPU: a block of 5 pays only if all 4 drafts are accepted, not at a good drafter's rate
    steep = AdaptiveBlock(CostTable.curve([1, 2, 3, 4, 5], [0.0084, 0.0187, 0.0249, 0.0310, 0.0372]), 5)
    assert steep.choice.probe_width(steep.drafter, 5, steep.rate(1)) == (2, False)
    assert set(simulate(steep, [0.9], 300)) == {1}


def test_every_constant_of_the_policy_is_listed_in_the_docs_with_its_reason():
    """docs/adaptive.md's table lists each module-level upper-case name of dflash_mlx/policy/ (but `FORMAT`, a
    file version), with its value and why, and there are fewer than the 51 the policy had before."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    names = set()
    for path in (root / "dflash_mlx" / "policy").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Name) and t.id.isupper():
                        names.add(t.id)
    names.discard("FORMAT")
    doc = (root / "docs" / "adaptive.md").read_text()
    table = doc[doc.index("## The constants") :]
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")}
    assert rows == names and len(names) < 51
    assert f"{len(names)}, where there were 51" in " ".join(table.split())


def test_a_source_chosen_is_no_longer_due_for_a_probe():
    """A probe that paid makes its source due at its next chance; chosen as the best instead, it runs, and a
    probe of it is no longer due: it must not pre-empt the next source that beats it (traced in `bench.py load
    --scenario run`: after the load stopped, each copy-index span the rule chose was replaced by a two-cycle
    probe of the drafter at b3, for 40-66 cycles of a window)."""
    policy = AdaptiveBlock(FLAT, 8)
    policy.drafter.due = True
    assert policy.choose(8) == 8
    assert not policy.drafter.due
    span = policy.span_source("lookup")
    span.estimate.seen = [100.0] * 7
    span.estimate.accepted = [100.0] * 7  # a span always accepted: the best source when offered
    src, width = policy.choose_from(8, [(span, 8)])
    assert src is span and width == 8


class _Drafter:
    """A drafter the planner only plans for (its drafts are never asked here)."""

    layer_ids = ()


class _Copies:
    """A span source that offers a span of every width asked, counting how often it is asked."""

    name = "copies"
    layer_ids = ()

    def __init__(self):
        self.asked = 0

    def offer(self, count: int) -> int:
        self.asked += 1
        return count


def _span_run(
    cost, cycles: int, seed: int = 0, slower_after: int | None = None, odds=None
) -> tuple[list[str], list[bool], int]:
    """A generation whose drafter and span source both lose (each draft rejected) on a quiet machine, run
    through the planner as the engine runs it (whether the anchor is read first, then the plan): the sources
    planned, whether each cycle read its anchor first, and how often the span source was asked for its offer.
    `slower_after`: from that cycle on, every cycle takes twice as long (another job started); `odds`: the span
    source's own `expected_tokens` (each offer's odds, as the suffix index gives them)."""
    import mlx.core as mx

    from dflash_mlx.acceptance import Acceptor
    from dflash_mlx.planner import CyclePlanner
    from dflash_mlx.sampling import SamplingSettings

    rng = random.Random(seed)
    policy = AdaptiveBlock(cost, 8, AcceptanceEstimate(7, priors=[0.02] * 7))
    copies = _Copies()
    if odds is not None:
        copies.expected_tokens = odds
    planner = CyclePlanner(policy, _Drafter(), Acceptor(SamplingSettings(), mx.array([1])), spans=[copies])
    names, reads = [], []
    for i in range(cycles):
        reads.append(planner.reads_anchor())
        plan = planner.plan(i, i)
        slow = 2.0 if slower_after is not None and i >= slower_after else 1.0
        planner.observe(plan, 0, DRAFTING_COSTS(plan.width) * slow * math.exp(rng.gauss(0, 0.03)))
        names.append(plan.name)
    return names, reads, copies.asked


def test_a_span_source_that_cannot_run_rests_until_its_probe_is_due():
    """A span source whose spans lose (each rejected) is not asked for an offer while it could not run: not at
    any width, its probe not due (each offer asked is Python on a small model's step, every cycle, under
    sampling say). It is still probed (its wait counts every cycle), and a frozen curve (sharded ranks) asks
    every cycle, as before."""
    names, reads, asked = _span_run(CostModel(DRAFTING_COSTS), 3000)
    probes = sum(1 for a, b in zip(names, names[1:]) if b == "copies" and a != "copies")
    widths = {"target": 1, "copies": 2, "draft": 2}  # (each probe's width here)
    spent = sum(DRAFTING_COSTS(widths[n]) for n in names)
    lost = sum(DRAFTING_COSTS(widths[n]) - DRAFTING_COSTS(1) for n in names if n != "target")
    # the span source's and the drafter's probes each keep to BUDGET of the time (and their switches)
    assert asked < 3000 / 4 and probes >= 2 and lost <= 2.5 * BUDGET * spent
    _, _, asked_frozen = _span_run(DRAFTING_COSTS, 600)
    assert asked_frozen >= 2 * 600  # (asked before the anchor is read, and again when planned)
    # a source with each offer's own odds (the suffix index: a deeper match is likelier) is asked every time
    _, _, asked_with_odds = _span_run(
        CostModel(DRAFTING_COSTS), 600, odds=lambda widest: [1.0 + 0.1 * w for w in range(widest)]
    )
    assert asked_with_odds >= 2 * 600 - 100


def test_a_change_of_the_machine_ends_a_span_sources_rest():
    """A rest was judged at the machine's old speed: where the machine changes, the span source is asked again
    at once (plain decoding, twice as dear, may now lose to it)."""
    quiet_asked = _span_run(CostModel(DRAFTING_COSTS), 1200)[2]
    _, _, asked = _span_run(CostModel(DRAFTING_COSTS), 1200, slower_after=600)
    assert asked > quiet_asked


def test_a_span_offered_when_its_anchor_is_read_for_it_runs():
    """The loop reads a cycle's anchor first (no pipelining) only where a span offered would run (`wants`): a
    span source offering every cycle is then planned, not passed over for plain decoding (`due` and the probe
    agree on when its probe is due, its cycles timed included)."""
    names, reads, _ = _span_run(CostModel(DRAFTING_COSTS), 3000)
    assert sum(reads[50:]) >= 2  # (past the first cycles, which time plain decoding and the drafter)
    # (a read cycle may run the drafter's probe instead, which comes first; never plain decoding)
    assert all(name != "target" for name, read in zip(names[50:], reads[50:]) if read)


class _Fleeting:
    """A span source that offers a span of every width before the anchor is read, and after it only with odds
    `goes_on` (the anchor went on with the match: under sampling a chance match rarely does)."""

    name = "copies"
    layer_ids = ()

    def __init__(self, rng: random.Random, goes_on: float):
        self.rng, self.goes_on, self.read = rng, goes_on, False

    def offer(self, count: int) -> int:
        return count if not self.read or self.rng.random() < self.goes_on else 0


def _fleeting_run(generations: int, length: int, goes_on: float) -> tuple[int, int, int]:
    """Generations sharing one cost model and span history, run through the planner as the engine runs them (the
    anchor read first where the planner asks for it, then `plan`; else `plan_unread`, pipelined), every span
    rejected: (anchor reads, those whose cycle was a plain step all the same, span cycles)."""
    import mlx.core as mx

    from dflash_mlx.acceptance import Acceptor
    from dflash_mlx.planner import CyclePlanner
    from dflash_mlx.sampling import SamplingSettings

    rng, cost, history = random.Random(0), CostModel(DRAFTING_COSTS), DrafterHistory(7)
    reads = wasted = spans = 0
    for _ in range(generations):
        policy = AdaptiveBlock(cost, 8, AcceptanceEstimate(7, priors=[0.02] * 7), span_history=lambda name: history)
        copies = _Fleeting(rng, goes_on)
        planner = CyclePlanner(policy, _Drafter(), Acceptor(SamplingSettings(), mx.array([1])), spans=[copies])
        for i in range(length):
            copies.read = False
            read = planner.reads_anchor()
            copies.read = True
            plan = planner.plan(i, i) if read else planner.plan_unread(i, i)
            planner.observe(plan, 0, DRAFTING_COSTS(plan.width) * math.exp(rng.gauss(0, 0.03)))
            reads, wasted, spans = reads + read, wasted + (read and plan.name == "target"), spans + plan.spans
    return reads, wasted, spans


@pytest.mark.parametrize("generations, length", [(1, 3000), (50, 60)])
def test_an_anchor_read_for_a_probe_that_offered_no_span_rests_the_source(generations, length):
    """Where a span source's probe is due and it offers a span, the loop reads the anchor first, giving up the
    pipelining of that cycle (about 0.4 of a plain step of the demo pair on this CPU, at most a step). Where the
    anchor does not go on with the span (a chance match under sampling), the cycle is plain all the same: the
    source then rests a probe's wait, a rest the setup's generations share. Before, it was read for again every
    cycle it offered until a span ran: 231 such reads in 3,000 cycles, 265 in 50 replies of 60 (8%)."""
    reads, wasted, spans = _fleeting_run(generations, length, goes_on=0.1)
    assert wasted <= 2 * BUDGET * generations * length and spans >= 2  # (still probed)
    # where the anchor goes on with the span, the span runs when read for, as before (28-32 span cycles)
    reads, wasted, spans = _fleeting_run(generations, length, goes_on=0.9)
    assert spans >= 20 and wasted <= reads / 3


def test_probes_that_lose_more_than_hoped_are_priced_at_what_they_lost():
    # a drafter its history calls usually right (hopes 0.9) that accepts nothing: each probe is expected to lose
    # little, loses a block's time, and the probes' time keeps to the budget once they are priced at what they lost
    def run(learns: bool) -> tuple[float, int]:
        hopeful = AcceptanceEstimate(7, priors=[0.9] * 7, hopes=[0.9] * 7)
        policy = AdaptiveBlock(CostModel(DRAFTING_COSTS, learns=learns), 8, hopeful)
        rng = random.Random(0)
        chosen = simulate(policy, [0.0], 3000, times=lambda b: DRAFTING_COSTS(b) * math.exp(rng.gauss(0, 0.02)))
        later = chosen[500:]
        lost = sum(DRAFTING_COSTS(b) - DRAFTING_COSTS(1) for b in later)
        return lost / (len(later) * DRAFTING_COSTS(1)), sum(a == 1 and b > 1 for a, b in zip(later, later[1:]))

    share, probes = run(learns=True)
    assert share <= 1.5 * BUDGET and probes >= 2  # (still probed: it may recover)
    # where no time is learnt, nothing is measured: a probe is priced at its hopes alone
    assert run(learns=False)[0] > 3 * BUDGET
