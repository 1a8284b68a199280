"""An OpenAI-compatible HTTP server for DFlash (``dflash-mlx serve``).

Modules: `request` (validating request bodies; `messages` checks chat
messages and tools, `errors` holds the field error), `stops` (stop sequences
on text), `channels` (a reply split into content, reasoning and tool calls),
`worker` (the one thread that owns the model), `prompt_cache` (an LRU of
sessions, one per conversation) and `session_store` (its files on disk),
`responses` (OpenAI response objects), `handler` (HTTP routes and SSE), `app`
(the server and `make_server`); the Typer ``serve`` command is `cli.serve_cmd`.
"""

from .app import DFlashServer, make_server

__all__ = ["DFlashServer", "make_server"]
