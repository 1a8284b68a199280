"""The APIs coding agents speak, through their official clients, against the real ``dflash-mlx serve``.

- the bundled pair, served with no options: the ``anthropic`` package
  (``messages.create``, ``messages.stream``, ``count_tokens``, thinking on/off,
  sampling fields through ``extra_body``, an error) and the ``openai`` package's
  ``responses.create`` / ``responses.stream`` (``previous_response_id``): greedy
  text equal to chat completions' for the same conversation, a conversation's
  next turn served from the prompt cache, the three dialects batched together;
- the scripted target (`helpers.scripted`, a 16k context) with a drafter:
  tool round trips in both dialects (``tool_use`` / ``tool_result``,
  ``function_call`` / ``function_call_output``), thinking into thinking blocks
  and reasoning items, the one rule for tool results in the three dialects
  (several calls answered in any order, an unknown id and a result with no
  call before it refused naming the dialect's field), and a Claude-Code-shaped
  request (tests/data: a long system prompt, fifteen tools, ``cache_control``
  marks, an earlier assistant turn with thinking and tool_use, ``stream:
  true``) sent as raw HTTP;
- ``--api-key`` (listening on every interface): both clients with the key,
  without it a 401 in each dialect.
"""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest

from helpers import make_draft
from helpers.scripted import ANSWER, CALL, REASONING, WEATHER_TOOL, make_scripted_target
from helpers.servers import ServeProcess

pytestmark = pytest.mark.slow  # real servers

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

QUESTION = "Tom has 3 boxes with 12 apples each. How many apples?"
SYSTEM = "You answer arithmetic questions."
NEXT = "And if he eats 5 of them?"
CLAUDE_CODE = Path(__file__).parent / "data" / "claude_code_request.json"
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
WEATHER = "What is the weather in Paris?"
WEATHER_ASK = {
    "model": "default_model",
    "max_tokens": 64,
    "tools": [TOOL],
    "messages": [{"role": "user", "content": WEATHER}],
}


def _clients(url: str, key: str = "unused"):
    return (
        anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=300),
        openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300),
    )


@pytest.fixture(scope="module")
def demo():
    server = ServeProcess()
    yield server
    assert server.stop() == 0, server.stderr


@pytest.fixture(scope="module")
def scripted_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted-long")
    target = make_scripted_target(root / "target", context=16384)
    return target, make_draft(root / "draft", target, target_layer_ids=[1, 2], block_size=4)


@pytest.fixture(scope="module")
def scripted(scripted_dirs):
    target, draft = scripted_dirs
    server = ServeProcess("--model", str(target), "--draft", str(draft))
    yield server
    assert server.stop() == 0, server.stderr


def _chat(client, messages, max_tokens=48, **kw):
    return client.chat.completions.create(model="demo", messages=messages, max_tokens=max_tokens, **kw)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


# -- the bundled pair ----------------------------------------------------------------------------


