"""Copy-aware drafting: cycles that verify a span copied from the context (a span source, `policy.adaptive`).

Greedy output must stay mlx-lm's on every cache type (plain KV, Gated DeltaNet, sliding-window rings)
while cycles switch between lookup spans, the drafter's blocks and plain steps. Two kinds of lookup:
the real index on tiny targets whose greedy replies repeat themselves (the lookup fires on its own),
and, on every family, an index that knows the reply and offers spans with a chosen acceptance pattern
(every acceptance length, so every cache is rolled back by every amount after a lookup cycle).
Sampled output must follow the target's distribution where the lookup proposes point masses.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import make_session, stream_batch_generate, stream_generate
from dflash_mlx.policy.adaptive import AdaptiveBlock
from dflash_mlx.policy.cost import CostTable
from dflash_mlx.proposers.base import Proposal
from dflash_mlx.proposers.lookup import LookupIndex, LookupProposer
from dflash_mlx.proposers.oracle import OracleProposer
from dflash_mlx.sampling import SamplingSettings, distribution
from helpers import (
    TINY_VOCAB,
    assert_same_stream,
    check_follows,
    prompt_ids,
    reference,
    two_token_distributions,
    without_eos,
)

FAMILIES = ["qwen3", "qwen3_5", "qwen3_next", "llama_sliding", "gemma3_text", "gemma4"]
CURVE = CostTable.curve([1, 2, 4, 8, 16], [0.010, 0.0125, 0.0175, 0.0275, 0.0475])  # a row: a quarter forward
LOOPING = [("qwen3", 0), ("qwen3", 3), ("gemma3_text", 0)]  # (family, prompt seed): greedy replies that repeat


class KnowingSource(LookupProposer):
    """A span source that knows the reply: its spans are the reply's next tokens with one corrupted, so
    that a span after k cycles has `pattern[k % len(pattern)]` right (a test's control over the lookup's
    acceptance, by time: a lookup left alone for a while finds the pattern moved on). It always offers a
    span (always in a copy: plain steps read their token first)."""

    def __init__(self, prompt: list[int], reply: list[int], pattern: list[int]):
        super().__init__(LookupIndex())
        self.begin, self.reply, self.pattern, self.cycles = len(prompt), reply + [0] * 64, pattern, -1

    def commit(self, tokens: list[int]) -> None:
        super().commit(tokens)
        self.cycles += 1  # (the prompt's token is not a cycle's)

    def offer(self, count: int) -> int:
        return count

    def propose(self, anchor, position: int, count: int, *, sampling=None, key=None) -> Proposal:
        at = len(self.index.tokens) - self.begin  # reply tokens committed so far
        span = list(self.reply[at : at + count])
        keep = self.pattern[self.cycles % len(self.pattern)]
        if keep < len(span):
            span[keep] = (span[keep] + 1) % TINY_VOCAB
        return Proposal(tokens=mx.array(span, mx.int32))


def kinds(responses) -> list[str]:
    """Each cycle's kind: the source whose drafts were accepted ("lookup", "dflash", "oracle"), "miss" (none accepted),
    "plain" (b = 1)."""
    out, drafted = [], None
    for r in responses:
        drafted = r.source if r.from_draft else drafted
        if r.cycle_tokens is not None:
            out.append(drafted or ("plain" if r.cycle_block_size == 1 else "miss"))
            drafted = None
    return out


@pytest.mark.parametrize("family, seed", LOOPING)
def test_greedy_with_the_real_lookup_equals_mlx_lm(tiny_pair, family, seed):
    model, tokenizer, draft = tiny_pair(family)
    prompt = prompt_ids(20, seed=seed)
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 120)
        for block_size in (None, 4, AdaptiveBlock(CURVE, 16)):
            got = list(stream_generate(model, draft, tok, prompt, max_tokens=120, block_size=block_size))
            assert_same_stream(got, want, logprob_atol=1e-3)
            # (whether this machine's timing-driven default copies is not this test's business)
            assert block_size is None or Counter(r.source for r in got)["lookup"] > 0, block_size
        off = list(stream_generate(model, draft, tok, prompt, max_tokens=120, lookup=False))
        assert_same_stream(off, want, logprob_atol=1e-3)
        assert "lookup" not in {r.source for r in off}


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_across_lookup_dflash_and_plain_switches_equals_mlx_lm(tiny_pair, family):
    """The adaptive policy (on a fixed curve) with a lookup that is right, then wrong for a while, then right,
    and an oracle drafter accepting 3 of 15 (runs of each source, switching both ways) or none (plain steps
    between the spans); a fixed block of 4 with every lookup acceptance length."""
    model, tokenizer, draft = tiny_pair(family)
    prompt = prompt_ids(24, seed=32)
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 160)
        reply = [r.token for r in want]
        spans = [15, 15] + [0] * 20 + [15] * 60  # (right long enough that the span's probes find it so)
        runs = (
            (OracleProposer(reply + [0] * 16, [3, 0, 1], TINY_VOCAB, 16), AdaptiveBlock(CURVE, 16), spans),
            (OracleProposer(reply + [0] * 16, [0], TINY_VOCAB, 16), AdaptiveBlock(CURVE, 16), spans),
            (draft, 4, [0, 1, 2, 3]),
        )
        for k, (proposer, block_size, pattern) in enumerate(runs):
            session = make_session(model, proposer)
            session._lookup_source = KnowingSource(prompt, reply, pattern)  # (the session keeps its source: this one)
            got = list(
                stream_generate(model, proposer, tok, prompt, max_tokens=160, block_size=block_size, session=session)
            )
            assert_same_stream(got, want, logprob_atol=1e-3)
            seen = kinds(got)
            if block_size == 4:
                assert "lookup" in seen and {r.cycle_tokens for r in got if r.cycle_tokens} == {1, 2, 3, 4}
                continue
            drafted = [k for k in seen if k != "miss"]
            changes = {(a, b) for a, b in zip(drafted, drafted[1:]) if a != b}
            assert (
                {("lookup", "oracle"), ("oracle", "lookup")} <= changes
                if k == 0
                else {
                    ("lookup", "plain"),
                    ("plain", "lookup"),
                }
                <= changes
            ), (k, seen)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_lookup_spans_with_a_quantized_kv_cache_equal_mlx_lm(tiny_pair, family):
    """No lookup span crosses the point where mlx-lm quantizes the cache unquantized (its width is the
    engine's room), and the cycles after it verify against the quantized cache as mlx-lm decodes."""
    model, tokenizer, draft = tiny_pair(family, head_dim=32)
    prompt = prompt_ids(14, seed=4)
    kw = dict(kv_bits=8, kv_group_size=32, quantized_kv_start=23, prefill_step_size=5)
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 60, **kw)
        session = make_session(model, draft)
        session._lookup_source = KnowingSource(prompt, [r.token for r in want], [15, 4, 0, 15])
        got = list(stream_generate(model, draft, tok, prompt, max_tokens=60, block_size=8, session=session, **kw))
    assert_same_stream(got, want, logprob_atol=2e-3)
    assert "lookup" in kinds(got)


