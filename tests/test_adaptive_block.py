"""Blocks that change between cycles: lossless on every cache type, sessions, stops, sampling.

A `Cycling` policy forces block changes (1 -> 16 -> 1, runs of b = 1 that the
engine pipelines, odd sizes) on the families of every cache type: plain KV
(qwen3), Gated DeltaNet (qwen3_5, qwen3_next) and sliding-window rings
(llama_sliding, gemma3_text, gemma4). The adaptive policy itself
(`block_size=None`) runs against an oracle whose acceptance collapses and
recovers. The output must be mlx-lm's greedy stream throughout.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from dflash_mlx import make_session, stream_generate
from dflash_mlx.engine import speculative_cycles
from dflash_mlx.policy.adaptive import AdaptiveBlock
from dflash_mlx.policy.cost import CostTable
from dflash_mlx.proposers.oracle import OracleProposer
from dflash_mlx.sampling import SamplingSettings, distribution
from helpers import TINY_VOCAB, assert_same_stream, chi_square_p, prompt_ids, reference, with_eos, without_eos

FAMILIES = ["qwen3", "qwen3_5", "qwen3_next", "llama_sliding", "gemma3_text", "gemma4"]
SCHEDULE = [1, 1, 1, 16, 1, 16, 16, 1, 3, 1, 1, 2, 8, 5, 1, 1, 1, 1, 16]


class Cycling:
    """A block policy that repeats a schedule (the engine's `BlockPolicy` shape)."""

    def __init__(self, schedule):
        self.schedule, self.max_block, self.i, self.chosen = list(schedule), max(schedule), 0, []

    def choose(self, limit):
        b = min(limit, self.schedule[self.i % len(self.schedule)])
        self.i += 1
        return b

    def observe(self, block_size, accepted, seconds):
        self.chosen.append(block_size)


def oracle_for(want, pattern):
    return OracleProposer([r.token for r in want] + [0] * 16, pattern, TINY_VOCAB, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_changing_blocks_equal_mlx_lm(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    prompt = prompt_ids(30, seed=21)
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 150)
        for proposer in (draft, oracle_for(want, [15, 0, 3, 15, 1])):
            policy = Cycling(SCHEDULE)
            got = list(stream_generate(model, proposer, tok, prompt, max_tokens=150, block_size=policy, lookup=False))
            assert_same_stream(got, want, logprob_atol=1e-3)
            assert {1, 16} <= set(policy.chosen)
            assert [r.cycle_block_size for r in got if r.cycle_tokens is not None] == policy.chosen
        # with lookup spans filling the policy's blocks where the reply repeats itself (tiny models loop)
        got = list(stream_generate(model, draft, tok, prompt, max_tokens=150, block_size=Cycling(SCHEDULE)))
        assert_same_stream(got, want, logprob_atol=1e-3)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "llama_sliding"])
