"""OpenAI's standard request fields and structured outputs on `dflash-mlx serve`, as clients send them.

- The real console script on the bundled pair, driven by the official ``openai`` client: every field of
  the Chat Completions and Completions request schemas in `FIELDS` (the SDK's own parameters) is served
  with the same greedy text as the request without it (a no-op here), honoured, or refused with a 400
  naming it; a field outside the schema is still a 400. ``chat.completions.parse`` with a pydantic model
  returns a valid parsed object with DFlash on (cycles of more than one token in the ``dflash`` object),
  whole and streamed; the Responses API's ``text.format`` (``responses.parse``) and Anthropic's
  ``output_config.format`` too; a schema llguidance cannot compile is a 400 naming ``response_format``
  (``text.format``, ``output_config.format``), and so are the issue's two schemas that compile but fail at
  their first token (an ``anyOf`` of 5,000 objects, a ``$ref`` loop), in every dialect.
- In process: the greedy text under a schema equals plain constrained decoding of the same model
  through mlx-lm (`GrammarLogitsProcessor`), for concurrent requests with different schemas (batched
  rows) on the bundled pair and on a second family (a tiny llama pair); ``reasoning_effort`` switches
  the template's reasoning and the legacy ``functions`` round trip (the scripted target); a schema that
  fails mid-output is its request's 400 naming ``response_format`` while the requests beside it (rows of
  its batch) get the text they get alone, with ``--decode-concurrency`` 1 and 4.
"""

from __future__ import annotations

import http.client
import json
import threading

import pytest
from mlx_lm import stream_generate as mlx_lm_stream_generate

from dflash_mlx import load
from dflash_mlx.server import make_server
from dflash_mlx.structured import GrammarLogitsProcessor
from helpers import load_pair, make_draft
from helpers.scripted import CALL, WEATHER_TOOL, make_scripted_target
from helpers.formats import Answer, Order, schema_format
from helpers.servers import ServeProcess

pytestmark = pytest.mark.slow  # servers

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

QUESTION = "Tom has 3 boxes with 12 apples each. How many apples? Reply in JSON."
MESSAGES = [{"role": "user", "content": QUESTION}]


SAME, HONOURED = "same", "honoured"  # served with the text of the request without the field; changes it
# (field, the SDK's keyword arguments, the outcome: SAME, HONOURED or the field a 400 names)
FIELDS = [
    ("store", dict(store=True), SAME),
    ("metadata", dict(metadata={"user": "u1", "run": "7"}), SAME),
    ("service_tier", dict(service_tier="auto"), SAME),
    ("user", dict(user="u1"), SAME),
    ("safety_identifier", dict(safety_identifier="h4sh"), SAME),
    ("prompt_cache_key", dict(prompt_cache_key="conversation-1"), SAME),
    ("prompt_cache_options", dict(prompt_cache_options={"mode": "implicit", "ttl": "30m"}), SAME),
    ("prompt_cache_retention", dict(prompt_cache_retention="24h"), SAME),
    ("modalities", dict(modalities=["text"]), SAME),
    ("parallel_tool_calls", dict(parallel_tool_calls=False), SAME),
    ("verbosity", dict(verbosity="low"), SAME),
    ("prediction", dict(prediction={"type": "content", "content": "There are 36 apples."}), SAME),
    ("reasoning_effort", dict(reasoning_effort="high"), SAME),  # (the demo template has no reasoning switch)
    ("response_format text", dict(response_format={"type": "text"}), SAME),
    ("n", dict(n=1), SAME),
    ("seed", dict(seed=7), SAME),  # (greedy)
    ("functions", dict(functions=[WEATHER_TOOL["function"]], function_call="auto"), SAME),  # (the demo
    # template renders no tools)
    ("response_format json_object", dict(response_format={"type": "json_object"}), HONOURED),
    ("response_format json_schema", dict(response_format=schema_format(Answer)), HONOURED),
    ("n > 1", dict(n=2), "n"),
    ("audio modalities", dict(modalities=["text", "audio"]), "modalities"),
    ("audio", dict(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("web_search_options", dict(web_search_options={}), "web_search_options"),
    ("moderation", dict(moderation={"model": "omni-moderation-latest"}), "moderation"),
    ("functions and tools", dict(functions=[WEATHER_TOOL["function"]], tools=[WEATHER_TOOL]), "functions"),
    ("an unknown field", dict(extra_body={"definitely_not_a_field": 1}), "definitely_not_a_field"),
]


@pytest.fixture(scope="module")
def demo():
    server = ServeProcess()
    yield server
    assert server.stop() == 0, server.stderr


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client, **kwargs):
    return client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=48, **kwargs)