def test_anthropic_messages_equal_chat_completions(demo):
    claude, oai = _clients(demo.url)
    chat = _chat(oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    want = chat.choices[0].message.content
    ask = {"model": "demo", "max_tokens": 48, "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]}
    reply = claude.messages.create(**ask)
    assert (
        _text(reply) == want
        and reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    )
    use = reply.usage
    assert use.input_tokens + use.cache_read_input_tokens == chat.usage.prompt_tokens
    assert use.output_tokens == chat.usage.completion_tokens and reply.model_extra["dflash"]["cycles"] >= 1
    with claude.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want == _text(final) and final.usage.output_tokens == use.output_tokens
    blocks = [
        {"type": "text", "text": SYSTEM[:11]},
        {"type": "text", "text": SYSTEM[11:], "cache_control": {"type": "ephemeral"}},
    ]
    assert _text(claude.messages.create(**{**ask, "system": blocks})) == want  # text blocks: the same system
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        assert _text(claude.messages.create(**ask, thinking=thinking)) == want  # (the demo has no switch)
    count = claude.messages.count_tokens(model="demo", system=SYSTEM, messages=ask["messages"])
    assert count.input_tokens == chat.usage.prompt_tokens
    assert [m.id for m in claude.models.list()] == [m.id for m in oai.models.list()] == ["demo"]


def test_sampling_fields_ride_in_extra_body(demo):
    claude, _ = _clients(demo.url)
    ask = {"model": "demo", "max_tokens": 24, "messages": [{"role": "user", "content": QUESTION}]}
    greedy = _text(claude.messages.create(**ask))
    assert _text(claude.messages.create(**ask, extra_body={"temperature": 1.5, "top_k": 1})) == greedy  # top-1
    assert _text(claude.messages.create(**ask, extra_body={"temperature": 0.0, "top_p": 0.5})) == greedy


def test_a_conversation_continued_through_messages_reuses_its_cached_prefix(demo):
    claude, oai = _clients(demo.url)
    first = claude.messages.create(model="demo", max_tokens=32, messages=[{"role": "user", "content": QUESTION}])
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": NEXT},
    ]
    second = claude.messages.create(model="demo", max_tokens=32, messages=history)
    assert second.usage.cache_read_input_tokens > 0
    chat = _chat(
        oai,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": _text(first)},
            {"role": "user", "content": NEXT},
        ],
        max_tokens=32,
    )
    assert _text(second) == chat.choices[0].message.content
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_anthropic_errors_are_anthropics_and_the_server_serves_on(demo):
    claude, _ = _clients(demo.url)
    ask = {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": QUESTION}]}
    for kwargs, field in (
        ({"extra_body": {"top_k": -1}}, "top_k"),
        ({"model": "another-model"}, "model"),
        ({"stop_sequences": [""]}, "stop_sequences"),
    ):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(**{**ask, **kwargs})
        assert caught.value.status_code == 400 and caught.value.body["type"] == "error"
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        assert caught.value.body["error"]["message"].startswith(field + ":")
    assert claude.messages.create(**ask).usage.output_tokens == 8


def test_openai_responses_equal_chat_completions_and_continue(demo):
    _, oai = _clients(demo.url)
    chat = _chat(oai, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    first = oai.responses.create(model="demo", instructions=SYSTEM, input=QUESTION, max_output_tokens=48)
    assert first.output_text == chat.choices[0].message.content and first.status in ("completed", "incomplete")
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.usage.output_tokens == chat.usage.completion_tokens and first.model_extra["dflash"]["cycles"] >= 1
    with oai.responses.stream(model="demo", instructions=SYSTEM, input=QUESTION, max_output_tokens=48) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == first.output_text
    second = oai.responses.create(
        model="demo", instructions=SYSTEM, previous_response_id=first.id, input=NEXT, max_output_tokens=32
    )
    assert second.usage.input_tokens_details.cached_tokens > 0
    chat = _chat(
        oai,
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": NEXT},
        ],
        max_tokens=32,
    )
    assert second.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="demo", input=NEXT, previous_response_id="resp_unknown")
    assert caught.value.body["param"] == "previous_response_id"