def test_the_adaptive_block_follows_acceptance_and_stays_lossless(tiny_pair, family):
    """An oracle that accepts everything, then nothing, then everything: 16 -> 1 -> 16
    (on a fixed cost curve where each row costs a quarter of a forward, so the choices are
    the policy's alone; `block_size=None` runs the same policy on this machine's curve)."""
    model, tokenizer, _ = tiny_pair(family)
    prompt = prompt_ids(25, seed=22)
    curve = CostTable.curve([1, 2, 4, 8, 16], [0.010, 0.0125, 0.0175, 0.0275, 0.0475])
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 400)
        oracle = oracle_for(want, [15] * 8 + [0] * 18 + [15] * 200)
        policy = AdaptiveBlock(curve, 16)
        got = list(stream_generate(model, oracle, tok, prompt, max_tokens=400, block_size=policy, lookup=False))
        assert_same_stream(got, want, logprob_atol=1e-3)
        assert_same_stream(
            list(
                stream_generate(model, oracle_for(want, [15] * 8 + [0] * 18 + [15] * 200), tok, prompt, max_tokens=400)
            ),
            want,
            logprob_atol=1e-3,
        )
    blocks = [r.cycle_block_size for r in got if r.cycle_tokens is not None]
    first_plain = blocks.index(1)
    back = next(i for i in range(first_plain, len(blocks)) if blocks[i] > 8)
    assert max(blocks[:first_plain]) > 8 and back > first_plain  # large, then plain, then large again


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gemma4"])
def test_a_session_across_block_changes(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(20, seed=23)
        r1 = [
            r.token
            for r in stream_generate(
                model, draft, tok, p1, max_tokens=40, session=session, block_size=Cycling([1, 1, 16, 1])
            )
        ]
        assert r1 == [r.token for r in reference(model, tok, p1, 40)]
        p2 = p1 + r1 + prompt_ids(6, seed=24)
        got = list(stream_generate(model, draft, tok, p2, max_tokens=40, session=session, block_size=4))
        assert_same_stream(got, reference(model, tok, p2, 40), logprob_atol=1e-3)
        p3 = p2 + [r.token for r in got] + prompt_ids(3, seed=25)
        got = list(stream_generate(model, draft, tok, p3, max_tokens=40, session=session))  # adaptive
        assert_same_stream(got, reference(model, tok, p3, 40), logprob_atol=1e-3)
    assert session.reused > len(p2)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_stop_token_at_a_pipelined_plain_step_keeps_nothing_after_it(tiny_pair, family):
    """At b = 1 the next step is queued on the stop token before it is read: it is undone whole."""
    model, tokenizer, draft = tiny_pair(family)
    p1 = prompt_ids(15, seed=26)
    with without_eos(tokenizer) as tok:
        stream = [r.token for r in reference(model, tok, p1, 30)]
    stop = next(i for i in range(4, 30) if stream[i] not in stream[:i])
    session = make_session(model, draft)
    with with_eos(tokenizer, {stream[stop]}) as tok:
        got = list(stream_generate(model, draft, tok, p1, max_tokens=30, session=session, block_size=1))
    assert [r.token for r in got] == stream[: stop + 1] and got[-1].finish_reason == "stop"
    assert session.tokens == p1 + stream[:stop]
    held = [c.offset for c in session.cache if isinstance(c, KVCache)]
    assert held and set(held) == {len(session.tokens)}
    assert session.proposer.context_end == len(session.tokens)  # the drafter saw every fed position
    with without_eos(tokenizer) as tok:
        p2 = p1 + stream[: stop + 1] + prompt_ids(4, seed=27)
        got = list(stream_generate(model, draft, tok, p2, max_tokens=20, session=session, block_size=8))
        assert_same_stream(got, reference(model, tok, p2, 20), logprob_atol=1e-3)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "llama_sliding"])
