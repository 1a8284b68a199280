"""Measuring T(B, b), the seconds of one batched step of B rows at block b, for the batch's cost model.

`batch_cost_model(session, max_block)` returns the setup's model through
`policy.calibration.model_for`, as one request's curve: the same key (the
decoder named), file, fit, stability check and online correction. Measured by
stepping the batch decoder itself on private sessions at every (rows, block)
point, round after round (the first a warm-up), each row count's rounds
fitted as one request's are. docs/adaptive.md.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ..acceptance import Acceptor
from ..policy.calibration import PROMPT_TOKENS, calibration_key, grid_for, model_for
from ..policy.cost import CostModel, CostTable
from ..policy.fit import fitted_curve, instability
from ..sampling import SamplingSettings
from ..session import Session
from .engine import BatchDecoder

ROWS = (1, 2, 4, 8)
ROUNDS = 3  # the first is a warm-up


def batch_cost_model(session: Session, max_block: int, *, force: bool = False) -> CostModel:
    """This setup's model of T(B, b) up to `max_block` (measured at first use, then cached)."""
    key = {**calibration_key(session.target, session.proposer, max_block, decoder="batch"), "rows": list(ROWS)}

    def measure_table() -> tuple[CostTable, dict]:
        blocks = key["grid"]
        rounds = measure(session, max_block)
        lines = [fitted_curve(blocks, table) for table in rounds]
        return CostTable(blocks, lines, ROWS), {
            "rounds": ROUNDS - 1,
            "instability": round(max(instability(blocks, t) for t in rounds), 4),
        }

    return model_for(key, measure_table, force=force)


def measure(session: Session, max_block: int, rows=ROWS, rounds: int = ROUNDS) -> list[list[list[float]]]:
    """Per row count, seconds per step at every grid block, one list per timed round, on private
    sessions like `session`."""
    blocks = grid_for(max_block)
    fork = getattr(session.proposer, "fork", None)
    if session.proposer is not None and not callable(fork):
        raise ValueError(f"{type(session.proposer).__name__} has no fork(): a batch cannot be calibrated with it.")
    vocab = session.target.vocab_size
    out = []
    for n in rows:
        decoder = BatchDecoder(session.target, max_block)
        requests = []
        for r in range(n):
            prompt = mx.array([(7919 * i + 13 + 101 * r) % vocab for i in range(PROMPT_TOKENS)], mx.int32)
            private = Session(session.target, fork() if session.proposer is not None else None)
            requests.append((private, prompt, Acceptor(SamplingSettings(), prompt), -1, max_block))
        decoder.insert_many(requests)
        table = []
        for k in range(rounds):
            times = []
            for b in blocks:
                tic = time.perf_counter()
                decoder.step(block_size=b)
                mx.synchronize()
                times.append(time.perf_counter() - tic)
            if k:
                table.append(times)
        out.append(table)
    return out
