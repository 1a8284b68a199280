"""Greedy DFlash equals mlx-lm's own greedy decoding, token for token.

The reference is `mlx_lm.stream_generate` without a draft (generate_step).
Drafters are random tiny checkpoints (they mostly get rejected) and an oracle
proposer that offers the target's true continuation with one corruption per
block, cycling through every acceptance length 0..b-1.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import stream_generate
from dflash_mlx.models.block_size import default_block_size
from dflash_mlx.engine import speculative_cycles
from dflash_mlx.proposers.oracle import OracleProposer
from dflash_mlx.proposers import DFlashProposer
from dflash_mlx.targets.adapter import TargetAdapter
from helpers import (
    ALL_FAMILIES,
    EOS_ID,
    TINY_VOCAB,
    assert_cycle_accounting,
    assert_same_stream,
    greedy_with_margins,
    ours,
    prompt_ids,
    reference,
    with_eos,
    without_eos,
)

DENSE = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral"]
BF16_OK = ["llama", "qwen2", "qwen3", "mistral"]  # MLX's CPU MoE gather is float32-only


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_tiny_targets_have_the_margins_these_tests_rely_on(tiny_target, family):
    """Equal token streams mean something only if greedy decoding is not a near-tie or a loop: the tiny
    targets' top two logits stay apart and their 200-token continuations vary (tests/helpers builders)."""
    model, tok = mlx_lm.load(str(tiny_target(family)))
    prompt = tok.encode("The cat sat on the warm window", add_special_tokens=False)[:7]
    tokens, gaps = greedy_with_margins(model, prompt, 200)
    assert np.percentile(gaps, 5) > 0.03 and gaps.min() > 1e-4
    assert len(set(tokens)) > 40 and len(set(tokens[-50:])) > 5


def oracle_for(want, block_size):
    continuation = [r.token for r in want] + [0] * block_size
    return OracleProposer(continuation, list(range(block_size)), TINY_VOCAB, block_size)


@pytest.mark.parametrize("block_size", [1, 2, 5, 16])
@pytest.mark.parametrize("family", DENSE)
def test_random_drafter_equals_mlx_lm(tiny_pair, family, block_size):
    model, tokenizer, draft = tiny_pair(family)
    prompt = prompt_ids(7)
    want = reference(model, tokenizer, prompt, 200)
    got = ours(model, draft, tokenizer, prompt, 200, block_size=block_size)
    assert_same_stream(got, want)
    assert_cycle_accounting(got, block_size)


@pytest.mark.parametrize("block_size", [2, 5, 16])
@pytest.mark.parametrize("family", DENSE)
def test_oracle_covers_every_acceptance_length(tiny_pair, family, block_size):
    model, tokenizer, _ = tiny_pair(family)
    prompt = prompt_ids(7, seed=1)
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, 200)
        got = ours(model, oracle_for(want, block_size), tok, prompt, 200, block_size=block_size)
    assert_same_stream(got, want)
    cycles = assert_cycle_accounting(got, block_size)
    assert set(range(1, block_size + 1)) <= set(cycles)  # accepted 0..b-1 drafts
    drafted = sum(r.from_draft for r in got)
    assert drafted == sum(c - 1 for c in cycles if c)  # every cycle: accepted drafts + 1 bonus


@pytest.mark.parametrize("prompt_len", [1, 7, 650])
@pytest.mark.parametrize("prefill_step_size", [2048, 256])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_prompt_lengths_and_chunked_prefill(tiny_pair, family, prompt_len, prefill_step_size):
    model, tokenizer, draft = tiny_pair(family)
    prompt = prompt_ids(prompt_len, seed=2)
    want = reference(model, tokenizer, prompt, 60, prefill_step_size=prefill_step_size)
    for proposer in (draft, oracle_for(want, 5)):
        got = ours(model, proposer, tokenizer, prompt, 60, block_size=5, prefill_step_size=prefill_step_size)
        assert_same_stream(got, want)


@pytest.mark.parametrize("max_tokens", [1, 2, 17, 200])
@pytest.mark.parametrize("block_size", [2, 16])
def test_max_tokens_honoured_exactly(tiny_pair, max_tokens, block_size):
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = prompt_ids(7, seed=1)
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, max_tokens)
        for proposer in (draft, oracle_for(want, block_size)):
            got = ours(model, proposer, tok, prompt, max_tokens, block_size=block_size)
            assert_same_stream(got, want)
            assert len(got) == max_tokens and got[-1].finish_reason == "length"
            assert_cycle_accounting(got, block_size)


