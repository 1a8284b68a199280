"""Measuring a setup's cost table on this machine, caching it on disk, and the process's model of it.

`cost_model(target, proposer, max_block, kv=...)` returns one request's
`CostModel` for this setup (the models, their dtypes and quantization, the KV
cache's quantization, the device, the software): this process's, else one
made from `<cache>/calibration/<key>.json`, else measured by running the real
loop (`engine.speculative_cycles`) on private caches and a private copy of
the proposer, in timed stretches of each grid block, fitted by `fit`. The
batch decoder's table (`batch.calibration`) goes through the same `model_for`:
the same key (with the decoder), file format, checks and model. A measurement
whose rounds disagree on the shape (a busy machine) is measured again, and
one that stays unstable is used but not cached. The loop's timings scale the
table in the process's model (`cost.CostModel`), never in the file: the file
is what a calibration measured. Sharded ranks all take rank 0's curve, which
does not learn (they must choose the same blocks). Why: docs/adaptive.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import mlx.core as mx

from ..acceptance import Acceptor
from ..models.facts import model_facts
from ..proposers.base import Proposal
from ..sampling import SamplingSettings
from ..sharding.group import broadcast_floats
from ..utils.io import write_json_atomic
from ..utils.machine import chip, loaded_blas
from .base import ScheduledBlocks
from .cost import CostModel, CostTable
from .fit import fitted_curve, instability

FORMAT = 8  # bump when what is measured changes (older files are then measured again)
GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ROUNDS = 4  # timed rounds, after a warm-up cycle of each block
MIN_ROUNDS = 2  # the rounds run whatever the budget
BUDGET_SECONDS = 1.5  # past MIN_ROUNDS, no round starts that would end after this (a large model, a slow machine)
SHARDED_ROUNDS = 5
PLAIN_STRETCH = 12  # cycles per b = 1 stretch (plain steps are short and decide whether drafting pays at all)
DRAFT_STRETCH = 3  # cycles per stretch of a larger block (its first one not timed); both halved on a slow setup
PROMPT_TOKENS = 16
STABLE = 0.25  # rounds whose T(b) / T(1) spread further than this (`fit.instability`) are a busy machine's
ATTEMPTS = 3  # measurements at most, while they are unstable

_models: dict[str, CostModel] = {}  # key digest -> this process's model of it
_lock = threading.Lock()


def calibration_dir() -> Path:
    base = os.environ.get("DFLASH_MLX_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg, "dflash-mlx") if xdg else os.path.join(os.path.expanduser("~"), ".cache", "dflash-mlx")
    return Path(base) / "calibration"


def clear_calibrations() -> int:
    """Delete every cached calibration (and forget this process's models); return how many files went."""
    forget()
    removed = 0
    folder = calibration_dir()
    if folder.is_dir():
        for path in folder.glob("*.json"):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def forget(digest: str | None = None) -> None:
    """Drop this process's model of the table cached as `<digest>.json` (None: of every table): the next
    lookup reads the file."""
    with _lock:
        for key in [k for k in _models if digest is None or k == digest]:
            del _models[key]


def grid_for(max_block: int, grid=GRID) -> list[int]:
    return sorted({b for b in grid if b < max_block} | {max_block})


def calibration_key(target, proposer, max_block: int, kv=None, decoder: str = "single", sampled: bool = False) -> dict:
    """Everything the cost table depends on: the models, the KV cache's quantization, the device, the
    software, the decoder measured (one request's loop, or the batch decoder), and whether cycles sample
    (a sampled verify's acceptance works on full distributions, row by row: dearer with every row)."""
    group = _group(target)
    return {
        "format": FORMAT,
        "decoder": decoder,
        "sampling": "sampled" if sampled else "greedy",
        "target": model_facts(target.model),
        "draft": model_facts(getattr(proposer, "drafter", proposer)) if proposer is not None else None,
        "proposer": type(proposer).__name__,
        "grid": grid_for(max_block),
        "kv": dataclasses.asdict(kv) if kv is not None else None,
        "device": str(mx.default_device()),
        **_machine_facts(),
        **({"tensor_ranks": group.size(), "rounds": SHARDED_ROUNDS} if group is not None else {}),
    }


def _group(target):
    """The group of a tensor-sharded target (more than one rank), else None."""
    group = getattr(target, "group", None)
    return group if group is not None and group.size() > 1 else None


@functools.lru_cache(maxsize=1)
def _machine_facts() -> dict:
    """What cannot change within a process (read once)."""
    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "chip": chip(),
        "cpu_count": os.cpu_count(),
        "blas": loaded_blas(),
        "mlx": mx.__version__,
    }


def digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def file_for(key: dict) -> Path:
    return calibration_dir() / f"{digest(key)}.json"


def read_table(key: dict) -> tuple[CostTable, dict] | None:
    """The cached table for `key` and its file's document, or None when the file is missing, unreadable,
    or for another key."""
    try:
        doc = json.loads(file_for(key).read_text(encoding="utf-8"))
        if doc.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        return CostTable(doc["blocks"], doc["seconds"], doc["rows"]), doc
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_table(key: dict, table: CostTable, notes: dict) -> bool:
    """Cache `table` for `key` (atomically), with `notes`; False (and a warning) where it cannot be written."""
    path = file_for(key)
    doc = {
        **notes,
        "key": key,
        "rows": list(table.rows),
        "blocks": list(table.blocks),
        "seconds": [list(line) for line in table.seconds],
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, json.loads(json.dumps(doc, default=str)))
        return True
    except OSError as e:  # e.g. a read-only cache directory: keep the table for this process only
        warnings.warn(f"Cannot cache the block-size calibration in {path.parent}: {e}", stacklevel=3)
        return False


def model_for(
    key: dict, measure: Callable[[], tuple[CostTable, dict]], *, force: bool = False, group=None
) -> CostModel:
    """This process's model of `key`'s table: made from the cached file, else from `measure()` (its table
    and notes, `instability` among them; measured again while unstable, ATTEMPTS at most, and cached
    only once stable). `force`: measure again. `group`: sharded ranks, which take rank 0's table."""
    name = digest(key)
    with _lock:
        if name in _models and not force:
            return _models[name]
        leader = group is None or group.rank() == 0
        found = None if force or not leader else read_table(key)
        if group is not None:
            model = _follow_the_leader(key, group, found, measure)
        elif found is not None:
            table, doc = found
            model = CostModel(table, learns=doc.get("learns", True) is not False)
            model.notes = {
                **{k: v for k, v in doc.items() if k not in ("key", "rows", "blocks", "seconds")},
                "read": True,
            }
        else:
            table, notes = _measured(measure)
            if notes["stable"]:
                write_table(key, table, notes)
            model = CostModel(table)  # (an unstable one is used in this process, not cached)
            model.notes = notes
        _models[name] = model
        return model


def _measured(measure) -> tuple[CostTable, dict]:
    """The most stable of up to ATTEMPTS measurements (stopping at the first stable one)."""
    tic, best = time.perf_counter(), None
    for attempt in range(1, ATTEMPTS + 1):
        table, notes = measure()
        if best is None or notes["instability"] < best[1]["instability"]:
            best = (table, notes)
        if notes["instability"] <= STABLE:
            break
    table, notes = best
    return table, {
        **notes,
        "stable": notes["instability"] <= STABLE,
        "attempts": attempt,
        "calibration_seconds": round(time.perf_counter() - tic, 3),
        "measured_at": time.time(),
        "source": "measured",
    }


def _follow_the_leader(key: dict, group, found, measure) -> CostModel:
    """Sharded ranks: rank 0's cached table, or the one they all measure (rank 0's fit), which never learns
    (every rank must choose the same blocks)."""
    leader = group.rank() == 0
    blocks = key["grid"]
    if broadcast_floats(group, [float(found is not None)] if leader else None, 1)[0] > 0:
        seconds = broadcast_floats(group, list(found[0].line()) if leader else None, len(blocks))
        return CostModel(CostTable.curve(blocks, seconds), learns=False)
    table, notes = measure()
    seconds = broadcast_floats(group, list(table.line()) if leader else None, len(blocks))
    table = CostTable.curve(blocks, seconds)
    if leader:
        write_table(key, table, {**notes, "source": "measured", "measured_at": time.time()})
    return CostModel(table, learns=False)


# ------------------------------------------------------------------ one request's curve, by the engine


