"""The OpenAI-compatible server, through a real HTTP client on a local port.

The pair is the tiny qwen3 target with the constant drafter of
tests/helpers/constant_draft.py (drafts get accepted). Expected texts are mlx-lm's own
greedy decoding, computed before the server starts (MLX must not run in two
threads at once). The Typer command runs in a subprocess and is stopped with
SIGINT.
"""

from __future__ import annotations

import contextlib

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx.server import make_server
from dflash_mlx.server.stops import StopText
from helpers import load_pair
from helpers.calibrations import cheap_blocks_cache

pytestmark = pytest.mark.slow  # servers

PROMPT = "hello world"
CHATS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a story"}]}],
]
TEXTS = [PROMPT, "The quick brown fox"]
PROCESSORS = {  # request fields -> make_logits_processors arguments
    "bias": ({"logit_bias": {"77": 3.5}}, dict(logit_bias={77: 3.5})),
    "repetition": (
        {"repetition_penalty": 1.6, "repetition_context_size": 5},
        dict(repetition_penalty=1.6, repetition_context_size=5),
    ),
    "presence": ({"presence_penalty": 1.5}, dict(presence_penalty=1.5, presence_context_size=20)),
    "frequency": (
        {"frequency_penalty": 0.8, "frequency_context_size": 8},
        dict(frequency_penalty=0.8, frequency_context_size=8),
    ),
}


@pytest.fixture(scope="module")
def pair(constant_pair_dirs):
    """((target dir, constant drafter dir), (model, tokenizer, drafter))."""
    dirs = constant_pair_dirs(PROMPT)
    return dirs, load_pair(*dirs)


def chat_ids(tokenizer, messages):
    flat = [
        {**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]} for m in messages
    ]
    return tokenizer.encode(
        tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )


def greedy(model, tokenizer, ids, max_tokens, processors=None):
    rs = list(
        mlx_lm_stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens, logits_processors=processors)
    )
    return "".join(r.text for r in rs), rs


@pytest.fixture(scope="module")
def expected(pair):
    """mlx-lm's greedy replies (40 tokens) for every prompt the tests send, keyed by name."""
    _, (model, tokenizer, _) = pair
    want = {}
    for i, messages in enumerate(CHATS):
        want[f"chat{i}"] = greedy(model, tokenizer, chat_ids(tokenizer, messages), 40)
    for i, text in enumerate(TEXTS):
        want[f"text{i}"] = greedy(model, tokenizer, tokenizer.encode(text), 40)
    for name, (_, kwargs) in PROCESSORS.items():
        want[name] = greedy(model, tokenizer, tokenizer.encode(PROMPT), 40, make_logits_processors(**kwargs))
    return want


@pytest.fixture(scope="module")
def server(pair, expected, tmp_path_factory):
    """The server, on a curve where blocks pay (helpers.calibrations): whether the tiny pair's drafting
    pays on this machine's own calibration depends on its load, and these tests show drafts accepted."""
    (_, draft_dir), (model, tokenizer, draft) = pair
    with cheap_blocks_cache(tmp_path_factory.mktemp("calibration"), model, draft):
        srv = make_server(model, tokenizer, draft, port=0, model_id="tiny", draft_id=str(draft_dir)).start()
        yield srv
        srv.stop()


