"""The cost model the loop keeps true: a calibrated table, scaled per source by the cycles it times.

No model runs and nothing is timed: a simulated machine (a true curve per
source, a level that drifts, noise; a busy machine where multi-row verifies
slow far more than one-row steps and times scatter) tells the policy how long
each cycle it chose took, as the engine would.
"""

from __future__ import annotations

import math
import random
import threading

import pytest

from dflash_mlx.batch.block_choice import BatchBlockChoice
from dflash_mlx.policy.adaptive import AdaptiveBlock, adaptive_policy
from dflash_mlx.policy.choice import BUDGET
from dflash_mlx.policy.cost import CHANGE, SURE, THIN, WINDOW, CostModel, CostTable
from dflash_mlx.policy.estimate import AcceptanceEstimate, SpanOdds

GRID = [1, 2, 3, 4, 6, 8]
# the demo pair here: measured on a quiet machine, and while two CPU-bound jobs ran (rows look dear)
QUIET = CostTable.curve(GRID, [0.0050, 0.0095, 0.00975, 0.0100, 0.0104, 0.0108])
BUSY = CostTable.curve(GRID, [0.0075, 0.0187, 0.0210, 0.0232, 0.0262, 0.0300])
# the demo pair while two CPU-bound jobs run through the generation: a block costs a dozen plain steps
LOADED = CostTable.curve(GRID, [0.022, 0.28, 0.29, 0.30, 0.31, 0.32])
# a curve on which no block pays (4-bit rows on a CPU), and the true one where they do
NO_BLOCK_PAYS = CostTable.curve([1, 2, 3, 4, 5], [0.0080, 0.0171, 0.0267, 0.0346, 0.0405])
CHEAP = CostTable.curve([1, 2, 3, 4, 5], [0.0080, 0.0110, 0.0114, 0.0118, 0.0122])


class Machine:
    """Seconds of a cycle at block b: the true curve, times a level that drifts, times noise."""

    def __init__(self, curve: CostTable, seed: int = 0, drift: float = 0.0, noise: float = 0.03):
        self.curve, self.rng, self.level, self.drift, self.noise = curve, random.Random(seed), 1.0, drift, noise

    def __call__(self, b: int, rows: int = 1) -> float:
        self.level = min(3.0, max(0.5, self.level * math.exp(self.rng.gauss(0, self.drift))))
        return self.curve(b, rows) * self.level * math.exp(self.rng.gauss(0, self.noise))


def run(policy, machine, cycles: int, rates=(0.85,), seed: int = 1) -> list[int]:
    """Cycles of `policy` on `machine` with a drafter accepting each draft with probability rates[k]."""
    return timed(policy, machine, cycles, rates, seed)[0]


def timed(policy, machine, cycles: int, rates=(0.85,), seed: int = 1) -> tuple[list[int], float]:
    """The blocks `run` chose, and the tokens per second they committed."""
    rng, chosen, tokens, seconds = random.Random(seed), [], 0, 0.0
    for _ in range(cycles):
        b = policy.choose(100)
        accepted = 0
        while accepted < b - 1 and rng.random() < rates[min(accepted, len(rates) - 1)]:
            accepted += 1
        t = machine(b)
        policy.observe(b, accepted, t)
        chosen.append(b)
        tokens, seconds = tokens + accepted + 1, seconds + t
    return chosen, tokens / seconds


class Drafter:  # any weakly referenceable drafter: the key of its generations' history
    pass


def replies(model: CostModel, drafter, machine, count: int, cycles: int, rates, seed: int) -> list[int]:
    """The blocks `count` carried generations of `cycles` cycles each chose, sharing `model` and the history."""
    chosen = []
    for g in range(count):
        policy = adaptive_policy(None, drafter, 8, carry=True, cost=model)
        chosen += run(policy, machine, cycles, rates=rates, seed=seed + g)
    return chosen


def ratio(model: CostModel, b: int = 8, rows: int = 1) -> float:
    """The model's T(b) / T(1): the drafter's cost over plain decoding's."""
    return model.seconds("drafter", b, rows) / model.seconds("target", 1, rows)


