"""An OpenAI-compatible HTTP server for DFlash (``dflash-mlx serve``).

Modules: `request` (validating request bodies), `stops` (stop sequences on
text), `worker` (the one thread that owns the model), `responses` (OpenAI
response objects), `handler` (HTTP routes and SSE), `app` (the server and
`make_server`), `command` (the Typer ``serve`` command).
"""

from .app import DFlashServer, make_server

__all__ = ["DFlashServer", "make_server"]
