"""Chat messages and tool definitions of a /v1/chat/completions body, validated.

`messages` accepts OpenAI's message list: string content or text parts,
assistant messages carrying ``tool_calls`` (their JSON-string arguments are
parsed into objects, which chat templates expect, as mlx_lm.server does) and
``role: "tool"`` results, each of which must follow a call (and name one of
its ids when both give ids). `tools` checks function definitions (a name, an
object of parameters), `tool_choice` the choice ("auto", "none", "required"
or a function of the tools). Errors are `RequestError`s naming the field.
"""

from __future__ import annotations

import json

from .errors import RequestError


def messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages", "expected a non-empty list of messages")
    out, calls = [], None  # calls: the ids of the last assistant message's tool calls, while tool results follow
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(where, "expected an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"{where}.content[{j}]", "only text parts ({'type': 'text', 'text': ...}) are supported"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"{where}.content", f"expected a string or a list of text parts, got {content!r}")
        message = {**message, "content": content}
        if message.get("tool_calls") is not None:
            if message["role"] != "assistant":
                raise RequestError(f"{where}.tool_calls", "only assistant messages carry tool calls")
            message["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
            calls = [c.get("id") for c in message["tool_calls"]]
        elif message["role"] == "tool":
            _answers_a_call(message, where, calls)
        else:
            calls = None
        out.append(message)
    return out


def _answers_a_call(message: dict, where: str, calls: list | None) -> None:
    """A tool message must follow an assistant message with tool calls (other tool results between)."""
    if calls is None:
        raise RequestError(where, "a tool message must follow an assistant message with tool_calls")
    call_id = message.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise RequestError(f"{where}.tool_call_id", f"expected a string, got {call_id!r}")
    known = [c for c in calls if c is not None]
    if call_id is not None and known and call_id not in known:
        raise RequestError(f"{where}.tool_call_id", f"{call_id!r} answers none of the calls before it ({known})")


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RequestError(where, f"expected a list of tool calls, got {calls!r}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{at}.function", "expected an object with a non-empty string 'name'")
        arguments = call_arguments(function.get("arguments", {}), f"{at}.function.arguments")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def call_arguments(arguments, where: str) -> dict:
    """A tool call's arguments as the object chat templates take (OpenAI sends a JSON string)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(where, f"not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise RequestError(where, f"expected a JSON object, got {arguments!r}")
    return arguments


def tools(value) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise RequestError("tools", f"expected a list of tools, got {value!r}")
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise RequestError(where, "expected an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function", f"expected an object, got {function!r}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{where}.function.name", "expected a non-empty string")
        if not isinstance(function.get("description", ""), str):
            raise RequestError(f"{where}.function.description", "expected a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise RequestError(
                f"{where}.function.parameters", f"expected a JSON Schema object, got {function['parameters']!r}"
            )
    return value or None


def tool_choice(choice, defined: list | None):
    if choice is None:
        return None
    if choice in ("auto", "none", "required"):
        if choice == "required" and not defined:
            raise RequestError("tool_choice", "'required' needs tools")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        names = [t["function"]["name"] for t in defined or []]
        if name not in names:
            raise RequestError("tool_choice", f"names the function {name!r}, which is not among tools ({names})")
        return choice
    raise RequestError(
        "tool_choice",
        f"expected 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
    )
