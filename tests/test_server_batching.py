"""Batched serving (`--decode-concurrency`, `server.batching`) as clients see it.

The console script on the bundled pair, driven by the official `openai`
client from several threads at once: chat and text completions, whole and
streamed, a stop sequence, logprobs and a request fixing its block all get
the replies a one-at-a-time server (``--decode-concurrency 1``) gives, and
they were decoded together (``dflash.batch_rows``). A streamed client that
goes away mid-reply leaves the batch; the others finish unchanged. In
process, on Gated DeltaNet and sliding-window targets: a prompt longer than
a prefill chunk joins a running request (prefilled a chunk per step) and
both replies equal mlx-lm's greedy ones; with a batch memory bound too small
for two rows, the second request waits for the first and is served alone.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from mlx_lm.generate import generate as mlx_lm_generate

from dflash_mlx import make_session
from dflash_mlx.server import make_server
from dflash_mlx.server.limits import Footprint, weight_bytes
from helpers import prompt_ids, without_eos
from helpers.servers import ServeProcess

pytestmark = pytest.mark.slow  # servers

openai = pytest.importorskip("openai")

MAX_TOKENS = 24
CHATS = [
    "Tom has 3 boxes with 12 apples each. How many apples?",
    "Sara reads 5 pages a day. How many pages does she read in a week?",
    "A train goes 60 km per hour for 2 hours. How far does it go?",
]
TEXT = "Question: Ben has 7 pens and buys 5 more. How many pens does he have?\nAnswer:"


def _requests() -> list[tuple[str, dict]]:
    """(kind, arguments) of the concurrent mix."""
    chat = [{"role": "user", "content": c} for c in CHATS]
    return [
        ("chat", {"messages": [chat[0]]}),
        ("chat_stream", {"messages": [chat[1]]}),
        ("chat", {"messages": [chat[2]], "logprobs": True, "top_logprobs": 2}),
        ("text", {"prompt": TEXT, "stop": ["."]}),
        ("text", {"prompt": TEXT, "extra_body": {"num_draft_tokens": 2}}),
        ("chat", {"messages": [chat[1]], "temperature": 0.8, "seed": 7}),  # its draws keyed by position
    ]


def _ask(client, kind: str, args: dict) -> dict:
    args = {"model": "demo", "max_tokens": MAX_TOKENS, "temperature": 0.0, **args}
    if kind == "chat_stream":
        text, finish, dflash = "", None, {}
        for chunk in client.chat.completions.create(**args, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            dflash = (chunk.model_extra or {}).get("dflash", dflash)
        return {"text": text, "finish": finish, "dflash": dflash}
    if kind == "chat":
        reply = client.chat.completions.create(**args)
        choice = reply.choices[0]
        out = {"text": choice.message.content, "finish": choice.finish_reason}
        if choice.logprobs is not None:
            out["logprobs"] = [(t.token, round(t.logprob, 3)) for t in choice.logprobs.content]
    else:
        reply = client.completions.create(**args)
        out = {"text": reply.choices[0].text, "finish": reply.choices[0].finish_reason}
    out["dflash"] = (reply.model_extra or {}).get("dflash", {})
    return out


def _all_at_once(url: str) -> list[dict]:
    requests = _requests()
    results: list = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def one(i):
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            start.wait()
            try:
                results[i] = _ask(client, *requests[i])
            except Exception as e:  # (reported by the assertion below)
                results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [r for r in results if isinstance(r, Exception)], results
    return results


@pytest.fixture(scope="module")
def batched():
    server = ServeProcess("--decode-concurrency", "4")
    yield server
    assert server.stop() == 0, server.stderr


def test_concurrent_requests_get_the_replies_served_one_at_a_time(batched):
    serial = ServeProcess("--decode-concurrency", "1")
    try:
        want = _all_at_once(serial.url)
    finally:
        assert serial.stop() == 0, serial.stderr
    got = _all_at_once(batched.url)
    for g, w in zip(got, want):
        assert (g["text"], g["finish"], g.get("logprobs")) == (w["text"], w["finish"], w.get("logprobs"))
        assert "batch_rows" not in w["dflash"]
    assert max(g["dflash"].get("batch_rows", 0) for g in got if g["dflash"]) >= 2  # they shared steps
    assert got[3]["finish"] == "stop" and "." not in got[3]["text"]
    assert got[4]["dflash"]["block_size"] == 3  # the request's own block


def test_a_client_going_away_leaves_the_batch(batched):
    client = openai.OpenAI(base_url=batched.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    alone = _ask(client, "chat", {"messages": [{"role": "user", "content": CHATS[0]}]})
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": CHATS[1]}], max_tokens=2000, temperature=0.0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    other: list = []
    worker = threading.Thread(
        target=lambda: other.append(_ask(client, "chat", {"messages": [{"role": "user", "content": CHATS[0]}]}))
    )
    worker.start()
    next(chunks)
    stream.close()  # the client goes away mid-reply
    worker.join(300)
    assert other and other[0]["text"] == alone["text"]
    again = _ask(client, "chat", {"messages": [{"role": "user", "content": CHATS[0]}]})
    assert again["text"] == alone["text"] and again["dflash"]["batch_rows"] == 1  # the stream has left
    client.close()


def _completion(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def _post(url: str, body: dict) -> dict:
    with urllib.request.urlopen(_completion(url, body), timeout=300) as reply:
        return json.loads(reply.read())


def _first_token_then(url: str, first: dict, then: dict) -> tuple[dict, dict]:
    """`first` streamed; `then` sent once its first token arrived; both replies."""
    out = {}

    def streamed():
        text, last = "", None
        with urllib.request.urlopen(_completion(url, {**first, "stream": True}), timeout=300) as reply:
            for line in reply:
                line = line.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("choices"):
                    text += event["choices"][0]["text"]
                last = event
                if not started.is_set():
                    started.set()
        out["first"] = {"choices": [{"text": text}], "dflash": last.get("dflash", {})}

    started = threading.Event()
    thread = threading.Thread(target=streamed)
    thread.start()
    assert started.wait(300)
    out["then"] = _post(url, then)
    thread.join(300)
    return out["first"], out["then"]


def _served(model, tokenizer, draft, first: dict, then: dict, **server) -> tuple[dict, dict]:
    """`_first_token_then` against an in-process server made with `server` arguments."""
    app = make_server(model, tokenizer, draft, port=0, decode_concurrency=4, **server).start()
    try:
        return _first_token_then(app.url, first, then)
    finally:
        app.stop()


def _greedy(model, tokenizer, prompt: list[int], n: int) -> str:
    return mlx_lm_generate(model, tokenizer, prompt, max_tokens=n, verbose=False)


@pytest.mark.parametrize("family", ["qwen3_5", "llama_sliding"])
def test_a_long_prompt_joins_a_running_request_chunk_by_chunk(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    short, long = prompt_ids(6, seed=1), prompt_ids(40, seed=2)
    with without_eos(tokenizer) as tok:  # (the first reply outlasts the second's prefill)
        first, then = _served(
            model,
            tok,
            draft,
            {"prompt": short, "max_tokens": 200},
            {"prompt": long, "max_tokens": 12},
            prefill_step_size=8,
        )
        assert first["choices"][0]["text"] == _greedy(model, tok, short, 200)
        assert then["choices"][0]["text"] == _greedy(model, tok, long, 12)
    assert then["dflash"]["batch_rows"] == 2


def test_a_request_that_does_not_fit_waits(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    a, b = prompt_ids(6, seed=3), prompt_ids(9, seed=4)
    footprint = Footprint.measure(lambda: make_session(model, draft), lookup=True)  # (as the server measures it)
    one_row = weight_bytes(model, draft) + max(footprint.bytes(len(a) + 100), footprint.bytes(len(b) + 10))
    with without_eos(tokenizer) as tok:
        first, then = _served(
            model,
            tok,
            draft,
            {"prompt": a, "max_tokens": 100},
            {"prompt": b, "max_tokens": 10},
            max_batch_bytes=one_row,
        )
        assert first["choices"][0]["text"] == _greedy(model, tok, a, 100)
        assert then["choices"][0]["text"] == _greedy(model, tok, b, 10)
    assert first["dflash"]["batch_rows"] == then["dflash"]["batch_rows"] == 1
