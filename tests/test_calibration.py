"""The cost-curve calibration: measured at first use (again while its rounds disagree), cached on disk,
reused, rewritten when unusable or when the loop's own cycles contradict it.

Every test points DFLASH_MLX_CACHE_DIR at its own directory and forgets the
process's cost models, so what is on disk decides.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_mlx import make_session, stream_generate
from dflash_mlx.policy import calibration
from dflash_mlx.policy.base import ScheduledBlocks
from dflash_mlx.policy.calibration import (
    GRID,
    calibration_key,
    clear_calibrations,
    cost_model,
    file_for,
    grid_for,
    read_table,
)
from dflash_mlx.policy.cost import CostTable
from dflash_mlx.policy.fit import affine_past_one, fitted_curve, instability, non_decreasing, polished
from dflash_mlx.targets.quantized_kv import KVQuantization
from helpers import prompt_ids, without_eos


@pytest.fixture(scope="module")
def setup(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    session = make_session(model, draft)
    return model, tokenizer, draft, session.target, session.proposer


def key_of(target, proposer, max_block, kv=None):
    return calibration_key(target, proposer, max_block, kv)


@pytest.fixture
def stable(monkeypatch):
    """Calibrations count as stable whatever this machine's load (their rounds' agreement is tested apart)."""
    monkeypatch.setattr(calibration, "STABLE", float("inf"))


def test_first_use_measures_and_writes_the_curve(calibration_cache, setup, stable):
    model, tokenizer, draft, target, proposer = setup
    with without_eos(tokenizer) as tok:
        out = list(stream_generate(model, draft, tok, prompt_ids(8), max_tokens=10))  # adaptive: calibrates
    assert len(out) == 10
    files = list(calibration_cache.glob("*.json"))
    assert len(files) == 1 and files[0] == file_for(key_of(target, proposer, draft.config.block_size))
    doc = json.loads(files[0].read_text())
    assert doc["blocks"] == grid_for(draft.config.block_size) == [b for b in GRID if b < 16] + [16]
    assert doc["rows"] == [1] and len(doc["seconds"]) == 1
    line = doc["seconds"][0]
    assert all(t > 0 for t in line) and doc["calibration_seconds"] > 0 and doc["source"] == "measured"
    assert line == sorted(line)  # fitted non-decreasing
    assert doc["instability"] >= 0 and doc["stable"] and doc["attempts"] == 1
    assert doc["key"]["mlx"] and doc["key"]["target"]["parameters"] > 0 and doc["key"]["draft"]["block_size"] == 16
    assert doc["key"]["decoder"] == "single" and doc["key"]["kv"] is None


def test_a_cached_curve_is_reused_without_measuring(calibration_cache, setup, stable, monkeypatch):
    _, _, draft, target, proposer = setup
    first = cost_model(target, proposer, 8)
    calibration.forget()

    def refuse(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "measure", refuse)
    again = cost_model(target, proposer, 8)
    assert again.table == first.table and again.table.blocks == tuple(grid_for(8)) and again.notes["read"]
    assert cost_model(target, proposer, 8) is again  # this process's model of it


def write(target, proposer, max_block, seconds, **notes):
    key = key_of(target, proposer, max_block)
    path = file_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "key": json.loads(json.dumps(key, default=str)),
                "rows": [1],
                "blocks": grid_for(max_block),
                "seconds": [seconds],
                **notes,
            }
        )
    )
    return path


def test_a_model_in_memory_is_used_until_forgotten(calibration_cache, setup, monkeypatch):
    _, _, _, target, proposer = setup
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured"))
    path = write(target, proposer, 4, [0.01, 0.02, 0.03, 0.04])
    assert cost_model(target, proposer, 4).table.line() == (0.01, 0.02, 0.03, 0.04)
    write(target, proposer, 4, [0.01, 0.011, 0.012, 0.013])
    assert cost_model(target, proposer, 4).table.line() == (0.01, 0.02, 0.03, 0.04)  # the process's model
    calibration.forget("not-this-one")
    assert cost_model(target, proposer, 4).table.line() == (0.01, 0.02, 0.03, 0.04)
    calibration.forget(path.stem)
    assert cost_model(target, proposer, 4).table.line() == (0.01, 0.011, 0.012, 0.013)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "bad numbers", "empty"])
def test_a_corrupt_or_stale_file_is_ignored_and_rewritten(calibration_cache, setup, stable, damage):
    _, _, _, target, proposer = setup
    key = key_of(target, proposer, 4)
    path = file_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    good = {"key": key, "rows": [1], "blocks": grid_for(4), "seconds": [[0.01, 0.02, 0.03, 0.04]]}
    text = {
        "garbage": "not json at all {",
        "truncated": json.dumps(good)[:40],
        "other key": json.dumps(dict(good, key=dict(key, mlx="0.0.1"))),
        "bad numbers": json.dumps(dict(good, seconds=[[0.01, -1, 0.03, 0.04]])),
        "empty": "",
    }[damage]
    path.write_text(text)
    assert read_table(key) is None
    model = cost_model(target, proposer, 4)  # measured, not fatal
    assert model.table.line() != tuple(good["seconds"][0])
    doc = json.loads(path.read_text())  # rewritten, whole
    assert doc["key"] == json.loads(json.dumps(key)) and doc["seconds"] == [list(model.table.line())]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_the_key_tells_setups_apart(setup, tiny_pair):
    _, _, _, target, proposer = setup
    bf16, _, bf16_draft = tiny_pair("qwen3", dtype="bfloat16")
    other = make_session(bf16, bf16_draft)
    kv4, kv8 = KVQuantization(4), KVQuantization(8, 64, 0)
    keys = [
        key_of(target, proposer, 8),
        key_of(target, proposer, 16),
        key_of(other.target, other.proposer, 8),
        key_of(target, None, 8),
        key_of(target, proposer, 8, kv4),
        key_of(target, proposer, 8, kv8),
        calibration_key(target, proposer, 8, decoder="batch"),
        calibration_key(target, proposer, 8, sampled=True),
    ]
    assert len({json.dumps(k, sort_keys=True, default=str) for k in keys}) == len(keys)
    assert {"device", "chip", "mlx", "blas", "format", "kv", "decoder", "sampling"} <= set(keys[0])


def test_clear_and_force(calibration_cache, setup, stable, monkeypatch):
    _, _, _, target, proposer = setup
    cost_model(target, proposer, 4)
    assert clear_calibrations() == 1 and not list(calibration_cache.glob("*.json"))
    calls = []
    real = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    cost_model(target, proposer, 4)
    cost_model(target, proposer, 4)
    cost_model(target, proposer, 4, force=True)
    assert len(calls) == 2


QUIET_ROUNDS = [
    [0.005, 0.0095, 0.0098, 0.010],
    [0.0052, 0.0097, 0.0101, 0.0103],
    [0.0049, 0.0094, 0.0096, 0.0099],
    [0.0050, 0.0096, 0.0099, 0.0102],
]
STALLED_ROUNDS = [row[:] for row in QUIET_ROUNDS]
STALLED_ROUNDS[1][2] *= 3  # a moment's stall in one round: the medians ignore it
BUSY_ROUNDS = [
    [0.005, 0.010, 0.011, 0.012],
    [0.009, 0.010, 0.011, 0.012],
    [0.005, 0.019, 0.020, 0.021],
    [0.007, 0.030, 0.031, 0.032],
]  # the shape changes from round to round


def test_how_far_the_rounds_disagree():
    grid = grid_for(4)
    assert instability(grid, QUIET_ROUNDS) < 0.05 and instability(grid, STALLED_ROUNDS) < 0.05
    assert instability(grid, BUSY_ROUNDS) > calibration.STABLE
    assert instability(grid, QUIET_ROUNDS[:1]) == 0 and instability([1], QUIET_ROUNDS) == 0
    assert instability([1, 2], [[1.0, 2.0], [2.0, 4.0]]) == pytest.approx(0)  # slower, the same shape


def test_rounds_that_disagree_are_measured_again_and_cached_once_stable_or_confirmed(
    calibration_cache, setup, monkeypatch
):
    """A busy machine's rounds disagree on T(b) / T(1): the calibration measures again, keeps the most
    stable and caches it only once stable; an unstable one is used in this process, never cached."""
    _, _, _, target, proposer = setup
    tables = [BUSY_ROUNDS, QUIET_ROUNDS]
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: tables.pop(0))
    model = cost_model(target, proposer, 4)
    assert not tables and model.notes["attempts"] == 2 and model.notes["stable"]
    path = file_for(key_of(target, proposer, 4))
    doc = json.loads(path.read_text())
    assert doc["seconds"] == [pytest.approx(fitted_curve(grid_for(4), QUIET_ROUNDS))]
    assert doc["instability"] == pytest.approx(instability(grid_for(4), QUIET_ROUNDS), abs=1e-4)

    tables[:] = [BUSY_ROUNDS] * calibration.ATTEMPTS
    busy = cost_model(target, proposer, 4, force=True)
    assert not tables and not busy.notes["stable"] and busy.notes["attempts"] == calibration.ATTEMPTS
    assert json.loads(path.read_text()) == doc  # the cached one stands
    assert busy.table.line() == pytest.approx(fitted_curve(grid_for(4), BUSY_ROUNDS))  # used, in this process
    for _ in range(4):  # the loop's cycles agree with it: it is still not cached
        for b in (4, 1, 4, 1):
            busy.add("drafter" if b > 1 else "target", b, busy.table(b))
    assert json.loads(path.read_text()) == doc


def test_the_loop_scales_a_cached_curve_in_its_process_and_leaves_the_file_alone(calibration_cache, setup, monkeypatch):
    """A cached curve from a busy machine (blocks look dear): the loop's cycles on a quiet one scale it in
    this process's model (its ratio of the drafter to plain decoding); the file stays what was measured."""
    _, _, _, target, proposer = setup
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: pytest.fail("measured"))
    busy = [0.0075, 0.0187, 0.0210, 0.0232]
    quiet = CostTable.curve(grid_for(4), [0.0050, 0.0095, 0.00975, 0.0100])
    path = write(target, proposer, 4, busy, source="measured")
    before = path.read_text()
    model = cost_model(target, proposer, 4)
    for _ in range(6):  # runs of block 4 with plain steps among them, as re-timing makes them
        for b in (4, 4, 4, 1, 1, 4):
            model.add("drafter" if b > 1 else "target", b, quiet(b))
    assert model.seconds("drafter", 4) / model.seconds("target", 1) == pytest.approx(2.0, rel=0.05)
    assert path.read_text() == before
    calibration.forget()
    again = cost_model(target, proposer, 4)
    assert again.table.line() == tuple(busy) and again.seconds("drafter", 4) == again.table(4)  # afresh


