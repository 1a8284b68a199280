"""Measuring the cost curve T(b) on this machine, once, and caching it on disk.

`cost_curve(target, proposer, max_block)` returns the curve for this setup
(the models, their dtypes and quantization, the device, the software): from
memory, else from `<cache>/calibration/<key>.json`, else measured by running
the real loop (`engine.speculative_cycles`) on private caches and a private
copy of the proposer, in timed stretches of each grid block, fitted by `fit`
and checked against the drafter's own forward. Sharded ranks all take rank 0's
curve. The design, the cache's location and why each rule: docs/adaptive.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import threading
import time
import warnings
from operator import is_
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..models.facts import model_config, model_facts, read_facts
from ..proposers.base import Proposal
from ..sharding.group import broadcast_floats
from ..utils.io import write_json_atomic
from ..utils.machine import chip, loaded_blas
from .base import ScheduledBlocks
from .cost import CostCurve
from .fit import draft_floor, fitted_curve, plausible, with_floor

FORMAT = 7  # bump when what is measured changes (older files are then measured again)
GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ROUNDS = 4  # timed rounds, after a warm-up cycle of each block
MIN_ROUNDS = 2  # the rounds run whatever the budget
BUDGET_SECONDS = 1.5  # past MIN_ROUNDS, no round starts that would end after this (a large model, a slow machine)
SHARDED_ROUNDS = 5
STRETCH = {1: 12}  # cycles per block in a stretch (DRAFT_STRETCH unless given), the first one not timed
DRAFT_STRETCH = 3
SHORT_STRETCH = {1: 6}  # where MIN_ROUNDS rounds of the above would overrun the budget (SHORT_DRAFT_STRETCH)
SHORT_DRAFT_STRETCH = 2
PROMPT_TOKENS = 16
DRAFT_REPEATS = 3  # timed drafter forwards per block, after a warm-up one

_memo: dict[tuple, tuple[str, CostCurve]] = {}  # `_frozen(key)` -> (its digest, curve): a hit hashes no JSON
_known_setups: dict[tuple, tuple] = {}  # `_setup`'s identity -> (what it was made of, `_frozen(key)`): no key built
_lock = threading.Lock()


def calibration_dir() -> Path:
    base = os.environ.get("DFLASH_MLX_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg, "dflash-mlx") if xdg else os.path.join(os.path.expanduser("~"), ".cache", "dflash-mlx")
    return Path(base) / "calibration"


def clear_calibrations() -> int:
    """Delete every cached calibration (and forget the in-memory ones); return how many files went."""
    with _lock:
        _memo.clear()
    removed = 0
    folder = calibration_dir()
    if folder.is_dir():
        for path in folder.glob("*.json"):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def forget_curve(digest: str | None = None) -> None:
    """Drop this process's copy of the curve cached as `<digest>.json` (None: of every curve): the next
    lookup reads the file."""
    with _lock:
        for memo_key in [k for k, (d, _) in _memo.items() if digest is None or d == digest]:
            del _memo[memo_key]


def grid_for(max_block: int) -> list[int]:
    return sorted({b for b in GRID if b < max_block} | {max_block})


def calibration_key(target, proposer, max_block: int) -> dict:
    """Everything T(b) depends on: the models, the device, the software."""
    group = _group(target)
    return {
        "format": FORMAT,
        "target": model_facts(target.model),
        "draft": model_facts(getattr(proposer, "drafter", proposer)) if proposer is not None else None,
        "proposer": type(proposer).__name__,
        "grid": grid_for(max_block),
        "device": str(mx.default_device()),
        **_machine_facts(),
        **({"tensor_ranks": group.size(), "rounds": SHARDED_ROUNDS} if group is not None else {}),
    }


def _setup(target, proposer, max_block: int) -> tuple | None:
    """(what identifies this setup within the process, what it was made of: the models' facts, configs and
    types, which `read_facts` returns as the same objects while the models are unchanged), or None where the
    key is always built (a proposer that is not a module, a sharded target)."""
    drafter = getattr(proposer, "drafter", proposer)
    model = target.model
    if not isinstance(model, nn.Module) or not isinstance(drafter, nn.Module) or _group(target) is not None:
        return None
    made_of = (read_facts(model), read_facts(drafter), model_config(model), model_config(drafter), type(model),
               type(drafter))
    return (id(model), id(drafter), type(proposer).__name__, max_block, str(mx.default_device())), made_of


def _group(target):
    """The group of a tensor-sharded target (more than one rank), else None."""
    group = getattr(target, "group", None)
    return group if group is not None and group.size() > 1 else None


@functools.lru_cache(maxsize=1)
def _machine_facts() -> dict:
    """What cannot change within a process (read once: every adaptive generation builds a key)."""
    return {"machine": platform.machine(), "system": platform.system(), "chip": chip(),
            "cpu_count": os.cpu_count(), "blas": loaded_blas(), "mlx": mx.__version__}  # fmt: skip


def _frozen(value):
    """`value` (a calibration key) made hashable: dicts and lists as tuples, in their order."""
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _read(path: Path, key: dict) -> CostCurve | None:
    """The cached curve, or None when the file is missing, unreadable, or for another key."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        return CostCurve([int(b) for b in doc["grid"]], [float(t) for t in doc["seconds"]])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class _DummyDrafts:
    """Free drafts (zeros) for timing a proposer that cannot be forked: the verify's cost only."""

    layer_ids: tuple[int, ...] = ()

    def __init__(self, block_size: int):
        self.block_size = block_size

    def start(self, *args, **kwargs) -> None:  # (target, prompt, reused): nothing to ingest, as add_context
        pass

    add_context = start

    def state(self) -> list:
        return []

    def propose(self, anchor, position, count, *, sampling=None, key=None) -> Proposal:
        return Proposal(tokens=mx.zeros((count,), mx.int32))


