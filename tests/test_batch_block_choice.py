"""The batch's block (`batch.block_choice`) and its cost table (`batch.calibration`).

The table interpolates between measured (rows, block) points and extrapolates
past the last rows. The choice maximises the batch's expected tokens per
second: a large block for rows the drafter fits, plain batched decoding when
it fits none, a large block still when one row of several is a poor fit;
at b = 1 it probes now and then, as often as keeps failed probes to BUDGET of
the time (a probe of many rows costs several plain steps), and afresh for a
new batch. The table is measured once per setup
and cached on disk; a corrupt file is ignored and rewritten. Rows fixing
different blocks in one batch keep their own blocks and their greedy output.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import mlx.core as mx
import pytest

import dflash_mlx
from dflash_mlx.acceptance import Acceptor
from dflash_mlx.batch import calibration
from dflash_mlx.batch.block_choice import BatchBlockChoice
from dflash_mlx.batch.calibration import batch_cost_model
from dflash_mlx.batch.engine import BatchDecoder
from dflash_mlx.policy.choice import BUDGET
from dflash_mlx.policy.cost import THIN, WINDOW
from dflash_mlx.policy.cost import CostModel, CostTable
from dflash_mlx.policy.estimate import DISCOUNT, AcceptanceEstimate
from dflash_mlx.sampling import SamplingSettings
from dflash_mlx.session import make_session
from helpers import prompt_ids, without_eos


@dataclass
class Row:
    max_block: int
    estimate: AcceptanceEstimate


def compute_bound(rows, blocks) -> CostTable:
    """A CPU-like table: 10 ms plus 1 ms per verified token."""
    return CostTable(blocks, [[0.010 + 0.001 * n * b for b in blocks] for n in rows], rows)


def row(good: bool, max_block: int = 8) -> Row:
    """A row with a long history: every draft accepted (`good`), or none."""
    r = Row(max_block, AcceptanceEstimate(max_block - 1))
    for _ in range(60):
        r.estimate.observe(max_block - 1, max_block - 1 if good else 0)
    return r


def test_the_choice_weighs_blocks_against_plain_batched_decoding():
    cost = compute_bound([1, 2, 4, 8], [1, 2, 3, 4, 6, 8])
    choice = BatchBlockChoice(cost, 8)
    assert choice.best([row(True)]) == 8  # a drafter that is always right: the whole block
    assert choice.best([row(False) for _ in range(8)]) == 1  # never right: plain batched decoding
    assert choice.best([row(True), row(True), row(True), row(False)]) > 1  # one poor row does not pull the rest down
    assert choice.best([row(True, max_block=3)]) == 3  # a row's own largest block bounds it


def test_probes_at_plain_decoding_keep_to_their_budget_and_restart():
    table = compute_bound([1, 8], [1, 2, 8])
    choice = BatchBlockChoice(table, 8)
    rows = [row(False)]  # one row: a probe at block 2 loses about 1 ms against plain decoding's 11
    expected = rows[0].estimate.expected_tokens(2)[-1]  # (its drafts are hardly ever accepted)
    wait = max(WINDOW, math.ceil((table(2, 1) - expected * table(1, 1)) / (BUDGET * table(1, 1)))) - 1
    blocks = [choice.choose(rows) for _ in range(wait + 1)]
    assert blocks == [1] * wait + [2]
    choice.observe(rows, 2, [0])  # the probe accepted nothing: the next one waits as long
    assert [choice.choose(rows) for _ in range(wait + 1)] == [1] * wait + [2]
    choice.reset()
    assert [choice.choose(rows) for _ in range(wait + 1)][-1] == 2
    # 8 rows: a probe costs 26 ms where a plain step of the 8 costs 18: it comes much later
    choice = BatchBlockChoice(table, 8)
    rows = [row(False) for _ in range(8)]
    expected = 8 * rows[0].estimate.expected_tokens(2)[-1]
    wait = math.ceil((table(2, 8) - expected / 8 * table(1, 8)) / (BUDGET * table(1, 8))) - 1
    assert wait > 4 * WINDOW
    assert [choice.choose(rows) for _ in range(wait + 1)] == [1] * wait + [2]


def test_other_rows_are_decided_afresh():
    """A settled run of plain batched decoding holds for its rows: rows the drafter fits taking their places
    (as many) are decided at once, not at the next probe."""
    choice = BatchBlockChoice(compute_bound([1, 4], [1, 2, 8]), 8)
    poor = [row(False) for _ in range(4)]
    assert [choice.choose(poor) for _ in range(3)] == [1, 1, 1]
    assert choice.choose([row(True) for _ in range(4)]) == 8


def test_the_table_is_measured_once_and_cached(calibration_cache, tiny_pair, monkeypatch):
    from dflash_mlx.policy import calibration as shared

    monkeypatch.setattr(shared, "STABLE", float("inf"))  # cached whatever this machine's load
    model, tokenizer, draft = tiny_pair("qwen3")
    session = make_session(model, draft)
    calls = []
    real = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = batch_cost_model(session, 4)
    assert calls == [1] and first.table.rows == calibration.ROWS and first.table.blocks == (1, 2, 3, 4)
    assert all(list(line) == sorted(line) for line in first.table.seconds)  # each row count's line non-decreasing
    (written,) = calibration_cache.glob("*.json")
    doc = json.loads(written.read_text())
    assert doc["key"]["decoder"] == "batch" and doc["rows"] == list(calibration.ROWS)  # the single curve's format
    shared.forget()
    again = batch_cost_model(session, 4)  # from the file
    assert calls == [1] and again.table == first.table
    written.write_text("{ half")
    shared.forget()
    batch_cost_model(session, 4)  # corrupt: measured again and rewritten
    assert calls == [1, 1] and "seconds" in written.read_text()


def test_rows_fixing_different_blocks_keep_them(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    prompts = [prompt_ids(7, seed=11), prompt_ids(13, seed=12)]
    with without_eos(tokenizer) as tok:
        want = [
            [r.token for r in dflash_mlx.stream_generate(model, draft, tok, p, max_tokens=16, block_size=4)]
            for p in prompts
        ]
        sessions = [make_session(model, draft) for _ in prompts]
        decoder = BatchDecoder(sessions[0].target, 8)
        got, blocks = {}, {}
        for session, prompt, cap in zip(sessions, prompts, (2, 6)):
            p = mx.array(prompt)
            first = decoder.insert(session, p, Acceptor(SamplingSettings(), p), max_tokens=16, max_block=cap)
            got[first.uid], blocks[first.uid] = list(first.tokens), set()
        while decoder.rows:
            for r in decoder.step():
                got[r.uid].extend(r.tokens)
                blocks[r.uid].add(r.block_size)
    assert list(got.values()) == want
    assert list(blocks.values())[0] == {2} and 6 in list(blocks.values())[1]


def test_a_row_alone_times_its_steps_so_a_busy_curve_heals(calibration_cache, tiny_pair):
    """A row alone in the batch chooses as one request does, on its cost model: its steps are timed into
    that model (a curve cached on a busy machine is scaled by what this path's steps take, as the
    single-request loop's are), not left at the cached table with every level wanting timing forever."""
    from dflash_mlx.models.block_size import default_block_size
    from dflash_mlx.policy.calibration import calibration_key, cost_model, file_for, forget, grid_for

    model, tokenizer, draft = tiny_pair("qwen3")
    session = make_session(model, draft)
    max_block = default_block_size(model, draft)
    grid = grid_for(max_block)
    key = calibration_key(session.target, session.proposer, max_block)
    busy = [0.005 * (1 + 1.5 * (b - 1)) for b in grid]  # a block of 8 at 11.5 plain steps: two jobs on two cores
    doc = {"key": key, "rows": [1], "blocks": grid, "seconds": [busy], "learns": True, "source": "measured"}
    file_for(key).parent.mkdir(parents=True, exist_ok=True)
    file_for(key).write_text(json.dumps(doc, default=str))
    forget()
    with without_eos(tokenizer) as tok:
        for _ in dflash_mlx.stream_batch_generate(model, draft, tok, [prompt_ids(9, seed=3)], max_tokens=48):
            pass
    costs = cost_model(session.target, session.proposer, max_block)
    assert costs.table.line() == pytest.approx(busy)  # (the cached curve, as the row read it)
    assert costs.cycles >= 20 and min(costs.level(source)[2] for source in ("target", "drafter")) >= THIN


def test_a_batch_step_is_observed_once(calibration_cache, tiny_pair):
    """Each step of several rows reaches the batch's choice once: one timed cycle in its cost model per step
    at the width it chose, and each row's acceptance counted once."""
    model, _, draft = tiny_pair("qwen3")
    grid = (1, 2, 4, 8)
    table = CostTable(grid, [[0.01 * (1 + 0.02 * (b - 1)) * n for b in grid] for n in (1, 2, 4, 8)], (1, 2, 4, 8))
    choice = BatchBlockChoice(CostModel(table), 8)  # (blocks cheap: the rows draft)
    prompts = [prompt_ids(7, seed=11), prompt_ids(13, seed=12)]
    sessions = [make_session(model, draft) for _ in prompts]
    decoder = BatchDecoder(sessions[0].target, 8, choice)
    for session, prompt in zip(sessions, prompts):
        p = mx.array(prompt)
        decoder.insert(session, p, Acceptor(SamplingSettings(), p), max_tokens=24)
    seen, steps = [], 0
    while len(decoder.rows) == 2:
        before = [list(r.estimate.seen) for r in decoder.rows]
        widths = {r.block_size for r in decoder.step()}
        steps += 1
        if len(decoder.rows) == 2 and widths != {1}:
            after = [r.estimate.seen[0] for r in decoder.rows]
            seen += [round(a - b[0] * DISCOUNT, 6) for a, b in zip(after, before)]
    assert steps > 3 and 0 < choice.cost.cycles <= steps  # (the first cycle after a change of source is not timed)
    assert seen and set(seen) == {1.0}  # (position 0 observed once per drafted step: discounted, plus one)
