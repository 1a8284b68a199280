"""``python -m dflash_mlx.generate``: the same as ``python -m dflash_mlx generate`` (mlx_lm generate's flags).

Only an entry point. ``dflash_mlx.generate`` is the library's function
(`dflash_mlx.generation.generate`): imported as a module, this file puts that
function in its place, so ``import dflash_mlx.generate`` cannot rebind the
package's `generate` to a module.
"""

import sys

if __name__ == "__main__":
    from dflash_mlx.__main__ import main

    main(["generate", *sys.argv[1:]])
else:
    from dflash_mlx.generation import generate

    sys.modules[__name__] = generate
