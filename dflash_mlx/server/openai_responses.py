"""OpenAI's Responses API (``POST /v1/responses``) over the server's core, the subset local servers serve.

A body becomes a chat `GenerationRequest`: ``instructions`` is the system
message (not carried to later responses, as OpenAI does); ``input`` is a
string (one user message) or items: messages (``user``, ``assistant``,
``system``, ``developer`` taken as ``system``; string or text parts),
``reasoning`` items (the next assistant turn's ``reasoning_content``),
``function_call`` items (the assistant turn's tool calls) and
``function_call_output`` items (tool messages answering an earlier call not
answered yet: the rule every dialect shares, `conversation`; their
``call_id`` is optional in OpenAI's spec, and without one an output answers
the oldest open call). ``previous_response_id`` puts the stored conversation
of that response (its input and output, `Conversations`) before the input:
the server keeps the conversations of its most recent responses
(``--response-store-size``, least recently used first out; ``store: false``
keeps nothing) and an unknown or evicted id is a 400 naming it; the prompt
cache reuses the conversation's prefix as for any other turn. ``tools`` of type function, ``tool_choice``
(checked, not enforced, as in every dialect), ``reasoning.effort``
(``none`` is ``--reasoning off``, ``minimal`` ``low``, the others themselves;
a template switched on / off takes any effort as on), ``max_output_tokens``,
``temperature`` and ``top_p`` (absent: the server's defaults, greedy).
``metadata`` is echoed; ``include``, ``text.verbosity``, ``prompt_cache_key``,
``user``, ``safety_identifier``, ``service_tier`` and ``parallel_tool_calls``
are accepted and change nothing; ``text.format`` (``json_schema`` with
``schema`` and ``strict``, ``json_object``) constrains the output to its
grammar (`formats`); images, files, other tool types, ``truncation: "auto"``
and unknown fields are a 400 naming the field.

The reply is a ``response`` object: ``output`` items in the order the model
wrote them (``reasoning`` with ``reasoning_text`` content, ``message`` with
``output_text``, ``function_call`` with its JSON ``arguments``), ``status``
(``completed``, or ``incomplete`` with ``max_output_tokens``), ``usage``
(cached and reasoning tokens: those whose text went to the reasoning channel)
and the ``dflash`` statistics; streamed as the documented ``response.*`` events
with sequence numbers. Errors are OpenAI's error objects.
"""

from __future__ import annotations

import json
import time
import uuid

from .budget import Kept, python_bytes
from .conversation import CHOICES, ToolCalls, function_tool, text, tool_choice
from .dialect import Blocks, Exchange, Outcome
from .errors import RequestError
from .formats import response_format
from .openai_fields import metadata
from .openai_chat import error_body
from .fields import EFFORTS, Fields, listed, reasoning_args
from .request import GenerationRequest, check_model, sampling

KNOWN = {
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning",
    "previous_response_id",
    "store",
    "stream",
    "stream_options",
    "metadata",
    "include",
    "text",
    "truncation",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
}
TEXTS = ("input_text", "output_text")  # the text parts of messages and function call outputs
CALL_FIELDS = ("call_id", "name", "arguments")  # a function_call item's id, name and arguments
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens"}  # the worker's field names, in this dialect
DEFAULT_STORED = 100  # responses whose conversations are kept (--response-store-size)


class Conversations(Kept):
    """The conversations (chat messages, instructions aside) of the most recent responses, by id: at most
    `size` (0: none kept), the least recently used going first, within the server's byte `budget` (each
    counted at the bytes of its Python objects); shared by the handler threads."""

    def __init__(self, size: int = DEFAULT_STORED, budget=None):
        if size < 0:
            raise ValueError(f"the response store size must be >= 0, got {size}.")
        super().__init__(size, budget)

    def get(self, response_id: str) -> list[dict]:
        messages = super().get(response_id)
        if messages is None:
            raise RequestError(
                "previous_response_id",
                f"no stored response {response_id!r}: unknown, made "
                f"with store: false, or evicted (this server keeps the conversations of its "
                f"last {self.size} responses, --response-store-size, within its memory budget)",
            )
        return list(messages)

    def put(self, response_id: str, messages: list[dict]) -> None:
        super().put(response_id, messages, python_bytes(messages))


def error(status: int, message: str, field: str | None = None) -> dict:
    if field in RENAMED and message.startswith(field + ":"):
        field, message = RENAMED[field], RENAMED[field] + message[len(field) :]
    return error_body(message, field, status)


