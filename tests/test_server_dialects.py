"""Anthropic's Messages API and OpenAI's Responses API on the wire, in process (the scripted target).

The target is `helpers.scripted`'s: its replies are known (a think block and a
tool call after a user turn, a plain answer after a tool result), served with
a drafter (DFlash on). Checked here at the HTTP level, where the official
clients would hide them: the exact stream event sequences, the stop reasons,
usage against chat completions' for the same conversation, the dialects'
error shapes naming the field, the API key, the store of conversations, and
the warning of a server listening beyond loopback without a key. The official
clients and the console script: tests/test_agent_clients.py.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading

import pytest

from dflash_mlx.server import make_server
from dflash_mlx.server.errors import RequestError
from dflash_mlx.server.openai_responses import Conversations
from helpers import load_pair, make_draft
from helpers.scripted import ANSWER, CALL, REASONING, WEATHER_TOOL, make_scripted_target

pytestmark = pytest.mark.slow  # servers

QUESTION = "What is the weather in Paris?"
TOOL = {
    "name": "get_weather",
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
FUNCTION = {
    "type": "function",
    "name": "get_weather",
    "description": WEATHER_TOOL["function"]["description"],
    "parameters": WEATHER_TOOL["function"]["parameters"],
}
ASK = {"model": "scripted", "max_tokens": 64, "messages": [{"role": "user", "content": QUESTION}], "tools": [TOOL]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    target = make_scripted_target(root / "target")
    return load_pair(target, make_draft(root / "draft", target, target_layer_ids=[1, 2], block_size=4))


@pytest.fixture(scope="module")
def server(pair):
    srv = make_server(*pair, port=0, model_id="scripted").start()
    yield srv
    srv.stop()


def post(server, path: str, body, headers: dict | None = None, method: str = "POST"):
    """(status, JSON) or, for a stream, (status, [(event name, data), ...])."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    reply = conn.getresponse()
    text = reply.read().decode()
    conn.close()
    if reply.getheader("Content-Type") != "text/event-stream":
        return reply.status, json.loads(text)
    events = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        events.append((lines.get("event"), json.loads(lines["data"])))
    return reply.status, events


def answered(reply: dict) -> list:
    """A tool round trip's next messages: the reply's turn and the tool's result."""
    call = next(b for b in reply["content"] if b["type"] == "tool_use")
    return [
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "18, sunny"}]},
    ]


def test_messages_stream_is_anthropics_event_sequence(server):
    status, events = post(server, "/v1/messages", {**ASK, "stream": True})
    assert status == 200
    assert [name for name, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",  # thinking
        "content_block_start",
        "content_block_delta",
        "content_block_stop",  # tool_use
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    thinking, tool = events[2][1]["content_block"], events[5][1]["content_block"]
    assert thinking == {"type": "thinking", "thinking": "", "signature": ""} and events[2][1]["index"] == 0
    assert events[3][1]["delta"] == {"type": "thinking_delta", "thinking": REASONING}
    assert tool["type"] == "tool_use" and tool["name"] == "get_weather" and tool["input"] == {}
    assert tool["id"].startswith("toolu_") and events[5][1]["index"] == 1
    assert events[6][1]["delta"]["type"] == "input_json_delta"
    assert json.loads(events[6][1]["delta"]["partial_json"]) == CALL["arguments"]
    end = events[8][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["dflash"]["cycles"] >= 1  # DFlash ran; the statistics ride where clients ignore them
    status, whole = post(server, "/v1/messages", ASK)
    assert status == 200 and whole["type"] == "message" and whole["stop_reason"] == "tool_use"
    assert [b["type"] for b in whole["content"]] == ["thinking", "tool_use"]
    assert whole["content"][0]["thinking"] == REASONING and whole["content"][1]["input"] == CALL["arguments"]
    assert whole["usage"]["output_tokens"] == end["usage"]["output_tokens"] == 7
    use = whole["usage"]
    assert (
        use["input_tokens"] + use["cache_read_input_tokens"]
        == start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"]
    )


def test_messages_usage_and_text_equal_chat_completions(server):
    status, first = post(server, "/v1/messages", ASK)
    messages = ASK["messages"] + answered(first)
    status, reply = post(server, "/v1/messages", {**ASK, "messages": messages})
    assert status == 200 and reply["content"] == [{"type": "text", "text": ANSWER}]
    assert reply["stop_reason"] == "end_turn" and reply["usage"]["cache_read_input_tokens"] > 0
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(CALL["arguments"])},
    }
    chat = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18, sunny"},
    ]
    status, completion = post(server, "/v1/chat/completions", {"messages": chat, "tools": [WEATHER_TOOL]})
    assert completion["choices"][0]["message"]["content"] == ANSWER
    use = reply["usage"]
    assert use["input_tokens"] + use["cache_read_input_tokens"] == completion["usage"]["prompt_tokens"]
    assert use["output_tokens"] == completion["usage"]["completion_tokens"]
    counted = {k: v for k, v in ASK.items() if k != "max_tokens"} | {"messages": messages}
    status, count = post(server, "/v1/messages/count_tokens?beta=true", counted)
    assert status == 200 and count == {"input_tokens": completion["usage"]["prompt_tokens"]}