def measure(target, proposer, grid: list[int], rounds: int = ROUNDS,
            budget: float | None = BUDGET_SECONDS) -> list[list[float]]:  # fmt: skip
    """Seconds per cycle at each grid block, one row per round (after a warm-up cycle of each block),
    measured by the loop itself on private state. Once MIN_ROUNDS rounds are done, no round starts
    that would end after `budget` seconds (`another_round`; None: all `rounds`, as sharded ranks must
    run the same cycles)."""
    from ..engine import speculative_cycles  # the engine imports this package
    from ..session import Session

    fork = getattr(proposer, "fork", None)
    private = fork() if callable(fork) else _DummyDrafts(max(grid))
    began = time.perf_counter()
    one_round: list[int] = []

    def after_warm_up(seconds: list[tuple[int, float]]) -> list[int]:
        stretch = stretches(grid, [t for _, t in seconds], budget, time.perf_counter() - began)
        one_round.extend(b for b in grid for _ in range(stretch[b]))
        return one_round * rounds

    policy = ScheduledBlocks(list(grid), then=after_warm_up)
    cycles = speculative_cycles(target, _prompt(target), private, max_tokens=-1, block_size=policy,
                                session=Session(target, private))  # fmt: skip
    last_end = began  # when the warm-up or the last round ended (each cycle is handed out once)
    try:
        for _ in cycles:
            if policy.done:
                break
            if not one_round:  # still in the warm-up
                continue
            done, within = divmod(len(policy.seconds) - len(grid), len(one_round))
            if budget is not None and within == 0 and done >= 0:
                now = time.perf_counter()
                if not another_round(done, now - began, now - last_end, budget):
                    break
                last_end = now
    finally:
        cycles.close()
    per_round = len(one_round)
    # timed: all but a stretch's first cycle, and for b = 1 its last step too (it queues the next block)
    counts = {b: one_round.count(b) for b in grid}
    timed = [0 < i < counts[b] - (b == 1) for b in grid for i in range(counts[b])]
    table = []
    for r in range(min(rounds, (len(policy.seconds) - len(grid)) // per_round) if per_round else 0):
        samples: dict[int, list[float]] = {b: [] for b in grid}
        start = len(grid) + r * per_round
        for (b, seconds), t in zip(policy.seconds[start : start + per_round], timed):
            if t:
                samples[b].append(seconds)
        table.append([statistics.median(samples[b]) for b in grid])
    return table


def stretches(grid: list[int], warm_up: list[float], budget: float | None, elapsed: float) -> dict[int, int]:
    """Cycles per stretch at each grid block: STRETCH and DRAFT_STRETCH, or the shorter SHORT_STRETCH and
    SHORT_DRAFT_STRETCH where MIN_ROUNDS rounds of the longer ones, judged by the warm-up cycle of each
    block (`warm_up`, seconds in grid order), would end after `budget` (a large model, a slow machine:
    its cycles are long, so a moment's jitter weighs less in each). None: the longer ones (sharded ranks
    must run the same cycles)."""
    long = {b: STRETCH.get(b, DRAFT_STRETCH) for b in grid}
    if budget is None or len(warm_up) < len(grid):
        return long
    if elapsed + MIN_ROUNDS * sum(long[b] * t for b, t in zip(grid, warm_up)) <= budget:
        return long
    return {b: SHORT_STRETCH.get(b, SHORT_DRAFT_STRETCH) for b in grid}


def another_round(done: int, elapsed: float, last: float, budget: float) -> bool:
    """Whether a calibration that has `done` rounds after `elapsed` seconds, the last taking `last`,
    starts another: always below MIN_ROUNDS, then while one more like the last ends within `budget`."""
    return done < MIN_ROUNDS or elapsed + last <= budget


def _prompt(target) -> mx.array:
    vocab = target.vocab_size
    return mx.array([(7919 * i + 13) % vocab for i in range(PROMPT_TOKENS)], mx.int32)


def draft_seconds(target, proposer, blocks: list[int]) -> list[float]:
    """Seconds of one drafter forward at each block in `blocks` (ascending; proposing b - 1 tokens),
    timed alone on a private fork holding a short context: the least of DRAFT_REPEATS after a warm-up
    (a floor wants what the forward costs, not what a busy moment adds), never more than a larger
    block's. Zeros for a proposer that cannot be forked."""
    from ..engine import speculative_cycles
    from ..session import Session

    fork = getattr(proposer, "fork", None)
    if not callable(fork):
        return [0.0] * len(blocks)
    private = fork()
    session = Session(target, private)
    for _ in speculative_cycles(target, _prompt(target), private, max_tokens=2, block_size=max(blocks),
                                session=session):  # fmt: skip
        pass  # the prompt and one cycle: the drafter's context ends where the caches do
    position, anchor = len(session.tokens), mx.array([session.tokens[-1]], mx.int32)
    out = []
    for b in blocks:
        times = []
        for _ in range(DRAFT_REPEATS + 1):
            tic = time.perf_counter()
            mx.eval(private.propose(anchor, position, b - 1).tokens)
            times.append(time.perf_counter() - tic)
        out.append(min(times[1:]))
    return [min(out[i:]) for i in range(len(out))]


def calibration_file(target, proposer, max_block: int) -> Path:
    """Where this setup's calibration is cached."""
    return calibration_dir() / f"{_digest(calibration_key(target, proposer, max_block))}.json"


def cached_curve(target, proposer, max_block: int) -> CostCurve | None:
    """This setup's valid cached calibration, or None (nothing is measured)."""
    return _read(calibration_file(target, proposer, max_block), calibration_key(target, proposer, max_block))


def _checked(target, proposer, grid: list[int], table: list[list[float]]) -> tuple[list[float], dict]:
    """The fitted curve of `table`, measured again (rounds pooled) when it breaks the drafter's floor
    and kept on the floor; and what the cache file records about it."""
    timed = sorted({min(2, grid[-1]), grid[-1]} - {1})
    drafts = draft_seconds(target, proposer, timed) if timed else []
    floor = draft_floor(grid, timed, drafts)
    seconds = fitted_curve(grid, table)
    first_plausible = plausible(seconds, floor)
    if not first_plausible:
        table = table + measure(target, proposer, grid)
        seconds = fitted_curve(grid, table)
    notes = {"rounds": len(table), "draft_seconds": dict(zip(map(str, timed), drafts)),
             "remeasured": not first_plausible, "plausible": plausible(seconds, floor)}  # fmt: skip
    return with_floor(seconds, floor), notes


def cost_curve(target, proposer, max_block: int, *, force: bool = False) -> CostCurve:
    """This setup's calibrated curve up to `max_block` (measured at first use, then cached;
    `force`: measure again and replace the cached one)."""
    setup = _setup(target, proposer, max_block)
    known = _known_setups.get(setup[0]) if setup is not None and not force else None
    if known is not None and all(map(is_, known[0], setup[1])):  # (held there: no id is reused)
        found = _memo.get(known[1])  # (gone after clear_calibrations or forget_curve)
        if found is not None:
            return found[1]
    key = calibration_key(target, proposer, max_block)
    memo_key = _frozen(key)
    with _lock:
        if setup is not None:
            _known_setups[setup[0]] = (setup[1], memo_key)
        if memo_key in _memo and not force:
            return _memo[memo_key][1]
        digest = _digest(key)
        path = calibration_dir() / f"{digest}.json"
        group = _group(target)
        leader = group is None or group.rank() == 0
        curve = None if force or not leader else _read(path, key)
        if group is not None:  # the ranks follow rank 0: its cached curve, or one they all measure
            found = broadcast_floats(group, [float(curve is not None)] if leader else None, 1)[0] > 0
            if found:
                curve = CostCurve(list(key["grid"]), broadcast_floats(group, curve.seconds if leader else None,
                                                                      len(key["grid"])))  # fmt: skip
        if curve is None:
            tic = time.perf_counter()
            grid = key["grid"]
            if group is None:
                table = measure(target, proposer, grid)
                seconds, checked = _checked(target, proposer, grid, table)
            else:
                table = measure(target, proposer, grid, rounds=SHARDED_ROUNDS, budget=None)
                seconds = broadcast_floats(group, fitted_curve(grid, table) if leader else None, len(grid))
                checked = {"rounds": len(table)}
            curve = CostCurve(list(grid), seconds)
            doc = {"key": key, "grid": curve.grid, "seconds": curve.seconds, **checked,
                   "calibration_seconds": round(time.perf_counter() - tic, 3), "measured_at": time.time()}  # fmt: skip
            try:
                if leader:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_json_atomic(path, json.loads(json.dumps(doc, default=str)))
            except OSError as e:  # e.g. a read-only cache directory: keep the curve for this process only
                warnings.warn(f"Cannot cache the block-size calibration in {path.parent}: {e}", stacklevel=2)
        _memo[memo_key] = (digest, curve)
        return curve