def test_closing_a_stream_inside_a_run_of_plain_steps(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(18, seed=28)
        want = [r.token for r in reference(model, tok, p1, 40)]
        stream = stream_generate(model, draft, tok, p1, max_tokens=40, session=session, block_size=Cycling([1]))
        partial = [next(stream).token for _ in range(9)]
        stream.close()
        assert partial == want[:9]
        assert session.proposer.context_end == len(session.tokens)
        p2 = p1 + partial + prompt_ids(5, seed=29)
        got = list(stream_generate(model, draft, tok, p2, max_tokens=30, session=session, block_size=16))
        assert_same_stream(got, reference(model, tok, p2, 30), logprob_atol=1e-3)


def test_plain_steps_are_queued_before_the_previous_token_is_read(tiny_pair):
    """mlx-lm's pipelining: at b = 1, verify n + 1 is built before cycle n's token reaches the host
    (the session hears of cycle n after it); ring caches, which cannot undo one row, are not pipelined."""
    for family, pipelined in (("qwen3", True), ("qwen3_5", True), ("llama_sliding", False)):
        model, tokenizer, draft = tiny_pair(family)
        session = make_session(model, draft)
        events = []
        verify, fed = session.target.verify, session.fed
        session.target.verify = lambda *a: (events.append("verify"), verify(*a))[1]
        session.fed = lambda tokens: (events.append("fed"), fed(tokens))[1]
        try:
            cycles = speculative_cycles(
                session.target,
                mx.array(prompt_ids(10, seed=30)),
                session.proposer,
                max_tokens=12,
                block_size=1,
                session=session,
            )
            assert sum(len(c.tokens) for c in cycles) == 12
        finally:
            del session.target.verify, session.fed
        ahead = [events[:i].count("verify") - events[:i].count("fed") for i, e in enumerate(events) if e == "fed"]
        assert ahead[:-1] == ([2] * (len(ahead) - 1) if pipelined else [1] * (len(ahead) - 1)), (family, events)


def test_calibrating_in_the_middle_of_a_session_leaves_it_alone(tiny_pair, monkeypatch, tmp_path):
    from dflash_mlx.policy import calibration

    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "STABLE", float("inf"))  # cached whatever this machine's load
    model, tokenizer, draft = tiny_pair("qwen3_5")
    session = make_session(model, draft)
    with without_eos(tokenizer) as tok:
        p1 = prompt_ids(16, seed=31)
        r1 = [r.token for r in stream_generate(model, draft, tok, p1, max_tokens=20, session=session, block_size=4)]
        calibration.clear_calibrations()
        p2 = p1 + r1 + prompt_ids(4, seed=32)
        got = list(stream_generate(model, draft, tok, p2, max_tokens=30, session=session))  # calibrates first
        assert_same_stream(got, reference(model, tok, p2, 30), logprob_atol=1e-3)
    assert list(tmp_path.glob("calibration/*.json")) and session.reused > len(p1)


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_across_a_block_change(tiny_pair):
    """t2 comes from a plain step, t3 from the first row of a block of 3 (a drafted position)."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = prompt_ids(6, seed=33)
    s = SamplingSettings(temperature=1.0, top_k=12)
    p1 = np.array(distribution(model(mx.array(prompt)[None])[0, -1:], s)[0], dtype=np.float64)
    firsts = [int(t) for t in np.nonzero(p1 > 1e-9)[0]]
    p2 = np.array(distribution(model(mx.array([prompt + [t] for t in firsts]))[:, -1], s), dtype=np.float64)
    pairs = [(a, int(b), p1[a] * p2[i, b]) for i, a in enumerate(firsts) for b in np.nonzero(p2[i] > 1e-9)[0]]
    p3_rows = np.array(distribution(model(mx.array([prompt + [a, b] for a, b, _ in pairs]))[:, -1], s))
    p3 = sum(w * p3_rows[i].astype(np.float64) for i, (_, _, w) in enumerate(pairs))
    runs, thirds = 900, []
    with without_eos(tokenizer) as tok:
        for seed in range(runs):
            out = list(
                stream_generate(
                    model,
                    draft,
                    tok,
                    prompt,
                    max_tokens=4,
                    temperature=1.0,
                    top_k=12,
                    seed=seed,
                    block_size=Cycling([1, 3]),
                )
            )
            assert [r.cycle_block_size for r in out if r.cycle_tokens][:1] == [1]
            thirds.append(out[2].token)
    counts = np.bincount(thirds, minlength=TINY_VOCAB)
    probs = p3 / p3.sum()
    assert counts[probs <= 1e-9].sum() == 0
    small = probs * runs < 5
    c = np.append(counts[~small], counts[small].sum())
    p = np.append(probs[~small], probs[small].sum())
    assert chi_square_p(c, p) > 1e-3


def test_every_call_carries_the_drafters_acceptance_of_its_kind_and_a_seed_still_fixes_the_text(tiny_pair, monkeypatch):
    from dflash_mlx.policy import calibration
    from dflash_mlx.policy.cost import CostModel

    curve = CostModel(CostTable.curve([1, 2, 4, 8, 16], [0.010, 0.0125, 0.0175, 0.0275, 0.0475]), learns=False)
    monkeypatch.setattr(calibration, "cost_model", lambda *a, **k: curve)  # rows cost: the choice is clear
    model, tokenizer, _ = tiny_pair("qwen3")
    prompt = prompt_ids(12, seed=34)
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 40)
        useless = oracle_for(want, [0])  # rejects every draft

        def first_block(**kw):
            out = list(stream_generate(model, useless, tok, prompt, max_tokens=40, **kw))
            return next(r.cycle_block_size for r in out if r.cycle_tokens is not None), out

        fresh, out = first_block()
        assert_same_stream(out, want, logprob_atol=1e-3)
        carried, out = first_block()
        assert_same_stream(out, want, logprob_atol=1e-3)
        assert carried < fresh  # the second greedy call starts from what the first learnt
        seeded = [first_block(temperature=1.0, seed=5) for _ in range(2)]
        assert seeded[0][0] == fresh  # the first sampled call: its kind's history is new (not the greedy one)
        assert seeded[1][0] < fresh  # the next starts from what the first learnt: other blocks, the same text
        assert [r.token for r in seeded[0][1]] == [r.token for r in seeded[1][1]]
        assert first_block(temperature=1.0)[0] < fresh  # an unseeded call carries the same history