def test_the_table_interpolates_extrapolates_and_refuses_nonsense():
    curve = CostTable.curve([1, 2, 4], [1.0, 2.0, 3.0])
    assert [curve(b) for b in (1, 2, 3, 4, 6)] == [1.0, 2.0, 2.5, 3.0, 4.0]
    batch = CostTable([1, 4], [[1.0, 4.0], [2.0, 8.0], [4.0, 16.0]], rows=[1, 2, 4])
    assert batch(1, 1) == 1.0 and batch(4, 4) == 16.0
    assert batch(1, 3) == pytest.approx(3.0) and batch(2, 1) == pytest.approx(2.0)
    assert batch(4, 8) == pytest.approx(32.0)  # past the last rows: the last two rows' slope
    for blocks, seconds, rows in (
        ([2, 4], [[1, 2]], [1]),
        ([1, 1], [[1, 2]], [1]),
        ([1, 2], [[1, 0]], [1]),
        ([1], [[]], [1]),
        ([1], [[1.0]], [1, 2]),
        ([1], [[1.0], [2.0]], [2, 1]),
    ):
        with pytest.raises(ValueError):
            CostTable(blocks, seconds, rows)


def test_a_cycle_changing_to_or_from_plain_decoding_is_not_timed():
    model = CostModel(QUIET)
    policy = AdaptiveBlock(model, 8)
    for b in (8, 8, 1, 1, 1, 8, 8, 6):
        policy.observe(b, 0, QUIET(b))
    # timed: the second 8, the second and third 1, the last 8 and the 6 (drafting to drafting)
    assert model.cycles == 5 and model.level("target")[2] == 2 and model.level("drafter")[2] == 3
    assert model.level("drafter")[0] == pytest.approx(0.0, abs=1e-12)  # the table as it was measured
    policy.observe(6, 0, None)  # not timed (the engine's first cycle): nothing
    assert model.cycles == 5


def test_a_curve_measured_on_a_busy_machine_is_corrected_within_its_first_cycles():
    """The issue's scenario: the cached curve says T(8) = 4 T(1) (a busy calibration), the machine is quiet
    (2.2 T(1)). The loop times plain decoding and the drafter at once (neither was timed in this process),
    and the blocks follow the quiet machine; the table itself is what the calibration measured."""
    model = CostModel(BUSY)
    chosen = run(AdaptiveBlock(model, 8), Machine(QUIET), 60)
    assert model.table is BUSY and ratio(model) == pytest.approx(QUIET(8) / QUIET(1), rel=0.15)
    assert chosen[-40:].count(8) > 30


def test_a_machine_whose_speed_wanders_keeps_the_policy_drafting():
    """The level wanders by 2x and more: plain decoding's level, measured less often, lags the drafter's; a
    lag that makes drafting look dearer runs plain decoding, which is then measured afresh."""
    for seed in range(3):
        model = CostModel(QUIET)
        chosen = run(AdaptiveBlock(model, 8), Machine(QUIET, seed, drift=0.02), 1500, seed=seed)
        assert chosen[-500:].count(8) > 450


def test_a_curve_that_says_no_block_pays_is_timed_once_and_corrected():
    """The table's shape among drafting blocks is the calibration's; the loop scales it: here the drafter's
    blocks cost a third of what the table says, measured at the narrowest, and the policy drafts."""
    model = CostModel(NO_BLOCK_PAYS)
    chosen = run(AdaptiveBlock(model, 5), Machine(CHEAP), 300, rates=(0.9,))
    assert chosen.index(2) < 3 and chosen[-100:].count(1) < 20  # drafting, once its time was measured
    assert ratio(model, 2) == pytest.approx(CHEAP(2) / CHEAP(1), rel=0.15)
    frozen = AdaptiveBlock(NO_BLOCK_PAYS, 5)
    assert set(run(frozen, Machine(CHEAP), 300, rates=(0.9,))) == {1}  # a frozen curve is never timed


def test_a_switch_costs_what_first_cycles_take_beyond_their_level_where_it_is_sure():
    """The first cycle after another source's is not timed into a level (a drafter's first block takes in
    the rows that waited; plain decoding's first step is not pipelined), but what it takes beyond its level is
    a switch's cost, which a probe pays on top of its cycles: probes come later by that much. First cycles
    scattering about their level as every cycle does are no cost."""
    sampled = CostTable.curve(GRID, [0.0029, 0.0059, 0.0062, 0.0066, 0.0072, 0.0079])

    def probes(first_extra: float, noise: float = 0.0) -> tuple[int, float]:
        model, rng = CostModel(sampled), random.Random(5)
        policy = AdaptiveBlock(model, 8)
        chosen, last = [], 1
        for _ in range(3000):
            b = policy.choose(100)
            t = sampled(b) * math.exp(rng.gauss(0, noise))
            policy.observe(b, 0, t + (first_extra * sampled(b) if (b > 1) != (last > 1) else 0.0))
            chosen.append(b)
            last = b
        return sum(a == 1 and b > 1 for a, b in zip(chosen, chosen[1:])), model.switch("drafter")

    plain, none = probes(0.0)
    dear, charged = probes(0.5)
    assert none == 0 and charged == pytest.approx(0.5 * sampled(3), rel=0.05)
    assert dear < 0.75 * plain
    scattered, charged = probes(0.0, noise=0.3)
    assert charged == 0.0  # noise alone (a slow first cycle now and then) is no cost of switching
    model = CostModel(sampled, learns=False)
    model.add_switch("drafter", 3, 10 * sampled(3))
    assert model.switch("drafter") == 0.0  # (a model that does not learn: the table alone)