def test_a_pinned_curve_does_not_learn(calibration_cache, setup, monkeypatch):
    _, _, _, target, proposer = setup
    write(target, proposer, 4, [0.0075, 0.0187, 0.0210, 0.0232], learns=False)
    model = cost_model(target, proposer, 4)
    assert not model.learns and model.stale("drafter") is None


@pytest.mark.slow
def test_the_calibrate_command_on_the_bundled_pair(tmp_path):
    """The real console script: measure (saying how far its rounds agreed), then read from the cache (or,
    on a machine too busy to cache it, measure again), then clear."""
    env_dir = tmp_path / "cache"
    import os

    env = dict(os.environ, DFLASH_MLX_CACHE_DIR=str(env_dir))
    exe = shutil.which("dflash-mlx")
    first = subprocess.run(
        [exe, "calibrate", "--json"], capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL
    )
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout.strip().splitlines()[-1])
    assert doc["model"] == "demo" and doc["cached"] is False and doc["max_block_size"] == 8
    assert [r["block"] for r in doc["curve"]] == grid_for(8) and doc["curve"][0]["break_even_tokens_per_cycle"] == 1
    assert doc["source"] == "measured" and doc["stable"] == (doc["instability"] <= calibration.STABLE)
    assert doc["written"] == doc["stable"] == (env_dir / "calibration" / Path(doc["file"]).name).exists()
    table = subprocess.run(
        [exe, "calibrate"], capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL
    )
    said = " ".join(table.stdout.split())
    assert table.returncode == 0 and "tokens/cycle to beat" in said and "rounds agree on T(b) / T(1) within" in said
    assert ("read from the cache" in said) if doc["written"] else ("not cached" in said or "measured in" in said)
    files = len(list((env_dir / "calibration").glob("*.json")))
    cleared = subprocess.run(
        [exe, "calibrate", "--clear"], capture_output=True, text=True, env=env, timeout=600, stdin=subprocess.DEVNULL
    )
    assert cleared.returncode == 0 and f"Removed {files} cached calibration" in " ".join(cleared.stdout.split())
    assert not list((env_dir / "calibration").glob("*.json"))
    bad = subprocess.run(
        [exe, "calibrate", "--clear", "--force"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
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
    long = {1: calibration.PLAIN_STRETCH, 2: calibration.DRAFT_STRETCH, 4: calibration.DRAFT_STRETCH}
    short = {1: 6, 2: 2, 4: 2}  # (halved, rounded up)
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
