"""Suffix drafting across requests (`proposers.suffix`): what earlier generations produced drafts what a later
one produces again, through every library entry point.

Greedy output must stay mlx-lm's on every cache type while cycles verify suffix spans accepted whole, in part
or not at all (an index holding the replies of earlier calls, or a reply with tokens changed), in single and
batched decoding, from a session's default index, from another thread and through the mlx-lm drop-in.
Sampled output must follow the target's distribution where the suffix proposes point masses; a seeded
sampled call records in the index but drafts nothing from it.
"""

from __future__ import annotations

import threading
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx
from dflash_mlx import SuffixIndex, make_session, stream_batch_generate, stream_generate
from dflash_mlx.mlx_lm import api as plugin
from dflash_mlx.policy.adaptive import AdaptiveBlock
from dflash_mlx.policy.cost import CostTable
from dflash_mlx.proposers.suffix import SuffixProposer
from dflash_mlx.sampling import SamplingSettings, distribution
from helpers.calibrations import cheap_blocks_cache
from helpers import (
    TINY_VOCAB,
    assert_same_stream,
    check_follows,
    prompt_ids,
    reference,
    two_token_distributions,
    without_eos,
)

FAMILIES = ["qwen3", "qwen3_5", "llama_sliding", "gemma3_text"]  # KV, Gated DeltaNet, sliding-window rings
CURVE = CostTable.curve([1, 2, 4, 8, 16], [0.010, 0.0125, 0.0175, 0.0275, 0.0475])  # a row: a quarter forward
SAMPLED = dict(temperature=1.0, top_k=4)


def record(index: SuffixIndex, prompt: list[int], reply: list[int]) -> None:
    """What a generation of `reply` after `prompt` leaves in the index."""
    source = SuffixProposer(index)
    source.start(None, prompt)
    source.commit(reply)


def suffix_tokens(responses) -> int:
    return Counter(r.source for r in responses)["suffix"]


def suffix_cycles(responses) -> list[int]:
    """The tokens of each cycle that committed accepted suffix drafts."""
    out, drafted = [], False
    for r in responses:
        drafted |= r.source == "suffix"
        if r.cycle_tokens is not None:
            out += [r.cycle_tokens] if drafted else []
            drafted = False
    return out


def changed(reply: list[int], every: list[int]) -> list[int]:
    """`reply` with the tokens at gaps of `every` (cycled) changed: once MIN_MATCH tokens after a change match
    again, spans are accepted up to the next change (gaps of 5 to 8: 0 to 3 drafts accepted)."""
    out, at, k = list(reply), every[0], 0
    while at < len(out):
        out[at] = (out[at] + 1) % TINY_VOCAB
        k += 1
        at += every[k % len(every)]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_shared_index_equals_mlx_lm(tiny_pair, family):
    """The same prompt again drafts its earlier reply (accepted whole); an index holding that reply with tokens
    changed has its spans accepted in part (every cache rolled back by many amounts); a fixed block and the
    adaptive one on a fixed curve; with the copy index beside it too."""
    model, tokenizer, draft = tiny_pair(family)
    prompt = prompt_ids(24, seed=7)
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 80)
        reply = [r.token for r in want]
        for block_size in (4, AdaptiveBlock(CURVE, 16)):
            index = SuffixIndex()
            first = list(
                stream_generate(
                    model, draft, tok, prompt, max_tokens=80, block_size=block_size, suffix_index=index, lookup=False
                )
            )
            again = list(
                stream_generate(
                    model, draft, tok, prompt, max_tokens=80, block_size=block_size, suffix_index=index, lookup=False
                )
            )
            assert_same_stream(first, want, logprob_atol=1e-3)
            assert_same_stream(again, want, logprob_atol=1e-3)
            assert suffix_tokens(again) > 40, Counter(r.source for r in again)
            for lookup in (False, True):
                partial = SuffixIndex()
                record(partial, prompt, changed(reply, [6, 5, 8, 7, 12]))
                got = list(
                    stream_generate(
                        model,
                        draft,
                        tok,
                        prompt,
                        max_tokens=80,
                        block_size=block_size,
                        suffix_index=partial,
                        lookup=lookup,
                    )
                )
                assert_same_stream(got, want, logprob_atol=1e-3)
                if not lookup:  # (accepted in part, by different lengths)
                    assert len(set(suffix_cycles(got))) > 1, suffix_cycles(got)


