"""Chat completions' spelling of a conversation (``messages``, ``tools``, ``tool_choice``), translated
into the shared parser (`conversation`), errors naming chat completions' own fields.

``messages`` is OpenAI's message list: string content or text parts, assistant
messages carrying ``tool_calls`` (their JSON-string arguments parsed into
objects, which chat templates expect, as mlx_lm.server does), ``role: "tool"``
results (``tool_call_id`` required, as OpenAI's spec has it) and the legacy
``role: "function"`` results (no id: the oldest open call), under
`conversation`'s one rule for tool results. ``tools`` are function
definitions, ``tool_choice`` "auto", "none", "required" or a function of the
tools. Messages and tools otherwise reach the template as the client sent
them, as mlx_lm.server passes them (the same prompt, token for token).
"""

from __future__ import annotations

from . import conversation
from .conversation import ToolCalls, function_tool, text
from .errors import RequestError
from .fields import listed


def messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages", "expected a non-empty list of messages")
    out, calls = [], ToolCalls()
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(where, "expected an object with a string 'role'")
        content = message.get("content")
        message = {**message, "content": "" if content is None else text(content, f"{where}.content")}
        if message.get("tool_calls") is not None:
            if message["role"] != "assistant":
                raise RequestError(f"{where}.tool_calls", "only assistant messages carry tool calls")
            message["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls", calls)
        elif message["role"] in ("tool", "function"):
            legacy = message["role"] == "function"  # (its spec has no id)
            answer = calls.result(
                message.get("tool_call_id"), message["content"], where, "tool_call_id", optional=legacy
            )
            message = {**message, **answer}
        out.append(message)
    return out


def _tool_calls(value, where: str, calls: ToolCalls) -> list[dict]:
    if not isinstance(value, list):
        raise RequestError(where, f"expected a list of tool calls, got {value!r}")
    out = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise RequestError(f"{at}.function", f"expected an object with 'name' and 'arguments', got {function!r}")
        names = ("id", "function.name", "function.arguments")
        parsed = calls.call(call.get("id"), function.get("name"), function.get("arguments", {}), f"{at}.", names)
        out.append({**call, "function": {**function, "arguments": parsed["function"]["arguments"]}})
    return out


def tools(value) -> list | None:
    """The request's ``tools``, checked, as the client sent them (None for none)."""
    for i, tool in enumerate(listed(value, "tools", "tools")):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(where, "expected an object with type 'function'")
        if not isinstance(tool.get("function"), dict):
            raise RequestError(f"{where}.function", f"expected an object, got {tool.get('function')!r}")
        function_tool(tool["function"], f"{where}.function.")
    return value or None


def tool_choice(choice, defined: list | None):
    if choice is None:
        return None
    if choice in conversation.CHOICES:
        return conversation.tool_choice(choice, defined, "tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        return conversation.tool_choice("function", defined, "tool_choice", name, "tool_choice.function.name")
    raise RequestError(
        "tool_choice",
        f"expected 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
    )