def drafted(chosen: list[int]) -> int:
    return sum(b > 1 for b in chosen)


def test_a_settled_plain_run_is_decided_at_its_probes_with_the_same_blocks():
    """While plain decoding is the clear choice, the rule runs again only at the first probe due (and after it):
    the blocks chosen are those of running it every cycle on a curve that does not learn; on one that does, its
    probes come as often (a level moved by the cycles since may move one by a cycle or two)."""
    from dflash_mlx.policy.choice import Choice

    class EveryCycle(Choice):
        def choose(self, offers):
            self._quiet = None
            return super().choose(offers)

    for learns in (False, True):
        runs = []
        for every in (False, True):
            policy, machine = AdaptiveBlock(CostModel(QUIET, learns=learns), 8), Machine(QUIET, seed=1)
            if every:
                policy.choice = EveryCycle(policy.cost, policy.plain)
            decided = []
            best = policy.choice.best
            policy.choice.best = lambda offers: decided.append(1) or best(offers)
            chosen = run(policy, machine, 1500, rates=(0.1,), seed=2)
            runs.append((chosen, len(decided)))
        (settled, decisions), (every_cycle, all_decisions) = runs
        assert settled == every_cycle if not learns else abs(drafted(settled) - drafted(every_cycle)) <= 3
        assert settled.count(1) > 1400 and drafted(settled) >= 10
        assert all_decisions >= 1400 and decisions <= 2 * drafted(settled) + WINDOW  # (at a probe and after it)


def fixed_odds(r: float) -> SpanOdds:
    """A drafter's acceptance known outright (each draft accepted with odds r): nothing to learn."""
    return SpanOdds(lambda widest: [sum(r**k for k in range(b)) for b in range(1, widest + 1)])


class SlowerSteps(Machine):
    """The machine with plain steps 25% dearer (less than a change of it) and blocks as they were."""

    def __call__(self, b: int, rows: int = 1) -> float:
        return super().__call__(b, rows) * (1.25 if b == 1 else 1.0)


def test_a_settled_plain_run_ends_once_its_timings_bring_plain_decoding_within_resolution_of_the_drafter():
    """A drafter 10% slower than plain decoding leaves plain decoding the clear choice: a settled run, decided
    again at the drafter's probes. Plain steps turning 25% dearer (no change of the machine: the drafter's level
    stands) make the drafter the better: the run's timings, added each WINDOW, end it, and drafting takes over
    within a window or so, not at the next probe."""
    for seed in range(5):
        policy = AdaptiveBlock(CostModel(QUIET), 8, fixed_odds(0.49))  # E(8) = 1.95 tokens in 10.8 ms: 0.9 x plain
        before = run(policy, Machine(QUIET, seed=seed), 1500, rates=(0.49,), seed=seed)
        assert before[-1000:].count(1) > 950
        after = run(policy, SlowerSteps(QUIET, seed=seed + 10), 300, rates=(0.49,), seed=seed + 20)
        takes_over = next(i for i in range(len(after)) if all(b > 1 for b in after[i : i + WINDOW]))
        assert takes_over <= WINDOW + 2, (seed, after[:40])


def test_another_generations_timed_cycles_end_a_settled_plain_run():
    """Generations share the model: a drafter found cheaper by another's cycles is tried by one in a settled plain
    run at its run's next WINDOW of timings, not at its next probe (its own blocks then price it again)."""
    model = CostModel(QUIET)
    policy, other = AdaptiveBlock(model, 8, fixed_odds(0.49)), AdaptiveBlock(model, 8, fixed_odds(0.49))
    assert run(policy, Machine(QUIET, seed=3), 600, rates=(0.49,), seed=3)[-300:].count(1) > 280
    for _ in range(2 * WINDOW):  # the other's blocks, timed at 0.8 of what they cost (a drafter made cheaper)
        other.observe(8, 1, 0.8 * QUIET(8))
    after = run(policy, Machine(QUIET, seed=4), 100, rates=(0.49,), seed=4)
    assert next(i for i, b in enumerate(after) if b > 1) <= WINDOW


