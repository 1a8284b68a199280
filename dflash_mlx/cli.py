"""The ``dflash-mlx`` command line (Typer): ``--version`` and ``models``.

Thin layer: parse, call, render. ``main()`` is the console-script entry point;
on Linux it first re-executes with the system OpenBLAS preloaded (see
``dflash_mlx.openblas``). Embedders and tests use ``app`` directly.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_mlx import __version__, openblas
from dflash_mlx.registry import registry_entries

app = typer.Typer(
    name="dflash-mlx",
    help="Lossless block-diffusion speculative decoding (DFlash) for MLX.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dflash-mlx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """Lossless block-diffusion speculative decoding (DFlash) for MLX."""


@app.command()
def models(
    mlx: Annotated[
        bool, typer.Option("--mlx", help="Also list the MLX conversions each entry matches.")
    ] = False,
) -> None:
    """List the known target -> drafter pairs (models.toml)."""
    table = Table(
        title="DFlash model pairs (models.toml)", box=box.SIMPLE_HEAD, show_lines=mlx,
        pad_edge=False,
    )
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("target", overflow="fold")
    table.add_column("drafter", overflow="fold")
    table.add_column("block", justify="right", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("notes")
    for entry in registry_entries():
        target = escape(entry.target)
        if mlx and entry.mlx_targets:
            target += "".join(f"\n[dim]{escape(m)}[/dim]" for m in entry.mlx_targets)
        table.add_row(
            entry.name, target, escape(entry.draft), str(entry.block_size), entry.kind,
            escape(entry.notes),
        )
    Console().print(table)


def main() -> None:
    """Console entry point: preload OpenBLAS on Linux (re-exec), then run the app."""
    openblas.maybe_reexec()
    app()


if __name__ == "__main__":
    main()