def test_batched_rows_share_the_index_and_equal_the_rows_served_alone(tiny_pair):
    """Rows of one batch draft from what earlier calls and earlier rows produced (a repeated prompt in the same
    call, one row at a time), each row's output mlx-lm's greedy stream."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompts = [prompt_ids(20, seed=0), prompt_ids(20, seed=3), prompt_ids(20, seed=5)]
    with without_eos(tokenizer) as tok:
        want = [[r.token for r in reference(model, tok, p, 60)] for p in prompts]
        for block_size in (None, 4):
            index = SuffixIndex()
            for run in range(2):
                got, sources = [[] for _ in prompts], [Counter() for _ in prompts]
                for i, r in stream_batch_generate(
                    model,
                    draft,
                    tok,
                    prompts,
                    max_tokens=60,
                    block_size=block_size,
                    max_batch=3,
                    suffix_index=index,
                    lookup=False,
                ):
                    got[i].append(r.token)
                    sources[i][r.source] += 1
                assert got == want, (block_size, run)
                if block_size == 4:
                    assert all((s["suffix"] > 20) == (run == 1) for s in sources), sources
            assert index.tokens > 0
        index, got = SuffixIndex(), {0: [], 1: []}
        for i, r in stream_batch_generate(
            model,
            draft,
            tok,
            [prompts[0]] * 2,
            max_tokens=60,
            block_size=4,
            max_batch=1,
            suffix_index=index,
            lookup=False,
        ):
            got[i].append(r)
        assert [r.token for r in got[0]] == [r.token for r in got[1]] == want[0]
        assert suffix_tokens(got[1]) > suffix_tokens(got[0]) + 20  # (the first copies only its own repeats)


def test_a_session_carries_its_index_and_another_thread_shares_it(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3_5")
    index = SuffixIndex()
    session = make_session(model, draft, suffix_index=index)
    prompt = prompt_ids(18, seed=2)
    out = {}
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 50)
        first = list(stream_generate(model, draft, tok, prompt, max_tokens=50, block_size=4, session=session))
        assert index.tokens > 50 and suffix_tokens(first) == 0

        def other():  # a fresh call on another thread, given the same index (read there: its stream's arrays)
            got = stream_generate(
                model, draft, tok, prompt, max_tokens=50, block_size=4, suffix_index=index, lookup=False
            )
            out["got"] = [(r.token, r.source) for r in got]

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert_same_stream(first, want, logprob_atol=1e-3)
    assert [token for token, _ in out["got"]] == [r.token for r in want]
    assert Counter(source for _, source in out["got"])["suffix"] > 25
    with pytest.raises(ValueError, match="suffix_index must be a dflash_mlx.SuffixIndex"):
        list(stream_generate(model, draft, tokenizer, prompt, max_tokens=4, suffix_index={}))


def test_the_mlx_lm_drop_in_passes_the_index_through(tiny_pair_dirs):
    """A script with only its import line changed, given `suffix_index=`; dropped where mlx-lm decodes."""
    import mlx_lm

    target, draft = tiny_pair_dirs("qwen3")
    model, tokenizer = plugin.load(target, draft=draft)
    prompt = mx.array(prompt_ids(16, seed=9))
    with without_eos(tokenizer) as tok:
        want = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=40)]
        index = SuffixIndex()
        runs = [list(plugin.stream_generate(model, tok, prompt, max_tokens=40, suffix_index=index)) for _ in range(2)]
        assert [[r.token for r in run] for run in runs] == [want, want]
        # (the first run may draft from its own earlier tokens; the second has the whole first run)
        assert suffix_tokens(runs[1]) > max(suffix_tokens(runs[0]), 10), [suffix_tokens(r) for r in runs]
        with pytest.warns(UserWarning, match="falling back"):
            sampler = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731 - a custom sampler: mlx-lm decodes
            plain = plugin.stream_generate(model, tok, prompt, max_tokens=8, suffix_index=index, sampler=sampler)
            assert [r.token for r in plain] == want[:8]


def _first_token_picks(model, prompt: list[int], settings: SamplingSettings) -> tuple[np.ndarray, dict]:
    """The target's first-token distribution and, for each token it may sample, its greedy pick after it."""
    p1 = np.array(distribution(model(mx.array(prompt)[None])[0, -1:], settings)[0], dtype=np.float64)
    likely = [int(x) for x in np.nonzero(p1 > 1e-9)[0]]
    picks = mx.argmax(model(mx.array([prompt + [x] for x in likely]))[:, -1], axis=-1).tolist()
    return p1, dict(zip(likely, picks))


