"""The ``dflash-mlx`` Typer app: one command per module, registered here.

Commands: ``chat``, ``generate``, ``bench``, ``calibrate``, ``models``,
``doctor``, ``serve``, and ``train`` from its own package.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .. import __version__
from .bench_cmd import bench
from .calibrate_cmd import calibrate
from .chat import chat
from .generate_cmd import generate
from .info import doctor, models
from .serve_cmd import serve
from ..train.command import train

app = typer.Typer(
    name="dflash-mlx",
    help="Lossless block-diffusion speculative decoding (DFlash) for MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dflash-mlx {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Lossless block-diffusion speculative decoding (DFlash) for MLX."""


app.command()(chat)
app.command()(generate)
app.command()(bench)
app.command()(calibrate)
app.command()(models)
app.command()(doctor)
app.command()(train)
app.command()(serve)
