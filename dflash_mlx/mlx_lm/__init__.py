"""mlx-lm's API with DFlash underneath: ``from dflash_mlx.mlx_lm import load, stream_generate, generate``.

The one-import switch for mlx-lm scripts. `api` holds the drop-in functions,
`cache` runs mlx-lm's own prompt-cache lists, `samplers` recovers
``make_sampler`` settings, `cli` is ``python -m dflash_mlx generate``.
"""

from .api import (
    DFlashPromptCache,
    generate,
    load,
    make_prompt_cache,
    remember_draft,
    remembered_draft,
    stream_generate,
)

__all__ = [
    "DFlashPromptCache",
    "generate",
    "load",
    "make_prompt_cache",
    "remember_draft",
    "remembered_draft",
    "stream_generate",
]
