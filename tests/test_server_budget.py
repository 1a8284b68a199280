"""One byte budget for everything the server keeps (issue 58).

- `MemoryBudget` evicts the least recently used entry of all its parts until what is asked fits, and
  says when nothing more can go (no server).
- In process, one request at a time: ``/health`` shows each part (weights, active requests, the prompt
  cache, stored responses, compiled grammars) against the budget, and a budget that holds three
  conversations keeps the most recent (an older one's next turn prefills its whole prompt again).
- The real ``dflash-mlx serve --decode-concurrency 1`` under a budget that holds about ten 1,500-token
  conversations: twenty of them keep its resident memory under the budget + the process as it was with
  its model loaded and serving + 300 MB, flat once the budget is full (the last eight add less than one
  conversation's bytes; without the budget each adds its own), and the oldest are the ones evicted.
"""

from __future__ import annotations

import http.client
import json
import random

import pytest

from dflash_mlx import load, make_session
from dflash_mlx.server import make_server
from dflash_mlx.server.budget import MemoryBudget
from dflash_mlx.server.limits import Footprint, weight_bytes
from dflash_mlx.structured import Grammar
from helpers.formats import Answer, schema_format
from helpers.servers import ServeProcess


class Entries:
    """A part of LRU entries (name -> bytes), its clock the order they were used in."""

    def __init__(self, clock: list, **sizes):
        self.clock, self.kept = clock, {}
        for name, size in sizes.items():
            self.use(name, size)

    def use(self, name, size):
        self.clock[0] += 1
        self.kept.pop(name, None)
        self.kept[name] = (size, self.clock[0])

    @property
    def nbytes(self):
        return sum(size for size, _ in self.kept.values())

    def oldest(self):
        return next(iter(self.kept.values()))[1] if self.kept else None

    def evict_oldest(self):
        self.kept.pop(next(iter(self.kept)))


class Fixed:
    nbytes = 50  # counted, never evicted


def test_the_budget_evicts_the_least_recently_used_across_its_parts():
    clock = [0]
    cache = Entries(clock, a=10, b=10)
    store = Entries(clock, x=5)
    cache.use("c", 10)
    budget = MemoryBudget(100)
    for name, part in [("fixed", Fixed()), ("cache", cache), ("store", store)]:
        budget.register(name, part)
    assert budget.used == 85 and budget.make_room(15) and budget.used == 85  # fits: nothing goes
    assert budget.make_room(30) and list(cache.kept) == ["c"] and list(store.kept) == ["x"]  # a, b: the oldest
    assert budget.make_room(40) and list(cache.kept) == ["c"] and not store.kept  # then x, used before c
    assert not budget.make_room(51) and not cache.kept  # the fixed part cannot give room: all went, in vain
    assert budget.usage() == {"budget_bytes": 100, "used_bytes": 50, "parts": {"fixed": 50, "cache": 0, "store": 0}}
    with pytest.raises(ValueError, match="cache"):
        budget.register("cache", Entries(clock))


# -- a server's budget ------------------------------------------------------------------------------


def _post(url: str, path: str, body: dict | None, method: str = "POST") -> tuple[int, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def _conversation(i: int, length: int) -> list[int]:
    return [random.Random(i).randrange(5, 4000) for _ in range(length)]


def _cached(url: str, prompt: list[int]) -> int:
    """The prompt tokens the prompt cache held for `prompt` (served, 8 tokens)."""
    status, body = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 8})
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def demo():
    return load("demo")


@pytest.mark.slow
def test_health_shows_every_part_against_the_budget(demo):
    model, tokenizer, draft = demo
    footprint = Footprint.measure(lambda: make_session(model, draft), lookup=True)
    grammar = Grammar(tokenizer, schema_format(Answer)).nbytes  # (counted at what it may grow to)
    budget = weight_bytes(model, draft) + grammar + 3 * footprint.bytes(300 + 8)  # and three conversations
    app = make_server(
        model, tokenizer, draft, port=0, model_id="demo", decode_concurrency=1, max_batch_bytes=budget
    ).start()
    try:
        for i in range(5):
            _cached(app.url, _conversation(i, 300))
        assert _post(app.url, "/v1/responses", {"model": "demo", "input": "Hello", "max_output_tokens": 8})[0] == 200
        ask = {
            "messages": [{"role": "user", "content": "Hi " * 60}],
            "max_tokens": 8,
            "response_format": schema_format(Answer),
        }
        assert _post(app.url, "/v1/chat/completions", ask)[0] == 200
        status, health = _post(app.url, "/health", None, "GET")
        memory, parts = health["memory"], health["memory"]["parts"]
        assert status == 200 and memory["budget_bytes"] == budget
        assert set(parts) == {"weights", "active", "prompt_cache", "grammars", "responses"}, parts
        assert parts["weights"] == weight_bytes(model, draft) and parts["active"] == 0
        assert parts["prompt_cache"] > 0 and parts["responses"] > 0 and parts["grammars"] > 0, parts
        assert memory["used_bytes"] == sum(parts.values()) <= budget
        assert health["requests"] == {"running": 0, "queued": 0, "cancelled": 0}
        assert _post(app.url, "/v1/chat/completions", ask)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _cached(app.url, _conversation(0, 300) + [7]) == 0  # the oldest went for the budget
    finally:
        app.stop()


def _rss_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith(field + ":")).split()[1]) / 1e3


@pytest.mark.slow
def test_twenty_conversations_stay_within_a_budget_for_ten(demo):
    model, _, draft = demo
    weights = weight_bytes(model, draft)
    footprint = Footprint.measure(lambda: make_session(model, draft), lookup=True)
    budget = weights + 10 * footprint.bytes(1500 + 8)
    server = ServeProcess("--decode-concurrency", "1", "--max-batch-bytes", str(budget), "--prompt-cache-size", "40")
    try:
        _cached(server.url, _conversation(100, 200))  # (serving once: the process with its model, warmed)
        loaded = _rss_mb(server.proc.pid, "VmRSS")
        resident = []
        for i in range(20):
            assert _cached(server.url, _conversation(i, 1500)) == 0
            resident.append(_rss_mb(server.proc.pid, "VmRSS"))
        peak = _rss_mb(server.proc.pid, "VmHWM")
        assert peak < loaded + (budget - weights) / 1e6 + 300, (peak, loaded, budget)
        # once the budget is full, memory stays flat: the last eight add less than one conversation's bytes
        assert resident[-1] - resident[-9] < footprint.bytes(1500 + 8) / 1e6, resident
        status, health = _post(server.url, "/health", None, "GET")
        assert health["memory"]["used_bytes"] <= budget, health
        assert _cached(server.url, _conversation(19, 1500) + [7]) >= 1499  # the newest are kept
        assert _cached(server.url, _conversation(0, 1500) + [7]) == 0  # the oldest were evicted
    finally:
        assert server.stop() == 0, server.stderr