def _items(value, calls: ToolCalls) -> list[dict]:
    """`input` as chat messages; `calls` (the conversation's calls so far) takes its calls and outputs."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("input", "expected a string or a non-empty list of items")
    out, reasoning = [], ""
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(where, f"expected an item (an object), got {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role", f"expected user, assistant, system or developer, got {role!r}")
            message = {
                "role": "system" if role == "developer" else role,
                "content": text(item.get("content"), f"{where}.content", TEXTS),
            }
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += text(parts, f"{where}.content", ("reasoning_text", "summary_text"))
        elif kind == "function_call":
            arguments = item.get("arguments", "")
            call = calls.call(item.get("call_id"), item.get("name"), arguments, f"{where}.", CALL_FIELDS)
            out, reasoning = _with_call(out, call, reasoning), ""
        elif kind == "function_call_output":
            output = text(item.get("output"), f"{where}.output", TEXTS)
            out.append(calls.result(item.get("call_id"), output, where, "call_id", optional=True))
        else:
            raise RequestError(
                f"{where}.type", f"expected message, reasoning, function_call or function_call_output, got {kind!r}"
            )
    return out


def _with_call(messages: list[dict], call: dict, reasoning: str) -> list[dict]:
    """Add a tool call to the assistant turn it belongs to (the last message, or a new one)."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or reasoning:
        last = {"role": "assistant", "content": ""}
        if reasoning:
            last["reasoning_content"] = reasoning
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)
    return messages


def _tools(value) -> list[dict]:
    out = []
    for i, tool in enumerate(listed(value, "tools", "tools")):
        t = Fields(tool if isinstance(tool, dict) else {}, f"tools[{i}].")
        if t.string("type", None, ("function",)) is None:
            raise RequestError(f"tools[{i}].type", "expected 'function' (only function tools are supported)")
        t.unknown({"type", "name", "description", "parameters", "strict"})
        t.boolean("strict", True)
        out.append(function_tool(tool, f"tools[{i}]."))
    return out


def _tool_choice(choice, tools: list):
    if choice is None:
        return None
    if choice in CHOICES:
        return tool_choice(choice, tools, "tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        return tool_choice("function", tools, "tool_choice", choice.get("name"), "tool_choice.name")
    raise RequestError(
        "tool_choice", f"expected 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, got {choice!r}"
    )


def _options(b: Fields, info) -> dict:
    """Check the fields that change nothing here or only the template; returns the template arguments."""
    for name in ("user", "safety_identifier", "prompt_cache_key", "service_tier"):
        b.string(name)
    b.boolean("parallel_tool_calls", True)
    b.string("truncation", None, ("disabled",))
    include = b.get("include", [])
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include) or len(include) > 32:
        raise RequestError("include", f"expected a list of at most 32 strings, got {include!r}")
    text = Fields(b.mapping("text"), "text.")
    text.unknown({"format", "verbosity"})
    text.string("verbosity", None, ("low", "medium", "high"))
    metadata(b)
    if b.mapping("stream_options") and not b.boolean("stream"):
        raise RequestError("stream_options", "only allowed with stream: true")
    Fields(b.mapping("stream_options"), "stream_options.").unknown({"include_obfuscation"})
    r = Fields(b.mapping("reasoning"), "reasoning.")
    r.unknown({"effort", "summary", "generate_summary"})
    r.string("summary", None, ("auto", "concise", "detailed"))
    effort = r.string("effort", None, tuple(EFFORTS))
    return {} if effort is None else reasoning_args(info, EFFORTS[effort], "reasoning.effort")