def test_one_slow_plain_step_does_not_keep_a_losing_drafter_running():
    """One plain step 30 times its cost (a page fault, another process's moment) raises plain decoding's level
    with a wide error. Judged against that level, any probe paid, so another followed at once; plain decoding
    never ran twice in a row to be timed again, and a drafter losing to it ran on (sampled demo GSM8K: a
    livelock of probes at b2). A probe pays by the margin that proves a source, and the hiccup washes out."""
    sampled = CostTable.curve(GRID, [0.0029, 0.0059, 0.0062, 0.0066, 0.0072, 0.0079])  # the demo pair at T > 0
    model, machine = CostModel(sampled), Machine(sampled, seed=2)
    policy = AdaptiveBlock(model, 8)
    run(policy, machine, 300, rates=(0.45,), seed=2)  # drafting loses: E(3) = 1.65 tokens in 2.1 plain steps
    while policy.choose(100) != 1:
        policy.observe(8, 0, machine(8))
    policy.observe(1, 0, 30 * machine(1))
    after = run(policy, machine, 400, rates=(0.45,), seed=3)
    assert sum(b > 1 for b in after) < 0.08 * len(after)
    assert abs(model.level("target")[0]) < 0.1  # timed again: the hiccup left its window


def test_load_coming_and_going_is_followed_both_ways():
    """Two CPU-bound jobs start while the policy drafts: it runs plainly within a few blocks, at nearly plain
    decoding's speed; they stop: it drafts again within a few cycles (plain decoding got faster: the
    drafter's time is stale and measured again at once)."""
    model = CostModel(QUIET)
    run(AdaptiveBlock(model, 8), Machine(QUIET), 200)
    loaded, speed = timed(AdaptiveBlock(model, 8), Machine(LOADED, seed=3, noise=0.5), 1500, seed=3)
    assert loaded.index(1) <= WINDOW and loaded[WINDOW:].count(1) > 0.98 * (1500 - WINDOW)
    plain = 1 / (LOADED(1) * math.exp(0.5**2 / 2))  # (the mean of the noise)
    assert speed > 0.9 * plain
    back = run(AdaptiveBlock(model, 8), Machine(QUIET, seed=4), 200, seed=4)
    assert model.changes >= 1 and back.index(8) <= 2 * WINDOW + 2 and back[-150:].count(8) > 130


def test_noise_alone_is_not_a_change_of_the_machine():
    """Cycle times scattering by a factor of 1.6 (two CPU-bound jobs on two cores), with bursts of slow
    cycles, at a steady level: the newest WINDOW cycles must lie all beyond CHANGE and SURE deviations of
    the cycles before them."""
    model = CostModel(LOADED)
    machine = Machine(LOADED, seed=6, noise=0.5)
    policy = AdaptiveBlock(model, 8)
    for i in range(3000):  # (and a burst of slow cycles now and then: another job's time slice)
        policy.observe(1, 0, machine(1) * (8.0 if i % 97 < WINDOW - 2 else 1.0))
    assert model.changes <= 1
    steady = CostModel(QUIET)
    for _ in range(40 + WINDOW):
        steady.add("target", 1, QUIET(1) * (CHANGE * 1.1 if steady.cycles >= 40 else 1.0))
    assert steady.changes == 1 and steady.level("target")[0] == pytest.approx(math.log(CHANGE * 1.1))


def test_drafting_must_be_proven_where_times_scatter():
    """A drafter whose blocks commit 15% less per second than plain decoding (where the table says they
    commit more): not taken on a quiet machine once timed, and seldom where cycle times scatter so widely
    (by a factor of 2.5) that a few lucky cycles make it look 50% better: the loop stays near plain
    decoding's speed. A drafter 28% better is taken on a quiet machine, and mostly where times scatter by
    a third."""
    cheap = CostTable.curve(GRID, [0.010, 0.012, 0.0125, 0.013, 0.0135, 0.014])
    worse = CostTable.curve(GRID, [0.010, 0.063, 0.064, 0.065, 0.066, 0.067])  # E(8) = 5.7 in 6.7 plain steps
    better = CostTable.curve(GRID, [0.010, 0.040, 0.041, 0.042, 0.043, 0.044])  # ... in 4.4 plain steps
    for curve, noise, plain_share, speed in (
        (worse, 0.03, 0.97, 0.97),
        (worse, 0.9, 0.8, 0.85),
        (better, 0.03, 0, 1.2),
    ):
        chosen, tps = timed(AdaptiveBlock(CostModel(cheap), 8), Machine(curve, noise=noise), 800, rates=(0.9,))
        plain = 1 / (curve(1) * math.exp(noise**2 / 2))  # (the mean of the noise)
        assert tps > speed * plain and chosen[-300:].count(1) >= plain_share * 300, (noise, tps / plain)
    chosen, tps = timed(AdaptiveBlock(CostModel(cheap), 8), Machine(better, noise=0.3), 800, rates=(0.9,))
    assert tps > 1.15 / (better(1) * math.exp(0.3**2 / 2))


