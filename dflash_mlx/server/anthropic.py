"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the server's core.

A body becomes a chat `GenerationRequest`: ``system`` (a string or text blocks)
is the system message; ``messages`` carry string or block content: ``text``;
in assistant turns ``thinking`` (the template's ``reasoning_content``) and
``tool_use`` (the turn's tool calls; ``redacted_thinking`` is dropped), in user
turns ``tool_result`` (a tool message answering an earlier ``tool_use`` not
answered yet, by its required ``tool_use_id``: the rule every dialect shares,
`conversation`). ``tools`` (name, description, ``input_schema``) become
function tools; ``tool_choice`` (``any`` is "required", ``tool`` a named
function) is checked like every dialect's and, like theirs, not enforced.
``thinking`` ("enabled" or "adaptive" / "disabled") switches the chat
template's reasoning as ``--reasoning on|off`` does (no effect when the
template has no switch); ``budget_tokens`` is accepted and advisory.
``max_tokens`` is required; ``temperature``, ``top_p`` and ``top_k`` (top-level
fields: the current SDK sends them through ``extra_body``) default to the
server's (greedy), and ``stop_sequences`` are stops. ``metadata``,
``cache_control`` marks (the prompt cache is automatic), ``context_management``,
``output_config.effort`` and the service fields are accepted and ignored;
``output_config.format`` (``{"type": "json_schema", "schema": ...}``)
constrains the output to its grammar (`formats`); images, documents, server
tools and a final assistant turn (prefill) are refused with a 400 naming the
field.

The reply: ``content`` blocks in the order the model wrote them (``thinking``
with an empty ``signature``, ``text``, ``tool_use`` with its parsed ``input``),
``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` with
``stop_sequence``, ``tool_use``), ``usage`` (``input_tokens`` the prompt tokens
the prompt cache did not hold, ``cache_read_input_tokens`` those it held,
``output_tokens``) and the ``dflash`` statistics; streamed as Anthropic's
events (``message_start``, ``ping``, ``content_block_start`` /
``content_block_delta`` with ``text_delta``, ``thinking_delta`` or
``input_json_delta`` / ``content_block_stop``, ``message_delta`` with the
statistics, ``message_stop``). Errors: ``{"type": "error", "error": {"type",
"message"}}`` with the status of the failure.
"""

from __future__ import annotations

import json
import uuid

from .conversation import ToolCalls, function_tool, text, tool_choice
from .dialect import Blocks, Exchange, Outcome
from .errors import RequestError
from .formats import response_format
from .fields import Fields, listed, reasoning_args
from .request import GenerationRequest, check_model, sampling, stops

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
IGNORED_OBJECTS = ("metadata", "cache_control", "context_management", "output_config", "diagnostics")
IGNORED_STRINGS = ("service_tier", "inference_geo", "speed", "user_profile_id", "workspace_id")
COUNT = {"model", "messages", "system", "tools", "tool_choice", "thinking", *IGNORED_OBJECTS, *IGNORED_STRINGS}
CREATE = COUNT | {"max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream"}
BLOCK_NAME = {"content": "text", "reasoning": "thinking"}


def error(status: int, message: str, field: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def parse(body: dict, info, known: set) -> GenerationRequest:
    """A /v1/messages body (or a count_tokens one, `known` its fields) as the server's request."""
    b = Fields(body)
    b.unknown(known)
    _ignored(b)
    output_format = Fields(b.mapping("output_config"), "output_config.").mapping("format")
    req = GenerationRequest(kind="chat", model=check_model(body.get("model"), info))
    tools = _tools(body.get("tools"))
    req.tools = tools or None
    req.tool_choice = _tool_choice(body.get("tool_choice"), tools)
    req.messages = _system(body.get("system")) + _messages(body.get("messages"))
    req.chat_template_kwargs = {**info.chat_template_args, **_thinking(b, info)}
    if "max_tokens" in known:
        if body.get("max_tokens") is None:
            raise RequestError("max_tokens", "required (the most tokens to generate, as Anthropic's API asks)")
        req.max_tokens = b.integer("max_tokens", None, low=1)
        sampling(b, req, info)
        req.stop = stops(body.get("stop_sequences"), "stop_sequences")
        req.stream = b.boolean("stream")
        req.grammar = response_format(output_format or None, info.grammars, "output_config.format")
        req.grammar_field = "output_config.format"
    return req


def _ignored(b: Fields) -> None:
    for name in IGNORED_OBJECTS:
        b.mapping(name)
    for name in IGNORED_STRINGS:
        b.string(name)
    meta = Fields(b.mapping("metadata"), "metadata.")
    meta.unknown({"user_id"})
    meta.string("user_id")
    config = Fields(b.mapping("output_config"), "output_config.")
    config.unknown({"effort", "format"})
    config.string("effort")


def _blocks(content, where: str) -> list:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(where, f"expected a string or a list of content blocks, got {content!r}")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"{where}[{j}]", "expected a content block (an object with a string 'type')")
    return content


def _text(block: dict, where: str, key: str = "text") -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key}", f"expected a string, got {value!r}")
    return value


def _system(system) -> list[dict]:
    return [] if system is None else [{"role": "system", "content": text(system, "system")}]


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages", "expected a non-empty list of messages")
    out, calls = [], ToolCalls()
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise RequestError(where, "expected an object with 'role' 'user' or 'assistant' and 'content'")
        blocks = _blocks(message.get("content"), f"{where}.content")
        if message["role"] == "assistant":
            if i == len(value) - 1:
                raise RequestError(where, "a final assistant turn (prefill) is not supported: end with a user turn")
            out.append(_assistant(blocks, f"{where}.content", calls))
        else:
            out += _user(blocks, f"{where}.content", calls)
    return out


def _assistant(blocks: list, where: str, made: ToolCalls) -> dict:
    said, thinking, calls = "", "", []
    for j, block in enumerate(blocks):
        at, kind = f"{where}[{j}]", block["type"]
        if kind == "text":
            said += _text(block, at)
        elif kind == "thinking":
            thinking += _text(block, at, "thinking")
        elif kind == "tool_use":
            names = ("id", "name", "input")
            calls.append(
                made.call(block.get("id"), block.get("name"), block.get("input", {}), f"{at}.", names, encoded=False)
            )
        elif kind != "redacted_thinking":
            raise RequestError(
                f"{at}.type", f"an assistant turn takes text, thinking and tool_use blocks, got {kind!r}"
            )
    message = {"role": "assistant", "content": said}
    if thinking:
        message["reasoning_content"] = thinking
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list, where: str, calls: ToolCalls) -> list[dict]:
    """A user turn: a tool message per tool_result, then the turn's text (if any, or no results)."""
    out, texts = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}[{j}]", block["type"]
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_result":
            if not isinstance(block.get("is_error", False), bool):
                raise RequestError(f"{at}.is_error", f"expected true or false, got {block['is_error']!r}")
            content = "" if block.get("content") is None else text(block["content"], f"{at}.content")
            out.append(calls.result(block.get("tool_use_id"), content, at, "tool_use_id"))
        else:
            raise RequestError(f"{at}.type", f"a user turn takes text and tool_result blocks, got {kind!r}")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tools(value) -> list[dict]:
    out = []
    for i, tool in enumerate(listed(value, "tools", "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(where, "expected an object with 'name' and 'input_schema'")
        if tool.get("type", "custom") != "custom":
            raise RequestError(
                f"{where}.type",
                f"server tools are not supported (only tools with an input_schema), got {tool['type']!r}",
            )
        out.append(function_tool(tool, f"{where}.", "input_schema", schema_required=True))
    return out


def _tool_choice(choice, tools: list):
    if choice is None:
        return None
    if not isinstance(choice, dict):
        raise RequestError("tool_choice", f"expected an object with 'type' auto, any, none or tool, got {choice!r}")
    c = Fields(choice, "tool_choice.")
    c.unknown({"type", "name", "disable_parallel_tool_use"})
    kind = c.string("type", None, ("auto", "any", "none", "tool"))
    c.boolean("disable_parallel_tool_use")
    if kind is None:
        raise RequestError("tool_choice.type", "expected 'auto', 'any', 'none' or 'tool'")
    mode = {"auto": "auto", "any": "required", "none": "none", "tool": "function"}[kind]
    return tool_choice(mode, tools, "tool_choice", c.get("name"), "tool_choice.name")


def _thinking(b: Fields, info) -> dict:
    """The chat template arguments ``thinking`` asks for ({} without it)."""
    if b.get("thinking") is None:
        return {}
    t = Fields(b.mapping("thinking"), "thinking.")
    t.unknown({"type", "budget_tokens", "display"})
    kind = t.string("type", None, ("enabled", "adaptive", "disabled"))
    if kind is None:
        raise RequestError("thinking.type", "expected 'enabled', 'adaptive' or 'disabled'")
    t.integer("budget_tokens", None, low=1)  # advisory: the model thinks as long as it does
    t.string("display", None, ("summarized", "omitted"))
    return reasoning_args(info, "off" if kind == "disabled" else "on", "thinking")


def usage(counts, completion_tokens: int = 0) -> dict:
    """Anthropic's usage for `counts` (a `Started` or an `Outcome`): input_tokens are those the cache
    did not hold (their total is input_tokens + cache_read_input_tokens, as Anthropic counts)."""
    prompt, cached = counts.prompt_tokens, counts.cached_tokens
    return {
        "input_tokens": prompt - cached,
        "output_tokens": completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(outcome: Outcome) -> str:
    if outcome.finish_reason == "length":
        return "max_tokens"
    if outcome.tool_calls:
        return "tool_use"
    return "stop_sequence" if outcome.stop_sequence is not None else "end_turn"


def tool_use(call: dict) -> dict:
    """A tool call (OpenAI's shape, from `channels`) as a tool_use block."""
    arguments = json.loads(call["function"]["arguments"])
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": arguments if isinstance(arguments, dict) else {"arguments": arguments},
    }


class Messages(Exchange):
    """A POST /v1/messages request."""

    error = staticmethod(error)

    def __init__(self, request: GenerationRequest, model: str):
        super().__init__(request, model)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.blocks = Blocks()

    @classmethod
    def parse(cls, body, server) -> Messages:
        return cls(parse(body, server.info, CREATE), server.model_id)

    def _message(self, content: list, usage_: dict, outcome: Outcome | None = None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(outcome) if outcome else None,
            "stop_sequence": outcome.stop_sequence if outcome else None,
            "usage": usage_,
        }

    def start(self, started) -> list:
        return [
            ("message_start", {"type": "message_start", "message": self._message([], usage(started))}),
            ("ping", {"type": "ping"}),
        ]

    def feed(self, delta, token=None, holding: bool = False) -> list:
        steps = self.blocks.feed(delta)
        return [e for step in steps for e in _events(step)] if self.request.stream else []

    def finish(self, delta, outcome: Outcome) -> list:
        events = self.feed(delta) + [e for step in self.blocks.close() for e in _events(step)]
        if not self.request.stream:
            return []
        end = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(outcome), "stop_sequence": outcome.stop_sequence},
            "usage": usage(outcome, outcome.completion_tokens),
        }
        if outcome.dflash:
            end["dflash"] = outcome.dflash
        return events + [("message_delta", end), ("message_stop", {"type": "message_stop"})]

    def fail(self, failed) -> list:
        return [("error", error(failed.status, failed.message, failed.field))]

    def whole(self, outcome: Outcome) -> dict:
        content = [_block(kind, value) for kind, value in self.blocks.blocks]
        out = self._message(content, usage(outcome, outcome.completion_tokens), outcome)
        if outcome.dflash:
            out["dflash"] = outcome.dflash
        return out


def _block(kind: str, value) -> dict:
    if kind == "tool":
        return tool_use(value)
    if kind == "reasoning":
        return {"type": "thinking", "thinking": value, "signature": ""}
    return {"type": "text", "text": value}


def _events(step: tuple) -> list:
    """A `dialect.Blocks` step as Anthropic's stream events."""
    what, index = step[0], step[1]
    if what == "open":
        empty = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if step[2] == "reasoning"
            else {"type": "text", "text": ""}
        )
        return [("content_block_start", {"type": "content_block_start", "index": index, "content_block": empty})]
    if what == "text":
        kind = BLOCK_NAME[step[2]]
        delta = {"type": f"{kind}_delta", kind: step[3]}
        return [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})]
    stop = ("content_block_stop", {"type": "content_block_stop", "index": index})
    if what == "close":
        return [stop]
    block = tool_use(step[2])
    arguments = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    return [
        (
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
        ),
        ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": arguments}),
        stop,
    ]


class CountTokens(Messages):
    """A POST /v1/messages/count_tokens request: the prompt's tokens, nothing generated."""

    @classmethod
    def parse(cls, body, server) -> CountTokens:
        return cls(parse(body, server.info, COUNT), server.model_id)

    def answer(self, server) -> dict:
        return {"input_tokens": len(server.worker.tokenize(self.request))}
