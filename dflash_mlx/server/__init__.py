"""The HTTP server of DFlash (``dflash-mlx serve``): OpenAI's and Anthropic's APIs over one core.

Modules: `request` (the request model, `GenerationRequest`, and chat
completions' body; `conversation` parses every dialect's text parts, tools,
tool_choice, tool calls and results under one rule, `messages` is chat
completions' spelling of them, `errors` holds the field error), `stops` (stop
sequences on text), `channels` (a reply split into ordered content, reasoning
and tool-call pieces), `dialect` (what each API dialect gives the handler) and
the dialects: `openai_chat` (chat and text completions), `anthropic`
(Messages), `openai_responses` (Responses); `handler` (HTTP routes, the API
key, SSE, cancelling the job of a client that left), `prompts` (a request
prepared in its handler's thread), `worker` (the one thread that owns the
model and only decodes) and `batching` (its batched loop), `budget` (the one
byte budget of everything the server keeps), `limits` (the caches' footprint,
the body limit), `events`, `prompt_cache` (an LRU of sessions, one per
conversation) and `session_store` (its files on disk), `app` (the server and
`make_server`); the Typer ``serve`` command is `cli.serve_cmd`.
"""

from .app import DFlashServer, make_server

__all__ = ["DFlashServer", "make_server"]
