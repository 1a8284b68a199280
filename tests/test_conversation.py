"""The shared parser of the dialects' conversations (`dflash_mlx.server.conversation`), fast, no server.

First the module alone: text parts, function tools, ``tool_choice`` and the
one rule for tool results (`ToolCalls`). Then the rule through each dialect's
parser (chat completions, Messages, Responses) on the same conversations: the
same verdict in all three, each error naming the dialect's own field. The
official clients against a real server: tests/test_agent_clients.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_mlx.server.anthropic import CREATE, parse as parse_messages
from dflash_mlx.server.conversation import ToolCalls, function_tool, text, tool_choice
from dflash_mlx.server.errors import RequestError
from dflash_mlx.server.openai_responses import Conversations, Responses
from dflash_mlx.server.request import ServerInfo, parse_request

INFO = ServerInfo(vocab_size=256, has_draft=False, has_chat_template=True)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "", "parameters": {}}}


def _fails(field: str, call, *args, **kwargs) -> str:
    with pytest.raises(RequestError) as caught:
        call(*args, **kwargs)
    assert caught.value.field == field, caught.value
    assert str(caught.value).startswith(f"{field}: ")
    return str(caught.value)


# -- the module alone --------------------------------------------------------------------------------


def test_text_is_a_string_or_joined_text_parts():
    assert text("hi", "c") == "hi"
    assert text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "c") == "ab"
    assert text([{"type": "input_text", "text": "a"}], "c", ("input_text",)) == "a"
    assert text([], "c") == ""
    _fails("c", text, 5, "c")
    _fails("c[1]", text, [{"type": "text", "text": "a"}, "b"], "c")
    assert "input_text" in _fails("c[0].type", text, [{"type": "image"}], "c", ("input_text",))
    _fails("c[0].text", text, [{"type": "text", "text": None}], "c")


def test_function_tools_take_the_dialects_field_names():
    assert function_tool({"name": "f"}, "tools[0].function.") == {
        "type": "function",
        "function": {"name": "f", "description": "", "parameters": {}},
    }
    schema = {"type": "object"}
    tool = function_tool({"name": "f", "description": "d", "input_schema": schema}, "tools[1].", "input_schema")
    assert tool["function"] == {"name": "f", "description": "d", "parameters": schema}
    _fails("tools[0].function.name", function_tool, {"name": ""}, "tools[0].function.")
    _fails("tools[0].parameters", function_tool, {"name": "f", "parameters": [1]}, "tools[0].")
    _fails("tools[0].input_schema", function_tool, {"name": "f"}, "tools[0].", "input_schema", schema_required=True)
    _fails("tools[0].description", function_tool, {"name": "f", "description": 5}, "tools[0].")


def test_tool_choice_is_one_internal_form():
    assert [tool_choice(m, [WEATHER], "tool_choice") for m in ("auto", "none", "required")] == [
        "auto",
        "none",
        "required",
    ]
    named = tool_choice("function", [WEATHER], "tool_choice", "get_weather", "tool_choice.name")
    assert named == {"type": "function", "function": {"name": "get_weather"}}
    assert tool_choice("none", None, "tool_choice") == "none"
    assert "no tools" in _fails("tool_choice", tool_choice, "required", None, "tool_choice")
    message = _fails("tool_choice.name", tool_choice, "function", [WEATHER], "tool_choice", "nope", "tool_choice.name")
    assert "get_weather" in message


def test_results_answer_open_calls_by_id_in_any_order():
    calls = ToolCalls()
    first = calls.call("a", "f", '{"x": 1}', "m[1].")
    assert first == {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    calls.call("b", "f", {}, "m[1].")
    assert calls.result("b", "2", "m[2]", "id") == {"role": "tool", "tool_call_id": "b", "content": "2"}
    assert calls.open == ["a"]
    calls.call("c", "f", "", "m[3].")  # a later turn's call; "a" is still open
    assert calls.result("a", "1", "m[4]", "id")["tool_call_id"] == "a"
    assert calls.result("c", "3", "m[5]", "id")["tool_call_id"] == "c"
    assert calls.open == []


def test_a_result_naming_no_open_call_is_refused_listing_the_open_ids():
    calls = ToolCalls()
    _fails("m[0].tool_call_id", calls.result, "a", "", "m[0]", "tool_call_id")  # no call before it
    calls.call("a", "f", {}, "m[1].")
    calls.call("b", "f", {}, "m[1].")
    message = _fails("m[2].tool_call_id", calls.result, "zzz", "", "m[2]", "tool_call_id")
    assert "names no call made before it" in message and "['a', 'b']" in message
    calls.result("a", "", "m[2]", "tool_call_id")
    message = _fails("m[3].tool_call_id", calls.result, "a", "", "m[3]", "tool_call_id")
    assert "answered already" in message and "['b']" in message
    _fails("m[3].tool_call_id", calls.result, 7, "", "m[3]", "tool_call_id")


def test_an_id_is_left_out_only_where_the_dialects_spec_allows_it():
    calls = ToolCalls()
    assert "no call is open" in _fails("m[0].id", calls.result, None, "", "m[0]", "id")
    _fails("m[0]", calls.result, None, "", "m[0]", "id", optional=True)  # no call to answer
    calls.call("a", "f", {}, "m[1].")
    calls.call("b", "f", {}, "m[1].")
    assert "['a', 'b']" in _fails("m[2].id", calls.result, None, "", "m[2]", "id")
    assert calls.result(None, "", "m[2]", "id", optional=True)["tool_call_id"] == "a"  # the oldest open call
    assert calls.result(None, "", "m[3]", "id", optional=True)["tool_call_id"] == "b"


def test_calls_need_an_id_a_name_and_object_arguments():
    calls = ToolCalls()
    names = ("call_id", "name", "arguments")
    _fails("i[0].call_id", calls.call, None, "f", "{}", "i[0].", names)
    _fails("i[0].name", calls.call, "c", "", "{}", "i[0].", names)
    assert "not valid JSON" in _fails("i[0].arguments", calls.call, "c", "f", "{no", "i[0].", names)
    _fails("i[0].arguments", calls.call, "c", "f", "[1]", "i[0].", names)
    _fails("m[1].input", calls.call, "c", "f", '{"a": 1}', "m[1].", ("id", "name", "input"), encoded=False)
    assert calls.open == []


def test_a_stored_conversation_carries_its_open_calls():
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "a"}, {"id": "b"}]},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
    ]
    calls = ToolCalls(history)
    assert calls.open == ["b"]
    assert "answered already" in _fails("i[0].call_id", calls.result, "a", "", "i[0]", "call_id")


# -- the one rule through each dialect's parser -------------------------------------------------------


def _chat(calls: list[str], results: list[str | None]) -> dict:
    made = [{"id": c, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}} for c in calls]
    history = [{"role": "assistant", "content": None, "tool_calls": made}] if calls else []
    answers = [{"role": "tool", "content": "18", **({"tool_call_id": r} if r else {})} for r in results]
    return {"messages": [{"role": "user", "content": "q"}, *history, *answers], "tools": [WEATHER]}


def _anthropic(calls: list[str], results: list[str | None]) -> dict:
    made = [{"type": "tool_use", "id": c, "name": "get_weather", "input": {}} for c in calls]
    history = [{"role": "assistant", "content": made}] if calls else []
    answers = [{"type": "tool_result", "content": "18", **({"tool_use_id": r} if r else {})} for r in results]
    tool = {"name": "get_weather", "input_schema": {}}
    return {
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "q"}, *history, {"role": "user", "content": answers}],
        "tools": [tool],
    }


def _responses(calls: list[str], results: list[str | None]) -> dict:
    made = [{"type": "function_call", "call_id": c, "name": "get_weather", "arguments": "{}"} for c in calls]
    answers = [{"type": "function_call_output", "output": "18", **({"call_id": r} if r else {})} for r in results]
    tool = {"type": "function", "name": "get_weather", "parameters": {}}
    return {"input": [{"role": "user", "content": "q"}, *made, *answers], "tools": [tool]}


def _parsed(dialect: str, body: dict) -> list[dict]:
    if dialect == "chat":
        return parse_request("chat", _chat(*body), INFO).messages
    if dialect == "anthropic":
        return parse_messages(_anthropic(*body), INFO, CREATE).messages
    server = SimpleNamespace(info=INFO, model_id="default", conversations=Conversations())
    return Responses.parse(_responses(*body), server).request.messages


DIALECTS = ["chat", "anthropic", "responses"]
# the field of the first result (its index), in each dialect's spelling
RESULT_ID = {
    "chat": lambda i: f"messages[{2 + i}].tool_call_id",
    "anthropic": lambda i: f"messages[2].content[{i}].tool_use_id",
    "responses": lambda i: f"input[{3 + i}].call_id",
}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_dialects_answer_several_calls_alike(dialect):
    messages = _parsed(dialect, (["a", "b"], ["b", "a"]))
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["a", "b"]
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in messages[2:]] == [
        ("tool", "b", "18"),
        ("tool", "a", "18"),
    ]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_dialects_refuse_an_unknown_id_naming_their_field(dialect):
    with pytest.raises(RequestError) as caught:
        _parsed(dialect, (["a", "b"], ["a", "nope"]))
    assert caught.value.field == RESULT_ID[dialect](1)
    assert "'nope' names no call made before it" in str(caught.value) and "['b']" in str(caught.value)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_dialects_refuse_a_result_with_no_call_before_it(dialect):
    with pytest.raises(RequestError) as caught:
        _parsed(dialect, ([], ["a"]))
    field = {"chat": "messages[1].tool_call_id", "anthropic": "messages[1].content[0].tool_use_id"}
    assert caught.value.field == field.get(dialect, "input[1].call_id")
    assert "no call is open" in str(caught.value)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_the_dialects_refuse_answering_a_call_twice(dialect):
    with pytest.raises(RequestError) as caught:
        _parsed(dialect, (["a", "b"], ["a", "a"]))
    assert caught.value.field == RESULT_ID[dialect](1) and "answered already" in str(caught.value)


def test_only_the_responses_spec_lets_a_result_leave_its_id_out():
    messages = _parsed("responses", (["a", "b"], [None, None]))
    assert [m["tool_call_id"] for m in messages[2:]] == ["a", "b"]  # the oldest open call, in turn
    for dialect in ("chat", "anthropic"):
        with pytest.raises(RequestError) as caught:
            _parsed(dialect, (["a", "b"], [None]))
        assert caught.value.field == RESULT_ID[dialect](0) and str(caught.value).split(": ")[1] == "required"


def test_the_legacy_function_message_answers_the_oldest_open_call():
    legacy = {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": "{}"}}
    body = {
        "functions": [WEATHER["function"]],
        "messages": [
            {"role": "user", "content": "q"},
            legacy,
            {"role": "function", "name": "get_weather", "content": "18"},
        ],
    }
    messages = parse_request("chat", body, INFO).messages
    assert messages[2] == {"role": "tool", "name": "get_weather", "content": "18", "tool_call_id": "call_legacy_1"}
    body["messages"] = [body["messages"][0], body["messages"][2]]
    with pytest.raises(RequestError) as caught:
        parse_request("chat", body, INFO)
    assert caught.value.field == "messages[1]"
    with pytest.raises(RequestError) as caught:
        parse_request("chat", {**body, "function_call": {"name": "nope"}}, INFO)
    assert caught.value.field == "function_call.name"  # (the legacy field, not tool_choice)


def test_a_result_may_answer_an_open_call_of_an_earlier_turn():
    body = _anthropic(["a", "b"], ["a"])
    body["messages"] += [
        {"role": "assistant", "content": "Waiting for the other."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b", "content": "19"}]},
    ]
    messages = parse_messages(body, INFO, CREATE).messages
    assert messages[-1] == {"role": "tool", "tool_call_id": "b", "content": "19"}
