"""Batched DFlash (`dflash_mlx.batch`): rows verified together, each as if served alone.

Rows of different prompt lengths join and leave mid-generation (continuous
batching through `stream_batch_generate` with a small `max_batch`, and
directly through `BatchDecoder.insert` between steps); every row's greedy
tokens equal `stream_generate`'s for that prompt alone, on dense, sliding-window
(rotating caches, gpt_oss sinks) and Gated DeltaNet targets. Sampled rows
with different settings in one batch follow the target's exact distribution
(first two tokens, the second from a batched verify). `batch_generate` on the
bundled pair returns mlx-lm's `BatchResponse` with the texts of one-by-one
generation.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchResponse

import dflash_mlx
from dflash_mlx.acceptance import Acceptor
from dflash_mlx.batch.engine import BatchDecoder
from dflash_mlx.sampling import SamplingSettings, distribution
from dflash_mlx.session import make_session
from helpers import TINY_VOCAB, chi_square_p, prompt_ids, without_eos

FAMILIES = ["qwen3", "qwen3_5", "qwen3_next", "llama_sliding", "gemma3_text", "gpt_oss"]
PROMPTS = [prompt_ids(n, seed=s) for n, s in ((5, 1), (17, 2), (9, 3), (30, 4), (12, 5))]


def alone(model, draft, tokenizer, prompt, n):
    return [r.token for r in dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=n, block_size=4)]


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_joining_and_leaving_equal_served_alone(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    limits = [24, 9, 30, 16, 20]  # rows leave at different cycles; with max_batch 2 the others join
    want = [alone(model, draft, tokenizer, p, n) for p, n in zip(PROMPTS, limits)]
    for block in (1, 8, None):  # None: the batch's own choice, per step
        got = [[] for _ in PROMPTS]
        for i, r in dflash_mlx.stream_batch_generate(
            model, draft, tokenizer, PROMPTS, max_tokens=limits, block_size=block, max_batch=2
        ):
            got[i].append(r.token)
        assert got == want, (family, block)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "llama_sliding"])
def test_rows_inserted_between_steps(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family)
    with without_eos(tokenizer) as tok:
        want = [alone(model, draft, tok, p, 20) for p in PROMPTS[:4]]
        sessions = [make_session(model, draft) for _ in PROMPTS[:4]]
        decoder = BatchDecoder(sessions[0].target, 8)
        got, order = {}, []

        def join(i):
            prompt = mx.array(PROMPTS[i])
            first = decoder.insert(sessions[i], prompt, Acceptor(SamplingSettings(), prompt), max_tokens=20)
            got[first.uid] = list(first.tokens)
            order.append(first.uid)

        join(0)
        join(1)
        steps = 0
        while decoder.rows or len(got) < 4:
            if steps in (1, 3):
                join(2 if steps == 1 else 3)
            for r in decoder.step():
                got[r.uid].extend(r.tokens)
            steps += 1
    assert [got[uid] for uid in order] == want
    # the sessions keep their conversations: a next turn continues from them as from a served-alone reply
    for session, prompt, tokens in zip(sessions, PROMPTS, want):
        assert session.tokens == prompt + tokens[:-1]


@pytest.mark.slow
def test_sampled_rows_with_different_settings_follow_the_target(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = prompt_ids(6, seed=5)
    settings = [dict(temperature=1.5), dict(temperature=1.0, top_k=20, top_p=0.95)]
    runs = 800
    mx.random.seed(0)  # (an unseeded row's seed comes from MLX's generator)
    rows = [dict(settings[i % 2], seed=i if i % 4 < 2 else None) for i in range(2 * runs)]  # keyed and rejection
    with without_eos(tokenizer) as tok:
        out = [[] for _ in rows]
        for i, r in dflash_mlx.stream_batch_generate(
            model, draft, tok, [prompt] * len(rows), max_tokens=2, block_size=3, max_batch=8, row_settings=rows
        ):
            out[i].append(r.token)
    for k, s in enumerate(settings):
        ss = SamplingSettings(**s)
        logits = model(mx.array(prompt)[None])[0, -1:]
        p1 = np.array(distribution(logits, ss)[0], dtype=np.float64)
        support = np.nonzero(p1 > 1e-9)[0]
        p2_given = np.array(
            distribution(model(mx.array([prompt + [int(t)] for t in support]))[:, -1], ss), dtype=np.float64
        )
        p2 = (p1[support, None] * p2_given).sum(axis=0)
        mine = [o for i, o in enumerate(out) if i % 2 == k]
        for tokens, probs in (([o[0] for o in mine], p1), ([o[1] for o in mine], p2)):
            counts = np.bincount(tokens, minlength=TINY_VOCAB)
            assert counts[probs <= 1e-9].sum() == 0, s
            small = probs * runs < 5
            c = np.append(counts[~small], counts[small].sum())
            p = np.append(probs[~small], probs[small].sum())
            assert chi_square_p(c, p / p.sum()) > 1e-3, s


def test_batch_generate_on_the_bundled_pair():
    from dflash_mlx.models.chat_template import render
    from dflash_mlx.datasets import sample

    model, tokenizer, draft = dflash_mlx.load("demo")
    prompts = [render(tokenizer, [{"role": "user", "content": c[0]}], {}) for c in sample("gsm8k", 5)]
    want = [dflash_mlx.generate(model, draft, tokenizer, p, max_tokens=40) for p in prompts]
    got = dflash_mlx.batch_generate(model, draft, tokenizer, prompts, max_tokens=40, max_batch=3, return_token_ids=True)
    assert isinstance(got, BatchResponse)
    assert got.texts == want
    assert got.stats.generation_tokens >= sum(len(t) for t in got.token_ids) and got.stats.generation_tps > 0
    with pytest.raises(ValueError, match="row_settings\\[0\\]: unknown keys"):
        dflash_mlx.batch_generate(model, draft, tokenizer, prompts[:1], row_settings=[{"temp": 1.0}])


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_batched_drafts_equal_each_rows_own(tiny_pair, family):
    """One drafter forward for rows of different context lengths drafts what each row drafts alone."""
    from dflash_mlx.batch.drafting import propose_rows

    model, tokenizer, draft = tiny_pair(family)
    sessions = [make_session(model, draft) for _ in PROMPTS[:3]]
    decoder = BatchDecoder(sessions[0].target, 8)
    for session, prompt in zip(sessions, PROMPTS):
        decoder.insert(session, mx.array(prompt), Acceptor(SamplingSettings(), mx.array(prompt)), max_tokens=50)
    decoder.step()  # the rows' contexts grow by different amounts
    plans = [row.planner.plan_at(8, 8) for row in decoder.rows]
    batched = [p.tokens.tolist() for p in propose_rows(decoder.rows, plans, 7)]
    alone = [propose_rows([row], [plan], 7)[0].tokens.tolist() for row, plan in zip(decoder.rows, plans)]
    assert batched == alone
    assert len({row.position for row in decoder.rows}) == 3