def test_the_session_keeps_its_index_in_step_with_the_conversation(tiny_pair):
    """A chat's next turn extends the index; a prompt that diverges cuts it back to what they share."""
    model, tokenizer, draft = tiny_pair("qwen3")
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(20, seed=0)
        r1 = [r.token for r in stream_generate(model, draft, tok, p1, max_tokens=30, session=session)]
        assert session._lookup.tokens == p1 + r1
        p2 = p1 + r1 + prompt_ids(5, seed=9)
        got = list(stream_generate(model, draft, tok, p2, max_tokens=30, session=session))
        assert_same_stream(got, reference(model, tok, p2, 30), logprob_atol=1e-3)
        p3 = p1[:10] + prompt_ids(6, seed=8)
        got = list(stream_generate(model, draft, tok, p3, max_tokens=20, session=session))
        assert_same_stream(got, reference(model, tok, p3, 20), logprob_atol=1e-3)
        assert session._lookup.tokens == p3 + [r.token for r in got]
        assert session._lookup.tokens == LookupIndex(session._lookup.tokens).tokens


def _copying_prompt(model, settings: SamplingSettings) -> list[int]:
    """A short prompt after which every likely first token x was seen before after the prompt's last two
    tokens, followed by the target's greedy pick after prompt + [x]: the lookup proposes a span for the
    second token whatever the first, right where the target agrees. Built to a fixed point (the likely
    tokens and their picks depend on the prompt); it ends inside a match (its first chunk again), so the
    first cycle reads its anchor before choosing."""
    tail, covered, follow = [7, 11], [2], {}
    for _ in range(12):
        prompt = [t for x in covered + covered[:1] for t in (*tail, x, follow.get(x, 3))] + tail
        p1 = np.array(distribution(model(mx.array(prompt)[None])[0, -1:], settings)[0])
        likely = [int(x) for x in np.nonzero(p1 > 1e-9)[0]]
        rows = model(mx.array([prompt + [x] for x in likely]))[:, -1]
        picks = dict(zip(likely, mx.argmax(rows, axis=-1).tolist()))
        if set(likely) <= set(covered) and all(follow.get(x) == t for x, t in picks.items()):
            return prompt
        covered += [x for x in likely if x not in covered]
        follow.update(picks)
    raise AssertionError("no copying prompt found")


