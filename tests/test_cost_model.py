"""The cost model the loop keeps true: a calibrated table as a prior, corrected by timed cycles.

No model runs and nothing is timed: a simulated machine (a true curve, a
level that drifts as other jobs come and go, noise) tells the policy how
long each cycle it chose took, as the engine would.
"""

from __future__ import annotations

import math
import random
import threading

import pytest

from dflash_mlx.batch.block_choice import BatchBlockChoice
from dflash_mlx.policy.adaptive import TIMING_BUDGET, AdaptiveBlock, adaptive_policy
from dflash_mlx.policy.cost import MIN_PAIR_SAMPLES, REPLACE_TOLERANCE, CostModel, CostTable, CycleTimer
from dflash_mlx.policy.estimate import AcceptanceEstimate

GRID = [1, 2, 3, 4, 6, 8]
# the demo pair here: measured on a quiet machine, and while two CPU-bound jobs ran (rows look dear)
QUIET = CostTable.curve(GRID, [0.0050, 0.0095, 0.00975, 0.0100, 0.0104, 0.0108])
BUSY = CostTable.curve(GRID, [0.0075, 0.0187, 0.0210, 0.0232, 0.0262, 0.0300])
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
    rng, chosen = random.Random(seed), []
    for _ in range(cycles):
        b = policy.choose(100)
        accepted = 0
        while accepted < b - 1 and rng.random() < rates[min(accepted, len(rates) - 1)]:
            accepted += 1
        policy.observe(b, accepted, machine(b))
        chosen.append(b)
    return chosen


def shape(table: CostTable, rows: int = 1) -> list[float]:
    line = table.line(rows)
    return [t / line[0] for t in line]


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
    timer = CycleTimer(model)
    for b in (8, 8, 1, 1, 1, 8, 8):
        timer.observe(b, QUIET(b), 1)
    # counted: the second 8, the second and third 1 and the last 8, which is compared with the 1s (once)
    assert model.cycles == 4 and model.comparisons(8, 1) == [pytest.approx(math.log(QUIET(8) / QUIET(1)))]
    timer.observe(6, QUIET(6), 1)  # drafting to drafting: timed, compared with the smaller block that ran
    assert model.cycles == 5 and len(model.comparisons(6, 1)) == 1 and not model.comparisons(8, 6)
    timer.observe(8, QUIET(8), 1)  # and the 8 after it with the 6
    assert len(model.comparisons(8, 6)) == 1 and len(model.comparisons(8, 1)) == 1
    timer.observe(8, QUIET(8), 1)  # a run goes on: nothing new to compare
    assert len(model.comparisons(8, 6)) == 1 and model.cycles == 7
    timer.observe(6, None, 1)  # not timed (the engine's first cycle): nothing
    assert model.cycles == 7


def test_a_curve_measured_on_a_busy_machine_is_replaced_within_a_few_dozen_cycles():
    """The issue's scenario: the cached curve says T(8) = 4 T(1) (a busy calibration), the machine is quiet
    (2.2 T(1)). The loop's own cycles replace the curve, write it (`on_replace`), and the blocks follow."""
    written = []
    model = CostModel(BUSY, on_replace=lambda table, notes: written.append(table))
    policy = AdaptiveBlock(model, 8)
    chosen = run(policy, Machine(QUIET), 60)
    assert written and written[-1] is model.table and model.replaced >= 1
    first = next(i for i, _ in enumerate(chosen) if i and model.replaced)  # (it was replaced by now)
    assert first < 60
    chosen += run(AdaptiveBlock(model, 8), Machine(QUIET, seed=2), 400, seed=2)
    true, learnt = shape(QUIET), shape(model.table)
    assert all(abs(x / y - 1) < 0.15 for x, y in zip(learnt, true)), (learnt, true)
    assert chosen[-200:].count(8) > 150  # and the policy drafts as the quiet curve says it should
    assert model.initial is BUSY  # (what a seeded request keeps to)


def test_a_machine_uniformly_slower_does_not_look_like_a_steeper_curve():
    for seed in range(3):
        model = CostModel(QUIET)
        policy = AdaptiveBlock(model, 8)
        run(policy, Machine(QUIET, seed, drift=0.02), 1500, seed=seed)  # the level wanders by 2x and more
        assert len(model.comparisons(8, 1)) >= MIN_PAIR_SAMPLES  # it was measured,
        assert all(abs(x / y - 1) < REPLACE_TOLERANCE for x, y in zip(shape(model.table), shape(QUIET)))  # and agreed


def test_a_curve_that_says_no_block_pays_is_still_probed_and_corrected():
    model = CostModel(NO_BLOCK_PAYS)
    policy = AdaptiveBlock(model, 5)
    chosen = run(policy, Machine(CHEAP), 3000, rates=(0.9,))
    assert model.replaced >= 1 and chosen[-300:].count(1) < 100  # drafting, once the curve was corrected
    # before it, the probes kept to their budget: plain decoding with a probe every MAX_PROBE_GAP or more
    frozen = AdaptiveBlock(NO_BLOCK_PAYS, 5)
    assert set(run(frozen, Machine(CHEAP), 300, rates=(0.9,))) == {1}  # a frozen curve is not probed


