"""A client that leaves stops its request, and a huge body never slows the others (issue 58).

The real ``dflash-mlx serve`` on the bundled pair, batched (the default) and ``--decode-concurrency 1``:

- a non-streamed request for 4,000 tokens at temperature 2 on each generating route (its text's end
  ruled out, so that it cannot finish on its own first), abandoned after 1 s (its client closes the
  connection, as a client's timeout does): from 2 s after that the server process uses under 0.5
  CPU-seconds over the next 3 s (its own CPU time from /proc, which a loaded machine does not inflate),
  and ``/health`` counts the request cancelled (it did not just finish); a streamed one, abandoned
  after its first event, too;
- a 20 MB body (one long message) sent while a 600-token stream runs: refused (413) before the body is
  read (the 413 arrives before a byte of it is sent), and the server's CPU time over the stream with it
  stays under 1.25x that over the stream alone, both measured in this test, interleaved (alone, with,
  with, alone, six of each), medians compared. CPU time, not wall time: with two CPU-bound processes
  beside it, a 200-token stream's wall time scattered by half between runs (0.17-0.35 s), which six of
  each cannot tell apart from a slowdown, while the server's own work does not scatter so (600 tokens:
  its CPU time, counted in 10 ms ticks, is then about half a second).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import threading
import time
from pathlib import Path

import dflash_mlx
import pytest
from mlx_lm.utils import load_tokenizer

from helpers.servers import ServeProcess

pytestmark = pytest.mark.slow  # servers

DEMO = Path(dflash_mlx.__file__).parent / "demo"
QUESTION = "Tom has 3 boxes with 12 apples each. How many apples?"
MESSAGES = [{"role": "user", "content": QUESTION}]
# Seconds of decoding that cannot end early: 4,000 tokens at temperature 2 (the 2048-token context cuts it), where
# the end of the text is ruled out (an EOS sampled at temperature 2 may end a free reply after a few dozen
# tokens): by a logit bias where the dialect has one, and by a JSON array of at least 1,500 numbers where not
LONG = {"max_tokens": 4000, "temperature": 2}
NO_EOS = {"logit_bias": {str(t): -100 for t in load_tokenizer(DEMO / "target").eos_token_ids}}
NUMBERS = {"type": "json_schema", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 1500}}
ROUTES = {
    "/v1/chat/completions": {"model": "demo", "messages": MESSAGES, **LONG, **NO_EOS},
    "/v1/completions": {"model": "demo", "prompt": QUESTION, **LONG, **NO_EOS},
    "/v1/messages": {"model": "demo", "messages": MESSAGES, **LONG, "output_config": {"format": NUMBERS}},
    "/v1/responses": {
        "model": "demo",
        "input": QUESTION,
        "max_output_tokens": 4000,
        "temperature": 2,
        "text": {"format": {**NUMBERS, "name": "numbers"}},
    },
}
ABANDONED_AFTER, GRACE, WINDOW, MAX_CPU = 1.0, 2.0, 3.0, 0.5  # seconds (the issue's)


@pytest.fixture(scope="module", params=["batched", "one at a time"])
def served(request):
    server = ServeProcess(*(["--decode-concurrency", "1"] if request.param == "one at a time" else []))
    for temperature in (0, 2):  # (a first request calibrates the block policy for its kind: not cancellable)
        conn = http.client.HTTPConnection(*_address(server.url), timeout=600)
        conn.request(
            "POST", "/v1/completions", json.dumps({"prompt": QUESTION, "max_tokens": 16, "temperature": temperature})
        )
        assert conn.getresponse().status == 200
        conn.close()
    yield server
    assert server.stop() == 0, server.stderr


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _health(url: str) -> dict:
    conn = http.client.HTTPConnection(*_address(url), timeout=60)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def _cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # (after the command's name: field 3 on)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _send(url: str, path: str, body: dict) -> socket.socket:
    sock = socket.create_connection(_address(url), timeout=120)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def _cpu_after_leaving(served, sock: socket.socket) -> float:
    """Close the client's connection; the server's CPU-seconds over WINDOW, from GRACE after it."""
    sock.close()
    time.sleep(GRACE)
    before = _cpu_seconds(served.proc.pid)
    time.sleep(WINDOW)
    return _cpu_seconds(served.proc.pid) - before


@pytest.mark.parametrize("path", list(ROUTES))
def test_an_abandoned_request_stops_decoding(served, path):
    cancelled = _health(served.url)["requests"]["cancelled"]
    sock = _send(served.url, path, ROUTES[path])
    time.sleep(ABANDONED_AFTER / 2)
    assert _health(served.url)["requests"]["running"] == 1  # it is being decoded
    time.sleep(ABANDONED_AFTER / 2)
    used = _cpu_after_leaving(served, sock)
    health = _health(served.url)
    assert used < MAX_CPU, (path, used)
    assert health["requests"]["running"] == 0 and health["requests"]["cancelled"] == cancelled + 1, health
    assert served.proc.poll() is None and "Traceback" not in served.stderr, served.stderr


def test_an_abandoned_stream_stops_decoding(served):
    cancelled = _health(served.url)["requests"]["cancelled"]
    sock = _send(served.url, "/v1/chat/completions", {**ROUTES["/v1/chat/completions"], "stream": True})
    received = b""
    while b"data:" not in received:  # the headers, then the first event
        chunk = sock.recv(4096)
        assert chunk, received
        received += chunk
    used = _cpu_after_leaving(served, sock)
    health = _health(served.url)
    assert used < MAX_CPU, used
    assert health["requests"]["running"] == 0 and health["requests"]["cancelled"] == cancelled + 1, health


# -- a 20 MB body beside a running stream -----------------------------------------------------------

STREAM = {"model": "demo", "prompt": QUESTION, "max_tokens": 600, **NO_EOS, "stream": True}
BIG = json.dumps({"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "apples " * 3_000_000}]})


def _refusal_before_the_body(url: str, size: int) -> bytes:
    """Send only the headers of a `size`-byte body: the server's answer, read before any of the body goes."""
    with socket.create_connection(_address(url), timeout=60) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n".encode()
        )
        return sock.recv(65536)


