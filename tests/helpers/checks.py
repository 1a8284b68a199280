"""Checks shared by the generation tests: prompts, mlx-lm references, stream comparisons, EOS copies.

- ``prompt_ids``: a reproducible random prompt; ``reference`` / ``ours``: mlx-lm's
  ``stream_generate`` and DFlash's, as lists of responses.
- ``assert_same_stream`` / ``assert_cycle_accounting``: DFlash's stream is mlx-lm's;
  cycles add up.
- ``check_lossless`` (with ``run_both`` and ``oracle_cycle_sizes``): the random drafter
  and the oracle both reproduce mlx-lm's greedy stream.
- ``with_eos`` / ``without_eos``: a copy of a (shared, cached) tokenizer with other stop
  tokens; the original is never mutated.
- ``chi_square_p``: Pearson's goodness-of-fit p-value for the sampling tests; ``two_token_distributions``
  and ``check_follows``: the target's exact first two distributions, and samples checked against one.

dflash_mlx is imported where it is used, so the package imports without it (as the
builders do).
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from typing import Iterable

import mlx.core as mx
import numpy as np
from mlx_lm import stream_generate as mlx_lm_stream_generate

from .tokenizer import TINY_VOCAB


def prompt_ids(length: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(8, TINY_VOCAB, size=length)]


def reference(model, tokenizer, prompt, max_tokens, **kw):
    return list(mlx_lm_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens, **kw))


def ours(model, draft, tokenizer, prompt, max_tokens, **kw):
    from dflash_mlx import stream_generate

    return list(stream_generate(model, draft, tokenizer, prompt, max_tokens=max_tokens, **kw))


def assert_same_stream(got, want, logprob_atol=1e-4):
    assert [r.token for r in got] == [r.token for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert [r.generation_tokens for r in got] == [r.generation_tokens for r in want]
    assert all(r.prompt_tokens == want[0].prompt_tokens for r in got)
    if logprob_atol is not None:
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.array(g.logprobs), np.array(w.logprobs), atol=logprob_atol)


def assert_cycle_accounting(got, block_size):
    cycles = [r.cycle_tokens for r in got if r.cycle_tokens is not None]
    assert got[0].cycle_tokens is None  # the first token comes from prefill
    assert sum(cycles) == got[-1].generation_tokens - 1
    assert all(1 <= c <= block_size for c in cycles)
    return cycles


@contextmanager
def with_eos(tokenizer, eos_token_ids: Iterable[int]):
    """A copy of ``tokenizer`` (an mlx-lm TokenizerWrapper) that stops on ``eos_token_ids`` only.

    ``load_pair`` caches its tokenizers and every test shares them, so they are
    never mutated: the copy shares the underlying HF tokenizer and detokenizer
    (both read-only here) and holds its own EOS set.
    """
    tok = copy.copy(tokenizer)
    tok.eos_token_ids = set(eos_token_ids)
    yield tok


def without_eos(tokenizer):
    """``with without_eos(tokenizer) as tok``: a copy that never stops early (long runs that
    cover every acceptance length)."""
    return with_eos(tokenizer, ())


def check_lossless(model, tokenizer, draft, prompt, max_tokens, block_size, logprob_atol=None, **kw):
    """The random drafter (with copy-aware drafting, the default) and the oracle (without: its pattern offers
    every acceptance length) both reproduce mlx-lm's greedy stream."""
    with without_eos(tokenizer) as tok:
        for proposer in (draft, "oracle"):
            got, want = run_both(model, tok, proposer, prompt, max_tokens, block_size, **kw)
            assert_same_stream(got, want, logprob_atol=logprob_atol)
            cycles = assert_cycle_accounting(got, block_size)
            if proposer == "oracle":  # its pattern offers acceptance lengths 0, 1, 2, ...
                assert set(oracle_cycle_sizes(block_size, max_tokens)) <= set(cycles)


def oracle_cycle_sizes(block_size: int, max_tokens: int) -> list[int]:
    """Cycle sizes (accepted + 1) of the oracle's first pattern round that fit in max_tokens."""
    sizes, committed = [], 1
    for accepted in range(block_size):
        if committed + accepted + 1 > max_tokens:
            break
        sizes.append(accepted + 1)
        committed += accepted + 1
    return sizes


