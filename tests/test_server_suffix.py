"""The server's suffix indexes (`server.suffix_scope`): what it generated drafts what it generates again,
within each scope, in both worker modes; several API keys; the budget; the console script's flags.

Privacy is checked by counting suffix tokens: with scope ``key`` a key's reply drafts exactly as many
suffix tokens as on a server that never served the other key (fixed blocks: the drafting choices do not
follow timing), with scope ``server`` more; the text is the same everywhere (greedy).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from dflash_mlx.server import make_server
from helpers import prompt_ids, without_eos
from helpers.servers import ServeProcess

pytestmark = pytest.mark.slow  # servers

KEYS = ["alpha-key", "beta-key"]


def ask(server, key: str | None, prompt: list[int], **body) -> dict:
    """A greedy completion of `prompt` (token ids) with a fixed block (the drafting choices follow no timing)."""
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0.0, "num_draft_tokens": 3, **body}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.loads(reply.read())


def suffix_of(reply: dict) -> int:
    return reply["dflash"]["tokens_by_source"].get("suffix", 0)


def card(server, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(server.url + "/v1/models", headers=headers)) as reply:
        return json.loads(reply.read())["data"][0]["suffix_index"]


@pytest.fixture(scope="module")
def pair(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    with without_eos(tokenizer) as tok:
        yield model, tok, draft


def served(pair, concurrency: int, **kw):
    model, tokenizer, draft = pair
    return make_server(model, tokenizer, draft, port=0, decode_concurrency=concurrency, **kw).start()


@pytest.mark.parametrize("concurrency", [1, 4])
def test_scope_key_never_drafts_one_keys_replies_into_anothers(pair, concurrency):
    prompt = prompt_ids(20, seed=3)
    with served(pair, concurrency, api_key=KEYS) as fresh:
        alone = ask(fresh, KEYS[1], prompt)  # what beta drafts on a server that never served alpha
    with served(pair, concurrency, api_key=KEYS) as server:  # (scope "key": the default with keys)
        first, again = ask(server, KEYS[0], prompt), ask(server, KEYS[0], prompt)
        other = ask(server, KEYS[1], prompt)
        assert card(server, KEYS[0])["scope"] == "key" and card(server, KEYS[1])["tokens"] > 0
        with pytest.raises(urllib.error.HTTPError, match="401"):
            ask(server, "gamma-key", prompt)
    with served(pair, concurrency, api_key=KEYS, suffix_scope="server") as shared:
        ask(shared, KEYS[0], prompt)
        across = ask(shared, KEYS[1], prompt)
    texts = {r["choices"][0]["text"] for r in (alone, first, again, other, across)}
    assert len(texts) == 1  # greedy: the same text whoever drafted what
    assert suffix_of(again) > suffix_of(first) + 10  # alpha's second reply drafts its first
    assert suffix_of(other) == suffix_of(alone)  # beta's: not a token from alpha's
    assert suffix_of(across) > suffix_of(alone) + 10  # one index for the server: alpha's reply drafts beta's


@pytest.mark.parametrize("concurrency", [1, 4])
def test_scope_conversation_drafts_only_from_the_same_conversation(pair, concurrency):
    """A retried step (the same prompt again: the prompt cache copies its session) drafts its earlier reply;
    another conversation sharing the prompt's beginning (a copy of the same session too) or its end drafts
    what a fresh server drafts; the index is the conversation session's (no shared bytes)."""
    prompt = prompt_ids(40, seed=3)  # (at least the 32 tokens the prompt cache copies a session for)
    others = [prompt[:36] + prompt_ids(4, seed=8), prompt_ids(4, seed=8) + prompt[4:]]
    with served(pair, concurrency, suffix_scope="conversation") as fresh:  # (the others are not one conversation)
        alone = [ask(fresh, None, other) for other in others]
    with served(pair, concurrency, suffix_scope="conversation") as server:
        first, retried = ask(server, None, prompt), ask(server, None, prompt)
        elsewhere = [ask(server, None, other) for other in others]
        assert card(server) == {"scope": "conversation", "max_tokens": 100_000, "tokens": 0, "bytes": 0}
    assert suffix_of(retried) > suffix_of(first) + 10
    assert [suffix_of(r) for r in elsewhere] == [suffix_of(r) for r in alone]
    assert [r["choices"] for r in elsewhere] == [r["choices"] for r in alone]


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_seeded_request_drafts_only_from_its_own_conversation(pair, concurrency):
    prompt = prompt_ids(20, seed=3)
    sampled = dict(temperature=0.7, top_k=3, seed=5)
    with served(pair, concurrency) as fresh:
        alone = ask(fresh, None, prompt, **sampled)
    with served(pair, concurrency) as server:
        ask(server, None, prompt)
        held = card(server)["tokens"]
        seeded = ask(server, None, prompt, **sampled)
        assert card(server)["tokens"] > held  # recorded, all the same
    assert seeded["choices"] == alone["choices"] and suffix_of(seeded) == suffix_of(alone)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_the_index_stays_within_its_budget_under_distinct_requests(pair, concurrency):
    with served(pair, concurrency, suffix_cache_tokens=150) as server:
        for seed in range(10):
            ask(server, None, prompt_ids(30, seed=100 + seed), max_tokens=40)
            state = card(server)
            assert 0 < state["tokens"] <= 150 and state["bytes"] > 0
        assert server.worker.suffix_bytes == state["bytes"]  # (what the batch's memory budget counts)
    with served(pair, concurrency, suffix_cache_tokens=0) as off:
        assert card(off) is None and suffix_of(ask(off, None, prompt_ids(20, seed=3))) == 0


