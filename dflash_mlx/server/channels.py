"""A reply's text split into content, reasoning and tool calls, as mlx_lm.server splits it.

The tokenizer (mlx-lm's `TokenizerWrapper`) knows the model's think markers
and tool-call markers; `mlx_lm.generate.make_text_state_machine` turns them
into a text state machine ("normal", "reasoning", "tool") that strips the
markers, and the tokenizer's `tool_parser` reads each finished tool block.
Tool calls come out in OpenAI's shape through mlx_lm.server's own
`ToolCallFormatter` (arguments as a JSON string, an id, an index when
streamed; the random ids it makes take OpenAI's "call_..." form), so a
reply carries the same fields as mlx_lm.server's. A tool
block that does not parse (a model that wrote something else between the
markers, a reply cut mid-call) is returned as content, markers included, and
does not make the finish reason "tool_calls" (mlx_lm.server drops such a
block with a warning).
`initial_state` reads the prompt: a template that opens a think block in the
generation prompt starts the reply in "reasoning".
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from mlx_lm.generate import TextStateMachine, make_text_state_machine


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def initial_state(tokenizer, prompt: list[int]) -> str:
    """ "reasoning" when the prompt ends inside an open think block, else "normal"."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        state = "reasoning"
    return tokenizer.response_initial_state or state


@dataclass
class Delta:
    """What a piece of the reply adds to each channel; `parts` keeps the pieces in the order the
    model wrote them (("reasoning" | "content", text) and ("tool", call)), for dialects whose
    replies are ordered blocks."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    parts: list[tuple[str, object]] = field(default_factory=list)

    def __post_init__(self):
        if not self.parts:
            pieces = [("reasoning", self.reasoning), ("content", self.content)]
            self.parts = [p for p in pieces if p[1]] + [("tool", c) for c in self.tool_calls]

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def put(self, channel: str, value) -> None:
        """Append text to "content" or "reasoning", or a call to "tool"."""
        if channel == "tool":
            self.tool_calls.append(value)
        elif value:
            setattr(self, channel, getattr(self, channel) + value)
        else:
            return
        if channel != "tool" and self.parts and self.parts[-1][0] == channel:
            self.parts[-1] = (channel, self.parts[-1][1] + value)
        else:
            self.parts.append((channel, value))

    def add(self, other: Delta) -> None:
        """Append `other`'s pieces (a whole reply gathers its deltas)."""
        for channel, value in other.parts:
            self.put(channel, value)


class Channels:
    """Feeds released reply text through the state machine; `finish` ends the reply."""

    def __init__(self, tokenizer, tools: list | None, state: str, *, streaming: bool):
        from mlx_lm.server import ToolCallFormatter  # mlx-lm's server module: imported only when serving

        self._machine = make_text_state_machine(tokenizer)
        self._state = self._machine.make_state(state)
        self._previous = state
        self._tool_text = ""
        self._format = ToolCallFormatter(tokenizer.tool_parser, tools, streaming)
        self._markers = (tokenizer.tool_call_start or "", tokenizer.tool_call_end or "")
        self.made_tool_call = False

    @property
    def in_tool_call(self) -> bool:
        """Inside a tool block: mlx_lm.server sends nothing until the block closes."""
        return self._previous == "tool"

    def feed(self, text: str) -> Delta:
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._collect(segments)

    def finish(self, finish_reason: str) -> Delta:
        """The end of the reply: a stop drops a held partial marker, a length cut releases it."""
        if finish_reason == "length":
            self._state, held, current = TextStateMachine.flush(self._state)
            delta = self._collect([(current, held)])
        else:
            self._state, current = TextStateMachine.discard(self._state)
            delta = self._collect([(current, "")])
        if self._previous == "tool":
            self._close_tool(delta, closed=False)
        return delta

    def finish_reason(self, finish_reason: str) -> str:
        return "tool_calls" if finish_reason == "stop" and self.made_tool_call else finish_reason

    def _collect(self, segments) -> Delta:
        delta = Delta()
        for state, text in segments:
            if state == "reasoning":
                delta.put("reasoning", text)
            elif state == "tool":
                self._tool_text += text
            elif state == "normal":
                if self._previous == "tool":
                    self._close_tool(delta)
                delta.put("content", text)
            self._previous = state
        return delta

    def _close_tool(self, delta: Delta, closed: bool = True) -> None:
        calls = self._format([self._tool_text]) if self._tool_text.strip() else []
        for call in calls:
            if _UUID.fullmatch(call["id"]):
                call["id"] = f"call_{uuid.UUID(call['id']).hex[:24]}"
        for call in calls:
            delta.put("tool", call)
        self.made_tool_call = self.made_tool_call or bool(calls)
        if not calls:  # not a tool call after all: the text as the model wrote it
            start, end = self._markers
            delta.put("content", start + self._tool_text + (end if closed else ""))
        self._tool_text = ""
