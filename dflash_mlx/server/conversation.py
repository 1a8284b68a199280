"""The parts of a conversation every API dialect spells its own way, parsed once: text parts, tools,
``tool_choice``, tool calls and tool results.

Each dialect (`messages` for chat completions, `anthropic`, `openai_responses`)
only translates its spelling into calls here, passing the paths of its own
fields, so a `RequestError` names the field the client sent
(``messages[2].content[0].tool_use_id``, ``input[3].call_id``). Out comes the
one form chat templates take: function tools ``{"type": "function",
"function": {"name", "description", "parameters"}}``, a ``tool_choice`` of
"auto", "none", "required" or ``{"type": "function", "function": {"name"}}``
(checked, not enforced), tool calls with object arguments, and ``role:
"tool"`` messages carrying the ``tool_call_id`` they answer.

Tool results follow one rule in every dialect (`ToolCalls`): a result answers
a tool call made earlier in the conversation and not answered yet (an open
call). A result that gives an id must name an open call: an unknown id, or one
answered already, is a 400 naming the result's id field and listing the open
ids (a result with no open call before it gets the same 400). A result may
leave its id out only where its dialect's spec makes the id optional, the
Responses API's ``function_call_output.call_id`` and chat completions' legacy
``role: "function"`` message (which has none); it then answers the oldest open
call. Chat completions' ``tool_call_id`` and Messages' ``tool_use_id`` are
required by their specs (and always sent by the official clients), so a result
without one is a 400 naming that field.
"""

from __future__ import annotations

import json

from .errors import RequestError

CHOICES = ("auto", "none", "required")  # the modes of tool_choice besides naming a function


def text(content, where: str, kinds: tuple = ("text",)) -> str:
    """A string, or the joined text of a list of text parts: objects whose ``type`` is one of `kinds`
    and whose ``text`` is a string (`where`: the content's field)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(where, f"expected a string or a list of text parts ({', '.join(kinds)}), got {content!r}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(at, f"expected a text part (an object with 'type' and 'text'), got {part!r}")
        if part.get("type") not in kinds:
            raise RequestError(
                f"{at}.type", f"only text parts ({', '.join(kinds)}) are supported here, got {part.get('type')!r}"
            )
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{at}.text", f"expected a string, got {part.get('text')!r}")
        texts.append(part["text"])
    return "".join(texts)


def function_tool(spec: dict, where: str, schema: str = "parameters", *, schema_required: bool = False) -> dict:
    """A function tool from `spec`, the object holding its ``name``, ``description`` (absent: "") and
    `schema` (the dialect's name for the parameters' JSON Schema; absent: any, unless `schema_required`);
    `where` prefixes the fields' names ("tools[0].function.")."""
    name, description, parameters = spec.get("name"), spec.get("description"), spec.get(schema)
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}name", f"expected a non-empty string, got {name!r}")
    if parameters is None and not schema_required:
        parameters = {}
    if not isinstance(parameters, dict):
        raise RequestError(f"{where}{schema}", f"expected a JSON Schema object, got {parameters!r}")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise RequestError(f"{where}description", f"expected a string, got {description!r}")
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def tool_choice(mode: str, tools: list | None, where: str, name=None, name_where: str | None = None):
    """The choice `mode` ("auto", "none", "required", or "function" naming the function `name`, whose
    field is `name_where`) for function `tools`, in the one internal form: a mode asking for a call
    needs tools, and a named function must be one of them."""
    if mode == "function":
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise RequestError(name_where or where, f"names the function {name!r}, which is not among tools ({names})")
        return {"type": "function", "function": {"name": name}}
    if mode == "required" and not tools:
        raise RequestError(where, "asks for a tool call, but the request gives no tools")
    return mode


class ToolCalls:
    """The tool calls of one conversation, in order: a dialect registers each assistant turn's calls
    (`call`) and answers them with results (`result`) under the module's one rule."""

    def __init__(self, messages: list[dict] = ()):
        """`messages`: the conversation so far, in the internal form (a stored one, already checked)."""
        self.open: list[str] = []  # ids of the calls no result has answered, oldest first
        self.answered: set[str] = set()
        for message in messages:
            self.open += [c["id"] for c in message.get("tool_calls") or []]
            if message.get("role") == "tool":
                self._close(message["tool_call_id"])

    def _close(self, call_id: str) -> None:
        if call_id in self.open:
            self.open.remove(call_id)
        self.answered.add(call_id)

    def _open_ids(self) -> str:
        return f"open calls: {self.open}" if self.open else "no call is open"

    def call(self, call_id, name, arguments, where: str, names: tuple = ("id", "name", "arguments"), *, encoded=True):
        """A tool call, now open, in the internal form ({"id", "type": "function", "function": {"name",
        "arguments"}}); `where` prefixes its fields, `names` are the dialect's names of its id, name and
        arguments; `encoded`: the arguments may come as the JSON string of an object (OpenAI's spelling;
        templates take the object)."""
        for value, field in ((call_id, names[0]), (name, names[1])):
            if not isinstance(value, str) or not value:
                raise RequestError(where + field, f"expected a non-empty string, got {value!r}")
        if encoded and isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise RequestError(where + names[2], f"not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise RequestError(where + names[2], f"expected {'a JSON' if encoded else 'an'} object, got {arguments!r}")
        self.open.append(call_id)
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}

    def result(self, call_id, content: str, where: str, id_name: str, *, optional: bool = False) -> dict:
        """The tool message of the result at `where` (its text `content`) answering the open call its id
        `call_id` (field `id_name`) names; `optional`: the dialect's spec lets the result leave the id out,
        and then it answers the oldest open call."""
        field = f"{where}.{id_name}"
        if call_id is None and not optional:
            raise RequestError(field, f"required: the id of the tool call this result answers ({self._open_ids()})")
        if call_id is None:
            if not self.open:
                raise RequestError(where, "answers no tool call: no call made before it is still open")
            call_id = self.open[0]
        elif not isinstance(call_id, str):
            raise RequestError(field, f"expected a string (the id of the tool call it answers), got {call_id!r}")
        elif call_id not in self.open:
            why = "answers a call answered already" if call_id in self.answered else "names no call made before it"
            raise RequestError(
                field, f"{call_id!r} {why}: a result answers an earlier call not answered yet ({self._open_ids()})"
            )
        self._close(call_id)
        return {"role": "tool", "tool_call_id": call_id, "content": content}