def test_re_timing_while_drafting_keeps_to_its_budget():
    model = CostModel(QUIET)
    run(AdaptiveBlock(model, 8), Machine(QUIET), 200, rates=(0.95,))
    chosen = run(AdaptiveBlock(model, 8), Machine(QUIET, seed=5), 3000, rates=(0.95,), seed=5)
    lost = sum(QUIET(b) for b in chosen) / (len(chosen) * QUIET(8)) - 1  # time against running block 8 only
    assert chosen.count(8) > 0.95 * len(chosen) and lost < 3 * BUDGET


def test_a_frozen_model_never_changes():
    model = CostModel(BUSY, learns=False)
    run(AdaptiveBlock(model, 8), Machine(QUIET), 300)
    assert model.cycles == 0 and model.level("drafter") == (0.0, 0.0, 0) and model.stale("drafter") is None
    learning = CostModel(BUSY)
    run(AdaptiveBlock(learning, 8), Machine(QUIET), 300)
    assert ratio(learning) < 0.6 * BUSY(8) / BUSY(1)
    assert adaptive_policy(None, None, 8, cost=learning).cost is learning


def test_generations_at_once_share_the_model_and_the_drafters_history_under_their_locks():
    model, drafter, errors = CostModel(BUSY), Drafter(), []

    def generations(seed):
        try:
            for k in range(10):
                policy = adaptive_policy(None, drafter, 8, carry=True, cost=model)
                run(policy, Machine(QUIET, seed=seed * 100 + k), 80, seed=k)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=generations, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    history = adaptive_policy(None, drafter, 8, carry=True, cost=model).history
    assert not errors and ratio(model) == pytest.approx(QUIET(8) / QUIET(1), rel=0.2)
    assert history.generations == 41 and 0.6 < history.learnt.rate(0) < 0.95


def test_the_batch_levels_are_kept_per_row_count():
    rows = (1, 2, 4, 8)  # on the busy table a batch's blocks cost 3 times what they do
    busy = CostTable(GRID, [[0.010 * n**0.5 * (1 + (b > 1) * (1.5 + 0.06 * n * b)) for b in GRID] for n in rows], rows)
    quiet = CostTable(GRID, [[0.010 * n**0.5 * (1 + (b > 1) * (0.5 + 0.02 * n * b)) for b in GRID] for n in rows], rows)
    model = CostModel(busy)
    choice = BatchBlockChoice(model, 8)
    batch = [type("Row", (), {"max_block": 8, "estimate": AcceptanceEstimate(7)})() for _ in range(4)]
    rng, machine, chosen = random.Random(0), Machine(quiet), []
    for _ in range(600):
        b = choice.choose(batch)
        accepted = []
        for _ in batch:
            n = 0
            while n < b - 1 and rng.random() < 0.85:
                n += 1
            accepted.append(n)
        choice.observe(batch, b, accepted, machine(b, len(batch)))
        chosen.append(b)
    assert ratio(model, rows=4) == pytest.approx(quiet(8, 4) / quiet(1, 4), rel=0.15)
    assert model.level("drafter", 2) == (0.0, 0.0, 0)  # a row count that never ran keeps the table's
    assert chosen[-100:].count(8) > 80


def test_a_level_that_jumps_drops_the_older_cycles_and_makes_the_others_stale():
    """Another job starting (slower) or stopping (faster): the newest WINDOW cycles, all CHANGE times off the
    WINDOW before, are the source's level, and every other source's level must be measured afresh; the way
    the machine went says which is measured at once (`Choice.wants_timing`)."""
    model = CostModel(QUIET)
    assert model.stale("target") == 0 and model.stale("drafter") == 0  # never timed in this process
    for _ in range(2 * WINDOW):
        model.add("target", 1, QUIET(1))
        model.add("drafter", 8, QUIET(8))
    assert model.stale("target") is None and model.stale("drafter") is None and model.changes == 0
    for _ in range(WINDOW):
        model.add("drafter", 8, 3.0 * QUIET(8))
    assert model.changes == 1 and model.level("drafter")[0] == pytest.approx(math.log(3.0))
    assert model.stale("target") == 1 and model.stale("drafter") is None  # slower: plain decoding wants timing
    model.add("target", 1, 3.0 * QUIET(1))  # measured afresh: its older cycles are of another machine
    assert model.level("target") == (pytest.approx(math.log(3.0)), pytest.approx(0.0), 1)
    for _ in range(2 * WINDOW - 1):  # plain decoding runs on the busy machine, then the job stops
        model.add("target", 1, 3.0 * QUIET(1))
    assert model.stale("drafter") is None  # (it was timed since)
    for _ in range(WINDOW):
        model.add("target", 1, QUIET(1))
    policy = AdaptiveBlock(model, 8)
    assert model.stale("drafter") == -1 and policy.choice.wants_timing(policy.drafter)
    model.add("drafter", 8, QUIET(8))
    for _ in range(2 * WINDOW - 1):  # the drafter runs; the job starts again, then stops
        model.add("drafter", 8, 3.0 * QUIET(8))
    for _ in range(WINDOW):
        model.add("drafter", 8, QUIET(8))
    # faster: plain decoding's level, timed under the load, wants timing too (every rate is judged against it)
    assert model.stale("target") == -1 and policy.choice.wants_timing(policy.plain)