def test_messages_stop_reasons(server):
    status, first = post(server, "/v1/messages", ASK)
    messages = ASK["messages"] + answered(first)
    status, cut = post(server, "/v1/messages", {**ASK, "messages": messages, "stop_sequences": ["sunny"]})
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == "sunny"
    assert cut["content"] == [{"type": "text", "text": ANSWER[: ANSWER.index("sunny")]}]
    status, events = post(
        server, "/v1/messages", {**ASK, "messages": messages, "stop_sequences": ["sunny"], "stream": True}
    )
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "sunny"}
    status, short = post(server, "/v1/messages", {**ASK, "max_tokens": 2})
    assert short["stop_reason"] == "max_tokens" and short["usage"]["output_tokens"] == 2
    assert short["content"] == [{"type": "thinking", "thinking": REASONING, "signature": ""}]


def test_thinking_switches_the_templates_reasoning(server):
    status, off = post(server, "/v1/messages", {**ASK, "thinking": {"type": "disabled"}})
    assert status == 200 and [b["type"] for b in off["content"]] == ["tool_use"]
    status, on = post(server, "/v1/messages", {**ASK, "thinking": {"type": "enabled", "budget_tokens": 2048}})
    assert [b["type"] for b in on["content"]] == ["thinking", "tool_use"]
    status, low = post(
        server,
        "/v1/responses",
        {"model": "scripted", "input": QUESTION, "tools": [FUNCTION], "reasoning": {"effort": "none"}},
    )
    assert [item["type"] for item in low["output"]] == ["function_call"]


def test_responses_stream_is_the_documented_event_sequence(server):
    body = {"model": "scripted", "input": QUESTION, "tools": [FUNCTION], "stream": True}
    status, events = post(server, "/v1/responses", body)
    assert status == 200
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(data["type"] == name for name, data in events)
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and events[0][1]["response"]["status"] == "in_progress"
    reasoning, call = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": REASONING}]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == CALL["arguments"]
    assert events[8][1]["item"]["id"] == events[11][1]["item"]["id"] == call["id"]
    assert final["usage"]["output_tokens"] == 7 and final["dflash"]["cycles"] >= 1
    status, whole = post(server, "/v1/responses", {**body, "stream": False})
    assert [i["type"] for i in whole["output"]] == ["reasoning", "function_call"]
    assert whole["output"][0]["content"] == reasoning["content"]
    assert [whole["usage"][k] for k in ("input_tokens", "output_tokens")] == [
        final["usage"][k] for k in ("input_tokens", "output_tokens")
    ]


