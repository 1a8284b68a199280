"""The ``dflash-mlx`` command line (Typer + rich): commands, and what only they use.

``main()`` is the console-script entry point: on Linux it first re-executes
with the system OpenBLAS preloaded (`openblas`), and only then imports the
app (`commands`: one module per command), so the package is imported once per
start. Embedders and tests use ``from dflash_mlx.cli import app``. The helpers
only commands use live here too: `benchmark`, `environment`, `live_panel`,
`common`.
"""

from __future__ import annotations

from . import openblas


def main() -> None:
    """Console entry point: preload OpenBLAS on Linux (re-exec), then run the app."""
    openblas.maybe_reexec()
    from .commands import app

    app()


def __getattr__(name: str):
    if name == "app":  # `from dflash_mlx.cli import app`
        from .commands import app

        return app
    raise AttributeError(f"module 'dflash_mlx.cli' has no attribute {name!r}")
