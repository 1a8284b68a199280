"""dflash-mlx: lossless block-diffusion speculative decoding (DFlash) for MLX.

Public API: ``load``, ``load_draft``, ``stream_generate``, ``generate``,
``make_session`` (caches kept across calls).
"""

__version__ = "0.1.0"

from .draft.load import load_draft
from .generate import DFlashResponse, generate, stream_generate
from .loading import load
from .session import make_session

__all__ = ["DFlashResponse", "generate", "load", "load_draft", "make_session", "stream_generate", "__version__"]
