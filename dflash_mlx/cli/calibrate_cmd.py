"""`dflash-mlx calibrate`: measure (or show) the cost curve the adaptive block size uses.

Shows, per block b, the seconds of one draft/verify cycle on this machine and
the tokens per cycle a block must commit to beat plain decoding (T(b) / T(1)).
`--force` measures again; `--clear` deletes every cached calibration.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from ..models.resolve import choose_block_size
from ..policy.calibration import cached_curve, calibration_dir, calibration_file, clear_calibrations, cost_curve
from ..session import make_session
from .common import DraftOpt, ModelOpt, console, fail, load_models, user_errors


def calibrate(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Measure again, replacing the cached curve.")] = False,
    clear: Annotated[bool, typer.Option("--clear", help="Delete every cached calibration, then exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure this machine's draft/verify cost per block size (the adaptive block's curve)."""
    if clear:
        if model is not None or draft is not None or force:
            fail("--clear deletes every cached calibration: it takes no --model, --draft or --force.")
        removed = clear_calibrations()
        console.print(f"Removed {removed} cached calibration(s) from {calibration_dir()}.")
        return
    choice, model_, _, drafter = load_models(model, draft)
    if drafter is None:
        fail(f"{choice.label} has no drafter to calibrate (pass --draft).")
    with user_errors():
        largest = choose_block_size(None, choice.entry, model_, drafter).size
    session = make_session(model_, drafter)
    target, proposer = session.target, session.proposer
    was_cached = not force and cached_curve(target, proposer, largest) is not None
    tic = time.perf_counter()
    with console.status("Calibrating…", spinner="dots") if not as_json else nullcontext():
        curve = cost_curve(target, proposer, largest, force=force)
    took = time.perf_counter() - tic
    path = calibration_file(target, proposer, largest)
    rows = [{"block": b, "ms_per_cycle": round(1000 * t, 3),
             "break_even_tokens_per_cycle": round(t / curve.seconds[0], 3)}
            for b, t in zip(curve.grid, curve.seconds)]  # fmt: skip
    if as_json:
        typer.echo(json.dumps({"model": choice.label, "max_block_size": largest, "cached": was_cached,
                               "seconds": round(took, 3), "file": str(path), "curve": rows}))  # fmt: skip
        return
    table = Table(title=f"{choice.label}: one draft/verify cycle per block", box=box.SIMPLE_HEAD)
    for col in ("block", "ms / cycle", "tokens/cycle to beat plain"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["block"]), f"{r['ms_per_cycle']:.2f}", f"{r['break_even_tokens_per_cycle']:.2f}")
    console.print(table)
    how = "read from the cache" if was_cached else f"measured in {took:.2f} s"
    console.print(f"[dim]{how}: {path}[/]")