def test_responses_continue_a_stored_conversation(server):
    status, first = post(server, "/v1/responses", {"model": "scripted", "input": QUESTION, "tools": [FUNCTION]})
    call = first["output"][-1]
    follow = {
        "model": "scripted",
        "previous_response_id": first["id"],
        "tools": [FUNCTION],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "18, sunny"}],
    }
    status, second = post(server, "/v1/responses", follow)
    assert status == 200 and second["output"][0]["content"][0]["text"] == ANSWER
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert second["previous_response_id"] == first["id"]
    status, unstored = post(server, "/v1/responses", {"model": "scripted", "input": QUESTION, "store": False})
    status, error = post(server, "/v1/responses", {**follow, "previous_response_id": unstored["id"]})
    assert status == 400 and error["error"]["param"] == "previous_response_id"
    assert unstored["id"] in error["error"]["message"] and "--response-store-size" in error["error"]["message"]
    status, error = post(server, "/v1/responses", {**follow, "previous_response_id": None})
    assert status == 400 and error["error"]["param"] == "input[0].call_id"  # no call before it


def test_the_store_keeps_the_most_recent_conversations():
    store = Conversations(2)
    for name in "abc":
        store.put(name, [{"role": "user", "content": name}])
    with pytest.raises(RequestError) as caught:
        store.get("a")
    assert caught.value.field == "previous_response_id"
    assert store.get("b") == [{"role": "user", "content": "b"}]  # b is now the most recent
    store.put("d", [])
    assert store.get("b") and store.get("d") == []
    with pytest.raises(RequestError):
        store.get("c")
    with pytest.raises(RequestError):
        Conversations(0).get("a")


BAD = [
    ("/v1/messages", {"max_tokens": None}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 0}, "max_tokens"),
    ("/v1/messages", {"top_k": -1}, "top_k"),
    ("/v1/messages", {"temperature": "hot"}, "temperature"),
    ("/v1/messages", {"stop_sequences": ["x"] * 100}, "stop_sequences"),
    ("/v1/messages", {"model": "claude-3-opus"}, "model"),
    ("/v1/messages", {"system": [{"type": "image"}]}, "system[0].type"),
    ("/v1/messages", {"messages": []}, "messages"),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].type",
    ),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}]},
        "messages[1]",
    ),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
        "messages[0].content[0].tool_use_id",
    ),
    (
        "/v1/messages",
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": [1]}]}]},
        "messages[0].content[0].tool_use_id",
    ),
    ("/v1/messages", {"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ("/v1/messages", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ("/v1/messages", {"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ("/v1/messages", {"thinking": {"type": "sometimes"}}, "thinking.type"),
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens"),
    ("/v1/messages", {"output_config": {"format": {"type": "xml"}}}, "output_config.format.type"),
    ("/v1/messages", {"metadata": {"user_id": 5}}, "metadata.user_id"),
    ("/v1/messages", {"definitely_not_a_field": 1}, "definitely_not_a_field"),
    ("/v1/responses", {"input": []}, "input"),
    (
        "/v1/responses",
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
        "input[0].content[0].type",
    ),
    (
        "/v1/responses",
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]},
        "input[0].arguments",
    ),
    (
        "/v1/responses",
        {"input": [{"type": "function_call_output", "call_id": {"a": 1}, "output": "x"}]},
        "input[0].call_id",
    ),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ("/v1/responses", {"max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"top_p": 0}, "top_p"),
    ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/responses", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/responses", {"reasoning": {"effort": "maximal"}}, "reasoning.effort"),
    (
        "/v1/responses",
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
        "text.format.schema",
    ),
    ("/v1/responses", {"previous_response_id": "resp_nope"}, "previous_response_id"),
    ("/v1/responses", {"truncation": "auto"}, "truncation"),
    ("/v1/responses", {"metadata": {"k": "v" * 600}}, "metadata"),
    ("/v1/responses", {"store": "yes"}, "store"),
    ("/v1/responses", {"background": True}, "background"),
]


