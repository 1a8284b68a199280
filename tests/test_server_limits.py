"""No request takes the server down (issue: limits from the model, not from the request).

- The real ``dflash-mlx serve`` on the bundled pair, batched (the default) and
  ``--decode-concurrency 1``: a table of hostile and odd requests covering every
  request field (oversized numbers, wrong types, deep nesting, huge stop lists,
  unknown fields, content parts, a stream cancelled mid-flight, bodies larger
  than a prompt filling the context can take: 413), each followed by a normal
  request that must return the reply it returned before the sweep; then good
  and bad requests interleaved from threads.
- In process, faults injected into each stage of the batched loop (admit:
  preparing it in its handler's thread; prefill, step, deliver, save) and of
  the one-at-a-time worker fail only the requests of that stage; the others
  get the texts they get when served alone, and the server serves on; a fault
  in the loop itself restarts it.
- A request whose caches cannot fit in the memory budget even alone is
  refused, naming max_tokens or the prompt.
- The library and the CLI refuse a block wider than the drafter's.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading

import pytest

from dflash_mlx import batch_generate, load, make_session, stream_generate
from dflash_mlx.server import make_server
from dflash_mlx.server import batching
from dflash_mlx.server.limits import Footprint, weight_bytes
from helpers import prompt_ids, without_eos
from helpers.servers import ServeProcess

pytestmark = pytest.mark.slow  # servers

QUESTION = "Tom has 3 boxes with 12 apples each. How many apples?"
MESSAGES = [{"role": "user", "content": QUESTION}]
NORMAL = {"model": "demo", "messages": MESSAGES, "max_tokens": 24}
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
BIG = {"role": "user", "content": "apples " * (20 * 2**20 // 7)}  # one long message: a 20 MB body


def _chat(**fields) -> dict:
    return {**NORMAL, **fields}


def _deep(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


# (name, path, body: a dict, or raw bytes; headers (None: JSON's), the statuses allowed)
BAD = {400}
HOSTILE = [
    ("num_draft_tokens huge (the issue's request)", CHAT, _chat(num_draft_tokens=1_000_000), None, BAD),
    ("num_draft_tokens negative", CHAT, _chat(num_draft_tokens=-1), None, BAD),
    ("num_draft_tokens a string", CHAT, _chat(num_draft_tokens="8"), None, BAD),
    ("num_draft_tokens the widest allowed", CHAT, _chat(num_draft_tokens=7), None, {200}),
    ("max_tokens 2**63 (capped by the context)", CHAT, _chat(max_tokens=2**63, stop=["."]), None, {200}),
    ("max_tokens 10**30 > int64", CHAT, _chat(max_tokens=10**30, stop=["."]), None, {200}),
    ("max_tokens zero", CHAT, _chat(max_tokens=0), None, BAD),
    ("max_tokens a float", CHAT, _chat(max_tokens=1.5), None, BAD),
    ("max_tokens a bool", CHAT, _chat(max_tokens=True), None, BAD),
    ("max_completion_tokens differs", CHAT, _chat(max_completion_tokens=10**18), None, BAD),
    ("temperature negative", CHAT, _chat(temperature=-1), None, BAD),
    ("temperature 1e308", CHAT, _chat(temperature=1e308, seed=1), None, {200}),
    ("temperature 1e-300 (greedy)", CHAT, _chat(temperature=1e-300), None, {200}),
    ("temperature 2**70, an integer", CHAT, _chat(temperature=2**70, seed=1), None, {200}),
    ("repetition_penalty 10**400, beyond a float", CHAT, _chat(repetition_penalty=10**400), None, BAD),
    (
        "temperature NaN",
        CHAT,
        b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        None,
        BAD,
    ),
    ("top_p zero", CHAT, _chat(top_p=0), None, BAD),
    ("top_k beyond the vocabulary", CHAT, _chat(top_k=10**12), None, BAD),
    ("min_p 5", CHAT, _chat(min_p=5), None, BAD),
    ("seed 2**64", CHAT, _chat(seed=2**64), None, BAD),
    ("seed negative", CHAT, _chat(seed=-1), None, BAD),
    ("stop: 10,000 sequences", CHAT, _chat(stop=["x"] * 10_000), None, BAD),
    ("stop: one of 10,000 characters", CHAT, _chat(stop=["x" * 10_000]), None, BAD),
    ("stop: an empty string", CHAT, _chat(stop=[""]), None, BAD),
    ("stop: a number", CHAT, _chat(stop=5), None, BAD),
    ("repetition_context_size 10**12", CHAT, _chat(repetition_penalty=1.1, repetition_context_size=10**12), None, BAD),
    ("repetition_penalty 1e308", CHAT, _chat(repetition_penalty=1e308), None, {200}),
    ("presence_penalty 3", CHAT, _chat(presence_penalty=3), None, BAD),
    ("frequency_context_size 2**40", CHAT, _chat(frequency_penalty=0.5, frequency_context_size=2**40), None, BAD),
    ("logit_bias out of the vocabulary", CHAT, _chat(logit_bias={"-1": 5}), None, BAD),
    ("logit_bias of 1e9", CHAT, _chat(logit_bias={"1": 1e9}), None, BAD),
    ("logit_bias on the whole vocabulary", CHAT, _chat(logit_bias={str(i): -1 for i in range(4096)}), None, {200}),
    ("logprobs a string", CHAT, _chat(logprobs="yes"), None, BAD),
    ("top_logprobs 10**9", CHAT, _chat(logprobs=True, top_logprobs=10**9), None, BAD),
    ("xtc with a drafter", CHAT, _chat(xtc_probability=0.5), None, BAD),
    ("draft_model another", CHAT, _chat(draft_model="other"), None, BAD),
    ("adapters", CHAT, _chat(adapters="lora"), None, BAD),
    ("n 10**9", CHAT, _chat(n=10**9), None, BAD),
    ("user a number", CHAT, _chat(user=5), None, BAD),
    ("return_meta_info a string", CHAT, _chat(return_meta_info="x"), None, BAD),
    ("model another", CHAT, _chat(model="gpt-4o"), None, BAD),
    ("stream a string", CHAT, _chat(stream="yes"), None, BAD),
    ("stream_options without stream", CHAT, _chat(stream_options={"include_usage": True}), None, BAD),
    ("an unknown field", CHAT, _chat(definitely_not_a_field=1), None, BAD),
    ("messages empty", CHAT, _chat(messages=[]), None, BAD),
    (
        "messages 10,000 levels deep",
        CHAT,
        b'{"model": "demo", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
        None,
        BAD,
    ),
    ("chat_template_kwargs 70 levels deep", CHAT, _chat(chat_template_kwargs={"x": _deep(70)}), None, BAD),
    (
        "an image part",
        CHAT,
        _chat(
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ]
        ),
        None,
        BAD,
    ),
    ("a message without a role", CHAT, _chat(messages=[{"content": "hi"}]), None, BAD),
    ("a prompt of 20,000 words", CHAT, _chat(messages=[{"role": "user", "content": "apples " * 20_000}]), None, BAD),
    ("a body of 20 MB (beyond what the context can take)", CHAT, _chat(messages=[BIG]), None, {413}),
    ("tools not a list", CHAT, _chat(tools="all"), None, BAD),
    (
        "a tool with a deep schema",
        CHAT,
        _chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "array", "items": _deep(40)}}},
                    },
                }
            ]
        ),
        None,
        {200},
    ),
    ("tool_choice unknown", CHAT, _chat(tool_choice="sometimes"), None, BAD),
    ("role_mapping with a template", CHAT, _chat(role_mapping={"user": "U:"}), None, BAD),
    ("chat_template_kwargs a string", CHAT, _chat(chat_template_kwargs="x"), None, BAD),
    ("text: token ids outside the vocabulary", TEXT, {"prompt": [10**9], "max_tokens": 4}, None, BAD),
    ("text: 80,000 token ids", TEXT, {"prompt": [5] * 80_000, "max_tokens": 4}, None, BAD),
    ("text: echo", TEXT, {"prompt": "hi", "echo": True}, None, BAD),
    ("text: best_of 10**9", TEXT, {"prompt": "hi", "best_of": 10**9}, None, BAD),
    ("text: legacy logprobs 10**9", TEXT, {"prompt": "hi", "logprobs": 10**9}, None, BAD),
    ("response_format a string", CHAT, _chat(response_format="json"), None, BAD),
    ("response_format of an unknown type", CHAT, _chat(response_format={"type": "xml"}), None, BAD),
    (
        "response_format: a schema with an unknown type",
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            }
        ),
        None,
        BAD,
    ),
    (
        "response_format: a schema that is a list",
        CHAT,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1, 2]}}),
        None,
        BAD,
    ),
    (
        "response_format: strict with a keyword llguidance cannot enforce",
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "strict": True, "schema": {"type": "string", "format": "colour"}},
            }
        ),
        None,
        BAD,
    ),
    (
        "response_format: an enum of 200,000 strings (a body beyond what the context can take)",
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"enum": [f"v{i}" for i in range(200_000)]}},
            }
        ),
        None,
        {413},
    ),
    (
        "response_format: an array of at least 10**9 items (cut by max_tokens)",
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "array", "minItems": 10**9, "items": {"type": "integer"}},
                },
            }
        ),
        None,
        {200},
    ),
    (
        "response_format: a catastrophic pattern",
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a*)*b" * 50}},
            }
        ),
        None,
        {200},
    ),
    (
        "response_format: a recursive $ref",
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}}}},
                },
            }
        ),
        None,
        {200},
    ),
    (
        "response_format: 3,000 required properties",
        CHAT,
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {f"k{i}": {"type": "integer"} for i in range(3000)},
                        "required": [f"k{i}" for i in range(3000)],
                    },
                },
            }
        ),
        None,
        {200},
    ),
    (
        "response_format: a minimum of Infinity (Python's JSON reads it)",
        CHAT,
        b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], '
        b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", '
        b'"minimum": Infinity}}}}',
        None,
        BAD,
    ),
    ("response_format json_object", CHAT, _chat(response_format={"type": "json_object"}), None, {200}),
    ("reasoning_effort unknown", CHAT, _chat(reasoning_effort="extreme"), None, BAD),
    ("reasoning_effort a number", CHAT, _chat(reasoning_effort=5), None, BAD),
    ("store a string", CHAT, _chat(store="yes"), None, BAD),
    ("metadata of 17 keys", CHAT, _chat(metadata={str(i): "v" for i in range(17)}), None, BAD),
    ("metadata a list", CHAT, _chat(metadata=["a"]), None, BAD),
    ("service_tier a number", CHAT, _chat(service_tier=5), None, BAD),
    ("safety_identifier of 10,000 characters", CHAT, _chat(safety_identifier="x" * 10_000), None, BAD),
    ("prompt_cache_key an object", CHAT, _chat(prompt_cache_key={"a": 1}), None, BAD),
    ("prompt_cache_options with more", CHAT, _chat(prompt_cache_options={"mode": "implicit", "x": 1}), None, BAD),
    ("modalities audio", CHAT, _chat(modalities=["audio"]), None, BAD),
    ("modalities of 10,000", CHAT, _chat(modalities=["text"] * 10_000), None, BAD),
    ("parallel_tool_calls a string", CHAT, _chat(parallel_tool_calls="no"), None, BAD),
    ("verbosity loud", CHAT, _chat(verbosity="loud"), None, BAD),
    ("prediction of another type", CHAT, _chat(prediction={"type": "diff", "content": "x"}), None, BAD),
    ("prediction content a number", CHAT, _chat(prediction={"type": "content", "content": 5}), None, BAD),
    ("functions not a list", CHAT, _chat(functions="all"), None, BAD),
    ("functions without a name", CHAT, _chat(functions=[{"parameters": {}}]), None, BAD),
    ("function_call naming a number", CHAT, _chat(function_call={"name": 5}), None, BAD),
    (
        "functions with tools",
        CHAT,
        _chat(functions=[{"name": "f"}], tools=[{"type": "function", "function": {"name": "f"}}]),
        None,
        BAD,
    ),
    ("web_search_options", CHAT, _chat(web_search_options={}), None, BAD),
    ("audio", CHAT, _chat(audio={"voice": "alloy", "format": "wav"}), None, BAD),
    (
        "stream_options include_obfuscation a string",
        CHAT,
        _chat(stream=True, stream_options={"include_obfuscation": "x"}),
        None,
        BAD,
    ),
    (
        "every no-op field at once",
        CHAT,
        _chat(
            store=False,
            metadata={"a": "b"},
            service_tier="flex",
            user="u",
            safety_identifier="s",
            prompt_cache_key="k",
            modalities=["text"],
            parallel_tool_calls=True,
            verbosity="high",
            reasoning_effort="none",
            prediction={"type": "content", "content": [{"type": "text", "text": "x"}]},
            prompt_cache_retention="in_memory",
        ),
        None,
        {200},
    ),
    ("not JSON", CHAT, b"{'messages': [", None, BAD),
    ("JSON null", CHAT, b"null", None, BAD),
    ("a JSON array", CHAT, b"[1, 2]", None, BAD),
    ("not UTF-8", CHAT, b"\xff\xfe\x00", None, BAD),
    ("a negative Content-Length", CHAT, b"{}", {"Content-Length": "-5"}, BAD),
    ("a Content-Length of 10**11", CHAT, b"{}", {"Content-Length": str(10**11)}, {413}),
    ("no Content-Length", CHAT, b"", {}, {411}),
    ("an unknown route", "/v1/embeddings", _chat(), None, {404}),
]


def _post(url: str, path: str, body, headers=None, timeout: float = 300) -> tuple[int, dict | None]:
    """POST a body (a dict as JSON, or raw bytes) with `headers` (None: JSON's, with its length)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.putrequest("POST", path)
        sent = {"Content-Type": "application/json", "Content-Length": str(len(data))} if headers is None else headers
        for key, value in sent.items():
            conn.putheader(key, value)
        conn.endheaders()
        conn.send(data)
        reply = conn.getresponse()
        raw = reply.read()
        return reply.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def _text(url: str) -> str:
    status, body = _post(url, CHAT, NORMAL)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def _cancel_a_stream(url: str, path: str = CHAT, body: dict | None = None) -> None:
    """Open a streamed request, read its first event, hang up."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        data = json.dumps(body or _chat(max_tokens=200, stream=True)).encode()
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + b"Content-Length: "
            + str(len(data)).encode()
            + b"\r\n\r\n"
            + data
        )
        received = b""
        while b"data:" not in received:  # the headers, then the first event
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk


def _peak_rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1e6


@pytest.fixture(scope="module", params=["batched", "one at a time"])
def served(request):
    server = ServeProcess(*(["--decode-concurrency", "1"] if request.param == "one at a time" else []))
    yield server
    assert server.stop() == 0, server.stderr


def test_a_sweep_of_hostile_requests_leaves_the_server_serving_unchanged(served):
    before = _text(served.url)
    for name, path, body, headers, allowed in HOSTILE:
        status, reply = _post(served.url, path, body, headers)
        assert status in allowed, (name, status, reply)
        if status >= 400:
            assert reply["error"]["message"], name
        assert _text(served.url) == before, name
    _cancel_a_stream(served.url)
    assert _text(served.url) == before
    assert served.proc.poll() is None and _peak_rss_gb(served.proc.pid) < 4, served.stderr
    assert "Traceback" not in served.stderr, served.stderr


def test_good_and_bad_requests_interleaved_from_threads(served):
    want = _text(served.url)
    bad = [h for h in HOSTILE if h[4] == BAD][:12]
    results: dict = {}

    def good(i):
        results[("good", i)] = _text(served.url)

    def hostile(i):
        name, path, body, headers, _ = bad[i]
        results[("bad", i)] = _post(served.url, path, body, headers)[0]

    threads = [threading.Thread(target=good if k % 2 == 0 else hostile, args=(k // 2,)) for k in range(2 * len(bad))]
    threads.append(threading.Thread(target=_cancel_a_stream, args=(served.url,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(results[("good", i)] == want for i in range(len(bad))), results
    assert all(results[("bad", i)] == 400 for i in range(len(bad))), results
    assert _text(served.url) == want


# -- the Anthropic and Responses dialects --------------------------------------------------------

ANTHROPIC, RESPONSES = "/v1/messages", "/v1/responses"
ASK = {"model": "demo", "max_tokens": 24, "messages": MESSAGES}
INPUT = {"model": "demo", "max_output_tokens": 24, "input": QUESTION}


def _ask(**fields) -> dict:
    return {**ASK, **fields}


def _input(**fields) -> dict:
    return {**INPUT, **fields}


TOO_LARGE = "413"  # refused before it is read: larger than what a prompt filling the context can take
# (name, path, body, the field a 400 names; None: served, 200)
DIALECT_HOSTILE = [
    ("messages: max_tokens missing", ANTHROPIC, _ask(max_tokens=None), "max_tokens"),
    (
        "messages: max_tokens 2**63 (capped by the context)",
        ANTHROPIC,
        _ask(max_tokens=2**63, stop_sequences=["."]),
        None,
    ),
    ("messages: max_tokens a string", ANTHROPIC, _ask(max_tokens="24"), "max_tokens"),
    ("messages: temperature 1e308", ANTHROPIC, _ask(temperature=1e308), None),
    ("messages: temperature 2**70, an integer", ANTHROPIC, _ask(temperature=2**70), None),
    ("messages: top_k beyond the vocabulary", ANTHROPIC, _ask(top_k=10**12), "top_k"),
    ("messages: 10,000 stop sequences", ANTHROPIC, _ask(stop_sequences=["x"] * 10_000), "stop_sequences"),
    (
        "messages: a stop sequence of 10,000 characters",
        ANTHROPIC,
        _ask(stop_sequences=["x" * 10_000]),
        "stop_sequences",
    ),
    ("messages: content not a list", ANTHROPIC, _ask(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (
        "messages: 5,000 text blocks (longer than the context)",
        ANTHROPIC,
        _ask(messages=[{"role": "user", "content": [{"type": "text", "text": "apples "}] * 5_000}]),
        "messages",
    ),
    ("messages: a role of its own", ANTHROPIC, _ask(messages=[{"role": "system", "content": "hi"}]), "messages[0]"),
    (
        "messages: a tool_result answering nothing",
        ANTHROPIC,
        _ask(
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]
        ),
        "messages[0].content[0].tool_use_id",
    ),
    (
        "messages: a tool_use input not an object",
        ANTHROPIC,
        _ask(
            messages=[
                MESSAGES[0],
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]},
                MESSAGES[0],
            ]
        ),
        "messages[1].content[0].input",
    ),
    (
        "messages: a tool with a 60-level schema",
        ANTHROPIC,
        _ask(
            tools=[
                {
                    "name": "f",
                    "input_schema": {"type": "object", "properties": {"a": {"type": "array", "items": _deep(55)}}},
                }
            ]
        ),
        None,
    ),
    ("messages: a server tool", ANTHROPIC, _ask(tools=[{"type": "bash_20250124", "name": "bash"}]), "tools[0].type"),
    ("messages: system a number", ANTHROPIC, _ask(system=5), "system"),
    ("messages: thinking a string", ANTHROPIC, _ask(thinking="on"), "thinking"),
    (
        "messages: budget_tokens 1e30",
        ANTHROPIC,
        _ask(thinking={"type": "enabled", "budget_tokens": 1e30}),
        "thinking.budget_tokens",
    ),
    ("messages: tool_choice a string", ANTHROPIC, _ask(tool_choice="auto"), "tool_choice"),
    ("messages: stream a string", ANTHROPIC, _ask(stream="yes"), "stream"),
    ("messages: an unknown field", ANTHROPIC, _ask(n=2), "n"),
    ("messages: metadata with more", ANTHROPIC, _ask(metadata={"user_id": "u", "x": 1}), "metadata.x"),
    (
        "messages: cache_control and context_management (ignored)",
        ANTHROPIC,
        _ask(cache_control={"type": "ephemeral"}, context_management={"edits": []}, metadata={"user_id": "u"}),
        None,
    ),
    (
        "count_tokens: 20,000 words (beyond the context: counted)",
        "/v1/messages/count_tokens",
        {"model": "demo", "messages": [{"role": "user", "content": "apples " * 20_000}]},
        None,
    ),
    ("count_tokens: max_tokens", "/v1/messages/count_tokens", _ask(), "max_tokens"),
    (
        "messages: a prompt of 20,000 words",
        ANTHROPIC,
        _ask(messages=[{"role": "user", "content": "apples " * 20_000}]),
        "messages",
    ),
    ("responses: input a number", RESPONSES, _input(input=5), "input"),
    (
        "responses: 5,000 items (longer than the context)",
        RESPONSES,
        _input(input=[{"role": "user", "content": "apples "}] * 5_000),
        "input",
    ),
    ("responses: a body of 20 MB", RESPONSES, _input(input=[BIG]), TOO_LARGE),
    (
        "responses: an item without a role",
        RESPONSES,
        _input(input=[{"type": "message", "content": "a"}]),
        "input[0].role",
    ),
    (
        "responses: a call output answering nothing",
        RESPONSES,
        _input(input=[{"type": "function_call_output", "call_id": "c", "output": "1"}]),
        "input[0].call_id",
    ),
    (
        "responses: arguments not JSON",
        RESPONSES,
        _input(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]),
        "input[0].arguments",
    ),
    ("responses: max_output_tokens 10**30", RESPONSES, _input(max_output_tokens=10**30), None),
    ("responses: max_output_tokens negative", RESPONSES, _input(max_output_tokens=-1), "max_output_tokens"),
    ("responses: temperature NaN-like string", RESPONSES, _input(temperature="nan"), "temperature"),
    (
        "responses: previous_response_id unknown",
        RESPONSES,
        _input(previous_response_id="resp_" + "x" * 10_000),
        "previous_response_id",
    ),
    ("responses: previous_response_id a number", RESPONSES, _input(previous_response_id=5), "previous_response_id"),
    ("responses: include of 10,000", RESPONSES, _input(include=["x"] * 10_000), "include"),
    ("responses: metadata of 1,000 keys", RESPONSES, _input(metadata={str(i): "v" for i in range(1000)}), "metadata"),
    ("responses: reasoning effort on a model without a switch", RESPONSES, _input(reasoning={"effort": "high"}), None),
    ("responses: store false", RESPONSES, _input(store=False), None),
    (
        "responses: text.format a schema llguidance cannot compile",
        RESPONSES,
        _input(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}),
        "text.format.schema",
    ),
    (
        "responses: text.format with an unknown key",
        RESPONSES,
        _input(text={"format": {"type": "json_object", "x": 1}}),
        "text.format.x",
    ),
    ("responses: text.format a string", RESPONSES, _input(text={"format": "json"}), "text.format"),
    ("responses: text.format json_object", RESPONSES, _input(text={"format": {"type": "json_object"}}), None),
    (
        "messages: output_config.format of a list schema",
        ANTHROPIC,
        _ask(output_config={"format": {"type": "json_schema", "schema": [1]}}),
        "output_config.format.schema",
    ),
    (
        "messages: output_config.format a schema of 200,000 enum values (a body beyond the context)",
        ANTHROPIC,
        _ask(output_config={"format": {"type": "json_schema", "schema": {"enum": [f"v{i}" for i in range(200_000)]}}}),
        TOO_LARGE,
    ),
    (
        "messages: output_config.format json_schema",
        ANTHROPIC,
        _ask(
            output_config={
                "format": {
                    "type": "json_schema",
                    "schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
                }
            }
        ),
        None,
    ),
    ("responses: an unknown field", RESPONSES, _input(conversation="c"), "conversation"),
]


def _message_text(url: str) -> str:
    status, body = _post(url, ANTHROPIC, ASK)
    assert status == 200, body
    return "".join(b["text"] for b in body["content"] if b["type"] == "text")


def test_hostile_requests_in_the_agent_dialects_leave_the_server_serving_unchanged(served):
    before, text = _text(served.url), _message_text(served.url)
    assert text == before  # the same conversation, the same greedy text
    for name, path, body, field in DIALECT_HOSTILE:
        status, reply = _post(served.url, path, body)
        if field is None:
            assert status == 200, (name, reply)
        elif field == TOO_LARGE:
            assert status == 413 and "context" in json.dumps(reply), (name, status, reply)
        else:
            assert status == 400, (name, status, reply)
            assert reply["error"]["message"].startswith(field + ":"), (name, reply)
            assert reply.get("type") == "error" if path.startswith(ANTHROPIC) else reply["error"]["param"] == field
        assert _message_text(served.url) == before, name
    _cancel_a_stream(served.url, ANTHROPIC, _ask(max_tokens=200, stream=True))
    assert _text(served.url) == before and _message_text(served.url) == before
    assert served.proc.poll() is None and "Traceback" not in served.stderr, served.stderr


# -- faults injected into the batched loop, in process --------------------------------------------

FAULTY = prompt_ids(7, seed=11)  # the request a fault is injected into
OTHERS = [prompt_ids(6, seed=12), prompt_ids(9, seed=13)]
TOKENS = 40


class Injected(RuntimeError):
    pass


def _is_faulty(prompt) -> bool:
    return list(prompt[: len(FAULTY)]) == FAULTY


@pytest.fixture(scope="module")
def no_eos_pair(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    with without_eos(tokenizer) as tok:
        yield model, tok, draft


@pytest.fixture(scope="module")
def alone(no_eos_pair):
    """Each request's text served alone."""
    app = make_server(*no_eos_pair, port=0, decode_concurrency=1).start()
    try:
        return {
            tuple(p): _post(app.url, TEXT, {"prompt": p, "max_tokens": TOKENS})[1]["choices"][0]["text"]
            for p in [FAULTY, *OTHERS]
        }
    finally:
        app.stop()


def _inject(app, stage: str, monkeypatch) -> list:
    """Make `stage` raise for the faulty request (in the decoder, which outlives the patch: once);
    returns the list the prompts of the requests that failing call served are added to."""
    worker, hit = app.worker, []

    def fail(prompts):
        hit.extend(list(p) for p in prompts)
        raise Injected(stage)

    if stage == "admit":
        prepare = worker.prepare  # (in the request's handler thread, before it is queued)
        monkeypatch.setattr(
            worker, "prepare", lambda request: fail([FAULTY]) if _is_faulty(request.prompt) else prepare(request)
        )
    elif stage in ("prefill", "step"):
        make = batching.batch_decoder

        def decoder(*args, **kwargs):
            made = make(*args, **kwargs)
            if stage == "prefill":
                insert_many = made.insert_many

                def failing_insert(requests, **kw):
                    prompts = [r[1].tolist() for r in requests]
                    return fail(prompts) if not hit and any(map(_is_faulty, prompts)) else insert_many(requests, **kw)

                made.insert_many = failing_insert
            else:
                step = made.step

                def failing_step(*a, **kw):
                    prompts = [r.session.tokens for r in made.rows]
                    return fail(prompts) if not hit and any(map(_is_faulty, prompts)) else step(*a, **kw)

                made.step = failing_step
            return made

        monkeypatch.setattr(batching, "batch_decoder", decoder)
    elif stage == "deliver":
        token_event = worker.token_event
        monkeypatch.setattr(
            worker,
            "token_event",
            lambda r, text, logprobs, top_n: fail([FAULTY]) if top_n == 3 else token_event(r, text, logprobs, top_n),
        )  # (only the faulty one asks for 3)
    elif stage == "save":
        put = worker.sessions.put
        monkeypatch.setattr(
            worker.sessions, "put", lambda session: fail([FAULTY]) if _is_faulty(session.tokens) else put(session)
        )
    return hit


@pytest.mark.parametrize(
    "concurrency, stage",
    [(4, "admit"), (4, "prefill"), (4, "step"), (4, "deliver"), (4, "save"), (1, "admit"), (1, "deliver"), (1, "save")],
)
def test_a_fault_in_one_stage_fails_only_its_requests(no_eos_pair, alone, concurrency, stage, monkeypatch):
    """In the batched loop (4) and the one-at-a-time worker (1)."""
    app = make_server(*no_eos_pair, port=0, decode_concurrency=concurrency).start()
    try:
        hit = _inject(app, stage, monkeypatch)
        bodies = [{"prompt": p, "max_tokens": TOKENS} for p in [FAULTY, *OTHERS]]
        bodies[0].update(logprobs=True, top_logprobs=3)
        replies: list = [None] * len(bodies)

        def ask(i):
            replies[i] = _post(app.url, TEXT, bodies[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert hit, f"the {stage} fault never fired"
        status, body = replies[0]
        if stage == "save":  # after the reply: the request itself was answered
            assert status == 200, replies
        else:
            assert status == 500 and "Injected" in body["error"]["message"], replies
        for (status, body), prompt in zip(replies[1:], OTHERS):
            if status == 200:
                assert body["choices"][0]["text"] == alone[tuple(prompt)]
            else:  # only a request that shared the failing forward (a joint prefill, the step)
                assert status == 500 and any(h[: len(prompt)] == prompt for h in hit), (replies, hit)
        monkeypatch.undo()  # the server serves on, every request as served alone
        for prompt in [FAULTY, *OTHERS]:
            status, body = _post(app.url, TEXT, {"prompt": prompt, "max_tokens": TOKENS})
            assert status == 200 and body["choices"][0]["text"] == alone[tuple(prompt)]
        assert app.worker.alive
    finally:
        app.stop()


def test_a_failing_loop_is_restarted_not_left_dead(no_eos_pair, monkeypatch):
    """A fault outside every request's stages (here: taking the next job) fails the requests in flight
    with a 500, the loop starts again, and the server answers (no 503 for good)."""
    app = make_server(*no_eos_pair, port=0, decode_concurrency=4)  # (its worker is waiting for a first job)
    worker, fired = app.worker, []
    next_job = worker.next_job

    def failing_next_job(wait):
        if not fired:
            fired.append(1)
            raise Injected("loop")
        return next_job(wait)

    monkeypatch.setattr(worker, "next_job", failing_next_job)
    app.start()
    try:
        status, body = _post(app.url, TEXT, {"prompt": OTHERS[0], "max_tokens": 4})
        assert fired and (status == 200 or "generation loop was interrupted" in body["error"]["message"]), body
        status, body = _post(app.url, TEXT, {"prompt": OTHERS[0], "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4 and worker.alive
    finally:
        app.stop()


# -- the memory guard --------------------------------------------------------------------------


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_request_whose_caches_cannot_fit_alone_is_refused(no_eos_pair, concurrency):
    model, tok, draft = no_eos_pair
    footprint = Footprint.measure(lambda: make_session(model, draft), lookup=True)  # (as the server measures it)
    budget = weight_bytes(model, draft) + footprint.bytes(300)  # room for one allocation step of tokens
    app = make_server(model, tok, draft, port=0, decode_concurrency=concurrency, max_batch_bytes=budget).start()
    try:
        status, body = _post(app.url, TEXT, {"prompt": OTHERS[0], "max_tokens": 1000})
        assert status == 400 and body["error"]["param"] == "max_tokens", body
        assert "at most" in body["error"]["message"]
        status, body = _post(app.url, TEXT, {"prompt": [5] * 2000, "max_tokens": 4})
        assert status == 400 and body["error"]["param"] == "prompt" and "caches" in body["error"]["message"], body
        status, body = _post(app.url, TEXT, {"prompt": OTHERS[0], "max_tokens": 100})
        assert status == 200 and body["usage"]["completion_tokens"] == 100
    finally:
        app.stop()


def test_the_footprint_grows_with_the_tokens_held(no_eos_pair):
    model, _, draft = no_eos_pair
    footprint = Footprint.measure(lambda: make_session(model, draft))
    assert footprint.per_token > 0
    for n in (10, 600, 1800):
        session, ids = make_session(model, draft), prompt_ids(n + 1, seed=1)
        session.hold(ids[:n])
        session.hold(ids)  # (the drafter ingests its newest rows with the next)
        assert footprint.bytes(n) / 2 <= session.nbytes <= footprint.bytes(n), n


# -- blocks wider than the drafter's ------------------------------------------------------------


def test_the_library_refuses_a_block_wider_than_the_drafters():
    model, tokenizer, draft = load("demo")
    for kwargs in ({"block_size": 10**6}, {"max_block_size": 10**6}, {"block_size": 9}):
        with pytest.raises(ValueError, match="at most 8, the drafter's block"):
            next(stream_generate(model, draft, tokenizer, QUESTION, max_tokens=4, **kwargs))
    with pytest.raises(ValueError, match="integer"):
        next(stream_generate(model, draft, tokenizer, QUESTION, max_tokens=4, block_size=2.5))
    with pytest.raises(ValueError, match="at most 8, the drafter's block"):
        batch_generate(model, draft, tokenizer, [QUESTION], max_tokens=4, block_size=10**6)


def test_the_cli_refuses_a_block_wider_than_the_drafters():
    run = subprocess.run(
        ["dflash-mlx", "generate", QUESTION, "-n", "4", "--block-size", "1000000"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "--block-size" in run.stderr and "at most 8" in run.stderr, run.stderr
