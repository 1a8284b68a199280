"""``python -m dflash_mlx``: ``generate`` takes mlx_lm generate's flags; anything else is the CLI.

``python -m dflash_mlx generate --model M --prompt P ...`` runs
`dflash_mlx.mlx_lm.cli` (``python -m dflash_mlx.generate ...`` does the same);
other arguments go to the ``dflash-mlx`` command line. On Linux both first
re-execute with the system OpenBLAS preloaded, as the console script does.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from dflash_mlx.cli import openblas

    openblas.maybe_reexec()
    if argv[:1] == ["generate"]:
        from dflash_mlx.mlx_lm.cli import main as generate_main

        generate_main(argv[1:])
        return
    from dflash_mlx.cli import app

    app(args=argv)


if __name__ == "__main__":
    main()