def test_the_dialects_batch_together(demo):
    claude, oai = _clients(demo.url)
    messages = [{"role": "user", "content": QUESTION}]
    calls = {
        "chat": lambda: _chat(oai, messages, 40).choices[0].message.content,
        "messages": lambda: _text(claude.messages.create(model="demo", max_tokens=40, messages=messages)),
        "responses": lambda: oai.responses.create(model="demo", input=QUESTION, max_output_tokens=40).output_text,
    }
    alone = {name: call() for name, call in calls.items()}
    assert alone["chat"] == alone["messages"] == alone["responses"]
    together = {}
    threads = [
        threading.Thread(target=lambda n=name, c=call: together.__setitem__(n, c())) for name, call in calls.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together == alone


# -- the scripted target: tools and thinking ---------------------------------------------------------


def test_anthropic_tool_use_round_trip_with_thinking(scripted):
    claude, oai = _clients(scripted.url)
    ask = WEATHER_ASK
    first = claude.messages.create(**ask)
    assert [b.type for b in first.content] == ["thinking", "tool_use"] and first.stop_reason == "tool_use"
    thinking, call = first.content
    assert thinking.thinking == REASONING and call.name == CALL["name"] and call.input == CALL["arguments"]
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.content[1].input == call.input
    chat = oai.chat.completions.create(
        model="default_model", messages=ask["messages"], tools=[WEATHER_TOOL], max_tokens=64
    )
    assert chat.choices[0].message.model_extra["reasoning"] == thinking.thinking
    history = ask["messages"] + [
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": json.dumps({"temperature": 18})}],
        },
    ]
    second = claude.messages.create(**{**ask, "messages": history})
    assert second.content[0].text == ANSWER and second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens > 0
    off = claude.messages.create(**ask, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["tool_use"]


def test_openai_responses_function_call_round_trip_with_reasoning(scripted):
    _, oai = _clients(scripted.url)
    first = oai.responses.create(model="default_model", input=WEATHER, tools=[FUNCTION])
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == REASONING
    call = first.output[1]
    assert call.name == CALL["name"] and json.loads(call.arguments) == CALL["arguments"]
    with oai.responses.stream(model="default_model", input=WEATHER, tools=[FUNCTION]) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature": 18})}]
    second = oai.responses.create(model="default_model", previous_response_id=first.id, input=result, tools=[FUNCTION])
    assert second.output_text == ANSWER and second.usage.input_tokens_details.cached_tokens > 0
    replayed = oai.responses.create(
        model="default_model",
        tools=[FUNCTION],
        input=[
            {"role": "user", "content": WEATHER},
            *[item.model_dump(exclude_none=True) for item in first.output],
            *result,
        ],
    )  # the same conversation, sent whole (store-free clients do this)
    assert replayed.output_text == ANSWER
    off = oai.responses.create(model="default_model", input=WEATHER, tools=[FUNCTION], reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["function_call"]


# -- tool results: one rule in the three dialects (server.conversation) -----------------------------

LONDON = {"city": "London"}  # the second call of a turn (the scripted model makes one)


def _refused(caught, field: str, *named: str) -> None:
    """A client's 400 naming `field` first, its message naming the ids in `named`."""
    body = caught.value.body
    error = body.get("error", body)  # (Anthropic's body is the whole error object, OpenAI's its "error")
    assert caught.value.status_code == 400 and error["message"].startswith(field + ": "), error
    assert all(repr(n) in error["message"] for n in named), error


def test_chat_tool_results_answer_open_calls_by_id(scripted):
    _, oai = _clients(scripted.url)
    ask = [{"role": "user", "content": WEATHER}]
    call = oai.chat.completions.create(model="default_model", messages=ask, tools=[WEATHER_TOOL], max_tokens=64)
    call = call.choices[0].message.tool_calls[0]
    extra = {
        "id": "call_london",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "London"}'},
    }
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump(), extra]}
    results = [
        {"role": "tool", "tool_call_id": "call_london", "content": "12, rain"},
        {"role": "tool", "tool_call_id": call.id, "content": "18, sunny"},
    ]  # (in the other order than the calls)

    def chat(messages):
        return oai.chat.completions.create(
            model="default_model", messages=messages, tools=[WEATHER_TOOL], max_tokens=64
        )

    assert chat(ask + [turn, *results]).choices[0].message.content == ANSWER
    with pytest.raises(openai.BadRequestError) as caught:
        chat(ask + [turn, results[0], {**results[1], "tool_call_id": "call_nope"}])
    _refused(caught, "messages[3].tool_call_id", "call_nope", call.id)  # the open id listed
    with pytest.raises(openai.BadRequestError) as caught:
        chat(ask + [turn, results[0], results[0]])
    _refused(caught, "messages[3].tool_call_id", "call_london")  # answered already
    with pytest.raises(openai.BadRequestError) as caught:
        chat(ask + [results[1]])
    _refused(caught, "messages[1].tool_call_id", call.id)  # no call before it


def test_anthropic_tool_results_answer_open_calls_by_id(scripted):
    claude, _ = _clients(scripted.url)
    ask = WEATHER_ASK
    first = claude.messages.create(**ask)
    call = first.content[-1]
    extra = {"type": "tool_use", "id": "toolu_london", "name": "get_weather", "input": LONDON}
    turn = {"role": "assistant", "content": [*first.content, extra]}
    results = [
        {"type": "tool_result", "tool_use_id": "toolu_london", "content": "12, rain"},
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18, sunny"}]},
    ]

    def create(*messages):
        return claude.messages.create(**{**ask, "messages": ask["messages"] + list(messages)})

    second = create(turn, {"role": "user", "content": results})
    assert second.content[0].text == ANSWER and second.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(turn, {"role": "user", "content": [results[0], {**results[1], "tool_use_id": "toolu_nope"}]})
    _refused(caught, "messages[2].content[1].tool_use_id", "toolu_nope", call.id)
    with pytest.raises(anthropic.BadRequestError) as caught:
        create({"role": "user", "content": results[1:]})
    _refused(caught, "messages[1].content[0].tool_use_id", call.id)  # no call before it