@pytest.mark.slow  # the dtype and quantization matrix: the full suite
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("family", BF16_OK)
def test_bfloat16_targets(tiny_pair, family, block_size):
    model, tokenizer, draft = tiny_pair(family, dtype="bfloat16")
    prompt = prompt_ids(7, seed=3)
    want = reference(model, tokenizer, prompt, 120)
    for proposer in (draft, oracle_for(want, block_size)):
        got = ours(model, proposer, tokenizer, prompt, 120, block_size=block_size)
        assert_same_stream(got, want, logprob_atol=None)


@pytest.mark.slow  # the dtype and quantization matrix: the full suite
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_quantized_targets(tiny_pair, family, bits):
    model, tokenizer, draft = tiny_pair(family, quantize_bits=bits)
    assert default_block_size(model, draft) == (5 if bits <= 4 else 16)
    prompt = prompt_ids(7, seed=4)
    want = reference(model, tokenizer, prompt, 120)
    for proposer in (draft, oracle_for(want, 16)):
        for block_size in (None, 16):
            got = ours(model, proposer, tokenizer, prompt, 120, block_size=block_size)
            assert_same_stream(got, want, logprob_atol=None)


def test_tied_embeddings_target(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3", tie_word_embeddings=True)
    assert not hasattr(model, "lm_head")
    prompt = prompt_ids(7)
    want = reference(model, tokenizer, prompt, 100)
    for proposer in (draft, oracle_for(want, 8)):
        assert_same_stream(ours(model, proposer, tokenizer, prompt, 100, block_size=8), want)


def test_eos_inside_a_block_ends_the_output(tiny_pair):
    model, tokenizer, _ = tiny_pair("qwen3")
    prompt = prompt_ids(7, seed=1)
    with without_eos(tokenizer) as tok:
        plain = reference(model, tok, prompt, 60)
    # Declare the 23rd generated token an EOS: with blocks of 16 fully accepted it
    # falls in the middle of the second cycle (tokens 18..33).
    eos_token = plain[22].token
    first = [r.token for r in plain].index(eos_token)
    with with_eos(tokenizer, {EOS_ID, eos_token}) as tok:
        want = reference(model, tok, prompt, 60)
        oracle = OracleProposer([r.token for r in plain], [15], TINY_VOCAB, 16)
        got = ours(model, oracle, tok, prompt, 60, block_size=16)
    assert_same_stream(got, want)
    assert len(got) == first + 1 and got[-1].token == eos_token
    assert got[-1].finish_reason == "stop" and got[-1].text == want[-1].text
    cycles = assert_cycle_accounting(got, 16)
    assert cycles[-1] == (first + 1) - 1 - sum(cycles[:-1]) and cycles[-1] < 16


def test_plain_path_without_drafter(tiny_pair):
    model, tokenizer, _ = tiny_pair("qwen2")
    prompt = prompt_ids(9)
    want = reference(model, tokenizer, prompt, 50)
    got = ours(model, None, tokenizer, prompt, 50)
    assert_same_stream(got, want)
    assert all(r.cycle_tokens is None and not r.from_draft for r in got)


def test_repeated_runs_are_identical(tiny_pair):
    model, tokenizer, draft = tiny_pair("llama")
    prompt = prompt_ids(11)
    runs = [
        [(r.token, r.cycle_tokens, r.from_draft) for r in ours(model, draft, tokenizer, prompt, 80, block_size=5)]
        for _ in range(3)
    ]
    assert runs[0] == runs[1] == runs[2]


def test_draft_context_holds_committed_positions_only(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = mx.array(prompt_ids(13))
    proposer = DFlashProposer(draft)
    target = TargetAdapter(model, proposer.layer_ids)
    committed = 0
    for cycle in speculative_cycles(target, prompt, proposer, max_tokens=90, block_size=6):
        committed += len(cycle.tokens)
        if committed < 90:  # the next cycle is already queued: its anchor is the last token
            anchor_position = prompt.size + committed - 1
            assert proposer.context_end == anchor_position
            assert all(c.visible_rows == anchor_position for c in proposer.cache)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_forward_without_logits_leaves_the_same_caches_and_features(tiny_pair, family):
    """Prefill chunks skip the output head (`forward` / `verify` with `logits=False`): caches and features match."""
    model, _, draft = tiny_pair(family)
    target = TargetAdapter(model, DFlashProposer(draft).layer_ids)
    ids = mx.array([prompt_ids(11)])
    for run in (target.forward, lambda ids, cache, logits: target.verify(ids, cache, logits)[:2]):
        runs = []
        for logits in (True, False):
            cache = target.make_cache()
            out, features = run(ids, cache, logits=logits)
            assert (out is None) == (not logits)
            runs.append((features, [x for _, x in tree_flatten([c.state for c in cache])]))
        assert mx.array_equal(runs[0][0], runs[1][0])
        assert len(runs[0][1]) == len(runs[1][1]) > 0
        assert all(x is y is None or mx.array_equal(x, y) for x, y in zip(runs[0][1], runs[1][1]))


def test_the_proposer_hands_its_newest_context_to_the_next_block(tiny_pair):
    """The last rows handed over wait for the next block's forward (fused there); a second handover
    or a look at the cache ingests them first, the state (what a prefill chunk evaluates) does not.
    Drafts equal those of a proposer whose context was ingested apart."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = mx.array([prompt_ids(13)])
    waiting, apart = DFlashProposer(draft), DFlashProposer(draft)
    target = TargetAdapter(model, waiting.layer_ids)
    features = target.forward(prompt, target.make_cache())[1]
    for p in (waiting, apart):
        p.start(target, prompt[0])
    waiting.add_context(features[:, :5])
    assert waiting._pending is not None and waiting.context_end == 5 and waiting._cache[0].end == 0
    waiting.add_context(features[:, 5:12])  # the first batch is ingested, the second waits
    assert waiting._cache[0].end == 5 and waiting.context_end == 12
    apart.add_context(features[:, :12])
    assert all(arrays == [] for arrays in apart.state()) and apart._pending is not None  # still waiting
    apart.cache  # ingests
    assert apart._pending is None and apart._cache[0].end == 12 and all(len(a) == 2 for a in apart.state())
    anchor = mx.array([int(prompt[0, 12])])
    fused = waiting.propose(anchor, 12, 5).tokens
    assert waiting._pending is None and waiting._cache[0].end == 12
    assert fused.tolist() == apart.propose(anchor, 12, 5).tokens.tolist()
    waiting.add_context(features[:, 12:])
    assert [c.end for c in waiting.cache] == [13, 13] and waiting._pending is None  # `cache` ingests


class _StateCalls(DFlashProposer):
    """Counts the engine's calls for the drafter state to evaluate."""

    calls = 0

    def state(self) -> list:
        self.calls += 1
        return super().state()


@pytest.mark.parametrize("block_size", [1, 4])
def test_the_prompt_context_waits_for_a_drafting_cycle(tiny_pair, block_size):
    """A one-chunk prompt: the prefill evaluates the drafter's ingested context after its chunk (nothing
    yet), and with the prompt's last row only when the first cycle drafts (it then ingests the prompt
    there, not in that cycle); a first cycle at b = 1 leaves it lazy. The output stays mlx-lm's."""
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = prompt_ids(13)
    proposer = _StateCalls(draft)
    target = TargetAdapter(model, proposer.layer_ids)
    cycles = speculative_cycles(target, mx.array(prompt), proposer, max_tokens=12, block_size=block_size)
    tokens = [t for c in cycles for t in c.tokens]
    assert proposer.calls == (1 if block_size == 1 else 2)
    assert tokens == [r.token for r in reference(model, tokenizer, prompt, 12)]


def test_bounded_draft_context_stays_lossless(tiny_pair):
    model, tokenizer, draft = tiny_pair("qwen3")
    prompt = prompt_ids(30, seed=2)
    want = reference(model, tokenizer, prompt, 80)
    got = ours(model, draft, tokenizer, prompt, 80, block_size=6, max_draft_context=16)
    assert_same_stream(got, want)
    proposer = DFlashProposer(draft, max_context=16)
    for _ in speculative_cycles(
        TargetAdapter(model, proposer.layer_ids), mx.array(prompt), proposer, max_tokens=40, block_size=6
    ):
        assert all(c.visible_rows <= 16 for c in proposer.cache)
    assert proposer.context_end > 16
    with pytest.raises(ValueError, match="max_draft_context"):
        next(stream_generate(model, draft, tokenizer, prompt, max_draft_context=0))