def run_both(model, tokenizer, proposer, prompt, max_tokens, block_size, lookup=None, **kw):
    """mlx-lm's stream and ours, with `proposer` ("oracle": the oracle of mlx-lm's stream); `lookup`
    (None: on, but for the oracle, whose pattern is the point)."""
    from dflash_mlx import stream_generate
    from dflash_mlx.proposers.oracle import OracleProposer

    want = list(mlx_lm_stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens, **kw))
    if lookup is None:
        lookup = proposer != "oracle"
    if proposer == "oracle":
        proposer = OracleProposer([r.token for r in want] + [0] * 16, list(range(block_size)), TINY_VOCAB)
    got = list(
        stream_generate(
            model, proposer, tokenizer, prompt, max_tokens=max_tokens, block_size=block_size, lookup=lookup, **kw
        )
    )
    return got, want


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's statistic (Wilson-Hilferty approximation)."""
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "samples outside the distribution's support"
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    k = int(support.sum()) - 1
    if k == 0:
        return 1.0
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def two_token_distributions(model, prompt: list[int], settings) -> tuple[np.ndarray, np.ndarray]:
    """The target's exact distributions (`settings`: a `SamplingSettings`) of the first token after `prompt`
    and of the second (the first marginalised)."""
    from dflash_mlx.sampling import distribution

    p1 = np.array(distribution(model(mx.array(prompt)[None])[0, -1:], settings)[0], dtype=np.float64)
    support = np.nonzero(p1 > 1e-9)[0]
    rows = model(mx.array([prompt + [int(t)] for t in support]))[:, -1]
    return p1, (p1[support, None] * np.array(distribution(rows, settings), dtype=np.float64)).sum(axis=0)


def check_follows(tokens: list[int], probs: np.ndarray) -> None:
    """The sampled `tokens` follow `probs` (none outside its support; Pearson's test, bins expected fewer than
    5 times pooled into one)."""
    counts = np.bincount(tokens, minlength=probs.size)
    assert counts[probs <= 1e-9].sum() == 0
    probs = probs / probs.sum()
    small = probs * len(tokens) < 5
    c, p = np.append(counts[~small], counts[small].sum()), np.append(probs[~small], probs[small].sum())
    assert chi_square_p(c, p) > 1e-3


def check_first_two_sampled_tokens(model, draft, tokenizer, prompt, settings: dict, runs: int = 1000) -> None:
    """Over `runs` calls, the first two tokens of `stream_generate(..., **settings)` follow the target's exact
    distributions (enumerated with the target; the second comes from a cycle that verified one draft); every
    other call is seeded (draws keyed by position), the rest unseeded (rejection sampling)."""
    from dflash_mlx import stream_generate
    from dflash_mlx.sampling import SamplingSettings

    s = SamplingSettings(**{k: v for k, v in settings.items() if k != "draft_sampling"})
    p1, p2 = two_token_distributions(model, prompt, s)
    firsts, seconds = [], []
    with without_eos(tokenizer) as tok:
        for run in range(runs):
            mx.random.seed(run)  # (an unseeded call's seed comes from MLX's generator)
            seed = run if run % 2 else None
            out = list(stream_generate(model, draft, tok, prompt, max_tokens=3, block_size=3, seed=seed, **settings))
            assert out[2].cycle_tokens is not None and (out[1].cycle_tokens is None or out[1].cycle_tokens == 1)
            firsts.append(out[0].token)
            seconds.append(out[1].token)
    check_follows(firsts, p1)
    check_follows(seconds, p2)
    assert not math.isnan(p2.sum())


def check_a_seed_fixes_the_text(model, draft, tokenizer, prompt, settings: dict, blocks=(2, 4, None), max_tokens=24):
    """A seeded call's text with `draft` at each of `blocks` (None: adaptive) is the seed's plain-path text
    (draft=None), for seeds 0..2."""
    from dflash_mlx import stream_generate

    with without_eos(tokenizer) as tok:
        for seed in range(3):
            kw = dict(max_tokens=max_tokens, seed=seed, **settings)
            plain = [r.token for r in stream_generate(model, None, tok, prompt, **kw)]
            for block in blocks:
                out = stream_generate(model, draft, tok, prompt, block_size=block, lookup=False, **kw)
                assert [r.token for r in out] == plain, (seed, block)


def check_keyed_drafts(model, proposer, tokenizer, prompt, settings: dict, max_tokens=24) -> int:
    """Through seeded generations, each sampled draft `proposer` proposes is the Gumbel-max of its own q row
    with the noise of the position it stands for (`sampling.row_noise` of the keys it was given): the noise
    the target draws that position with. Returns how many drafts were checked."""
    from dflash_mlx import stream_generate
    from dflash_mlx.sampling import row_noise

    seen, propose = [], proposer.propose

    def spy(anchor, position, count, *, sampling=None, key=None):
        proposal = propose(anchor, position, count, sampling=sampling, key=key)
        seen.append((proposal, key))
        return proposal

    proposer.propose = spy  # (this instance only, taken back below)
    try:
        with without_eos(tokenizer) as tok:
            for seed in range(3):
                kw = dict(max_tokens=max_tokens, seed=seed, block_size=4, lookup=False, **settings)
                list(stream_generate(model, proposer, tok, prompt, **kw))
    finally:
        del proposer.propose
    checked = 0
    for proposal, keys in seen:
        assert keys is not None and keys.shape == (proposal.tokens.size, 2)
        q = proposal.probs.astype(mx.float32)
        want = mx.argmax(mx.log(q) + row_noise(keys, q.shape[-1]), axis=-1)
        assert proposal.tokens.tolist() == want.tolist()
        checked += proposal.tokens.size
    return checked