def test_the_standard_fields_through_the_openai_client(demo):
    client = _client(demo.url)
    plain = _chat(client).choices[0].message.content
    for name, kwargs, outcome in FIELDS:
        if outcome in (SAME, HONOURED):
            message = _chat(client, **kwargs).choices[0].message
            assert (message.content == plain) == (outcome == SAME), (name, message)
            if outcome == HONOURED:
                assert message.content.startswith("{"), (name, message.content)
            continue
        with pytest.raises(openai.BadRequestError) as caught:
            _chat(client, **kwargs)
        assert caught.value.body["param"] == outcome, (name, caught.value.body)
        assert caught.value.body["message"].startswith(outcome + ":"), name
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in _chat(client, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
        if c.choices
    )
    assert streamed == plain
    text = client.completions.create(
        model="demo", prompt=QUESTION, max_tokens=24, user="u1", n=1, best_of=1, echo=False, seed=3, logprobs=2
    )
    assert text.choices[0].text and all(len(top) == 2 for top in text.choices[0].logprobs.top_logprobs)
    assert "Traceback" not in demo.stderr, demo.stderr


def _cycles_of_more_than_one(dflash: dict) -> int:
    return sum(dflash["acceptance_histogram"][1:])


def test_parse_with_a_pydantic_model_returns_a_valid_object_with_dflash_on(demo):
    client = _client(demo.url)
    for model in (Answer, Order):
        completion = client.chat.completions.parse(
            model="demo", messages=MESSAGES, response_format=model, max_tokens=200
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model), choice
        assert model.model_validate_json(choice.message.content) == choice.message.parsed
        dflash = completion.model_extra["dflash"]
        assert dflash["cycles"] >= 1 and _cycles_of_more_than_one(dflash) >= 1, dflash
    with client.chat.completions.stream(
        model="demo", messages=MESSAGES, response_format=Order, max_tokens=200
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Order)


def test_the_responses_and_messages_apis_take_a_schema(demo):
    response = _client(demo.url).responses.parse(
        model="demo", input=QUESTION, text_format=Answer, max_output_tokens=200
    )
    assert isinstance(response.output_parsed, Answer) and response.status == "completed"
    assert _cycles_of_more_than_one(response.model_extra["dflash"]) >= 1
    claude = anthropic.Anthropic(base_url=demo.url, api_key="unused", max_retries=0, timeout=300)
    message = claude.messages.create(
        model="demo",
        max_tokens=200,
        messages=MESSAGES,
        output_config={"format": {"type": "json_schema", "schema": Order.model_json_schema()}},
    )
    assert message.stop_reason == "end_turn"
    Order.model_validate_json("".join(b.text for b in message.content if b.type == "text"))


# the issue's two schemas: both compile, then fail at the first token (5,000 alternatives once the forced
# "{" is taken, past llguidance's limits; a reference loop that never reaches a token)
ROW_LIMIT = {"anyOf": [{"type": "object", "properties": {"k": {"const": i}}} for i in range(5000)]}
REF_LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
MID_OUTPUT = {  # starts (a free integer first), then fails at "a"
    "type": "object",
    "properties": {"x": {"type": "integer"}, "a": ROW_LIMIT},
    "required": ["x", "a"],
}


@pytest.mark.parametrize(
    "bad",
    [{"type": "object", "properties": {"a": {"type": "strin"}}}, ROW_LIMIT, REF_LOOP],
    ids=["an unknown type", "anyOf of 5,000 objects", "a $ref loop"],
)
def test_a_schema_the_grammar_library_rejects_is_a_400_naming_the_field(demo, bad):
    """Refused while compiling, or at the first token (the issue's two schemas compile, then fail there):
    a 400 naming the format field of each dialect, before anything is queued."""
    client = _client(demo.url)
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    assert caught.value.body["param"] == "response_format.json_schema.schema", caught.value.body
    assert "llguidance" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="demo", input=QUESTION, text={"format": {"type": "json_schema", "name": "x", "schema": bad}}
        )
    assert caught.value.body["param"] == "text.format.schema", caught.value.body
    claude = anthropic.Anthropic(base_url=demo.url, api_key="unused", max_retries=0, timeout=300)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="demo",
            max_tokens=20,
            messages=MESSAGES,
            output_config={"format": {"type": "json_schema", "schema": bad}},
        )
    assert caught.value.body["error"]["message"].startswith("output_config.format.schema:")
    assert demo.proc.poll() is None and "Traceback" not in demo.stderr, demo.stderr


# -- in process: equal to plain constrained decoding ----------------------------------------------


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=300)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    out = reply.status, json.loads(reply.read())
    conn.close()
    return out


def _plain(model, tokenizer, messages, response_format, max_tokens) -> str:
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    responses = mlx_lm_stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=max_tokens,
        logits_processors=[GrammarLogitsProcessor(tokenizer, response_format)],
    )
    return "".join(r.text for r in responses)