class Responses(Exchange):
    """A POST /v1/responses request; `conversation`: the messages to store with its reply (None: not
    stored)."""

    error = staticmethod(error)

    def __init__(
        self,
        request: GenerationRequest,
        model: str,
        echo: dict,
        conversation: list | None,
        conversations: Conversations,
    ):
        super().__init__(request, model)
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.echo, self.conversation, self.conversations = echo, conversation, conversations
        self.blocks, self.ids, self.sequence, self.reasoning_tokens = Blocks(), {}, 0, 0

    @classmethod
    def parse(cls, body, server) -> Responses:
        b, info = Fields(body), server.info
        b.unknown(KNOWN)
        req = GenerationRequest(kind="chat", model=check_model(body.get("model"), info))
        tools = _tools(body.get("tools"))
        req.tools, req.tool_choice = tools or None, _tool_choice(body.get("tool_choice"), tools)
        req.chat_template_kwargs = {**info.chat_template_args, **_options(b, info)}
        previous = b.string("previous_response_id")
        history = server.conversations.get(previous) if previous else []
        messages = history + _items(body.get("input"), ToolCalls(history))
        instructions = b.string("instructions")
        req.messages = ([{"role": "system", "content": instructions}] if instructions else []) + messages
        req.max_tokens = b.integer("max_output_tokens", None, low=1) or info.max_tokens
        sampling(b, req, info)
        req.stream = b.boolean("stream")
        text_format = Fields(b.mapping("text"), "text.").mapping("format")
        req.grammar = response_format(text_format or None, info.grammars, "text.format")
        req.grammar_field = "text.format"
        store = b.boolean("store", True)
        echo = {
            "instructions": instructions,
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": b.mapping("metadata"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": previous,
            "store": store,
            "temperature": req.temperature,
            "reasoning": {"effort": None, "summary": None, **b.mapping("reasoning")},
            "text": {"format": text_format or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "user": body.get("user"),
        }
        return cls(req, server.model_id, echo, messages if store else None, server.conversations)

    # -- the response object ------------------------------------------------------------------------

    def _response(self, status: str, output: list, outcome: Outcome | None = None, failure: dict | None = None):
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": failure,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "usage": None,
            **self.echo,
        }
        if outcome is not None:
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["usage"] = {
                "input_tokens": outcome.prompt_tokens,
                "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                "output_tokens": outcome.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            }
            if outcome.dflash:
                out["dflash"] = outcome.dflash
        return out

    def _item(self, index: int, kind: str, value, done: bool = True) -> dict:
        status = "completed" if done else "in_progress"
        if kind == "tool":
            return {
                "id": self.ids[index],
                "type": "function_call",
                "call_id": value["id"],
                "name": value["function"]["name"],
                "arguments": value["function"]["arguments"] if done else "",
                "status": status,
            }
        if kind == "reasoning":
            return {
                "id": self.ids[index],
                "type": "reasoning",
                "summary": [],
                "status": status,
                "content": [_part(kind, value)] if done else [],
            }
        return {
            "id": self.ids[index],
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_part(kind, value)] if done else [],
        }

    def _output(self) -> list:
        return [self._item(i, kind, value) for i, (kind, value) in enumerate(self.blocks.blocks)]

    # -- the exchange -------------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> tuple:
        self.sequence += 1
        return (
            f"response.{kind}" if kind != "error" else kind,
            {"type": f"response.{kind}" if kind != "error" else kind, "sequence_number": self.sequence - 1, **fields},
        )

    def start(self, started) -> list:
        response = self._response("in_progress", [])
        return [self._event("created", response=response), self._event("in_progress", response=response)]

    def feed(self, delta, token=None, holding: bool = False) -> list:
        if delta.reasoning and token is not None and token.token is not None:
            self.reasoning_tokens += 1
        return self._steps(self.blocks.feed(delta))

    def finish(self, delta, outcome: Outcome) -> list:
        events = self.feed(delta) + self._steps(self.blocks.close())
        if self.conversation is not None:
            self.conversations.put(self.id, self.conversation + [self._assistant()])
        if not self.request.stream:
            return []
        status = "incomplete" if outcome.finish_reason == "length" else "completed"
        return events + [self._event(status, response=self._response(status, self._output(), outcome))]

    def fail(self, failed) -> list:
        failure = {"code": "server_error" if failed.status >= 500 else "invalid_prompt", "message": failed.message}
        return [
            self._event("error", code=failure["code"], message=failed.message, param=failed.field),
            self._event("failed", response=self._response("failed", self._output(), failure=failure)),
        ]

    def whole(self, outcome: Outcome) -> dict:
        return self._response(
            "incomplete" if outcome.finish_reason == "length" else "completed", self._output(), outcome
        )

    def _assistant(self) -> dict:
        """The reply as the assistant turn of the stored conversation."""
        message = {"role": "assistant", "content": ""}
        for kind, value in self.blocks.blocks:
            if kind == "tool":
                function = value["function"]
                message.setdefault("tool_calls", []).append(
                    {
                        "id": value["id"],
                        "type": "function",
                        "function": {"name": function["name"], "arguments": json.loads(function["arguments"])},
                    }
                )
            else:
                key = "content" if kind == "content" else "reasoning_content"
                message[key] = message.get(key, "") + value
        return message

    def _steps(self, steps: list) -> list:
        """`dialect.Blocks` steps as the stream's events (none for a whole reply)."""
        events = []
        for step in steps:
            what, index, kind = step[0], step[1], "tool" if step[0] == "tool" else step[2]
            if what in ("open", "tool"):
                self.ids[index] = {"tool": "fc_", "reasoning": "rs_", "content": "msg_"}[kind] + uuid.uuid4().hex
            if self.request.stream:
                events += self._step_events(what, index, kind, step[-1])
        return events

    def _step_events(self, what: str, index: int, kind: str, value) -> list:
        at = {"item_id": self.ids[index], "output_index": index}
        name = "output_text" if kind == "content" else "reasoning_text"
        logprobs = {"logprobs": []} if kind == "content" else {}
        if what == "open":
            return [
                self._event("output_item.added", output_index=index, item=self._item(index, kind, "", False)),
                self._event("content_part.added", **at, content_index=0, part=_part(kind, "")),
            ]
        if what == "text":
            return [self._event(f"{name}.delta", **at, content_index=0, delta=value, **logprobs)]
        if what == "close":
            return [
                self._event(f"{name}.done", **at, content_index=0, text=value, **logprobs),
                self._event("content_part.done", **at, content_index=0, part=_part(kind, value)),
                self._event("output_item.done", output_index=index, item=self._item(index, kind, value)),
            ]
        arguments, function = value["function"]["arguments"], value["function"]["name"]
        return [
            self._event("output_item.added", output_index=index, item=self._item(index, kind, value, False)),
            self._event("function_call_arguments.delta", **at, delta=arguments),
            self._event("function_call_arguments.done", **at, arguments=arguments, name=function),
            self._event("output_item.done", output_index=index, item=self._item(index, kind, value)),
        ]


def _part(kind: str, text: str) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