def cost_model(target, proposer, max_block: int, *, kv=None, sampled: bool = False, force: bool = False) -> CostModel:
    """This setup's model of T(b) up to `max_block` for greedy or `sampled` cycles (measured at first use,
    then cached; `force`: measure again, replacing the cached one once stable)."""
    key = calibration_key(target, proposer, max_block, kv, sampled=sampled)
    group = _group(target)

    def measure_curve() -> tuple[CostTable, dict]:
        table = measure(
            target,
            proposer,
            key["grid"],
            rounds=SHARDED_ROUNDS if group else ROUNDS,
            budget=None if group else BUDGET_SECONDS,
            kv=kv,
            sampled=sampled,
        )
        return CostTable.curve(key["grid"], fitted_curve(key["grid"], table)), {
            "rounds": len(table),
            "instability": round(instability(key["grid"], table), 4),
        }

    return model_for(key, measure_curve, force=force, group=group)


def measure(
    target,
    proposer,
    grid: list[int],
    rounds: int = ROUNDS,
    budget: float | None = BUDGET_SECONDS,
    kv=None,
    sampled: bool = False,
) -> list[list[float]]:
    """Seconds per cycle at each grid block, one row per round (after a warm-up cycle of each block),
    measured by the loop itself on private state. Once MIN_ROUNDS rounds are done, no round starts
    that would end after `budget` seconds (`another_round`; None: all `rounds`, as sharded ranks must
    run the same cycles). `kv`: the KV cache quantized as from the first position on; `sampled`: cycles
    sampling at temperature 1 (drafts sampled too)."""
    from ..engine import speculative_cycles  # the engine imports this package
    from ..session import Session

    fork = getattr(proposer, "fork", None)
    # (a proposer that may offer nothing, `offer`, cannot be timed at a given block: its verify is)
    timed = callable(fork) and not hasattr(proposer, "offer")
    private = fork() if timed else _DummyDrafts(max(grid))
    began = time.perf_counter()
    one_round: list[int] = []

    def after_warm_up(seconds: list[tuple[int, float | None]]) -> list[int]:
        stretch = stretches(grid, [t for _, t in seconds], budget, time.perf_counter() - began)
        one_round.extend(b for b in grid for _ in range(stretch[b]))
        return one_round * rounds

    policy = ScheduledBlocks(list(grid), then=after_warm_up)
    prompt = _prompt(target)
    acceptor = Acceptor(SamplingSettings(temperature=1.0 if sampled else 0.0), prompt, seed=0 if sampled else None)
    cycles = speculative_cycles(
        target,
        prompt,
        private,
        max_tokens=-1,
        block_size=policy,
        acceptor=acceptor,
        session=Session(target, private),
        kv=dataclasses.replace(kv, start=0) if kv is not None else None,
    )
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
            if t and seconds is not None:
                samples[b].append(seconds)
        table.append([statistics.median(samples[b]) for b in grid])
    return table


def stretches(grid: list[int], warm_up: list, budget: float | None, elapsed: float) -> dict[int, int]:
    """Cycles per stretch at each grid block: PLAIN_STRETCH and DRAFT_STRETCH, or half as many (rounded up)
    where MIN_ROUNDS rounds of those, judged by the warm-up cycle of each block (`warm_up`, seconds in grid
    order; None where untimed), would end after `budget` (a large model, a slow machine: its cycles are
    long, so a moment's jitter weighs less in each). None: the longer ones (sharded ranks must run the
    same cycles)."""
    long = {b: PLAIN_STRETCH if b == 1 else DRAFT_STRETCH for b in grid}
    known = [(b, t) for b, t in zip(grid, warm_up) if t is not None]
    if budget is None or len(warm_up) < len(grid) or not known:
        return long
    typical = statistics.median(t for _, t in known)
    if elapsed + MIN_ROUNDS * sum(long[b] * (t if t is not None else typical) for b, t in zip(grid, warm_up)) <= budget:
        return long
    return {b: -(-n // 2) for b, n in long.items()}


def another_round(done: int, elapsed: float, last: float, budget: float) -> bool:
    """Whether a calibration that has `done` rounds after `elapsed` seconds, the last taking `last`,
    starts another: always below MIN_ROUNDS, then while one more like the last ends within `budget`."""
    return done < MIN_ROUNDS or elapsed + last <= budget


def _prompt(target) -> mx.array:
    vocab = target.vocab_size
    return mx.array([(7919 * i + 13) % vocab for i in range(PROMPT_TOKENS)], mx.int32)


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