def test_a_span_source_takes_its_drafters_cost_until_its_own_is_timed_thin_times_since_the_machine_changed():
    """A span runs only where the context matches, so its cost cannot be measured again at once: one slow
    cycle, or cycles timed under a load that has since stopped, would price it out for good (traced: the copy
    index, timed once while two jobs ran, stayed at 3.9x its cost after they stopped and never ran again).
    Until its own level rests on THIN cycles timed since the machine last changed it takes its drafter's."""
    model = CostModel(QUIET)
    for _ in range(2 * WINDOW):
        model.add("drafter", 8, QUIET(8))
    model.add("lookup", 8, 4.0 * QUIET(8))  # one slow cycle
    assert model.level("lookup", prior="drafter") == (pytest.approx(0.0), 0.0, 0)  # the drafter's
    assert model.seconds("lookup", 8, prior="drafter") == pytest.approx(QUIET(8))
    for _ in range(THIN - 1):
        model.add("lookup", 8, 0.7 * QUIET(8))
    assert model.level("lookup", prior="drafter")[0] == pytest.approx(math.log((4.0 + 0.7 * (THIN - 1)) / THIN))
    for _ in range(2 * WINDOW):  # a load comes: the copy index is timed under it, then the load stops
        model.add("lookup", 8, 3.0 * QUIET(8))
        model.add("drafter", 8, 3.0 * QUIET(8))
    for _ in range(WINDOW):
        model.add("drafter", 8, QUIET(8))
    assert model.stale("lookup") == -1  # faster: the load stopped
    assert model.level("lookup", prior="drafter")[0] == pytest.approx(0.0)  # the drafter's, not 3x
    model.add("lookup", 8, 0.7 * QUIET(8))  # timed afresh: its older cycles are of another machine
    assert model.level("lookup", prior="drafter")[0] == pytest.approx(0.0)  # (one cycle is not THIN)
    for _ in range(THIN - 1):
        model.add("lookup", 8, 0.7 * QUIET(8))
    assert model.level("lookup", prior="drafter")[0] == pytest.approx(math.log(0.7))
    assert model.level("lookup")[0] == pytest.approx(math.log(0.7))  # (with no prior: its own, always)


def test_a_level_timed_at_a_slow_moment_is_timed_afresh_when_it_resumes_faster():
    """A source's level is the mean of its newest WINDOW cycles; one timed at a slow moment (plain steps at 9 ms
    against 4.4 for a while, traced under sampling; here 2.5 times) is not corrected by running, since it keeps
    the source from running, and one probe's cycle moved it by an eighth. Its first timed cycle after other sources'
    (`resumed`) that is faster than its level by SURE of its cycles' robust deviations starts its level
    afresh, measured THIN times at once; a faster cycle in a run of its own, a slower one, or one within its
    noise does not. Its older cycles still count towards a change of the machine."""
    model = CostModel(QUIET)
    for i in range(2 * WINDOW):  # (a machine's noise: 5%)
        model.add("target", 1, 2.5 * (1.05 if i % 2 else 0.95) * QUIET(1))
        model.add("drafter", 8, QUIET(8))
    for _ in range(WINDOW):
        model.add("drafter", 8, QUIET(8))
    assert model.age("target") == WINDOW + 1 and model.age("drafter") == 0
    model.add("target", 1, 1.02 * QUIET(1), resumed=True)  # at the machine's speed
    level, _, n = model.level("target")
    assert level == pytest.approx(math.log(1.02)) and n == 1
    assert model.stale("target") == 0 and model.age("target") == 0  # one cycle: it wants timing at once
    for _ in range(WINDOW - 1):
        model.add("target", 1, QUIET(1))
    assert model.changes == 1 and model.stale("drafter") == -1  # all WINDOW below the slow ones: faster
    steady = CostModel(QUIET)
    for i in range(2 * WINDOW):
        steady.add("target", 1, 2.5 * (1.05 if i % 2 else 0.95) * QUIET(1))
    steady.add("target", 1, QUIET(1))  # in a run of its own: one of the window
    assert steady.level("target")[2] == WINDOW
    for seconds in (2.4 * QUIET(1), 3.0 * QUIET(1)):  # within its noise, or slower: kept
        steady.add("target", 1, seconds, resumed=True)
        assert steady.level("target")[2] == WINDOW


