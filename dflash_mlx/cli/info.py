"""`dflash-mlx models` (the registry as a table) and `dflash-mlx doctor` (the environment)."""

from __future__ import annotations

import platform
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..environment import describe
from ..openblas import openblas_path
from ..registry import registry_entries
from ..resolve import default_available, supported
from .common import console


def models(
    mlx: Annotated[bool, typer.Option("--mlx", help="Also list the MLX conversions each entry matches.")] = False,
) -> None:
    """List the known target -> drafter pairs (models.toml)."""
    table = Table(
        title="DFlash model pairs (models.toml)", box=box.SIMPLE_HEAD, show_lines=True, pad_edge=False,
        caption="* family not supported by this version yet", caption_justify="left",
    )
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("target", overflow="fold", ratio=3)
    table.add_column("drafter", overflow="fold", ratio=3)
    table.add_column("family", overflow="fold", ratio=1)
    table.add_column("block", justify="right", no_wrap=True)
    table.add_column("reasoning", overflow="fold", ratio=2)
    table.add_column("notes", overflow="fold", ratio=2)
    for entry in registry_entries():
        target = escape(entry.target)
        if mlx and entry.mlx_targets:
            target += "".join(f"\n[dim]{escape(m)}[/dim]" for m in entry.mlx_targets)
        family = escape(entry.family or "?")
        if not supported(entry):
            family += " [yellow]*[/yellow]"
        reasoning = ""
        if entry.reasoning:
            levels = "on/off" if entry.reasoning == "enable_thinking" else "/".join(entry.reasoning_values)
            reasoning = f"{entry.reasoning}: {levels}"
            if entry.reasoning_default:
                reasoning += f", default {entry.reasoning_default}"
        notes = entry.notes
        if entry.bundled:
            notes = (notes + " " if notes else "") + ("(bundled)" if default_available() else "(not installed)")
        table.add_row(
            entry.name, target, escape(entry.draft), family, str(entry.block_size),
            escape(reasoning), escape(notes),
        )
    Console(highlight=False).print(table)  # a fresh console: the width of the terminal as it is now


def doctor() -> None:
    """Report the platform, MLX and mlx-lm, the compute device, memory and (Linux) the BLAS in use."""
    info = describe()
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key in ("os", "chip", "cpu_count", "memory_gb", "python", "mlx", "mlx_lm", "dflash_mlx", "device", "blas"):
        if key in info:
            table.add_row(key.replace("_", " "), escape(str(info[key])))
    console.print(table)
    advice = []
    if info["device"] == "CPU" and platform.system() == "Darwin":
        advice.append("MLX sees no Metal GPU: check that this Python is arm64 (not Rosetta).")
    blas = info.get("blas", "")
    if blas and "OpenBLAS" not in blas:
        if openblas_path():
            advice.append(
                "The system OpenBLAS is installed but not loaded in this process. The `dflash-mlx` command "
                "preloads it by itself (unless DFLASH_MLX_NO_REEXEC=1); in Python, start with "
                f"LD_PRELOAD={openblas_path()}"
            )
        else:
            advice.append(
                "MLX is using its bundled reference BLAS, which is slow. Install the system OpenBLAS "
                "(Debian/Ubuntu: apt-get install libopenblas0-pthread); `dflash-mlx` then preloads it."
            )
    if not default_available():
        advice.append("The bundled demo pair is not installed: pass --model to chat, generate and bench.")
    for line in advice:
        console.print(f"[yellow]•[/] {escape(line)}")
    if not advice:
        console.print("[green]All good.[/]")
