"""The server's prompt cache (an LRU of sessions) and its files on disk, on every cache type.

Conversations are interleaved through one `PromptCache` the way the server's
worker uses it (`take` a session, generate, `put` it back), and every reply
is compared with mlx-lm's greedy decoding of the same prompt from scratch.
Saved sessions (`SessionStore`) are loaded in a new cache and continue their
conversation losslessly, ring and Gated DeltaNet state included.
"""

from __future__ import annotations

import logging

import pytest

from dflash_mlx import make_session, stream_generate
from dflash_mlx.server.prompt_cache import MIN_SHARED, PromptCache
from dflash_mlx.server.session_store import SessionStore, identity
from helpers import prompt_ids, reference, without_eos

FAMILIES = ["qwen3", "llama_sliding", "qwen3_next"]


def tokens(responses):
    return [r.token for r in responses]


def turn(cache, model, draft, tok, prompt, max_tokens=12):
    """One request as the worker serves it; returns (reply tokens, tokens reused from the cache)."""
    session = cache.take(prompt)
    reply = tokens(stream_generate(model, draft, tok, prompt, max_tokens=max_tokens, block_size=4, session=session))
    cache.put(session)
    assert reply == tokens(reference(model, tok, prompt, max_tokens))
    return reply, session.reused


@pytest.mark.parametrize("family", FAMILIES)
def test_interleaved_conversations_each_keep_their_cache(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    cache = PromptCache(lambda: make_session(model, draft), max_sessions=4)
    with without_eos(tokenizer) as tok:
        a1, b1 = prompt_ids(20, seed=1), prompt_ids(22, seed=2)
        ra, _ = turn(cache, model, draft, tok, a1)
        rb, _ = turn(cache, model, draft, tok, b1)
        a2, b2 = a1 + ra + prompt_ids(5, seed=3), b1 + rb + prompt_ids(6, seed=4)
        assert turn(cache, model, draft, tok, a2)[1] == len(a1) + len(ra) - 1
        assert turn(cache, model, draft, tok, b2)[1] == len(b1) + len(rb) - 1
        assert len(cache) == 2

        small = PromptCache(lambda: make_session(model, draft), max_sessions=1)
        ra, _ = turn(small, model, draft, tok, a1)
        turn(small, model, draft, tok, b1)
        assert turn(small, model, draft, tok, a1 + ra + prompt_ids(5, seed=3))[1] == 0  # A's session was evicted


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shared_prefix_is_copied_and_the_original_kept(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    cache = PromptCache(lambda: make_session(model, draft))
    system = prompt_ids(MIN_SHARED + 8, seed=5)  # a long shared system prompt
    with without_eos(tokenizer) as tok:
        a = system + prompt_ids(6, seed=6)
        ra, _ = turn(cache, model, draft, tok, a)
        _, reused = turn(cache, model, draft, tok, system + prompt_ids(7, seed=7))
        if family == "qwen3":
            assert reused == len(system)  # trimmed to the common prefix
        else:  # rings and Gated DeltaNet go back to their checkpoint: the end of A's prompt, not shared
            assert reused == 0
        assert len(cache) == 2
        assert turn(cache, model, draft, tok, a + ra + prompt_ids(4, seed=8))[1] == len(a) + len(ra) - 1


def test_the_byte_bound_evicts_the_least_recently_used(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    with without_eos(tokenizer) as tok:
        probe = PromptCache(lambda: make_session(model, draft))
        turn(probe, model, draft, tok, prompt_ids(20, seed=1))
        one = probe.nbytes
        assert one > 0
        cache = PromptCache(lambda: make_session(model, draft), max_bytes=int(one * 1.5))
        first = prompt_ids(20, seed=1)
        reply, _ = turn(cache, model, draft, tok, first)
        turn(cache, model, draft, tok, prompt_ids(20, seed=2))
        assert len(cache) == 1 and cache.nbytes <= one * 1.5
        assert turn(cache, model, draft, tok, first + reply + [3])[1] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_sessions_continue_after_a_restart(tiny_pair, tmp_path, family):
    model, tokenizer, draft = tiny_pair(family)
    key = identity(model, draft)
    cache = PromptCache(lambda: make_session(model, draft), store=SessionStore(tmp_path, key))
    with without_eos(tokenizer) as tok:
        a1, b1 = prompt_ids(20, seed=1), prompt_ids(21, seed=2)
        ra, _ = turn(cache, model, draft, tok, a1)
        rb, _ = turn(cache, model, draft, tok, b1)
        assert len(list(tmp_path.glob("*.safetensors"))) == 2

        restarted = PromptCache(lambda: make_session(model, draft), store=SessionStore(tmp_path, key))
        assert len(restarted) == 2
        assert turn(restarted, model, draft, tok, b1 + rb + prompt_ids(3, seed=9))[1] == len(b1) + len(rb) - 1
        assert turn(restarted, model, draft, tok, a1 + ra + prompt_ids(3, seed=8))[1] == len(a1) + len(ra) - 1


def test_corrupt_and_foreign_files_are_ignored_with_a_warning(tiny_pair, tmp_path, caplog):
    model, tokenizer, draft = tiny_pair("qwen3")
    other_model, _, other_draft = tiny_pair("qwen3_next")
    with without_eos(tokenizer) as tok:
        cache = PromptCache(lambda: make_session(model, draft), store=SessionStore(tmp_path, identity(model, draft)))
        turn(cache, model, draft, tok, prompt_ids(20, seed=1))
    (tmp_path / "broken.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    with caplog.at_level(logging.WARNING):
        foreign = SessionStore(tmp_path, identity(other_model, other_draft))
        loaded = PromptCache(lambda: make_session(other_model, other_draft), store=foreign)
    assert len(loaded) == 0
    text = caplog.text
    assert "broken.safetensors" in text and "another model" in text
    assert len(list(tmp_path.glob("*.safetensors"))) == 2  # another server's files are left alone
    same = PromptCache(lambda: make_session(model, draft), store=SessionStore(tmp_path, identity(model, draft)))
    assert len(same) == 1


def test_a_cache_of_size_zero_keeps_nothing(tiny_pair, tmp_path):
    model, tokenizer, draft = tiny_pair("qwen3")
    cache = PromptCache(
        lambda: make_session(model, draft), max_sessions=0, store=SessionStore(tmp_path, identity(model, draft))
    )
    with without_eos(tokenizer) as tok:
        a = prompt_ids(20, seed=1)
        reply, _ = turn(cache, model, draft, tok, a)
        assert turn(cache, model, draft, tok, a + reply + [5])[1] == 0
    assert len(cache) == 0 and not list(tmp_path.glob("*.safetensors"))


def test_a_next_turn_that_rewrites_the_reply_continues_its_conversation(tiny_pair):
    """A re-rendered reply may tokenize differently: the turn still takes its conversation's session
    (cut back inside the reply), while the same prompt asked again branches off a copy."""
    model, tokenizer, draft = tiny_pair("qwen3")
    cache = PromptCache(lambda: make_session(model, draft))
    with without_eos(tokenizer) as tok:
        a1 = prompt_ids(MIN_SHARED + 4, seed=1)
        reply, _ = turn(cache, model, draft, tok, a1)
        rewritten = a1 + reply[:-4] + [7, 8, 9] + prompt_ids(5, seed=2)
        assert turn(cache, model, draft, tok, rewritten)[1] == len(a1) + len(reply) - 4
        assert len(cache) == 1
        assert turn(cache, model, draft, tok, a1)[1] == len(a1) - 1  # asked again: a copy, cut to the prompt
        assert len(cache) == 2