def test_a_plain_level_priced_dear_is_timed_again_across_short_generations():
    """Plain decoding's level raised by a slow moment (1.8x, not a change of the machine) makes a drafter that
    loses by a quarter look better. A probe of plain decoding is priced at that level and waited for: counted
    per generation, a wait longer than a reply never ended (traced under sampling: the drafter ran as the best
    through 7 replies, 283 cycles, with no plain step timed). The wait counts the cycles timed since its level
    was (`CostModel.age`), and the probe's faster cycle times it afresh."""
    sampled = CostTable.curve(GRID, [0.0029, 0.0059, 0.0062, 0.0066, 0.0072, 0.0079])  # the demo pair at T > 0
    for seed in (0, 1, 3):
        model, machine, drafter = CostModel(sampled), Machine(sampled, seed=seed), Drafter()
        replies(model, drafter, machine, 10, 30, (0.5,), seed * 100)
        for _ in range(WINDOW):
            model.add("target", 1, 1.8 * machine(1))
        after = replies(model, drafter, machine, 20, 30, (0.5,), seed * 100 + 50)  # replies of 30 cycles
        assert model.changes == 0 and sum(b > 1 for b in after) < len(after) / 6, seed  # (110 to 580 before)
        assert abs(model.level("target")[0]) < 0.1


def test_a_drafter_priced_out_under_a_load_drafts_again_once_it_stops():
    """Two jobs start: plain steps take 3.7 times as long, scattering by a factor of 1.6, and blocks 1.6 times,
    60 times one cycle in ten. The drafter's level, a mean over few cycles with a stall among them, reads up to
    60 times its cost and plain decoding takes over; a probe of it is priced at that level, so it waits for
    ever. The jobs stop: plain decoding's own cycles must show it (traced in `bench.py load --scenario run`:
    the first window after the load ran 953 plain steps at 0.53 of b8). Shown not by the scatter's standard
    deviations, which hid it, nor after a faster plain cycle started plain decoding's level afresh and dropped
    the loaded cycles the change is seen against."""
    table = CostTable.curve(GRID, [0.0040, 0.0047, 0.0048, 0.0050, 0.0052, 0.0055])  # blocks look cheap here
    true = CostTable.curve(GRID, [0.0040, 0.0070, 0.0073, 0.0075, 0.0080, 0.0084])

    for seed in (8, 12, 17):  # (each ran plain decoding through every cycle after the load, with the code before)
        rng = random.Random(seed)

        def loaded(b: int, rows: int = 1) -> float:
            if b == 1:
                return true(1) * 3.7 * math.exp(rng.gauss(0, 0.5))
            return true(b) * (60 if rng.random() < 0.1 else 1.6) * math.exp(rng.gauss(0, 0.5))

        model, drafter = CostModel(table), Drafter()
        replies(model, drafter, Machine(true, seed=seed), 10, 35, (0.8,), seed * 1000)
        replies(model, drafter, loaded, 20, 35, (0.8,), seed * 1000 + 100)
        after = replies(model, drafter, Machine(true, seed=seed + 1), 20, 35, (0.8,), seed * 1000 + 200)
        assert after.count(1) < 0.1 * len(after), seed
        assert model.level("drafter")[0] < 0.6  # (e^0.42: the machine's blocks against the table's)