def test_sampled_tokens_follow_the_target_where_the_suffix_proposes_point_masses(tiny_pair):
    """Over many seeds, the second sampled token follows the target's exact distribution while its cycle
    verifies a suffix span (the greedy pick an earlier generation made after the first token), accepted in
    some runs, not in others."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt, settings = prompt_ids(12, seed=4), SamplingSettings(**SAMPLED)
    p1, picks = _first_token_picks(model, prompt, settings)
    p2 = two_token_distributions(model, prompt, settings)[1]
    firsts, seconds, accepted, runs = [], [], 0, 600
    session = make_session(model, draft)  # (the prompt is prefilled once)
    mx.random.seed(0)
    with without_eos(tokenizer) as tok:
        for _ in range(runs):
            index = SuffixIndex()  # (the same span every run: the earlier generations' picks only)
            for x, pick in picks.items():
                record(index, prompt + [x], [pick])
            out = list(
                stream_generate(
                    model,
                    draft,
                    tok,
                    prompt,
                    max_tokens=3,
                    block_size=3,
                    session=session,
                    suffix_index=index,
                    lookup=False,
                    **SAMPLED,
                )
            )
            assert [r.cycle_block_size for r in out if r.cycle_block_size][0] == 2  # the anchor and a span of 1
            firsts.append(out[0].token)
            seconds.append(out[1].token)
            accepted += out[1].source == "suffix"
    assert 0.05 * runs < accepted < 0.95 * runs
    check_follows(firsts, p1)
    check_follows(seconds, p2)


def test_batched_sampled_rows_with_suffix_spans_follow_the_target(tiny_pair):
    """The same in a batch (unseeded rows, which draft from the index; every row also records its tokens, so
    later rows vote among what earlier rows sampled too: still point masses)."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt, settings = prompt_ids(12, seed=4), SamplingSettings(**SAMPLED)
    p1, picks = _first_token_picks(model, prompt, settings)
    p2 = two_token_distributions(model, prompt, settings)[1]
    index, runs, got = SuffixIndex(), 480, {}
    for x, pick in picks.items():
        record(index, prompt + [x], [pick])
    mx.random.seed(1)
    with without_eos(tokenizer) as tok:
        for i, r in stream_batch_generate(
            model, draft, tok, [prompt] * runs, max_tokens=2, block_size=4, max_batch=8, suffix_index=index, **SAMPLED
        ):
            got.setdefault(i, []).append(r)
    assert all(len(out) == 2 for out in got.values()) and len(got) == runs
    assert 0.05 * runs < sum(out[1].source == "suffix" for out in got.values()) < 0.95 * runs
    check_follows([out[0].token for out in got.values()], p1)
    check_follows([out[1].token for out in got.values()], p2)


def test_a_seeded_sampled_call_drafts_from_the_index_and_keeps_the_text_of_its_seed(tiny_pair):
    """Other conversations' tokens draft for a seeded call, and its text is the seed's plain-path text."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt, settings = prompt_ids(12, seed=4), SamplingSettings(**SAMPLED)
    _, picks = _first_token_picks(model, prompt, settings)
    index = SuffixIndex()
    for x, pick in picks.items():
        record(index, prompt + [x], [pick])
    held = index.tokens
    seeded, unseeded = Counter(), Counter()
    with without_eos(tokenizer) as tok:
        for seed in range(30):
            kw = dict(max_tokens=3, block_size=3, suffix_index=index, lookup=False, **SAMPLED)
            out = list(stream_generate(model, draft, tok, prompt, seed=seed, **kw))
            seeded.update(r.source for r in out)
            plain = stream_generate(model, None, tok, prompt, seed=seed, max_tokens=3, **SAMPLED)
            assert [r.token for r in out] == [r.token for r in plain], seed
            unseeded.update(r.source for r in stream_generate(model, draft, tok, prompt, **kw))
    assert seeded["suffix"] > 0 and unseeded["suffix"] > 0
    assert index.tokens > held  # the seeded calls' replies are recorded too


def test_the_chat_keeps_an_index_across_reset_and_shows_its_tokens(tiny_pair_dirs):
    """`dflash-mlx chat`: the same question after /reset drafts the first reply (the panel's and the
    summary's sources name "suffix"); --suffix-cache-tokens 0 turns it off."""
    from typer.testing import CliRunner

    from dflash_mlx.cli.commands import app

    target, draft = tiny_pair_dirs("qwen3")
    args = ["chat", "--model", str(target), "--draft", str(draft), "-n", "40", "--block-size", "4", "--lookup", "off"]
    script = "hello there\n/reset\nhello there\n/stats\n/quit\n"
    on = CliRunner().invoke(app, args, input=script, catch_exceptions=False)
    off = CliRunner().invoke(app, [*args, "--suffix-cache-tokens", "0"], input=script, catch_exceptions=False)
    assert on.exit_code == off.exit_code == 0, on.output
    assert "suffix" in on.stdout and "suffix" not in off.stdout


def test_a_row_alone_in_a_batch_plans_as_one_request_does(tmp_path, tiny_pair_dirs):
    """A batch of one chooses each cycle as `stream_generate` does (plain decoding, the drafter or a span
    source, by rate, on the same pinned curve): the same sources and widths cycle by cycle, a span as wide as
    the policy prices it, not fitted into the block the drafter's policy chose."""
    target, draft = tiny_pair_dirs("qwen3")
    prompt = prompt_ids(24, seed=7)
    streams, keep = [], []
    for batched in (False, True):
        model, tokenizer, drafter = dflash_mlx.load(target, draft=draft)  # (its own drafter: no history shared)
        keep.append(drafter)
        with cheap_blocks_cache(tmp_path / str(batched), model, drafter), without_eos(tokenizer) as tok:
            reply = [r.token for r in reference(model, tok, prompt, 60)]
            index = SuffixIndex()
            record(index, prompt, changed(reply, [9, 7, 12]))
            if batched:
                run = [
                    r
                    for _, r in stream_batch_generate(model, drafter, tok, [prompt], max_tokens=60, suffix_index=index)
                ]
            else:
                run = list(stream_generate(model, drafter, tok, prompt, max_tokens=60, suffix_index=index))
        assert [r.token for r in run] == reply
        streams.append([(r.source, r.cycle_block_size) for r in run])
    assert streams[0] == streams[1]
    assert {"suffix", "dflash"} <= {source for source, _ in streams[0]}, Counter(s for s, _ in streams[0])