@pytest.mark.parametrize("path, fields, field", BAD)
def test_bad_input_is_a_400_in_the_dialects_shape_naming_the_field(server, path, fields, field):
    base = ASK if path == "/v1/messages" else {"model": "scripted", "input": QUESTION}
    status, reply = post(server, path, {**base, **fields})
    assert status == 400, reply
    if path == "/v1/messages":
        assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    else:
        assert reply["error"]["param"] == field and reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith(f"{field}: "), reply


def test_unknown_routes_and_the_model_list(server):
    status, reply = post(server, "/v1/messages/batches", ASK)
    assert status == 404 and reply["type"] == "error" and reply["error"]["type"] == "not_found_error"
    status, reply = post(server, "/v1/responses/compact", {"input": QUESTION})
    assert status == 404 and "no such endpoint" in reply["error"]["message"]
    status, models = post(server, "/v1/models", None, method="GET")
    assert models["data"][0]["id"] == "scripted" and models["data"][0]["type"] == "model"  # both SDKs' fields
    assert models["has_more"] is False and models["first_id"] == "scripted"


def test_a_prompt_beyond_the_context_names_the_dialects_field(server):
    long = "apples " * 3000
    status, reply = post(server, "/v1/messages", {**ASK, "messages": [{"role": "user", "content": long}]})
    assert status == 400 and reply["error"]["message"].startswith("messages: the prompt is")
    status, reply = post(server, "/v1/responses", {"model": "scripted", "input": long})
    assert status == 400 and reply["error"]["param"] == "input" and "context" in reply["error"]["message"]


def test_the_api_key_gates_every_route_but_health(pair):
    srv = make_server(*pair, port=0, model_id="scripted", api_key="secret").start()
    try:
        assert post(srv, "/health", None, method="GET")[0] == 200
        status, reply = post(srv, "/v1/messages", ASK)
        assert status == 401 and reply["error"]["type"] == "authentication_error" and reply["type"] == "error"
        status, reply = post(srv, "/v1/responses", {"input": QUESTION}, {"Authorization": "Bearer wrong"})
        assert status == 401 and "API key" in reply["error"]["message"]
        assert post(srv, "/v1/models", None, method="GET")[0] == 401
        assert post(srv, "/v1/chat/completions", {"messages": ASK["messages"]}, {"x-api-key": "secre"})[0] == 401
        assert post(srv, "/v1/messages", ASK, {"x-api-key": "secret"})[0] == 200
        assert post(srv, "/v1/responses", {"input": QUESTION}, {"Authorization": "Bearer secret"})[0] == 200
        assert post(srv, "/v1/models", None, {"authorization": "bearer secret"}, method="GET")[0] == 200
    finally:
        srv.stop()


