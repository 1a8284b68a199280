"""What an API dialect gives the HTTP handler: one `Exchange` per request, translating both ways.

The server has one request model (`request.GenerationRequest`: chat messages
and tools as chat templates take them, sampling, stops, limits) and one reply
model (the worker's `events`, the reply split by `channels.Channels` into
ordered content, reasoning and tool-call pieces, and an `Outcome`). A dialect
is one module with an `Exchange` subclass per route: `parse` turns a body into
a `GenerationRequest` (a `RequestError` naming the dialect's own field), and
the instance turns the reply back into the dialect's stream events (`start`,
`feed`, `finish`, `fail`), its whole reply (`whole`) and its error shape
(`error`). The handler (`handler.Handler`) owns everything else: the body, the
key check, submitting, reading events, SSE framing, cancellation.
"""

from __future__ import annotations

from dataclasses import dataclass

from .channels import Delta
from .events import Failed, Started, Token
from .request import GenerationRequest

Event = tuple  # (SSE event name or None, JSON object): one server-sent event


@dataclass
class Outcome:
    """How a reply ended, in the terms every dialect reports."""

    finish_reason: str  # the worker's: "stop" or "length"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the prompt cache held
    completion_tokens: int
    dflash: dict  # the acceptance statistics (`events.dflash_object`; {} without a drafter)
    stop_sequence: str | None = None  # the stop sequence that ended the reply
    tool_calls: bool = False  # the reply made at least one tool call
    seconds: float = 0.0  # since the request arrived

    @property
    def reason(self) -> str:
        """Chat completions' finish_reason: "tool_calls", "stop" or "length"."""
        return "tool_calls" if self.finish_reason == "stop" and self.tool_calls else self.finish_reason


class Exchange:
    """One request in one dialect (a subclass per route). `request` is what the worker runs."""

    done: bytes = b""  # what ends a stream after its last event

    def __init__(self, request: GenerationRequest, model: str):
        self.request, self.model = request, model

    @classmethod
    def parse(cls, body, server, key: int | None = None) -> Exchange:
        """The exchange of a parsed JSON body (`server`: its `info`, `model_id`, stores; `key`: the number
        of the API key the request came with, None without keys: what it may reach of the stores); raises
        `RequestError` naming the field."""
        raise NotImplementedError

    @staticmethod
    def error(status: int, message: str, field: str | None = None) -> dict:
        """The dialect's error body."""
        raise NotImplementedError

    def answer(self, server) -> dict | None:
        """A reply made without generating (token counting), or None: the request is generated."""
        return None

    def start(self, started: Started) -> list[Event]:
        """The stream's first events, once the first token exists."""
        return []

    def feed(self, delta: Delta, token: Token, holding: bool) -> list[Event]:
        """What one token adds (`holding`: inside a tool call, whose text is not released yet)."""
        raise NotImplementedError

    def finish(self, delta: Delta, outcome: Outcome) -> list[Event]:
        """The last piece of the reply (what the channels held back) and the stream's closing events."""
        raise NotImplementedError

    def fail(self, failed: Failed) -> list[Event]:
        """The events of a failure once streaming started (before, the handler answers `error`)."""
        return [(None, self.error(failed.status, failed.message, failed.field))]

    def whole(self, outcome: Outcome) -> dict:
        """The complete (non-streamed) reply, after `finish`."""
        raise NotImplementedError


class Blocks:
    """A reply as ordered blocks, for dialects whose replies are lists of them (Anthropic's content
    blocks, the Responses API's output items): a run of reasoning or of content text is one block,
    each tool call one more. `feed` returns the steps a stream reports, each with its block's index:
    ("open", i, kind), ("text", i, kind, piece), ("close", i, kind, text) and ("tool", i, call)
    (a call is whole when it comes); `blocks` holds the closed ones as (kind, text or call)."""

    def __init__(self):
        self.blocks: list[tuple[str, object]] = []
        self._open: list | None = None  # [kind, text so far]

    def feed(self, delta: Delta) -> list[tuple]:
        steps = []
        for kind, value in delta.parts:
            if self._open is not None and (kind == "tool" or kind != self._open[0]):
                steps += self.close()
            if kind == "tool":
                steps.append(("tool", len(self.blocks), value))
                self.blocks.append(("tool", value))
                continue
            if self._open is None:
                self._open = [kind, ""]
                steps.append(("open", len(self.blocks), kind))
            self._open[1] += value
            steps.append(("text", len(self.blocks), kind, value))
        return steps

    def close(self) -> list[tuple]:
        """Close the open block (the reply's end, or another kind of block starts)."""
        if self._open is None:
            return []
        kind, text = self._open
        self._open = None
        self.blocks.append((kind, text))
        return [("close", len(self.blocks) - 1, kind, text)]
