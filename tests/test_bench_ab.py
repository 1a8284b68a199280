"""`scripts/bench.py ab`'s statistics: the paired new / base ratio, its 95% interval and the stopping rule.

Only the arithmetic: nothing here runs a benchmark (the leg itself runs checkouts in subprocesses).
"""

from __future__ import annotations

import importlib.util
import math
import statistics
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_t_quantiles_match_the_table_and_the_normal_limit(bench):
    assert bench.t975(1) == 12.706 and bench.t975(4) == 2.776 and bench.t975(30) == 2.042
    assert bench.t975(40) == pytest.approx(2.0211, abs=2e-4)  # past the table: the expansion
    assert bench.t975(120) == pytest.approx(1.9799, abs=2e-4)
    assert bench.t975(10_000) == pytest.approx(1.96, abs=1e-3)
    assert all(bench.t975(df) > bench.t975(df + 1) for df in range(1, 60))  # no jump where the table ends
    with pytest.raises(ValueError):
        bench.t975(0)


def test_t_quantiles_agree_with_scipy(bench):
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 9, 19, 29, 31, 45, 80):
        assert bench.t975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=2e-3)


def test_the_estimate_is_the_geometric_mean_of_the_paired_ratios(bench):
    base = [100.0, 200.0, 50.0, 80.0]
    new = [110.0, 190.0, 52.0, 80.0]
    s = bench.paired_ratio(base, new)
    ratios = [n / b for b, n in zip(base, new)]
    assert s["rounds"] == 4
    assert s["ratio"] == pytest.approx(statistics.geometric_mean(ratios))
    logs = [math.log(r) for r in ratios]
    h = 3.182 * statistics.stdev(logs) / 2  # t(0.975, 3) x s / sqrt(4)
    low, high = s["ci95"]
    assert low == pytest.approx(s["ratio"] * math.exp(-h)) and high == pytest.approx(s["ratio"] * math.exp(h))
    assert s["half_width"] == pytest.approx(high - s["ratio"])
    assert high - s["ratio"] >= s["ratio"] - low  # the upper distance is the larger one


def test_the_ratio_is_paired_not_of_means(bench):
    """A round where both sides ran slow counts as much as a fast one: only each round's ratio matters."""
    s = bench.paired_ratio([10.0, 1000.0], [11.0, 1100.0])
    assert s["ratio"] == pytest.approx(1.1) and s["half_width"] == pytest.approx(0.0)


def test_one_round_has_no_interval(bench):
    s = bench.paired_ratio([100.0], [97.0])
    assert s["ratio"] == pytest.approx(0.97) and s["ci95"] is None and s["half_width"] == math.inf
    with pytest.raises(ValueError):
        bench.paired_ratio([100.0, 90.0], [97.0])


def test_the_interval_narrows_as_rounds_are_added(bench):
    ratios = [1.04, 0.96, 1.02, 0.98, 1.03, 0.97]
    widths = [bench.paired_ratio([1.0] * n, ratios[:n])["half_width"] for n in (2, 4, 6)]
    assert widths[0] > widths[1] > widths[2]


def test_the_stopping_rule_needs_every_configuration_narrow_and_the_minimum_rounds(bench):
    def summary(rounds, half_width):
        return {"rounds": rounds, "ratio": 1.0, "ci95": [0.99, 1.01], "half_width": half_width}

    narrow = {"batch width 1": summary(5, 0.02), "batch width 8": summary(5, 0.05)}
    assert bench.ab_settled(narrow, min_rounds=5, half_width=0.05)
    assert not bench.ab_settled(narrow, min_rounds=6, half_width=0.05)  # too few rounds, however narrow
    assert not bench.ab_settled({**narrow, "batch width 4": summary(5, 0.051)}, min_rounds=5, half_width=0.05)
    assert not bench.ab_settled({"x": summary(1, math.inf)}, min_rounds=1, half_width=0.05)


def test_each_pair_of_rounds_runs_both_orders(bench):
    orders = bench.ab_orders(0)
    rounds = [next(orders) for _ in range(20)]
    assert all(sorted(order) == ["base", "new"] for order in rounds)
    assert all(rounds[i] == rounds[i + 1][::-1] for i in range(0, 20, 2))
    assert {tuple(rounds[i]) for i in range(0, 20, 2)} == {("base", "new"), ("new", "base")}  # drawn, not fixed
