"""Measuring T(B, b), the seconds of one batched step of B rows at block b, once per setup.

`batch_cost(session, max_block)` returns the table for the session's target
and drafter on this machine: from memory, else from the calibration cache
(`<cache>/calibration/batch-<key>.json`, next to `policy.calibration`'s
curves and cleared with them), else measured by stepping the batch decoder
itself on private sessions at every (rows, block) point, the fastest of a few
rounds each, each row count's line non-decreasing. Between points the table
is interpolated linearly; past the last rows, extrapolated. docs/adaptive.md.
"""

from __future__ import annotations

import json
import threading
import time
import warnings

import mlx.core as mx

from ..acceptance import Acceptor
from ..policy.calibration import PROMPT_TOKENS, _digest, calibration_dir, calibration_key
from ..policy.fit import non_decreasing
from ..sampling import SamplingSettings
from ..session import Session
from ..utils.io import write_json_atomic
from .engine import BatchDecoder

FORMAT = 1
ROWS = (1, 2, 4, 8)
BLOCKS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ROUNDS = 3  # the first is a warm-up

_memo: dict[str, BatchCost] = {}
_lock = threading.Lock()


def _between(xs: list[int], ys: list[float], x: int) -> float:
    """ys at x, linear between the points, extrapolated from the last two past them."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return ys[-1] + slope * (x - xs[-1])


class BatchCost:
    """T(B, b) from a measured table: seconds[i][j] at rows[i], blocks[j]."""

    def __init__(self, rows: list[int], blocks: list[int], seconds: list[list[float]]):
        if len(seconds) != len(rows) or any(len(r) != len(blocks) for r in seconds):
            raise ValueError("A batch cost table needs one time per (rows, block) point.")
        if any(not (t > 0) for r in seconds for t in r):
            raise ValueError("Step times must be positive.")
        self.rows, self.blocks, self.seconds = list(rows), list(blocks), [list(r) for r in seconds]

    def __call__(self, rows: int, b: int) -> float:
        at_rows = [_between(self.blocks, line, b) for line in self.seconds]
        return _between(self.rows, at_rows, rows)


def forget_costs() -> None:
    """Drop this process's copies of the tables: the next lookup reads the cache files."""
    with _lock:
        _memo.clear()


def grid(max_block: int) -> list[int]:
    return sorted({b for b in BLOCKS if b < max_block} | {max_block})


def measure(session: Session, max_block: int, rows=ROWS, rounds: int = ROUNDS) -> list[list[float]]:
    """Seconds per step at every (rows, block) point, on private sessions like `session`."""
    blocks = grid(max_block)
    fork = getattr(session.proposer, "fork", None)
    if session.proposer is not None and not callable(fork):
        raise ValueError(f"{type(session.proposer).__name__} has no fork(): a batch cannot be calibrated with it.")
    vocab = session.target.vocab_size
    table = []
    for n in rows:
        decoder = BatchDecoder(session.target, max_block)
        requests = []
        for r in range(n):
            prompt = mx.array([(7919 * i + 13 + 101 * r) % vocab for i in range(PROMPT_TOKENS)], mx.int32)
            private = Session(session.target, fork() if session.proposer is not None else None)
            requests.append((private, prompt, Acceptor(SamplingSettings(), prompt), -1, max_block))
        decoder.insert_many(requests)
        samples: dict[int, list[float]] = {b: [] for b in blocks}
        for k in range(rounds):
            for b in blocks:
                tic = time.perf_counter()
                decoder.step(block_size=b)
                mx.synchronize()
                if k:
                    samples[b].append(time.perf_counter() - tic)
        table.append([min(samples[b]) for b in blocks])
    return table


def batch_cost(session: Session, max_block: int, *, force: bool = False) -> BatchCost:
    """This setup's batch cost table up to `max_block` (measured at first use, then cached)."""
    key = {**calibration_key(session.target, session.proposer, max_block), "batch_format": FORMAT,
           "rows": list(ROWS), "blocks": grid(max_block)}  # fmt: skip
    digest = _digest(key)
    with _lock:
        if digest in _memo and not force:
            return _memo[digest]
        path = calibration_dir() / f"batch-{digest}.json"
        cost = None if force else _read(path, key)
        if cost is None:
            tic = time.perf_counter()
            lines = [non_decreasing(line) for line in measure(session, max_block)]
            cost = BatchCost(list(ROWS), grid(max_block), lines)
            doc = {"key": key, "rows": cost.rows, "blocks": cost.blocks, "seconds": cost.seconds,
                   "calibration_seconds": round(time.perf_counter() - tic, 3), "measured_at": time.time()}  # fmt: skip
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_json_atomic(path, json.loads(json.dumps(doc, default=str)))
            except OSError as e:
                warnings.warn(f"Cannot cache the batch calibration in {path.parent}: {e}", stacklevel=2)
        _memo[digest] = cost
        return cost


def _read(path, key: dict) -> BatchCost | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        return BatchCost([int(n) for n in doc["rows"]], [int(b) for b in doc["blocks"]],
                         [[float(t) for t in line] for line in doc["seconds"]])  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
