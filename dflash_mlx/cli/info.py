"""`dflash-mlx models` (the registry as a table) and `dflash-mlx doctor` (the environment)."""

from __future__ import annotations

import platform
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .benchmark import BenchSettings, report, run_benchmark
from ..models.chat_template import reasoning_kwargs
from ..datasets import sample
from ..utils.machine import describe
from .openblas import openblas_path
from ..models.registry import registry_entries
from ..models.resolve import choose_block_size, default_available
from .common import DraftOpt, ModelOpt, console, load_models, user_errors


KIND_LABELS = {"dflash": "DFlash", "dflash2": "DFlash 2", "dspark": "DSpark"}
PUBLISHER_LABELS = {"authors": "method's authors", "vendor": "model's vendor", "community": "community"}


def models(
    mlx: Annotated[bool, typer.Option("--mlx", help="Also list the MLX conversions each entry matches.")] = False,
) -> None:
    """List the known target -> drafter pairs (models.toml)."""
    table = Table(title="DFlash model pairs (models.toml)", box=box.SIMPLE_HEAD, show_lines=True, pad_edge=False)
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("target, → drafter, details", overflow="fold")
    table.add_column("block", justify="right", no_wrap=True)
    for entry in registry_entries():
        lines = [escape(entry.target)] + [f"[dim]{escape(m)}[/dim]" for m in (entry.mlx_targets if mlx else ())]
        lines.append(f"[cyan]→ {escape(entry.draft)}[/cyan]")
        details = [entry.family or "?", KIND_LABELS[entry.kind]]
        if entry.publisher:
            details.append(f"published by the {PUBLISHER_LABELS[entry.publisher]}")
        if entry.reasoning:
            levels = "on/off" if entry.reasoning == "enable_thinking" else "/".join(entry.reasoning_values)
            default = f", default {entry.reasoning_default}" if entry.reasoning_default else ""
            details.append(f"{entry.reasoning}: {levels}{default}")
        if entry.notes:
            details.append(entry.notes)
        if entry.bundled:
            details.append("bundled" if default_available() else "bundled, not installed")
        lines.append(f"[dim]{escape('; '.join(details))}[/dim]")
        if entry.needs_shard:
            lines.append(f"[yellow]{escape(entry.memory_note)}[/yellow]")
        table.add_row(entry.name, "\n".join(lines), str(entry.block_size))
    Console(highlight=False).print(table)  # a fresh console: the width of the terminal as it is now


def doctor(
    selftest: Annotated[
        bool, typer.Option("--selftest", help="Also run a model greedy with and without DFlash and compare.")
    ] = False,
    model: ModelOpt = None,
    draft: DraftOpt = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=1, help="GSM8K prompts for --selftest.")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens per reply for --selftest.")] = 128,
) -> None:
    """Report the platform, MLX and mlx-lm, the compute device, memory and (Linux) the BLAS in use."""
    _environment_report()
    if selftest:
        _selftest(model, draft, num_prompts, max_tokens)


def _selftest(model: str | None, draft: str | None, num_prompts: int, max_tokens: int) -> None:
    """Greedy DFlash must reproduce mlx-lm's greedy text; report the speedup. Exit 1 on a mismatch."""
    choice, model_, tokenizer, drafter = load_models(model, draft)
    with user_errors():
        template_kwargs = reasoning_kwargs(tokenizer, None, choice.entry, choice.label)
        block = choose_block_size(None, choice.entry, model_, drafter)
    console.print(
        f"[bold]Self-test[/]: {escape(choice.label)}, {num_prompts} GSM8K prompts, "
        f"{max_tokens} tokens each, greedy, {block.label}…"
    )
    settings = BenchSettings(max_tokens=max_tokens, template_kwargs=template_kwargs)
    legs = run_benchmark(model_, tokenizer, drafter, sample("gsm8k", num_prompts), [block], settings)
    run = report(legs, {}, {})
    status = "[green]identical[/]" if run["greedy_matches"] else "[bold red]DIFFERENT[/]"
    console.print(
        f"outputs {status} · mlx-lm {run['baseline_tps']:.1f} tok/s · DFlash {run['dflash_tps']:.1f} tok/s · "
        f"speedup {run['speedup']:.2f}x · acceptance length {run['acceptance_length'] or 0:.2f}"
    )
    if not run["greedy_matches"]:
        bad = [p["index"] for p in run["prompts"] if not p["matches_baseline"]]
        console.print(f"[red]Prompts {bad} differ. Please report this with `dflash-mlx doctor` output.[/]")
        raise typer.Exit(1)


def _environment_report() -> None:
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
                f"LD_PRELOAD={openblas_path()} OPENBLAS_NUM_THREADS=1 (one thread decodes faster)"
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