def test_responses_tool_results_answer_open_calls_by_id_or_the_oldest(scripted):
    _, oai = _clients(scripted.url)
    first = oai.responses.create(model="default_model", input=WEATHER, tools=[FUNCTION])
    call = first.output[-1]
    extra = {"type": "function_call", "call_id": "call_london", "name": "get_weather", "arguments": json.dumps(LONDON)}
    results = [
        {"type": "function_call_output", "call_id": "call_london", "output": "12, rain"},
        {"type": "function_call_output", "output": "18, sunny"},  # (no call_id: the oldest open call)
    ]

    def create(items, **kw):
        return oai.responses.create(model="default_model", input=items, tools=[FUNCTION], **kw)

    second = create([extra, *results], previous_response_id=first.id)
    assert second.output_text == ANSWER
    replayed = [{"role": "user", "content": WEATHER}, *[i.model_dump(exclude_none=True) for i in first.output]]
    assert create(replayed + [extra, *results]).output_text == ANSWER  # the conversation sent whole
    with pytest.raises(openai.BadRequestError) as caught:
        create([extra, {**results[0], "call_id": "call_nope"}], previous_response_id=first.id)
    _refused(caught, "input[1].call_id", "call_nope", call.call_id, "call_london")
    with pytest.raises(openai.BadRequestError) as caught:
        create(results[:1])
    _refused(caught, "input[0].call_id", "call_london")  # no call before it
    with pytest.raises(openai.BadRequestError) as caught:
        create(results[1:])
    assert caught.value.body["param"] == "input[0]"  # no call for an output without an id to answer


def _raw_stream(url: str, path: str, body: dict, headers: dict) -> tuple[int, list]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json", **headers})
    reply = conn.getresponse()
    text = reply.read().decode()
    conn.close()
    events = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return reply.status, events


def test_a_claude_code_shaped_request(scripted):
    body = {**json.loads(CLAUDE_CODE.read_text()), "model": "default_model"}
    assert len(body["tools"]) == 15 and body["stream"] and body["system"][1]["cache_control"]
    headers = {
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219",
        "x-api-key": "unused",
        "user-agent": "claude-cli/2.0.0 (external, cli)",
    }
    for turn in range(2):
        status, events = _raw_stream(scripted.url, "/v1/messages?beta=true", body, headers)
        assert status == 200, events
        assert [name for name, _ in events] == [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
        assert events[3][1]["delta"] == {"type": "text_delta", "text": ANSWER}
        end = events[5][1]
        assert end["delta"]["stop_reason"] == "end_turn" and end["usage"]["output_tokens"] == 2
        use = events[0][1]["message"]["usage"]
        assert use["input_tokens"] + use["cache_read_input_tokens"] > 8000  # a long prompt
        if turn == 1:  # the same request again: served from the prompt cache
            assert use["cache_read_input_tokens"] >= use["input_tokens"] + use["cache_read_input_tokens"] - 1


# -- the API key -----------------------------------------------------------------------------------


def test_serve_api_key(scripted_dirs):
    target, draft = scripted_dirs
    server = ServeProcess("--model", str(target), "--draft", str(draft), "--api-key", "sesame", "--host", "0.0.0.0")
    try:
        assert "without an API key" not in server.stderr  # (beyond loopback, but with a key)
        claude, oai = _clients(server.url, "sesame")
        ask = {"model": "default_model", "max_tokens": 64, "messages": [{"role": "user", "content": WEATHER}]}
        assert claude.messages.create(**ask).stop_reason == "tool_use"
        assert oai.responses.create(model="default_model", input=WEATHER).status == "completed"
        wrong_claude, wrong_oai = _clients(server.url, "open")
        with pytest.raises(anthropic.AuthenticationError) as caught:
            wrong_claude.messages.create(**ask)
        assert caught.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            wrong_oai.responses.create(model="default_model", input=WEATHER)
        with pytest.raises(openai.AuthenticationError):
            wrong_oai.models.list()
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        assert server.stop() == 0, server.stderr
