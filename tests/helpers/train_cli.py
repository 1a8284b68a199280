"""`dflash-mlx train` through Typer's CliRunner: the command in a one-command app, as the CLI registers it."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from dflash_mlx.train.command import train

app = typer.Typer()
app.command("train")(train)


@app.callback()
def _root() -> None:
    """A one-command app, as the CLI registers it."""


_runner = CliRunner()


def run_train(*args) -> tuple[int, str]:
    """(exit code, output) of `dflash-mlx train ARGS`; an unexpected exception is raised as is."""
    result = _runner.invoke(app, ["train", *map(str, args)], env={"COLUMNS": "250"})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def train_ok(*args) -> str:
    """The output of a `dflash-mlx train ARGS` run that must succeed."""
    code, output = run_train(*args)
    assert code == 0, output
    return output