def test_load_coming_and_going_is_followed_both_ways():
    model = CostModel(QUIET)
    run(AdaptiveBlock(model, 8), Machine(QUIET), 200)
    # at 0.7 acceptance plain decoding is better on the busy machine, block 8 by 40% on the quiet one
    steep = run(AdaptiveBlock(model, 8), Machine(BUSY, seed=3), 1500, rates=(0.7,), seed=3)
    assert model.replaced >= 1 and shape(model.table)[-1] > 3.0
    assert steep[-300:].count(1) > 200
    back = run(AdaptiveBlock(model, 8), Machine(QUIET, seed=4), 1500, rates=(0.7,), seed=4)
    assert shape(model.table)[-1] < 2.6 and back[-300:].count(1) < 100


def test_re_timing_while_drafting_keeps_to_its_budget_once_sure():
    model = CostModel(QUIET)
    run(AdaptiveBlock(model, 8), Machine(QUIET), 2000, rates=(0.95,))  # every block compared often enough
    policy = AdaptiveBlock(model, 8)
    machine = Machine(QUIET, seed=5)
    chosen = run(policy, machine, 3000, rates=(0.95,), seed=5)
    lost = sum(QUIET(b) for b in chosen) / (len(chosen) * QUIET(8)) - 1  # time against running block 8 only
    assert chosen.count(8) > 0.9 * len(chosen) and lost < 3 * TIMING_BUDGET


def test_a_frozen_model_never_changes_and_seeded_requests_keep_the_first_table():
    model = CostModel(BUSY, learns=False)
    assert model.timer() is None
    run(AdaptiveBlock(model, 8), Machine(QUIET), 300)
    assert model.table is BUSY and model.replaced == 0
    learning = CostModel(BUSY)
    run(AdaptiveBlock(learning, 8), Machine(QUIET), 300)
    assert learning.table is not BUSY
    seeded = adaptive_policy(None, None, 8, cost=learning, frozen=True)
    assert seeded.timer is None and seeded.cost.table is BUSY  # the table this process started with
    assert adaptive_policy(None, None, 8, cost=learning).cost is learning


def test_generations_at_once_share_the_model_and_the_drafters_history_under_their_locks():
    class Drafter:  # any weakly referenceable drafter
        pass

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
    assert not errors and model.replaced >= 1 and shape(model.table)[-1] < 2.6
    assert history.generations == 41 and 0.6 < history.learnt.rate(0) < 0.95


def test_the_batch_table_is_kept_true_per_row_count():
    rows = (1, 2, 4, 8)
    busy = CostTable(GRID, [[0.010 * n**0.5 * (1 + 0.5 * (b > 1) + 0.2 * n * b) for b in GRID] for n in rows], rows)
    quiet = CostTable(GRID, [[0.010 * n**0.5 * (1 + 0.5 * (b > 1) + 0.02 * n * b) for b in GRID] for n in rows], rows)
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
    assert model.replaced >= 1 and model.table.line(4) != busy.line(4) and model.table.line(2) == busy.line(2)
    assert all(abs(x / y - 1) < 0.15 for x, y in zip(shape(model.table, 4), shape(quiet, 4)))
    assert chosen[-100:].count(8) > 80
    assert REPLACE_TOLERANCE < 0.15


def test_a_level_that_jumps_drops_the_older_comparisons():
    """Another job starting (slower) or stopping (faster, lasting) changes the machine: the comparisons made
    before are dropped, and faster makes the table suspect (a busy curve's dear blocks may be cheap now)."""
    model = CostModel(QUIET, confirmed=True)
    assert not model.suspect
    timer = CycleTimer(model)
    machine = Machine(QUIET, noise=0.01)
    for _ in range(8):
        for b in (8, 8, 8, 1, 1, 8):
            timer.observe(b, machine(b))
    assert model.changes == 0 and len(model.comparisons(8, 1)) >= 3
    machine.level = 3.0
    for b in (8,) * 10:
        timer.observe(b, machine(b))
    assert model.changes == 1 and not model.comparisons(8, 1) and not model.suspect
    for _ in range(6):
        for b in (8, 8, 8, 1, 1, 8):
            timer.observe(b, machine(b))
    machine.level = 1.0
    for b in (8,) * 9:  # faster for one stretch of CHANGE_CYCLES only: not yet
        timer.observe(b, machine(b))
    assert model.changes == 1
    for b in (8,) * 8:
        timer.observe(b, machine(b))
    assert model.changes == 2 and model.suspect and model.table is QUIET  # the shape never changed
