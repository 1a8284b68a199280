"""Sampling through the engine: processors, seeds, and the emitted distribution.

The full statistical matrix of the sampling issue (>= 20,000 runs per setting)
needs batched runs; here a smaller end-to-end check compares the first two
sampled tokens with the target's exact distribution, enumerated with the target.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_logits_processors

from dflash_mlx import stream_generate
from dflash_mlx.proposers.oracle import OracleProposer
from dflash_mlx.proposers.dflash import proposer_for
from helpers import (
    TINY_VOCAB,
    assert_same_stream,
    check_first_two_sampled_tokens,
    check_keyed_drafts,
    prompt_ids,
    without_eos,
)


@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_greedy_with_repetition_penalty_and_bias_equals_mlx_lm(tiny_pair, block_size):
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = prompt_ids(12, seed=3)
    processors = make_logits_processors(logit_bias={7: 3.0}, repetition_penalty=1.3, repetition_context_size=8)
    with without_eos(tokenizer) as tok:
        want = list(mlx_lm_stream_generate(model, tok, mx.array(prompt), max_tokens=120, logits_processors=processors))
        oracle = OracleProposer([r.token for r in want] + [0] * 16, list(range(block_size)), TINY_VOCAB)
        for proposer in (draft, oracle):
            got = list(
                stream_generate(
                    model, proposer, tok, prompt, max_tokens=120, block_size=block_size, logits_processors=processors
                )
            )
            assert_same_stream(got, want)
    plain = [r.token for r in mlx_lm_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=120)]
    assert plain != [r.token for r in want], "the processors should change this generation"


def test_seed_makes_sampling_reproducible(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = prompt_ids(9, seed=4)

    def run(seed):
        return [
            r.token
            for r in stream_generate(
                model, draft, tokenizer, prompt, max_tokens=40, block_size=4, temperature=1.5, seed=seed
            )
        ]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_a_seed_fixes_the_text_whatever_the_blocks_and_the_drafter(tiny_pair):
    """A seeded call's text is its seed's plain-path text (draft=None) at every block, fixed or adaptive,
    alone or batched, under filters and processors (draws keyed by position, `dflash_mlx.acceptance`)."""
    import dflash_mlx

    model, tokenizer, draft = tiny_pair("qwen3")
    prompts = [prompt_ids(9, seed=4), prompt_ids(14, seed=5)]
    filtered = dict(temperature=0.7, top_k=6, top_p=0.95)
    with without_eos(tokenizer) as tok:
        for kw in (dict(temperature=1.5), filtered):
            processors = make_logits_processors(repetition_penalty=1.3) if kw is filtered else None
            plain = []
            for seed, prompt in enumerate(prompts):
                go = dict(max_tokens=40, seed=seed, logits_processors=processors, **kw)
                plain.append([r.token for r in stream_generate(model, None, tok, prompt, **go)])
                for block in (1, 3, 6, None, None):
                    got = [r.token for r in stream_generate(model, draft, tok, prompt, block_size=block, **go)]
                    assert got == plain[-1], (kw, seed, block)
            assert plain[0] != [r.token for r in stream_generate(model, None, tok, prompts[0], **{**go, "seed": 9})]
            rows = [dict(kw, seed=seed, logits_processors=processors) for seed in range(len(prompts))]
            batched = [[] for _ in prompts]
            for i, r in dflash_mlx.stream_batch_generate(
                model, draft, tok, prompts, max_tokens=40, block_size=4, max_batch=2, row_settings=rows
            ):
                batched[i].append(r.token)
            assert batched == plain, kw
        assert check_keyed_drafts(model, proposer_for(draft), tok, prompts[0], dict(temperature=1.5)) > 20


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1.5),
        dict(temperature=1.0, top_k=20, top_p=0.95),
        dict(temperature=1.5, draft_sampling="argmax"),
    ],
)
def test_first_two_sampled_tokens_follow_the_target(tiny_pair, settings):
    model, tokenizer, draft = tiny_pair("qwen3")
    check_first_two_sampled_tokens(model, draft, tokenizer, prompt_ids(6, seed=5), settings)


def test_xtc_is_refused_with_a_drafter_and_runs_without(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = prompt_ids(8, seed=6)
    with pytest.raises(ValueError, match="XTC"):
        next(stream_generate(model, draft, tokenizer, prompt, temperature=1.0, xtc_probability=0.5))
    runs = [
        [
            r.token
            for r in stream_generate(
                model,
                None,
                tokenizer,
                prompt,
                max_tokens=20,
                temperature=1.0,
                xtc_probability=0.5,
                xtc_threshold=0.05,
                seed=4,
            )
        ]
        for _ in range(2)
    ]
    assert len(runs[0]) == 20 and runs[0] == runs[1]
    with pytest.raises(ValueError, match="draft_sampling"):
        next(stream_generate(model, draft, tokenizer, prompt, temperature=1.0, draft_sampling="top"))