def request(server, method, path, body=None, raw=None):
    """(status, parsed JSON or SSE events) over a fresh HTTP connection."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read().decode()
    conn.close()
    if response.getheader("Content-Type") == "text/event-stream":
        lines = [line[len("data: ") :] for line in payload.split("\n\n") if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return response.status, [json.loads(line) for line in lines[:-1]]
    return response.status, json.loads(payload)


def streamed_text(events, kind):
    key = "delta" if kind == "chat" else None
    return "".join(
        (e["choices"][0][key].get("content", "") if key else e["choices"][0]["text"])
        for e in events
        if e.get("choices")
    )


def test_models_health_and_unknown_paths(server):
    status, health = request(server, "GET", "/health")  # (use against the byte budget: test_server_budget)
    assert status == 200 and health["status"] == "ok" and health["requests"]["running"] == 0
    status, body = request(server, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny"] and body["data"][0]["draft"]
    assert request(server, "GET", "/v1/nothing")[0] == 404
    assert request(server, "POST", "/v1/embeddings", {})[0] == 404


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_completion_whole_and_streamed(server, pair, expected, i):
    _, (_, tokenizer, _) = pair
    want, responses = expected[f"chat{i}"]
    body = {"model": "tiny", "messages": CHATS[i], "max_tokens": 40}
    status, reply = request(server, "POST", "/v1/chat/completions", body)
    assert status == 200, reply
    assert reply["object"] == "chat.completion" and reply["model"] == "tiny"
    choice = reply["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want}
    assert choice["finish_reason"] == responses[-1].finish_reason
    assert reply["usage"]["prompt_tokens"] == len(chat_ids(tokenizer, CHATS[i]))
    assert reply["usage"]["completion_tokens"] == len(responses)
    assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + len(responses)
    stats = reply["dflash"]
    assert stats["cycles"] == len(responses) - 1 and sum(stats["acceptance_histogram"]) == stats["cycles"]
    status, events = request(
        server, "POST", "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert streamed_text(events, "chat") == want
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"] and "dflash" in events[-2]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(responses)


@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_text_completion_whole_and_streamed(server, expected, i):
    want, responses = expected[f"text{i}"]
    body = {"prompt": TEXTS[i], "max_tokens": 40}
    status, reply = request(server, "POST", "/v1/completions", body)
    assert status == 200, reply
    assert reply["object"] == "text_completion" and reply["choices"][0]["text"] == want
    status, events = request(server, "POST", "/v1/completions", {**body, "stream": True})
    assert status == 200 and streamed_text(events, "text") == want
    assert events[-1]["choices"][0]["finish_reason"] == reply["choices"][0]["finish_reason"]
    if i == 0:  # the constant drafter's run: drafts accepted (the adaptive block may start at b = 1)
        assert reply["dflash"]["drafted_tokens"] > 0
        status, fixed = request(server, "POST", "/v1/completions", {**body, "num_draft_tokens": 15})
        assert status == 200 and fixed["choices"][0]["text"] == want
        assert fixed["dflash"]["drafted_tokens"] > 10 and fixed["dflash"]["mean_acceptance_length"] > 1.5


def test_stop_sequences_cut_the_text(server, expected):
    want = expected["text0"][0]
    stop = want[10:14]
    assert want.count(stop) and want.index(stop) > 0
    for stream in (False, True):
        status, reply = request(
            server,
            "POST",
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 40, "stop": ["never there", stop], "stream": stream},
        )
        text = streamed_text(reply, "text") if stream else reply["choices"][0]["text"]
        finish = (reply[-1] if stream else reply)["choices"][0]["finish_reason"]
        assert (status, text, finish) == (200, want[: want.index(stop)], "stop")


def test_stop_text_holds_back_only_what_may_start_a_stop_sequence():
    s = StopText(["END", "xyz"])
    assert [s.feed(piece) for piece in ("abcE", "N", "xy", "q", "Ex")] == ["abc", "", "EN", "xyq", "E"]
    assert s.flush() == "x" and not s.stopped
    s = StopText(["END", "xyz"])
    assert [s.feed(piece) for piece in ("aaxyE", "ND tail", "more")] == ["aaxy", "", ""]
    assert s.stopped and s.flush() == ""
    s = StopText([])
    assert s.feed("END") == "END" and s.flush() == ""


def test_logprobs_match_mlx_lm(server, expected):
    _, responses = expected["text0"]
    status, reply = request(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "logprobs": 3})
    assert status == 200
    lp = reply["choices"][0]["logprobs"]
    want = [r.logprobs[r.token].item() for r in responses]
    np.testing.assert_allclose(lp["token_logprobs"], want, atol=1e-4)
    assert all(len(top) == 3 for top in lp["top_logprobs"]) and len(lp["text_offset"]) == len(responses)
    status, reply = request(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": CHATS[0], "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    )
    content = reply["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == 5
    assert all(
        len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"]
        for c in content
    )


@pytest.mark.parametrize("name", PROCESSORS)
def test_penalties_and_logit_bias_are_mlx_lm_processors(server, expected, name):
    status, reply = request(
        server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, **PROCESSORS[name][0]}
    )
    assert status == 200 and reply["choices"][0]["text"] == expected[name][0]


def test_num_draft_tokens_sets_the_block(server, expected):
    status, reply = request(
        server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "num_draft_tokens": 2}
    )
    stats = reply["dflash"]
    assert status == 200 and reply["choices"][0]["text"] == expected["text0"][0]
    assert stats["block_size"] == 3 and len(stats["acceptance_histogram"]) == 3 and stats["acceptance_histogram"][2]
    assert set(stats["block_sizes"]) == {"3"} or set(stats["block_sizes"]) <= {"1", "2", "3"}  # the last may be cut
    status, reply = request(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 40})
    stats = reply["dflash"]  # without num_draft_tokens: adaptive, up to the server's block
    assert status == 200 and reply["choices"][0]["text"] == expected["text0"][0]
    assert stats["block_size"] == "auto" and stats["max_block_size"] >= 2
    assert sum(stats["block_sizes"].values()) == stats["cycles"] > 0


@pytest.mark.parametrize("alone", [False, True])
def test_lookup_false_turns_copy_aware_drafting_off(server, pair, expected, alone):
    """A prompt whose reply repeats itself: lookup spans by default, none with "lookup": false, the same
    text; in the batched loop and served one at a time (`alone`: decode_concurrency 1); a server started
    with lookup off takes a request's "lookup": true. On a fixed block (a span fills it wherever the context
    matches): what the adaptive one chooses depends on the drafter's history from the module's other requests."""
    _, (model, tokenizer, draft) = pair
    body = {"prompt": PROMPT, "max_tokens": 40, "num_draft_tokens": 3}
    with contextlib.ExitStack() as stack:
        if alone:
            server = stack.enter_context(
                make_server(model, tokenizer, draft, port=0, decode_concurrency=1, lookup=False).start()
            )
            body["lookup"] = True
        status, on = request(server, "POST", "/v1/completions", body)
        assert status == 200 and on["choices"][0]["text"] == expected["text0"][0]
        status, off = request(server, "POST", "/v1/completions", {**body, "lookup": False})
    assert status == 200 and off["choices"][0]["text"] == expected["text0"][0]
    assert on["dflash"]["tokens_by_source"]["lookup"] > 0 and off["dflash"]["tokens_by_source"]["lookup"] == 0
    assert sum(off["dflash"]["tokens_by_source"].values()) == sum(on["dflash"]["tokens_by_source"].values())


def test_seeded_sampling_is_reproducible(server):
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 3.0, "top_p": 0.95, "top_k": 50, "min_p": 0.01}
    texts = [
        request(server, "POST", "/v1/completions", {**body, "seed": s})[1]["choices"][0]["text"] for s in (11, 11, 12)
    ]
    assert texts[0] == texts[1] != texts[2]


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/chat/completions", {"temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"top_p": 1.5}, "top_p"),
        ("/v1/chat/completions", {"top_k": -1}, "top_k"),
        ("/v1/chat/completions", {"top_k": 512}, "top_k"),
        ("/v1/chat/completions", {"min_p": 2}, "min_p"),
        ("/v1/chat/completions", {"seed": 1.5}, "seed"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
        ("/v1/chat/completions", {"stop": [""]}, "stop"),
        ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"9999": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"repetition_penalty": -1}, "repetition_penalty"),
        ("/v1/chat/completions", {"repetition_context_size": 5}, "repetition_context_size"),
        ("/v1/chat/completions", {"presence_penalty": 5}, "presence_penalty"),
        ("/v1/chat/completions", {"logprobs": "yes"}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"xtc_probability": 0.5}, "xtc_probability"),
        ("/v1/chat/completions", {"n": 2}, "n"),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools[0].function"),
        ("/v1/chat/completions", {"draft_model": "other"}, "draft_model"),
        ("/v1/chat/completions", {"stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"response_format": {"type": "json"}}, "response_format.type"),
        ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
        ),
        ("/v1/chat/completions", {"model": "gpt-4"}, "model"),
        ("/v1/chat/completions", {"adapters": "lora"}, "adapters"),
        ("/v1/chat/completions", {"role_mapping": {"user": "U: "}}, "role_mapping"),
        ("/v1/chat/completions", {"num_draft_tokens": -1}, "num_draft_tokens"),
        ("/v1/chat/completions", {"lookup": "no"}, "lookup"),
        ("/v1/completions", {"lookup": 0}, "lookup"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_fields_get_400_naming_them(server, path, body, field):
    base = {"messages": CHATS[0]} if "chat" in path else {"prompt": PROMPT}
    status, reply = request(server, "POST", path, {**base, "max_tokens": 4, **body})
    assert status == 400
    assert reply["error"]["param"] == field and reply["error"]["message"].startswith(f"{field}: ")


def test_malformed_bodies(server):
    assert request(server, "POST", "/v1/completions", raw=b"{not json")[0] == 400
    status, reply = request(server, "POST", "/v1/completions", raw=b"[1, 2]")
    assert status == 400 and "JSON object" in reply["error"]["message"]


def test_four_concurrent_requests_all_get_their_own_text(server, expected):
    jobs = [
        ("/v1/chat/completions", {"messages": CHATS[0]}, "chat0", False),
        ("/v1/completions", {"prompt": TEXTS[1]}, "text1", True),
        ("/v1/chat/completions", {"messages": CHATS[1]}, "chat1", True),
        ("/v1/completions", {"prompt": TEXTS[0]}, "text0", False),
    ]
    results = [None] * len(jobs)

    def run(i, path, body, stream):
        results[i] = request(server, "POST", path, {**body, "max_tokens": 40, "stream": stream})

    threads = [
        threading.Thread(target=run, args=(i, path, body, stream)) for i, (path, body, _, stream) in enumerate(jobs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for (path, _, name, stream), (status, reply) in zip(jobs, results):
        kind = "chat" if "chat" in path else "text"
        if stream:
            text = streamed_text(reply, kind)
        else:
            text = reply["choices"][0]["message"]["content"] if kind == "chat" else reply["choices"][0]["text"]
        assert status == 200 and text == expected[name][0], name


def test_next_chat_turn_reuses_the_cached_prefix(server, pair):
    _, (model, tokenizer, _) = pair
    first = request(server, "POST", "/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 12})[1]
    messages = CHATS[0] + [first["choices"][0]["message"], {"role": "user", "content": "more"}]
    status, reply = request(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 12})
    assert status == 200 and reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert reply["usage"]["prompt_tokens"] == len(chat_ids(tokenizer, messages))


def test_a_server_without_drafter_decodes_plainly(pair, expected):
    _, (model, tokenizer, _) = pair
    with make_server(model, tokenizer, None, port=0).start() as srv:
        status, reply = request(srv, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 40})
        assert status == 200 and reply["choices"][0]["text"] == expected["text0"][0] and "dflash" not in reply
        assert request(srv, "POST", "/v1/completions", {"prompt": PROMPT, "num_draft_tokens": 3})[0] == 400
        status, reply = request(
            srv,
            "POST",
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "xtc_probability": 0.5, "seed": 1},
        )
        assert status == 200 and reply["usage"]["completion_tokens"] == 8  # XTC runs without a drafter
    assert not srv.worker.alive


def test_stop_is_clean_even_with_a_request_in_flight(pair):
    _, (model, tokenizer, draft) = pair
    srv = make_server(model, tokenizer, draft, port=0).start()
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=60)
    # The tiny target ends this prompt's reply with EOS (token 0) after 230 tokens, which could finish
    # before stop() cancels it; with EOS barred the reply runs to the 4096-token context, seconds away.
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps(
            {"prompt": list(range(8, 40)), "max_tokens": 100000, "logit_bias": {"0": -100}, "stream": True}
        ),
    )
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    tic = time.perf_counter()
    srv.stop()
    assert time.perf_counter() - tic < 10
    rest = response.read().decode()  # the stream ends: an error event for the cancelled job, then [DONE]
    assert rest.rstrip().endswith("data: [DONE]") and "cancelled" in rest
    assert not srv.worker.alive
    with pytest.raises(OSError):
        socket.create_connection((host, port), timeout=2).close()
    srv.stop()  # a second stop does nothing


APP = """
import typer
from dflash_mlx.cli.serve_cmd import serve
app = typer.Typer()
app.command()(serve)
app()
"""


def test_serve_command_serves_and_stops_on_sigint(pair):
    (target_dir, draft_dir), _ = pair
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            APP,
            "--model",
            str(target_dir),
            "--draft",
            str(draft_dir),
            "--port",
            "0",
            "--chat-template-args",
            '{"enable_thinking": false}',
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        seen = []
        for line in proc.stderr:  # readiness: the "serving ... at URL" line (EOF if the process died)
            seen.append(line)
            if " at http://127.0.0.1:" in line:
                break
        assert seen and " at http://127.0.0.1:" in seen[-1], "".join(seen)
        port = int(seen[-1].split("http://127.0.0.1:")[1].split("/")[0])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 8}))
        reply = json.loads(conn.getresponse().read())
        conn.close()
        assert reply["usage"]["completion_tokens"] == 8 and reply["dflash"]["cycles"] > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stderr.close()


def test_a_plain_hugging_face_tokenizer_is_wrapped(pair, expected):
    _, (model, tokenizer, draft) = pair
    with make_server(model, tokenizer._tokenizer, draft, port=0).start() as srv:  # not mlx-lm's wrapper
        status, reply = request(srv, "POST", "/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 40})
        assert status == 200 and reply["choices"][0]["message"]["content"] == expected["chat0"][0]
    assert not srv.worker.alive
