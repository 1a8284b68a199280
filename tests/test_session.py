"""Sessions: caches reused across generations stay lossless on every cache type.

Each scenario runs a conversation through one `Session` and compares every
reply with mlx-lm's plain greedy decoding of the same full prompt from scratch.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from dflash_mlx import make_session, stream_generate
from dflash_mlx.proposers import DFlashProposer
from dflash_mlx.proposers.oracle import OracleProposer
from helpers import TINY_VOCAB, prompt_ids, reference, with_eos, without_eos

FAMILIES = ["qwen3", "llama_sliding", "qwen3_5", "gemma4"]
TRIMMABLE = {"qwen3"}  # only plain KV caches: the others go back to the checkpoint


def tokens_of(responses):
    return [r.token for r in responses]


def same(got, prompt, max_tokens, model, tokenizer, atol=1e-3):
    """`got` is mlx-lm's greedy stream for `prompt` from scratch, log-probabilities included
    (the tiny models' margins are wide: tokens alone would hide a slightly wrong cache)."""
    want = reference(model, tokenizer, prompt, max_tokens)
    assert tokens_of(got) == tokens_of(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g.logprobs), np.array(w.logprobs), atol=atol)
    return tokens_of(got)


def run(model, draft, tokenizer, session, prompt, max_tokens, block_size=4):
    return list(
        stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens, block_size=block_size, session=session)
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_conversation_reuses_the_prefix_and_stays_lossless(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(30, seed=1)
        r1 = same(run(model, draft, tok, session, p1, 25), p1, 25, model, tok)
        assert session.reused == 0

        # The next turn extends prompt and reply: only the new tokens are prefilled.
        p2 = p1 + r1 + prompt_ids(9, seed=2)
        r2 = same(run(model, draft, tok, session, p2, 30, block_size=6), p2, 30, model, tok)
        assert session.reused == len(p1) + len(r1) - 1  # the reply's last token was never fed

        # A re-rendered history that diverges inside the last reply.
        p3 = p2 + r2[:5] + [(r2[5] + 1) % TINY_VOCAB or 9] + prompt_ids(6, seed=3)
        same(run(model, draft, tok, session, p3, 20), p3, 20, model, tok)
        assert session.reused == (len(p2) + 5 if family in TRIMMABLE else len(p2))

        # An unrelated prompt starts afresh.
        p4 = prompt_ids(12, seed=4)
        same(run(model, draft, tok, session, p4, 15), p4, 15, model, tok)
        assert session.reused == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_an_interrupted_reply_leaves_the_session_usable(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(20, seed=6)
        want = tokens_of(reference(model, tok, p1, 40))
        stream = stream_generate(model, draft, tok, p1, max_tokens=40, block_size=5, session=session)
        partial = [next(stream).token for _ in range(7)]
        stream.close()  # Ctrl-C: a verify is queued and must be undone
        assert partial == want[:7]
        assert session.tokens == (p1 + partial)[: len(session.tokens)]
        p2 = p1 + partial + prompt_ids(5, seed=7)
        same(run(model, draft, tok, session, p2, 20), p2, 20, model, tok)
        assert session.reused > len(p1)


class Cancelled(Exception):
    pass


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_cancelled_midway_leaves_the_session_usable(tiny_pair, family):
    """A progress callback that raises (a caller cancelling a long prompt) stops the prefill after
    some chunks reached the caches: the next turn must not build on them as if they were not there."""
    model, tokenizer, draft = tiny_pair(family)
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(20, seed=11)
        r1 = same(run(model, draft, tok, session, p1, 10), p1, 10, model, tok)
        p2 = p1 + r1 + prompt_ids(30, seed=12)

        def cancel(done, total):
            if done > len(p1) + len(r1):  # after a chunk of the new tokens was fed
                raise Cancelled

        with pytest.raises(Cancelled):
            list(
                stream_generate(
                    model,
                    draft,
                    tok,
                    p2,
                    max_tokens=10,
                    block_size=4,
                    session=session,
                    prefill_step_size=8,
                    prompt_progress_callback=cancel,
                )
            )
        same(run(model, draft, tok, session, p2, 25), p2, 25, model, tok)
        if family in TRIMMABLE:  # cut back to what the caches held before the cancelled turn
            assert session.reused == len(p1) + len(r1) - 1
        else:  # back to the checkpoint at the end of the last prompt
            assert session.reused == len(p1)


class RaisingBlocks:
    """Blocks 1, 1, 4, 1, ... (plain steps chained on lazy tokens, then a drafting block), raising at
    choice `at`: after a verify was queued and before the loop recorded it."""

    max_block = 4

    def __init__(self, at: int):
        self.at, self.chosen = at, 0

    def choose(self, limit: int) -> int:
        self.chosen += 1
        if self.chosen == self.at:
            raise Cancelled
        return min(limit, 4 if self.chosen % 3 == 0 else 1)

    def observe(self, block_size, accepted, seconds) -> None:
        pass


def raising_processor(at: int):
    calls = []

    def processor(tokens, logits):
        calls.append(1)
        if len(calls) == at:
            raise Cancelled
        return logits

    return processor


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("raiser", ["processor", "policy"])
def test_an_exception_inside_a_reply_leaves_the_session_usable(tiny_pair, family, raiser):
    """A logits processor or a block policy raising after a verify went into the caches: the session
    must not keep those rows as if they were not there."""
    model, tokenizer, draft = tiny_pair(family)
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(20, seed=13)
        if raiser == "processor":
            kw = dict(block_size=4, logits_processors=[raising_processor(at=12)])
        else:
            kw = dict(block_size=RaisingBlocks(at=8))
        got = []
        with pytest.raises(Cancelled):
            for r in stream_generate(model, draft, tok, p1, max_tokens=40, session=session, **kw):
                got.append(r.token)
        assert got == tokens_of(reference(model, tok, p1, len(got)))[: len(got)] and got
        assert session.tokens == (p1 + got)[: len(session.tokens)]
        p2 = p1 + got + prompt_ids(5, seed=14)
        same(run(model, draft, tok, session, p2, 20), p2, 20, model, tok)
        assert session.reused >= len(p1)  # the prompt stays (plain KV: cut back; others: the checkpoint)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stream_left_open_is_settled_when_the_session_is_used_again(tiny_pair, family):
    """A stream kept in a variable after a `break` still has a verify queued in the caches: the next turn
    settles it first, the old stream then refuses to go on, and collecting it later changes nothing."""
    model, tokenizer, draft = tiny_pair(family)
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(20, seed=15)
        stream = stream_generate(model, draft, tok, p1, max_tokens=40, block_size=4, session=session)
        partial = [next(stream).token for _ in range(6)]
        p2 = p1 + partial + prompt_ids(5, seed=16)
        r2 = same(run(model, draft, tok, session, p2, 20), p2, 20, model, tok)
        with pytest.raises(RuntimeError, match="left open while its session was used again"):
            next(stream)
        del stream
        gc.collect()
        p3 = p2 + r2 + prompt_ids(4, seed=17)
        same(run(model, draft, tok, session, p3, 15), p3, 15, model, tok)
        stream = stream_generate(model, draft, tok, p3, max_tokens=40, block_size=4, session=session)
        next(stream), next(stream)  # left open again: a copy and a reset settle it too
        copied = session.copy() if hasattr(session.proposer, "fork") else None
        session.reset()
        same(run(model, draft, tok, session, p1, 10), p1, 10, model, tok)
        if copied is not None:  # the copy holds the prompt and what the open stream had committed
            assert copied.tokens[: len(p3)] == p3 and len(copied.tokens) > len(p3)
            p4 = copied.tokens + prompt_ids(3, seed=18)
            same(run(model, draft, tok, copied, p4, 8), p4, 8, model, tok)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_stop_token_inside_a_block_keeps_nothing_after_it(tiny_pair, family):
    model, tokenizer, _ = tiny_pair(family)
    p1 = prompt_ids(15, seed=8)
    with without_eos(tokenizer) as tok:
        stream = tokens_of(reference(model, tok, p1, 30))
    stop = next(i for i in range(3, 30) if stream[i] not in stream[:i])  # first occurrence
    oracle = OracleProposer(stream + [0] * 16, [15], TINY_VOCAB, 16)  # accept every draft
    session = make_session(model, oracle)
    with with_eos(tokenizer, {stream[stop]}) as tok:
        got = run(model, oracle, tok, session, p1, 30, block_size=16)
    assert tokens_of(got) == stream[: stop + 1]
    assert got[-1].finish_reason == "stop"
    assert session.tokens == p1 + stream[:stop]  # the stop token itself is never fed
    held = [c.offset for c in session.cache if isinstance(c, KVCache)]
    assert held and set(held) == {len(session.tokens)}
    # The next turn goes on from there, exactly.
    with without_eos(tokenizer) as tok:
        p2 = p1 + stream[: stop + 1] + prompt_ids(4, seed=9)
        same(run(model, oracle, tok, session, p2, 12), p2, 12, model, tok)
    assert session.reused == len(p1) + stop


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_a_stop_token_first_undoes_the_cycle_queued_on_it(tiny_pair, family, block_size):
    """The first cycle is built on the prompt's lazy token; when that token is a stop token the
    cycle is undone whole: the caches hold the prompt alone and the next turn goes on exactly."""
    model, tokenizer, _ = tiny_pair(family)
    p1 = prompt_ids(15, seed=12)
    with without_eos(tokenizer) as tok:
        stream = tokens_of(reference(model, tok, p1, 20))
    oracle = OracleProposer(stream + [0] * 16, [15], TINY_VOCAB, 16)  # accept every draft
    session = make_session(model, oracle)
    with with_eos(tokenizer, {stream[0]}) as tok:
        got = run(model, oracle, tok, session, p1, 30, block_size=block_size)
    assert tokens_of(got) == stream[:1] and got[-1].finish_reason == "stop"
    assert session.tokens == p1
    held = [c.offset for c in session.cache if isinstance(c, KVCache)]
    assert not held or set(held) == {len(p1)}
    with without_eos(tokenizer) as tok:
        p2 = p1 + stream[:1] + prompt_ids(4, seed=13)
        same(run(model, oracle, tok, session, p2, 12, block_size=block_size), p2, 12, model, tok)
    assert session.reused == len(p1)


def test_session_must_match_the_model_and_drafter(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    session = make_session(model, draft)
    with pytest.raises(ValueError, match="another model or drafter"):
        list(stream_generate(model, None, tokenizer, [5, 6], max_tokens=2, session=session))
    with pytest.raises(ValueError, match="max_draft_context"):
        list(stream_generate(model, draft, tokenizer, [5, 6], max_tokens=2, session=session, max_draft_context=4))


def test_plain_decoding_session(tiny_pair):
    model, tokenizer, _ = tiny_pair("qwen3_5")
    session = make_session(model)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(10, seed=10)
        r1 = tokens_of(run(model, None, tok, session, p1, 12))
        p2 = p1 + r1 + [11, 12]
        same(run(model, None, tok, session, p2, 12), p2, 12, model, tok)
    assert session.reused == len(p1) + len(r1) - 1


def test_the_draft_sampling_choice_belongs_to_its_call(tiny_pair):
    """`draft_sampling="argmax"` on one call does not leak into the next call on the same session."""
    model, tokenizer, draft = tiny_pair("qwen3")
    seen = []

    class Spy(DFlashProposer):
        def propose(self, anchor, position, count, *, sampling=None, key=None):
            seen.append(sampling)
            return super().propose(anchor, position, count, sampling=sampling, key=key)

    spy = Spy(draft)
    session = make_session(model, spy)
    # the first sampled call measures the sampled cost curve, with sampled drafts from a fork of the spy
    list(stream_generate(model, spy, tokenizer, "the cat", max_tokens=2, temperature=0.8, seed=1, session=session))
    for choice, sampled in (("argmax", False), (None, True), ("sample", True), ("argmax", False), (None, True)):
        seen.clear()
        list(
            stream_generate(
                model,
                spy,
                tokenizer,
                "the cat",
                max_tokens=12,
                temperature=0.8,
                seed=1,
                block_size=4,  # (drafting every cycle, whatever the sampled history has learnt)
                draft_sampling=choice,
                session=session,
            )
        )
        assert seen and all((s is not None) == sampled for s in seen), choice
    assert session.draft_sampling == "sample"
    argmax_session = make_session(model, spy, draft_sampling="argmax")  # a session's own default
    seen.clear()
    list(stream_generate(model, spy, tokenizer, "the cat", max_tokens=12, temperature=0.8, session=argmax_session))
    assert seen and all(s is None for s in seen)


def test_a_finished_generation_leaves_nothing_open_on_its_session(tiny_pair):
    """A generation run to its end (or closed) lets go of its session: nothing of its loop stays reachable
    from the session (else every session kept a reference cycle through its last loop, and memory a prompt
    cache evicts would wait for the cyclic collector)."""
    model, tokenizer, draft = tiny_pair("qwen3")
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        run(model, draft, tok, session, prompt_ids(20, seed=21), 12)
        assert session._open is None
        stream = stream_generate(model, draft, tok, prompt_ids(20, seed=22), max_tokens=40, session=session)
        next(stream)
        assert session._open is not None  # (open: settled should the session be used before it is closed)
        stream.close()
        assert session._open is None