@pytest.mark.parametrize("pair_name", ["demo", "llama"])
def test_concurrent_requests_with_their_own_schemas_equal_plain_constrained_decoding(tiny_pair, pair_name):
    model, tokenizer, draft = load("demo") if pair_name == "demo" else tiny_pair("llama")
    asks = [
        (MESSAGES, schema_format(Answer)),
        ([{"role": "user", "content": "Order some fruit."}], schema_format(Order)),
        (MESSAGES, {"type": "json_object"}),
    ]
    server = make_server(model, tokenizer, draft, port=0, model_id="m").start()
    try:
        replies: list = [None] * len(asks)

        def ask(i):
            messages, response_format = asks[i]
            replies[i] = _post(
                server,
                "/v1/chat/completions",
                {"messages": messages, "max_tokens": 300, "response_format": response_format},
            )

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    finally:
        server.stop()
    for (messages, response_format), (status, body) in zip(asks, replies):
        assert status == 200, body
        text = body["choices"][0]["message"]["content"]
        assert text == _plain(model, tokenizer, messages, response_format, 300)
        assert body["dflash"]["cycles"] >= 1
    for model_class, (_, body) in zip((Answer, Order), replies):  # (bounded schemas: every reply ends)
        assert body["choices"][0]["finish_reason"] == "stop"
        model_class.model_validate_json(body["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripted")
    target = make_scripted_target(root / "target")
    pair = load_pair(target, make_draft(root / "draft", target, target_layer_ids=[1, 2], block_size=4))
    server = make_server(*pair, port=0, model_id="scripted").start()
    yield server
    server.stop()


WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_reasoning_effort_switches_the_templates_reasoning(scripted):
    status, on = _post(
        scripted, "/v1/chat/completions", {"messages": WEATHER, "tools": [WEATHER_TOOL], "reasoning_effort": "high"}
    )
    assert status == 200 and on["choices"][0]["message"]["reasoning"]
    status, off = _post(
        scripted, "/v1/chat/completions", {"messages": WEATHER, "tools": [WEATHER_TOOL], "reasoning_effort": "none"}
    )
    assert status == 200 and "reasoning" not in off["choices"][0]["message"]
    assert off["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == CALL["name"]


def test_the_legacy_functions_round_trip(scripted):
    body = {"messages": WEATHER, "functions": [WEATHER_TOOL["function"]], "function_call": "auto"}
    status, reply = _post(scripted, "/v1/chat/completions", body)
    choice = reply["choices"][0]
    assert status == 200 and choice["finish_reason"] == "function_call", reply
    call = choice["message"]["function_call"]
    assert call["name"] == CALL["name"] and json.loads(call["arguments"]) == CALL["arguments"]
    assert "tool_calls" not in choice["message"]
    history = WEATHER + [
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": call["name"], "content": "sunny, 24 C"},
    ]
    status, answer = _post(scripted, "/v1/chat/completions", {**body, "messages": history})
    assert status == 200 and answer["choices"][0]["message"]["content"], answer
    status, refused = _post(scripted, "/v1/chat/completions", {**body, "function_call": {"name": 5}})
    assert status == 400 and refused["error"]["param"] == "function_call"


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_grammar_that_fails_is_its_requests_400_and_the_others_are_served_as_alone(concurrency):
    """Beside two ordinary requests (and in a batch, as rows beside them): a schema the grammar library
    cannot start is refused before it is queued, one that fails mid-output ends with a 400 naming its
    format field; the ordinary requests get the text they get alone, in both worker modes."""
    model, tokenizer, draft = load("demo")
    plain = [{"messages": MESSAGES, "max_tokens": 40}, {"prompt": QUESTION, "max_tokens": 40}]
    paths = ["/v1/chat/completions", "/v1/completions"]
    failing = [
        {"messages": MESSAGES, "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": s}}
        for s in ({"name": "start", "schema": ROW_LIMIT}, {"name": "mid", "schema": MID_OUTPUT})
    ]
    server = make_server(model, tokenizer, draft, port=0, model_id="demo", decode_concurrency=concurrency).start()
    try:
        alone = [_post(server, path, body) for path, body in zip(paths, plain)]
        replies: list = [None] * 4

        def ask(i):
            replies[i] = _post(server, (paths + paths[:1] * 2)[i], (plain + failing)[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        after = _post(server, paths[0], plain[0])  # the server serves on, unchanged
    finally:
        server.stop()
    for (status, body), want in zip(replies[:2], alone):
        assert status == 200 and body["choices"] == want[1]["choices"], (body, want)
    (start_status, start), (mid_status, mid) = replies[2:]
    assert start_status == 400 and start["error"]["param"] == "response_format.json_schema.schema", start
    assert mid_status == 400 and mid["error"]["param"] == "response_format", mid
    assert mid["error"]["message"].startswith("response_format: "), mid
    assert after[0] == 200 and after[1]["choices"] == alone[0][1]["choices"], after