def test_blocks_that_are_very_slow_now_and_then_cost_what_they_cost_on_average():
    """Two CPU-bound jobs and two OpenBLAS threads (traced cycle by cycle): a block of 8 costs about 10 ms
    most of the time and about 600 ms one cycle in five, a plain step 9 ms. The drafter commits 5 tokens a
    block: 0.5 a millisecond when quick, 0.04 on average against plain decoding's 0.11. The policy runs
    plain decoding: a median of the newest cycles would see only the quick ones and keep drafting."""
    plain_ms, quick_ms, stalled_ms = 0.009, 0.010, 0.600
    rng = random.Random(3)

    def machine(b: int, rows: int = 1) -> float:
        return plain_ms if b == 1 else (stalled_ms if rng.random() < 0.2 else quick_ms)

    model = CostModel(QUIET)
    chosen, tps = timed(AdaptiveBlock(model, 8), machine, 2000, rates=(0.9,))
    assert chosen[-1000:].count(1) > 0.9 * 1000
    assert tps > 0.9 / plain_ms
    levels = [math.log(t / QUIET(8)) for t in [quick_ms] * (WINDOW - 1) + [stalled_ms]]
    mean = CostModel(QUIET)
    for y in levels:
        mean.add("drafter", 8, QUIET(8) * math.exp(y))
    assert mean.seconds("drafter", 8) == pytest.approx(((WINDOW - 1) * quick_ms + stalled_ms) / WINDOW)


def test_a_lone_slow_plain_step_does_not_prove_a_worse_drafter():
    """Plain steps of 3.7 ms, one in 40 taking 25 ms (a hiccup: another process's time slice), and a
    drafter committing 2.4 tokens in blocks of 14 ms (5.8 ms a token: a third slower than plain decoding).
    The hiccup raises plain decoding's level (a mean of its newest 8 steps) to 6.7 ms a step for 8 steps;
    that level's standard error must widen with it, so drafting is not proven against it. (Traced on
    sampled demo GSM8K: with the error taken from the robust spread, a lone hiccup's level took the
    drafter on, and drafting ran 30% of the cycles at 0.84 of plain decoding's speed.)"""
    table = CostTable.curve(GRID, [0.0035, 0.0062, 0.0066, 0.0070, 0.0080, 0.0090])  # the calibrated curve
    rng = random.Random(5)

    def machine(b: int, rows: int = 1) -> float:
        if b == 1:
            return 0.025 if rng.random() < 1 / 40 else 0.0037 * math.exp(rng.gauss(0, 0.03))
        return 0.014 * math.exp(rng.gauss(0, 0.03))

    model = CostModel(table)
    for _ in range(WINDOW - 1):
        model.add("target", 1, 0.0037)
    model.add("target", 1, 0.025)
    level, error, _ = model.level("target")
    assert math.exp(level) * table(1) > 0.006  # the hiccup raised the level
    assert level - math.log(0.0037 / table(1)) < SURE * error  # ... by less than the level is sure of
    chosen, tps = timed(AdaptiveBlock(CostModel(table), 8), machine, 3000, rates=(0.6,))
    assert chosen[-2000:].count(1) > 0.95 * 2000, chosen[-2000:].count(1)
    assert tps > 0.95 / 0.0044  # (plain decoding's mean step, the hiccups included)


def test_cycles_added_together_are_the_cycles_added_one_by_one():
    """`add_many` (a settled plain run's timings, added once per WINDOW) leaves the model as adding each cycle
    would: levels, their errors, staleness, changes of the machine and the resumed-faster rule."""
    rng = random.Random(3)
    cycles = [
        (1, QUIET(1) * math.exp(rng.gauss(0, 0.05)) * (3.0 if 40 <= i < 70 else 1.0), i % 17 == 0) for i in range(120)
    ]
    one, many = CostModel(QUIET), CostModel(QUIET)
    one.add("drafter", 4, QUIET(4))
    many.add("drafter", 4, QUIET(4))
    for b, seconds, resumed in cycles:
        one.add("target", b, seconds, resumed=resumed)
    for i in range(0, len(cycles), WINDOW - 1):
        many.add_many("target", cycles[i : i + WINDOW - 1])
    assert one.changes == many.changes >= 2
    for source in ("target", "drafter"):
        assert one.level(source) == pytest.approx(many.level(source))
        assert one.stale(source) == many.stale(source) and one.age(source) == many.age(source)


def test_a_settled_plain_runs_timings_reach_the_model_each_window():
    """A settled run of plain steps (the rule runs once per WINDOW of them) adds their timings together, at the
    rule's next run or once WINDOW wait: the model sees a machine that got slower within a window or so."""
    model = CostModel(QUIET)
    policy = AdaptiveBlock(model, 8, AcceptanceEstimate(7, priors=[0.02] * 7))
    for _ in range(200):
        b = policy.choose(8)
        policy.observe(b, 0, QUIET(b))
    assert model.level("target")[0] == pytest.approx(0.0, abs=0.01)
    for _ in range(3 * WINDOW):  # the machine twice as slow (a change of it: the drafter is timed again too)
        b = policy.choose(8)
        policy.observe(b, 0, 2 * QUIET(b))
    assert model.level("target")[0] == pytest.approx(math.log(2), abs=0.05)
