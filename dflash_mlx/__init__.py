"""dflash-mlx: lossless block-diffusion speculative decoding (DFlash) for MLX.

Public API: ``load``, ``load_draft``, ``stream_generate``, ``generate``,
``make_session`` (caches kept across calls), ``DFlashResponse``, ``SuffixIndex``
(what generations produced, drafting what later ones produce again), and for
many prompts at once ``batch_generate`` / ``stream_batch_generate``. They are
imported on first use, so ``import dflash_mlx`` (and every console-script
start, which may re-execute itself once) stays cheap; see ARCHITECTURE.md for
the layout behind them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "DFlashResponse": "dflash_mlx.generation",
    "SuffixIndex": "dflash_mlx.proposers.suffix",
    "batch_generate": "dflash_mlx.batch.generate",
    "stream_batch_generate": "dflash_mlx.batch.generate",
    "generate": "dflash_mlx.generation",
    "stream_generate": "dflash_mlx.generation",
    "load": "dflash_mlx.models.loading",
    "load_draft": "dflash_mlx.draft.load",
    "make_session": "dflash_mlx.session",
}

__all__ = [
    "DFlashResponse",
    "SuffixIndex",
    "batch_generate",
    "generate",
    "load",
    "load_draft",
    "make_session",
    "stream_batch_generate",
    "stream_generate",
    "__version__",
]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
