"""``python -m dflash_mlx.generate``: the same as ``python -m dflash_mlx generate`` (mlx_lm generate's flags).

Only an entry point: the library's `generate` / `stream_generate` live in
`dflash_mlx.generation` and at the package's top level (``dflash_mlx.generate``).
"""

if __name__ == "__main__":
    import sys

    from dflash_mlx.__main__ import main

    main(["generate", *sys.argv[1:]])
