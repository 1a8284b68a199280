"""The cost-curve calibration: measured once, cached on disk, reused, rewritten when unusable.

Every test points DFLASH_MLX_CACHE_DIR at its own directory and forgets the
in-memory curves, so what is on disk decides.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from dflash_mlx import make_session, stream_generate
from dflash_mlx.policy import calibration
from dflash_mlx.policy.base import ScheduledBlocks
from dflash_mlx.policy.calibration import (
    GRID, cached_curve, calibration_file, calibration_key, clear_calibrations, cost_curve, grid_for,
)
from dflash_mlx.policy.fit import (
    affine_past_one, draft_floor, fitted_curve, non_decreasing, plausible, polished, with_floor,
)
from helpers import prompt_ids, without_eos


@pytest.fixture(scope="module")
def setup(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    session = make_session(model, draft)
    return model, tokenizer, draft, session.target, session.proposer


def test_first_use_measures_and_writes_the_curve(calibration_cache, setup):
    model, tokenizer, draft, target, proposer = setup
    with without_eos(tokenizer) as tok:
        out = list(stream_generate(model, draft, tok, prompt_ids(8), max_tokens=10))  # adaptive: calibrates
    assert len(out) == 10
    files = list(calibration_cache.glob("*.json"))
    assert len(files) == 1 and files[0] == calibration_file(target, proposer, draft.config.block_size)
    doc = json.loads(files[0].read_text())
    assert doc["grid"] == grid_for(draft.config.block_size) == [b for b in GRID if b < 16] + [16]
    assert all(t > 0 for t in doc["seconds"]) and doc["calibration_seconds"] > 0
    assert doc["seconds"] == sorted(doc["seconds"])  # fitted non-decreasing
    assert doc["key"]["mlx"] and doc["key"]["target"]["parameters"] > 0 and doc["key"]["draft"]["block_size"] == 16


def test_a_cached_curve_is_reused_without_measuring(calibration_cache, setup, monkeypatch):
    _, _, draft, target, proposer = setup
    first = cost_curve(target, proposer, 8)
    calibration.forget_curve()

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "measure", refuse)
    again = cost_curve(target, proposer, 8)
    assert again.seconds == first.seconds and again.grid == first.grid == grid_for(8)
    assert cached_curve(target, proposer, 8).seconds == first.seconds


def test_a_curve_in_memory_is_used_until_forgotten(calibration_cache, setup, monkeypatch):
    _, _, _, target, proposer = setup
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured"))
    path = calibration_file(target, proposer, 4)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(seconds):
        path.write_text(json.dumps({"key": json.loads(json.dumps(calibration_key(target, proposer, 4), default=str)),
                                    "grid": grid_for(4), "seconds": seconds}))  # fmt: skip

    write([0.01, 0.02, 0.03, 0.04])
    assert cost_curve(target, proposer, 4).seconds == [0.01, 0.02, 0.03, 0.04]
    write([0.01, 0.011, 0.012, 0.013])
    assert cost_curve(target, proposer, 4).seconds == [0.01, 0.02, 0.03, 0.04]  # the process's copy
    calibration.forget_curve("not-this-one")
    assert cost_curve(target, proposer, 4).seconds == [0.01, 0.02, 0.03, 0.04]
    calibration.forget_curve(path.stem)
    assert cost_curve(target, proposer, 4).seconds == [0.01, 0.011, 0.012, 0.013]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "bad numbers", "empty"])
def test_a_corrupt_or_stale_file_is_ignored_and_rewritten(calibration_cache, setup, damage):
    _, _, _, target, proposer = setup
    path = calibration_file(target, proposer, 4)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = calibration_key(target, proposer, 4)
    good = {"key": key, "grid": grid_for(4), "seconds": [0.01, 0.02, 0.03, 0.04]}
    text = {
        "garbage": "not json at all {",
        "truncated": json.dumps(good)[:40],
        "other key": json.dumps(dict(good, key=dict(key, mlx="0.0.1"))),
        "bad numbers": json.dumps(dict(good, seconds=[0.01, -1, 0.03, 0.04])),
        "empty": "",
    }[damage]
    path.write_text(text)
    assert cached_curve(target, proposer, 4) is None
    curve = cost_curve(target, proposer, 4)  # measured, not fatal
    assert curve.seconds != good["seconds"]
    doc = json.loads(path.read_text())  # rewritten, whole
    assert doc["key"] == json.loads(json.dumps(key)) and doc["seconds"] == curve.seconds
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_the_key_tells_setups_apart(setup, tiny_pair):
    _, _, _, target, proposer = setup
    bf16, _, bf16_draft = tiny_pair("qwen3", dtype="bfloat16")
    other = make_session(bf16, bf16_draft)
    keys = [calibration_key(target, proposer, 8), calibration_key(target, proposer, 16),
            calibration_key(other.target, other.proposer, 8), calibration_key(target, None, 8)]  # fmt: skip
    assert len({json.dumps(k, sort_keys=True, default=str) for k in keys}) == 4
    assert {"device", "chip", "mlx", "blas", "format"} <= set(keys[0])


def test_clear_and_force(calibration_cache, setup, monkeypatch):
    _, _, _, target, proposer = setup
    cost_curve(target, proposer, 4)
    assert clear_calibrations() == 1 and not list(calibration_cache.glob("*.json"))
    calls = []
    real = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(calibration, "draft_seconds", lambda t, p, blocks: [0.0] * len(blocks))  # no re-measuring
    cost_curve(target, proposer, 4)
    cost_curve(target, proposer, 4)
    cost_curve(target, proposer, 4, force=True)
    assert len(calls) == 2


@pytest.mark.slow
def test_the_calibrate_command_on_the_bundled_pair(tmp_path):
    """The real console script: measure, then read from the cache, then clear."""
    env_dir = tmp_path / "cache"
    import os

    env = dict(os.environ, DFLASH_MLX_CACHE_DIR=str(env_dir))
    exe = shutil.which("dflash-mlx")
    first = subprocess.run([exe, "calibrate", "--json"], capture_output=True, text=True, env=env, timeout=600,
                           stdin=subprocess.DEVNULL)  # fmt: skip
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout.strip().splitlines()[-1])
    assert doc["model"] == "demo" and doc["cached"] is False and doc["max_block_size"] == 8
    assert [r["block"] for r in doc["curve"]] == grid_for(8) and doc["curve"][0]["break_even_tokens_per_cycle"] == 1
    table = subprocess.run([exe, "calibrate"], capture_output=True, text=True, env=env, timeout=600,
                           stdin=subprocess.DEVNULL)  # fmt: skip
    assert table.returncode == 0 and "read from the cache" in table.stdout and "tokens/cycle to beat" in table.stdout
    cleared = subprocess.run([exe, "calibrate", "--clear"], capture_output=True, text=True, env=env, timeout=600,
                             stdin=subprocess.DEVNULL)  # fmt: skip
    assert cleared.returncode == 0 and "Removed 1 cached calibration" in " ".join(cleared.stdout.split())
    assert not list((env_dir / "calibration").glob("*.json"))
    bad = subprocess.run([exe, "calibrate", "--clear", "--force"], capture_output=True, text=True, env=env,
                         timeout=600, stdin=subprocess.DEVNULL)  # fmt: skip
    assert bad.returncode != 0 and "--clear" in bad.stderr + bad.stdout


def test_the_fitted_curve_is_the_closest_non_decreasing_one():
    # the demo pair's medians on one machine: block 3's and 6's below their left neighbours'
    measured = [8.7, 15.8, 14.3, 16.4, 15.1, 17.2]
    assert non_decreasing(measured) == pytest.approx([8.7, 15.05, 15.05, 15.75, 15.75, 17.2])
    assert non_decreasing([3.0, 2.0, 1.0]) == pytest.approx([2.0] * 3) and non_decreasing([1.0, 2.0]) == [1.0, 2.0]


def test_a_rounds_drift_cancels_in_the_polished_levels():
    true = [5.0, 8.0, 8.5, 9.0, 10.0, 11.0]
    drift = [1.0, 1.6, 0.9, 1.3, 1.0]  # the machine busier in some rounds: every block alike
    table = [[d * t for t in true] for d in drift]
    table[2][3] *= 1.5  # and one stall
    levels = polished(table)
    assert [x / levels[0] for x in levels] == pytest.approx([t / true[0] for t in true], rel=1e-6)
    assert levels[0] == pytest.approx(true[0], rel=1e-6)  # at the median round's level
    medians = [sorted(row[j] for row in table)[2] for j in range(len(true))]
    assert medians[3] / medians[0] != pytest.approx(true[3] / true[0], rel=0.05)  # per-block medians keep it


def test_blocks_past_one_are_fitted_with_a_line_unless_it_misses():
    grid = [1, 2, 3, 4, 6, 8]
    noisy = [6.0, 11.6, 12.1, 12.1, 12.1, 15.6]  # a calibration that made b = 8 look 29% dearer than b = 6
    line = affine_past_one(grid, noisy)
    assert line[0] == 6.0 and all(b > a for a, b in zip(line[1:], line[2:]))
    assert line[5] / line[4] < 1.1 and sum(line[1:]) == pytest.approx(sum(noisy[1:]))
    assert affine_past_one(grid, [6.0, 9.0, 8.0, 7.0, 6.5, 6.5])[1:] == pytest.approx([7.4] * 5)  # slope >= 0
    knee = [20.0, 21.0, 21.0, 21.0, 21.0, 21.0, 40.0, 80.0]  # flat, then compute-bound: the line misses
    assert affine_past_one([1, 2, 3, 4, 6, 8, 12, 16], knee) == knee
    assert affine_past_one([1, 2, 3], [1.0, 2.0, 3.5]) == [1.0, 2.0, 3.5]  # too few blocks for a line
    table = [[6.0, 11.6, 12.1, 12.1, 12.1, 15.6], [6.2, 11.9, 12.0, 12.6, 12.9, 13.1]]
    fitted = fitted_curve(grid, table)
    assert fitted == non_decreasing(fitted) and fitted[0] == pytest.approx(6.1, rel=0.01)


def test_the_rounds_stop_at_the_time_budget_after_the_minimum(setup):
    """A model whose rounds take long calibrates in about BUDGET_SECONDS: past MIN_ROUNDS no round starts
    that would end after the budget; without one (sharded ranks) every round runs."""
    _, _, _, target, proposer = setup
    grid = grid_for(4)
    spent = calibration.measure(target, proposer, grid, rounds=4, budget=0.0)
    assert len(spent) == calibration.MIN_ROUNDS and all(len(row) == len(grid) for row in spent)
    assert len(calibration.measure(target, proposer, grid, rounds=4, budget=None)) == 4
    assert len(calibration.measure(target, proposer, grid, rounds=3, budget=60.0)) == 3
    another = calibration.another_round
    assert another(0, 5.0, 5.0, 1.5) and another(calibration.MIN_ROUNDS - 1, 5.0, 5.0, 1.5)  # the minimum
    # a large model (0.5 s rounds) stops where the next round would overrun, not after it
    assert another(2, 0.9, 0.45, 1.5) and not another(3, 1.35, 0.45, 1.5)
    assert not another(2, 1.1, 0.5, 1.5) and another(2, 1.0, 0.5, 1.5)


def test_long_rounds_take_the_shorter_stretches():
    """A model whose MIN_ROUNDS rounds of the long stretches would overrun the budget (judged by its
    warm-up cycles) is timed in the short ones; sharded ranks (no budget) always take the long ones."""
    grid = [1, 2, 4]
    long = {1: calibration.STRETCH[1], 2: calibration.DRAFT_STRETCH, 4: calibration.DRAFT_STRETCH}
    short = {1: calibration.SHORT_STRETCH[1], 2: calibration.SHORT_DRAFT_STRETCH, 4: calibration.SHORT_DRAFT_STRETCH}
    assert sum(short.values()) < sum(long.values())
    fast, slow = [0.004, 0.007, 0.008], [0.05, 0.07, 0.08]  # the demo pair here; a large model on a Mac
    assert calibration.stretches(grid, fast, 1.5, 0.1) == long
    assert calibration.stretches(grid, slow, 1.5, 0.1) == short
    assert calibration.stretches(grid, slow, None, 0.1) == long
    assert calibration.stretches(grid, slow[:1], 1.5, 0.1) == long  # no warm-up seen (a b = 1 chain)
    round_seconds = sum(long[b] * t for b, t in zip(grid, fast))
    edge = 0.1 + calibration.MIN_ROUNDS * round_seconds
    assert calibration.stretches(grid, fast, edge, 0.1) == long
    assert calibration.stretches(grid, fast, edge * 0.99, 0.1) == short


def test_a_schedule_asks_for_its_rest_once_it_runs_out():
    asked = []

    def rest(seconds):
        asked.append(list(seconds))
        return [2, 9, 1]

    policy = ScheduledBlocks([1, 4], then=rest)
    picks = []
    for _ in range(5):
        picks.append(policy.choose(16))
        policy.observe(picks[-1], 0, 0.5)
    assert picks == [1, 4, 2, 4, 1] and asked == [[(1, 0.5), (4, 0.5)]]  # capped at the given maximum
    assert policy.done


def test_the_drafters_floor_tells_a_busy_machines_curve():
    grid = [1, 2, 3, 4, 6, 8]
    floor = draft_floor(grid, [2, 8], [1.2, 1.8])
    assert floor == pytest.approx([0.0, 1.2, 1.3, 1.4, 1.6, 1.8])
    assert draft_floor([1, 2, 4], [2], [1.0]) == [0.0, 1.0, 1.0] and draft_floor([1], [], []) == [0.0]
    quiet = [4.5, 6.8, 7.0, 7.3, 7.8, 8.3]  # the demo pair here: T(2) - T(1) = 2.3 ms, its drafter 1.2 ms
    busy = [7.2, 7.4, 7.5, 7.6, 7.8, 9.2]  # half a core taken 30 ms at a time: blocks look almost free
    assert plausible(quiet, floor) and with_floor(quiet, floor) == quiet
    assert not plausible(busy, floor)
    lifted = with_floor(busy, floor)
    assert lifted == pytest.approx([7.2, 8.4, 8.5, 8.6, 8.8, 9.2]) and lifted == sorted(lifted)
    assert plausible(lifted, floor)
    assert with_floor([5.0, 6.0, 6.1, 6.2], [0.0, 4.4, 1.0, 2.0]) == pytest.approx([5.0, 9.4, 9.4, 9.4])  # monotone


def test_a_curve_under_the_drafters_floor_is_measured_again_and_kept_on_it(calibration_cache, setup, monkeypatch):
    _, _, _, target, proposer = setup
    grid = grid_for(4)
    busy = [[0.0072, 0.0073, 0.0074, 0.0075]] * 4  # blocks that look free over a plain step
    quiet = [[0.0045, 0.0068, 0.0070, 0.0073]] * 4
    tables = [busy, quiet]
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: tables.pop(0))
    monkeypatch.setattr(calibration, "draft_seconds", lambda t, p, blocks: [0.0012 if b == 2 else 0.0016
                                                                              for b in blocks])
    curve = cost_curve(target, proposer, 4)
    assert not tables  # measured twice
    doc = json.loads(calibration_file(target, proposer, 4).read_text())
    assert doc["remeasured"] and doc["rounds"] == 8 and doc["draft_seconds"] == {"2": 0.0012, "4": 0.0016}
    floor = draft_floor(grid, [2, 4], [0.0012, 0.0016])
    assert all(t >= curve.seconds[0] + d - 1e-12 for t, d in zip(curve.seconds, floor))
    assert doc["seconds"] == curve.seconds and doc["plausible"] == plausible(curve.seconds, floor)

    calibration.forget_curve()  # busy every time: measured twice, lifted onto the floor, cached
    tables[:] = [busy, busy]
    curve = cost_curve(target, proposer, 4, force=True)
    doc = json.loads(calibration_file(target, proposer, 4).read_text())
    assert not tables and doc["remeasured"] and not doc["plausible"]
    assert curve.seconds == pytest.approx([0.0072, 0.0072 + 0.0012, 0.0072 + 0.0014, 0.0072 + 0.0016])

    tables[:] = [quiet, busy]  # a plausible curve is measured once
    curve = cost_curve(target, proposer, 4, force=True)
    assert tables == [busy] and curve.seconds == pytest.approx(fitted_curve(grid, quiet))
    assert not json.loads(calibration_file(target, proposer, 4).read_text())["remeasured"]


def test_the_drafter_is_timed_alone_on_a_private_copy(setup):
    model, tokenizer, draft, target, proposer = setup
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        before = [r.token for r in stream_generate(model, draft, tok, prompt_ids(8), max_tokens=12, block_size=4,
                                                   session=session)]  # fmt: skip
        state = [a.tolist() for c in session.proposer.cache for a in c.state]
        seconds = calibration.draft_seconds(session.target, session.proposer, [2, 16])
        assert len(seconds) == 2 and 0 < seconds[0] <= seconds[1]
        assert [a.tolist() for c in session.proposer.cache for a in c.state] == state  # the session's drafter untouched
        again = [r.token for r in stream_generate(model, draft, tok, prompt_ids(8), max_tokens=12, block_size=4,
                                                  session=session)]  # fmt: skip
    assert again == before and session.reused > 0

    class NoFork:
        layer_ids = ()

    assert calibration.draft_seconds(target, NoFork(), [2, 8]) == [0.0, 0.0]


def test_a_setup_seen_before_skips_the_key_until_a_model_changes_in_place(calibration_cache, tiny_pair_dirs,
                                                                          monkeypatch):
    """The process remembers which curve a (target, drafter) pair maps to while their facts stand; a target
    quantized in place is a new setup (its own key and file), not the old curve."""
    import mlx.nn as nn
    from mlx_lm import load

    from dflash_mlx import load_draft

    target_dir, draft_dir = tiny_pair_dirs("qwen3")
    model, _ = load(str(target_dir))  # a private copy: it is changed below
    session = make_session(model, load_draft(draft_dir, model))
    target, proposer = session.target, session.proposer
    first = cost_curve(target, proposer, 4)
    monkeypatch.setattr(calibration, "calibration_key", lambda *a: pytest.fail("the key was built again"))
    assert cost_curve(target, proposer, 4) is first
    monkeypatch.undo()
    old_file = calibration_file(target, proposer, 4)
    nn.quantize(model, group_size=32, bits=4)
    measured = []
    real = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))
    second = cost_curve(target, proposer, 4)
    assert measured and second is not first
    assert calibration_key(target, proposer, 4)["target"]["bits"] == 4
    assert calibration_file(target, proposer, 4) != old_file and calibration_file(target, proposer, 4).exists()
    calibration.forget_curve()  # (clear_calibrations and forget_curve drop it: the next lookup builds the key)
    monkeypatch.setattr(calibration, "calibration_key", lambda *a: pytest.fail("the key was built again"))
    with pytest.raises(pytest.fail.Exception):
        cost_curve(target, proposer, 4)