def test_bad_scopes_and_keys_are_refused(pair, tmp_path):
    """By `make_server` with the reason, and by `dflash-mlx serve` naming the flag before loading a model."""
    from typer.testing import CliRunner

    from dflash_mlx.cli.commands import app

    empty = tmp_path / "empty.txt"
    empty.write_text("# no key yet\n")
    for args, message in (
        (["--suffix-scope", "key"], "--suffix-scope key: the server has no API key"),
        (["--api-keys-file", str(empty)], "holds no key"),
        (["--suffix-cache-tokens", "-3"], "--suffix-cache-tokens"),
    ):
        run = CliRunner().invoke(app, ["serve", *args])
        assert run.exit_code == 2 and message in " ".join(run.output.split()), run.output
    model, tokenizer, draft = pair
    for kw, message in (
        (dict(suffix_scope="key"), "--suffix-scope key: the server has no API key"),
        (dict(suffix_scope="everyone"), "--suffix-scope: expected one of server, key, conversation"),
        (dict(suffix_cache_tokens=-1), "--suffix-cache-tokens: expected an integer >= 1"),
        (dict(api_key=["a", "a"]), "an API key is given twice"),
        (dict(api_key=[" a"]), "without surrounding whitespace"),
    ):
        with pytest.raises(ValueError, match=message):
            make_server(model, tokenizer, draft, port=0, **kw)


def test_the_console_script_takes_several_keys_and_the_suffix_flags(tmp_path):
    """`dflash-mlx serve` on the bundled default: a repeated --api-key and a keys file, --suffix-cache-tokens;
    the official client with either key; a bad scope refused naming the flag."""
    import openai

    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's key\nteam-key\n\n")
    flags = ["--api-key", "one-key", "--api-key", "two-key", "--api-keys-file", str(keys)]
    server = ServeProcess(*flags, "--suffix-cache-tokens", "5000")
    try:
        for key in ("one-key", "two-key", "team-key"):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            reply = client.completions.create(model="demo", prompt="Tom has 3 apples.", max_tokens=8)
            assert reply.usage.completion_tokens == 8
            info = client.models.list().data[0].model_extra["suffix_index"]
            assert info["scope"] == "key" and info["max_tokens"] == 5000 and info["tokens"] > 0
            client.close()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nobody", max_retries=0).models.list()
    finally:
        assert server.stop() == 0
