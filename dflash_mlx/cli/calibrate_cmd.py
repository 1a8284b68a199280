"""`dflash-mlx calibrate`: measure (or show) the cost curve the adaptive block size uses.

Shows, per block b, the seconds of one draft/verify cycle on this machine and
the tokens per cycle a block must commit to beat plain decoding (T(b) / T(1)),
where the curve came from (a calibration, or the loop that corrected it), and
how far the calibration's rounds agreed (a busy machine's disagree, and are
not cached). `--force` measures again; `--clear` deletes every cached curve.
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
from ..policy.calibration import STABLE, calibration_dir, calibration_key, clear_calibrations, cost_model, file_for
from ..session import make_session
from ..targets.quantized_kv import kv_quantization
from .common import (
    KV_DEFAULTS,
    DraftOpt,
    KVBitsOpt,
    KVGroupSizeOpt,
    ModelOpt,
    QuantizedKVStartOpt,
    console,
    fail,
    kv_settings,
    load_models,
    user_errors,
)


def calibrate(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Measure again, replacing the cached curve.")] = False,
    clear: Annotated[bool, typer.Option("--clear", help="Delete every cached calibration, then exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    sampled: Annotated[
        bool,
        typer.Option(
            "--sampled",
            help="The curve of sampled decoding (temperature > 0), "
            "whose verify is dearer per row than greedy decoding's.",
        ),
    ] = False,
    kv_bits: KVBitsOpt = KV_DEFAULTS["kv_bits"],
    kv_group_size: KVGroupSizeOpt = KV_DEFAULTS["kv_group_size"],
    quantized_kv_start: QuantizedKVStartOpt = KV_DEFAULTS["quantized_kv_start"],
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
    kv = kv_quantization(**kv_settings(model_, kv_bits, kv_group_size, quantized_kv_start) or {"kv_bits": None})
    with user_errors():
        largest = choose_block_size(None, choice.entry, model_, drafter).size
    session = make_session(model_, drafter)
    target, proposer = session.target, session.proposer
    path = file_for(calibration_key(target, proposer, largest, kv, sampled=sampled))
    tic = time.perf_counter()
    with console.status("Calibrating…", spinner="dots") if not as_json else nullcontext():
        cost = cost_model(target, proposer, largest, kv=kv, sampled=sampled, force=force)
    took = time.perf_counter() - tic
    notes = cost.notes
    measured = notes.get("measured_at") is not None and not notes.get("read")
    curve = cost.table
    rows = [
        {"block": b, "ms_per_cycle": round(1000 * t, 3), "break_even_tokens_per_cycle": round(t / curve.line()[0], 3)}
        for b, t in zip(curve.blocks, curve.line())
    ]
    instability = notes.get("instability")
    summary = {
        "model": choice.label,
        "max_block_size": largest,
        "sampled": sampled,
        "cached": not measured,
        "seconds": round(took, 3),
        "file": str(path),
        "source": notes.get("source", "measured"),
        "instability": instability,
        "stable": instability is None or instability <= STABLE,
        "written": path.exists() and (not measured or bool(notes.get("stable"))),
        "curve": rows,
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    title = f"{choice.label}: one {'sampled' if sampled else 'greedy'} draft/verify cycle per block"
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for col in ("block", "ms / cycle", "tokens/cycle to beat plain"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["block"]), f"{r['ms_per_cycle']:.2f}", f"{r['break_even_tokens_per_cycle']:.2f}")
    console.print(table)
    if instability is not None:
        agree = (
            f"its rounds agree on T(b) / T(1) within {instability:.0%} (a calibration is cached within {STABLE:.0%})"
        )
    else:
        agree = "its rounds' agreement was not recorded"
    if not measured:
        console.print(f"[dim]read from the cache ({agree}): {path}[/]")
    elif summary["written"]:
        console.print(f"[dim]measured in {took:.2f} s, {agree}: {path}[/]")
    else:
        console.print(
            f"[yellow]measured in {took:.2f} s, but not cached: {agree}; the machine looks busy. "
            "The loop scales the curve by its own cycles as it runs; or run this again when the machine is quiet.[/]"
        )