SAMPLED = dict(temperature=1.0, top_k=4)


def test_sampled_tokens_follow_the_target_where_the_lookup_proposes_point_masses(tiny_pair):
    """Over many seeds, the first two sampled tokens follow the target's exact distributions while the
    second comes from a cycle verifying a lookup span (q one-hot), accepted in some runs, not in others."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = _copying_prompt(model, SamplingSettings(**SAMPLED))
    p1, p2 = two_token_distributions(model, prompt, SamplingSettings(**SAMPLED))
    firsts, seconds, accepted, runs = [], [], 0, 600
    session = make_session(model, draft)  # (the prompt is prefilled once; its index kept)
    with without_eos(tokenizer) as tok:
        for seed in range(runs):
            out = list(
                stream_generate(
                    model, draft, tok, prompt, max_tokens=3, block_size=3, seed=seed, session=session, **SAMPLED
                )
            )
            # the second token's cycle verified the anchor and a span of 1 (room for 2 tokens)
            assert [r.cycle_block_size for r in out if r.cycle_block_size][0] == 2
            assert kinds(out)[0] in ("lookup", "miss")
            firsts.append(out[0].token)
            seconds.append(out[1].token)
            accepted += out[1].source == "lookup"
    assert 0.05 * runs < accepted < 0.95 * runs
    check_follows(firsts, p1)
    check_follows(seconds, p2)


def test_batched_sampled_rows_with_lookup_spans_follow_the_target(tiny_pair):
    """The same in a batch: every row verifies a lookup span (with slots past its cap) at a fixed block."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = _copying_prompt(model, SamplingSettings(**SAMPLED))
    p1, p2 = two_token_distributions(model, prompt, SamplingSettings(**SAMPLED))
    runs = 480
    got: dict[int, list] = {}
    with without_eos(tokenizer) as tok:
        for i, r in stream_batch_generate(
            model, draft, tok, [prompt] * runs, max_tokens=2, block_size=4, max_batch=8, seed=0, **SAMPLED
        ):
            got.setdefault(i, []).append(r)
    assert all(len(out) == 2 for out in got.values()) and len(got) == runs
    assert 0.05 * runs < sum(out[1].source == "lookup" for out in got.values()) < 0.95 * runs
    check_follows([out[0].token for out in got.values()], p1)
    check_follows([out[1].token for out in got.values()], p2)


def test_batched_rows_with_lookup_spans_equal_the_rows_served_alone(tiny_pair):
    """Rows of one batch, some verifying lookup spans (their replies repeat), some drafting: each row's
    output is mlx-lm's greedy stream; a row without lookup takes none."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompts = [prompt_ids(20, seed=0), prompt_ids(20, seed=3), prompt_ids(20, seed=5)]
    with without_eos(tokenizer) as tok:
        want = [[r.token for r in reference(model, tok, p, 60)] for p in prompts]
        for block_size in (None, 4):
            for lookup in (True, False):
                got, kinds_of = [[] for _ in prompts], Counter()
                for i, r in stream_batch_generate(
                    model, draft, tok, prompts, max_tokens=60, block_size=block_size, max_batch=3, lookup=lookup
                ):
                    got[i].append(r.token)
                    kinds_of[r.source] += 1
                assert got == want, (block_size, lookup)
                if block_size == 4 or not lookup:  # (adaptive: spans only at the drafting steps it chooses)
                    assert (kinds_of["lookup"] > 0) == lookup, kinds_of