def test_listening_beyond_loopback_without_a_key_warns(pair, caplog):
    for host, key, warns in (("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            srv = make_server(*pair, host=host, port=0, api_key=key)
        srv.stop()
        assert ("without an API key" in caplog.text) == warns, (host, key)


def test_the_three_dialects_batch_together(server, monkeypatch):
    """Requests in three dialects decode as rows of one batch (the first admitted waits until the
    others are queued); each reply is what it is alone."""
    jobs = {
        "chat": ("/v1/chat/completions", {"messages": ASK["messages"], "tools": [WEATHER_TOOL]}),
        "messages": ("/v1/messages", ASK),
        "responses": ("/v1/responses", {"model": "scripted", "input": QUESTION, "tools": [FUNCTION]}),
    }
    alone = {name: post(server, *job)[1] for name, job in jobs.items()}
    worker, running, held = server.worker, server.worker.running, []

    def when_all_queued(job, now):  # the first job admitted waits for the others to be queued (once)
        while now and not held and worker._jobs.qsize() < len(jobs) - 1:
            threading.Event().wait(0.01)
        held.append(job)
        return running(job, now)

    monkeypatch.setattr(worker, "running", when_all_queued)
    together = {}
    threads = [
        threading.Thread(target=lambda n=name, j=job: together.__setitem__(n, post(server, *j)[1]))
        for name, job in jobs.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    monkeypatch.undo()
    assert together["chat"]["choices"][0]["message"] == alone["chat"]["choices"][0]["message"] | {
        "tool_calls": together["chat"]["choices"][0]["message"]["tool_calls"]
    }  # (call ids are random)
    assert together["messages"]["content"][0] == alone["messages"]["content"][0]
    assert together["messages"]["content"][1]["input"] == alone["messages"]["content"][1]["input"]
    assert together["responses"]["output"][0]["content"] == alone["responses"]["output"][0]["content"]
    assert together["responses"]["output"][1]["arguments"] == alone["responses"]["output"][1]["arguments"]
    assert [
        together["chat"]["dflash"]["batch_rows"],
        together["messages"]["dflash"]["batch_rows"],
        together["responses"]["dflash"]["batch_rows"],
    ] == [3, 3, 3]


FULL_MESSAGES = {
    "model": "scripted",
    "max_tokens": 8,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "t", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "18"}]},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ],
    "tools": [TOOL],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "metadata": {"user_id": "u"},
    "stop_sequences": ["x"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 5,
}
FULL_RESPONSES = {
    "model": "scripted",
    "instructions": "Be brief.",
    "max_output_tokens": 8,
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18"},
    ],
    "tools": [FUNCTION],
    "tool_choice": "auto",
    "reasoning": {"effort": "low", "summary": "auto"},
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "include": ["reasoning.encrypted_content"],
    "store": True,
    "metadata": {"a": "b"},
    "parallel_tool_calls": False,
    "temperature": 0.3,
    "top_p": 0.8,
}
ODD = [
    None,
    0,
    -1,
    2**70,
    10**400,
    1.5,
    1e308,
    "",
    "x",
    [],
    [1],
    {},
    {"type": "text"},
    {"a": [1]},
    True,
    [[]],
    [{}],
    [{"type": None}],
]


def _paths(value, prefix=()):
    """Every place in a JSON value (the path to it)."""
    yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _paths(child, prefix + (key,))


def _replaced(body: dict, path: tuple, value) -> dict:
    out = json.loads(json.dumps(body))
    place = out
    for key in path[:-1]:
        place = place[key]
    place[path[-1]] = value
    return out


def test_every_field_of_odd_types_is_a_4xx_or_served_never_a_5xx(server):
    """Each place of full Messages, count_tokens and Responses bodies set to a value of every JSON
    type (whole and streamed): never a 5xx, and the server answers the full bodies as before."""
    counted = {
        k: v
        for k, v in FULL_MESSAGES.items()
        if k not in ("max_tokens", "stop_sequences", "temperature", "top_p", "top_k")
    }
    cases = [("/v1/messages", FULL_MESSAGES), ("/v1/messages/count_tokens", counted), ("/v1/responses", FULL_RESPONSES)]
    before = {path: post(server, path, body) for path, body in cases}
    assert all(status == 200 for status, _ in before.values()), before
    failures = []
    for path, body in cases:
        for place in list(_paths(body))[1:]:
            for value in ODD:
                for stream in (False, True) if "count" not in path else (False,):
                    sent = {**_replaced(body, place, value), **({"stream": True} if stream else {})}
                    status, reply = post(server, path, sent)
                    if status >= 500:
                        failures.append((path, place, value, stream, reply))
    assert not failures, failures[:5]
    again = {path: post(server, path, body) for path, body in cases}
    assert again["/v1/messages/count_tokens"] == before["/v1/messages/count_tokens"]
    unnamed = [
        [{k: v for k, v in b.items() if k != "id"} for b in reply[1]["content"]]
        for reply in (again["/v1/messages"], before["/v1/messages"])
    ]  # (tool_use ids are random)
    assert unnamed[0] == unnamed[1]
    assert again["/v1/responses"][1]["output"][0]["content"] == before["/v1/responses"][1]["output"][0]["content"]
