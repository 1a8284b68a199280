"""The server's suffix indexes (`server.suffix_scope`): what it generated drafts what it generates again,
within each scope, in both worker modes; several API keys; the index's token budget and its place in the
server's one byte budget; the console script's flags; the Responses API's store scoped per key.

Privacy is checked by counting suffix tokens: with scope ``key`` a key's reply drafts exactly as many
suffix tokens as on a server that never served the other key (fixed blocks: the drafting choices do not
follow timing), with scope ``server`` more; the text is the same everywhere (greedy). With several keys
a key cannot continue another key's stored response: the official client gets the 400 of an unknown id.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from dflash_mlx import make_session
from dflash_mlx.server import make_server
from dflash_mlx.server.limits import Footprint, weight_bytes
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
def test_a_seeded_request_drafts_from_the_index_and_keeps_the_text_of_its_seed(pair, concurrency):
    prompt = prompt_ids(20, seed=3)
    sampled = dict(temperature=0.7, top_k=3, seed=5)
    with served(pair, concurrency) as fresh:
        alone = ask(fresh, None, prompt, **sampled)
    with served(pair, concurrency) as server:
        ask(server, None, prompt)
        held = card(server)["tokens"]
        seeded = [ask(server, None, prompt, **sampled) for _ in range(2)]
        assert card(server)["tokens"] > held  # recorded
    assert [s["choices"] for s in seeded] == [alone["choices"]] * 2
    assert suffix_of(seeded[1]) > suffix_of(alone)  # the second drafted the first's reply


@pytest.mark.parametrize("concurrency", [1, 4])
def test_the_index_stays_within_its_budget_under_distinct_requests(pair, concurrency):
    with served(pair, concurrency, suffix_cache_tokens=150) as server:
        for seed in range(10):
            ask(server, None, prompt_ids(30, seed=100 + seed), max_tokens=40)
            state = card(server)
            assert 0 < state["tokens"] <= 150 and state["bytes"] > 0
        assert server.health()[1]["memory"]["parts"]["suffix_index"] == state["bytes"]  # (the byte budget's part)
    with served(pair, concurrency, suffix_cache_tokens=0) as off:
        assert card(off) is None and suffix_of(ask(off, None, prompt_ids(20, seed=3))) == 0


def used(server) -> dict:
    """The byte budget's use (`/health`'s ``memory``)."""
    return server.health()[1]["memory"]


@pytest.mark.parametrize("concurrency", [1, 4])
def test_the_index_gives_memory_back_within_the_servers_byte_budget(pair, concurrency):
    """Under a byte budget with room for the weights and three requests' caches (not the index's 100,000
    tokens), distinct requests keep the server within it after each: the least recently used sequences of
    the index go with the oldest conversations (it holds fewer tokens than on a roomy server, where it holds
    them all), and the newest stays: its request again drafts its reply."""
    model, _, draft = pair
    footprint = Footprint.measure(lambda: make_session(model, draft), lookup=True)
    budget = weight_bytes(model, draft) + 3 * footprint.bytes(40 + 48)
    prompts = [prompt_ids(40, seed=200 + i) for i in range(10)]
    with served(pair, concurrency) as roomy:
        for prompt in prompts:
            ask(roomy, None, prompt)
        unbounded = card(roomy)["tokens"]
    with served(pair, concurrency, max_batch_bytes=budget) as server:
        for prompt in prompts:
            first = ask(server, None, prompt)
            memory = used(server)
            assert memory["budget_bytes"] == budget and memory["used_bytes"] <= budget, memory
        assert 0 < card(server)["tokens"] < unbounded, (card(server), unbounded)  # (it gave some back)
        assert 0 < memory["parts"]["suffix_index"] == card(server)["bytes"]
        assert suffix_of(ask(server, None, prompts[-1])) > suffix_of(first) + 10
        assert used(server)["used_bytes"] <= budget


@pytest.mark.parametrize("concurrency", [1, 4])
def test_scope_conversation_the_oldest_conversations_give_memory_back(pair, concurrency):
    """Scope conversation: each conversation's index is its session's, so under the same budget the oldest
    conversations go whole (their next turn is prefilled again and drafts nothing from before), the newest
    stay (a retried step drafts its reply), and the shared part holds nothing."""
    model, _, draft = pair
    footprint = Footprint.measure(lambda: make_session(model, draft), lookup=True)
    budget = weight_bytes(model, draft) + 3 * footprint.bytes(40 + 48)
    prompts = [prompt_ids(40, seed=300 + i) for i in range(8)]
    with served(pair, concurrency, suffix_scope="conversation", max_batch_bytes=budget) as server:
        for prompt in prompts:
            first = ask(server, None, prompt)
            assert used(server)["used_bytes"] <= budget
        retried = ask(server, None, prompts[-1])
        assert retried["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert suffix_of(retried) > suffix_of(first) + 10
        oldest = ask(server, None, prompts[0])
        assert oldest["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert used(server)["used_bytes"] <= budget and used(server)["parts"]["suffix_index"] == 0


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
        words = " ".join(run.output.replace("│", " ").split())  # (rich's error panel wraps at the terminal's width)
        assert run.exit_code == 2 and message in words, run.output
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


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """`dflash-mlx serve` on the bundled default with a repeated --api-key, a keys file and
    --suffix-cache-tokens."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# the team's key\nteam-key\n\n")
    flags = ["--api-key", "one-key", "--api-key", "two-key", "--api-keys-file", str(keys)]
    server = ServeProcess(*flags, "--suffix-cache-tokens", "5000")
    yield server
    assert server.stop() == 0, server.stderr


def client(server, key: str):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_the_console_script_takes_several_keys_and_the_suffix_flags(keyed):
    """The official client with either key; a key the server does not know is a 401."""
    import openai

    for key in ("one-key", "two-key", "team-key"):
        with client(keyed, key) as oai:
            reply = oai.completions.create(model="demo", prompt="Tom has 3 apples.", max_tokens=8)
            assert reply.usage.completion_tokens == 8
            info = oai.models.list().data[0].model_extra["suffix_index"]
            assert info["scope"] == "key" and info["max_tokens"] == 5000 and info["tokens"] > 0
    with pytest.raises(openai.AuthenticationError), client(keyed, "nobody") as oai:
        oai.models.list()


def test_one_keys_stored_responses_are_not_anothers(keyed):
    """Through the official client: a key continues its own stored response; another key naming it gets the
    400 an id never made gets (the same message but for the id: nothing says it exists), and the first key
    can still continue it."""
    import openai

    with client(keyed, "one-key") as one, client(keyed, "two-key") as two:
        first = one.responses.create(model="demo", input="Tom has 3 apples.", max_output_tokens=8)
        refusals = []
        for previous in (first.id, "resp_" + "0" * 32):
            with pytest.raises(openai.BadRequestError) as caught:
                two.responses.create(model="demo", previous_response_id=previous, input="And then?")
            assert caught.value.body["param"] == "previous_response_id"
            refusals.append(caught.value.body["message"].replace(previous, "<id>"))
        assert refusals[0] == refusals[1]
        again = one.responses.create(
            model="demo", previous_response_id=first.id, input="And then?", max_output_tokens=8
        )
        assert again.status in ("completed", "incomplete") and again.usage.input_tokens > first.usage.input_tokens