def _post_big(url: str, out: list) -> None:
    """The whole body through an ordinary client (it sends everything, then reads the answer)."""
    conn = http.client.HTTPConnection(*_address(url), timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", body=BIG.encode(), headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        out.append((reply.status, json.loads(reply.read())))
    finally:
        conn.close()


def _stream_seconds(served, with_body: bool) -> float:
    """The server's CPU-seconds over a 600-token stream; with the 20 MB body sent once its first event
    arrived."""
    url, before = served.url, _cpu_seconds(served.proc.pid)
    sock = _send(url, "/v1/completions", STREAM)
    received, sender, answers = b"", None, []
    with sock:
        while not received.rstrip().endswith(b"data: [DONE]"):
            chunk = sock.recv(65536)
            assert chunk, received[-500:]
            received += chunk
            if with_body and sender is None and b"data:" in received:
                sender = threading.Thread(target=_post_big, args=(url, answers))
                sender.start()
    if sender is not None:
        sender.join(120)
        assert answers and answers[0][0] == 413, answers
    seconds = _cpu_seconds(served.proc.pid) - before  # (the 413 included)
    assert b'"finish_reason": "length"' in received, received[-500:]  # (all 600 tokens: EOS barred)
    return seconds


def test_a_20_mb_body_does_not_slow_a_running_stream(served):
    limit = _health(served.url)["max_body_bytes"]
    assert len(BIG) > 20 * 10**6 > limit
    assert _refusal_before_the_body(served.url, len(BIG)).startswith(b"HTTP/1.0 413")
    _stream_seconds(served, False)  # (a first stream warms what it alone would: not counted)
    times: dict[bool, list[float]] = {False: [], True: []}
    for with_body in (False, True, True, False) * 3:
        times[with_body].append(_stream_seconds(served, with_body))
    alone, beside = statistics.median(times[False]), statistics.median(times[True])
    assert beside < 1.25 * alone, times
    assert served.proc.poll() is None and "Traceback" not in served.stderr, served.stderr
