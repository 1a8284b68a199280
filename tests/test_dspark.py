"""DSpark drafters: every packaging drafted exactly as the reference (mlx-dspark 0.20.3) drafts it, and lossless.

- Loading: the four packagings and three backbones (helpers.dspark), reused
  embedding and head, a reduced draft vocabulary (`d2t`), a causal sliding
  block, no Markov head; what is not supported is refused naming the field.
- The drafts of our proposer equal the reference `DSparkDrafter`'s token for
  token on the same checkpoint and context, over several cycles and widths
  (`logits_start` 0 and 1: reading one as the other shifts every draft); the
  confidence head gives the reference's estimates; `logits_start` is derived
  as the reference derives it for every packaging.
- The block counts the anchor (a block-7 head whose anchor slot predicts
  verifies 8); the 4-bit cap applies to the verify width.
- Greedy output equals mlx-lm's on the families the suite sweeps; sampled
  drafts are drawn from their q with the Markov bias in it; a grammar chooses
  each draft before the next row (q included).
- A drafter whose Markov head alone predicts the target reaches the tokens per
  cycle the reference's drafts reach on the same prompts.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate as mlx_lm_stream_generate

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.draft.config import DraftConfigError
from dflash_mlx.draft.dspark_config import parse_dspark_config
from dflash_mlx.draft.load import DraftWeightsError
from dflash_mlx.models.block_size import capped_block_size, widest_block
from dflash_mlx.proposers import as_proposer
from dflash_mlx.proposers.dflash import proposer_for
from dflash_mlx.sampling import SamplingSettings
from dflash_mlx.structured import GrammarLogitsProcessor
from dflash_mlx.targets.adapter import TargetAdapter
from helpers import (
    ALL_FAMILIES,
    TINY_VOCAB,
    check_a_seed_fixes_the_text,
    check_first_two_sampled_tokens,
    check_keyed_drafts,
    chi_square_p,
    load_pair,
    prompt_ids,
    reference,
    without_eos,
)
from helpers.dspark import make_dspark, make_markov_dspark, successor_table
from helpers.dspark_reference import (
    ReferenceDrafting,
    check_drafts_match_the_reference,
    load_reference_drafter,
)
from helpers.dspark_reference import reference as yardstick
from helpers.formats import Order

TAPS = [1, 2]
VARIANTS = {
    "deepspec": {},
    "deepspec-anchor-slot": dict(block_size=8, logits_start=1),
    "deepspec-qwen3_5": dict(backbone="qwen3_5"),
    "deepspec-gemma4": dict(backbone="gemma4"),
    "deepspec-reused-embedding-and-head": dict(own_embedding=False, own_head=False),
    "deepspec-no-markov-head": dict(markov_rank=0, confidence=False),
    "deepspec-causal-window": dict(dflash_query_causal=True, sliding_window=12),
    "deepspec-attention-sink": dict(attention_sink_bias=True),
    "deepspec-interleaved-rope": dict(rope_is_neox_style=False),
    "speculators-anchor-slot": dict(packaging="speculators", block_size=8, logits_start=1),
    "speculators-slot-0-reduced-vocab": dict(packaging="speculators", block_size=7, draft_vocab_size=300),
    "specforge": dict(packaging="specforge"),
    "specforge-qwen3_5": dict(packaging="specforge", backbone="qwen3_5"),
    "specforge-yarn": dict(
        packaging="specforge",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "liquid": dict(packaging="liquid"),
}


def _checkpoint(tmp_path, target_dir, name="d", **kw):
    kw.setdefault("target_layer_ids", TAPS)
    return make_dspark(tmp_path / name, target_dir, **kw)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_drafts_equal_the_references_token_for_token(variant, qwen3_target, tmp_path):
    model, _, _ = load_pair(qwen3_target)
    draft_dir = _checkpoint(tmp_path, qwen3_target, **VARIANTS[variant])
    check_drafts_match_the_reference(model, draft_dir)


@pytest.mark.parametrize(
    "packaging, fields, expected",
    [
        ("deepspec", {}, 0),
        ("deepspec", {"logits_start": 1}, 1),
        ("deepspec", {"sample_from_anchor": False}, 1),
        ("deepspec", {"sample_from_anchor": True}, 0),
        ("speculators", {"tokens": 7, "block_size": 8}, 1),
        ("speculators", {"tokens": 8, "block_size": 8}, 0),
        ("speculators", {"sample_from_anchor": True}, 0),
        ("speculators", {}, 1),
        ("specforge", {}, 0),
        ("liquid", {}, 0),
    ],
)
def test_logits_start_is_derived_as_the_reference_derives_it(packaging, fields, expected, qwen3_target, tmp_path):
    fields = dict(fields)
    tokens = fields.pop("tokens", None)
    path = _checkpoint(tmp_path, qwen3_target, packaging=packaging, **fields)
    raw = json.loads((path / "config.json").read_text())
    if packaging == "speculators":
        methods = raw["speculators_config"]["proposal_methods"]
        if tokens is None:
            methods.clear()
        else:
            methods[0]["speculative_tokens"] = tokens
        (path / "config.json").write_text(json.dumps(raw))
    theirs = yardstick().config.DSparkConfig.from_json(str(path / "config.json"))
    ours = parse_dspark_config(raw)
    assert ours.logits_start == theirs.logits_start == expected
    assert ours.packaging == packaging


def test_the_block_counts_the_anchor_and_the_4bit_cap_bounds_the_verify(qwen3_target, tiny_target, tmp_path):
    model, _, _ = load_pair(qwen3_target)
    slot0 = load_draft(_checkpoint(tmp_path, qwen3_target, "a", block_size=7), model)
    anchor = load_draft(
        _checkpoint(tmp_path, qwen3_target, "b", packaging="speculators", block_size=8, logits_start=1), model
    )
    assert (slot0.config.max_drafts, widest_block(slot0)) == (7, 8)  # block 7, the anchor's slot predicting
    assert (anchor.config.max_drafts, widest_block(anchor)) == (7, 8)  # block 8, a pure anchor slot
    low, _, _ = load_pair(tiny_target("qwen3", quantize_bits=4))
    assert capped_block_size(widest_block(slot0), low, slot0) == 5  # the verify width: 4 drafts


@pytest.mark.parametrize(
    "change, match",
    [
        ({"markov_head_type": "gated"}, "markov_head_type"),
        ({"log_snr_conditioning": True}, "log_snr_conditioning"),
        ({"model_type": "llama"}, "model_type"),
        ({"logits_start": 7}, "logits_start"),
        ({"mask_token_id": 10_000}, "mask_token_id"),
    ],
)
def test_what_is_not_supported_is_refused_naming_it(change, match, qwen3_target, tmp_path):
    path = _checkpoint(tmp_path, qwen3_target, **change)
    with pytest.raises(DraftConfigError, match=match):
        load_draft(path)


def test_weights_that_do_not_fit_are_refused_naming_them(qwen3_target, tmp_path):
    reduced = _checkpoint(tmp_path, qwen3_target, "r", packaging="speculators", draft_vocab_size=300)
    weights = dict(mx.load(str(reduced / "model.safetensors")))
    weights.pop("d2t")
    mx.save_safetensors(str(reduced / "model.safetensors"), weights)
    with pytest.raises(DraftWeightsError, match="'d2t'"):
        load_draft(reduced)
    extra = _checkpoint(tmp_path, qwen3_target, "x")
    weights = dict(mx.load(str(extra / "model.safetensors")), **{"markov_head.markov_w3.weight": mx.zeros((2, 2))})
    mx.save_safetensors(str(extra / "model.safetensors"), weights)
    with pytest.raises(DraftWeightsError, match="markov_w3"):
        load_draft(extra)


# -- decoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_greedy_equals_mlx_lm_on_every_family(family, tiny_target, tmp_path):
    target_dir = tiny_target(family)
    model, tokenizer, _ = load_pair(target_dir)
    draft = load_draft(_checkpoint(tmp_path, target_dir, target_layer_ids=None), model)
    prompt = prompt_ids(9)
    with without_eos(tokenizer) as tok:
        want = [r.token for r in reference(model, tok, prompt, 60)]
        for block_size in (2, 8):
            got = [r.token for r in stream_generate(model, draft, tok, prompt, max_tokens=60, block_size=block_size)]
            assert got == want, (family, block_size)


def reference_tokens_per_cycle(model, draft_dir, prompt, max_tokens: int, count: int) -> tuple[list[int], float]:
    """Greedy speculative decoding with the reference's drafts (the target recomputed each cycle): the tokens
    and the mean tokens committed per cycle."""
    target = TargetAdapter(model, tuple(TAPS))
    drafting = ReferenceDrafting(load_reference_drafter(draft_dir, target.head, target.embed))
    sequence = list(prompt) + [int(mx.argmax(model(mx.array(prompt)[None])[0, -1]).item())]
    produced, cycles = 1, 0
    while produced < max_tokens:
        position = len(sequence) - 1
        _, features = target.forward(mx.array(sequence)[None], target.make_cache(), logits=False)
        drafting.add_context(features[:, drafting.context : position])
        drafts, _ = drafting.draft(sequence[-1], count)
        best = mx.argmax(model(mx.array(sequence + drafts)[None])[0, position:], axis=-1).tolist()
        accepted = 0
        while accepted < count and drafts[accepted] == best[accepted]:
            accepted += 1
        new = (drafts[:accepted] + [best[accepted]])[: max_tokens - produced]
        sequence += new
        produced += len(new)
        cycles += 1
    return sequence[len(prompt) :], (produced - 1) / cycles


@pytest.fixture(scope="module")
def markov_pair(qwen3_target, tmp_path_factory):
    """The qwen3 target and a drafter whose Markov head alone predicts its greedy continuations of PROMPTS."""
    model, tokenizer, _ = load_pair(qwen3_target)
    table = successor_table(model, tokenizer, MARKOV_PROMPTS, MARKOV_TOKENS, TINY_VOCAB)
    draft_dir = make_markov_dspark(tmp_path_factory.mktemp("markov") / "d", qwen3_target, table, target_layer_ids=TAPS)
    return model, tokenizer, draft_dir


MARKOV_PROMPTS = [prompt_ids(n, seed=60 + n) for n in (5, 9, 14)]
MARKOV_TOKENS = 48


def test_a_markov_dominated_drafter_reaches_the_references_tokens_per_cycle(markov_pair):
    model, tokenizer, draft_dir = markov_pair
    draft = load_draft(draft_dir, model)
    count = draft.config.max_drafts
    ours_total = theirs_total = 0.0
    with without_eos(tokenizer) as tok:
        for prompt in MARKOV_PROMPTS:
            got = list(
                stream_generate(model, draft, tok, prompt, max_tokens=MARKOV_TOKENS, block_size=count + 1, lookup=False)
            )
            tokens, theirs = reference_tokens_per_cycle(model, draft_dir, prompt, MARKOV_TOKENS, count)
            assert [r.token for r in got] == tokens == [r.token for r in reference(model, tok, prompt, MARKOV_TOKENS)]
            cycles = [r.cycle_tokens for r in got if r.cycle_tokens is not None]
            ours_total += sum(cycles) / len(cycles)
            theirs_total += theirs
    assert theirs_total / len(MARKOV_PROMPTS) > 2.0  # the Markov head does predict the target
    assert ours_total >= 0.9 * theirs_total, (ours_total, theirs_total)
    assert {r.source for r in got if r.from_draft} == {"dspark"}


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", ["sample", "argmax"])
def test_sampled_output_follows_the_target_with_the_markov_bias_active(markov_pair, draft_sampling):
    """Over seeded runs the first two tokens follow the target's distributions; the second comes from a cycle
    that verified a draft the Markov head proposed (sampled with its bias in q, or its argmax)."""
    model, tokenizer, draft_dir = markov_pair
    draft = load_draft(draft_dir, model)
    settings = {"temperature": 1.0, "draft_sampling": draft_sampling}
    check_first_two_sampled_tokens(model, draft, tokenizer, MARKOV_PROMPTS[0], settings)


def test_a_seed_fixes_the_text_and_drafts_share_the_targets_noise(markov_pair, qwen3_target, tmp_path):
    """The Markov-dominated drafter keeps a seed's text; a reduced vocabulary's drafts (drawn over the target's
    vocabulary, row by row) are the Gumbel-max of their q with each position's noise."""
    model, tokenizer, draft_dir = markov_pair
    check_a_seed_fixes_the_text(model, load_draft(draft_dir, model), tokenizer, MARKOV_PROMPTS[1], {"temperature": 0.5})
    reduced = load_draft(_checkpoint(tmp_path, qwen3_target, "r", packaging="speculators", draft_vocab_size=300), model)
    proposer = proposer_for(reduced)
    check_a_seed_fixes_the_text(model, proposer, tokenizer, MARKOV_PROMPTS[1], {"temperature": 1.0}, blocks=(3,))
    assert check_keyed_drafts(model, proposer, tokenizer, MARKOV_PROMPTS[1], {"temperature": 1.0}) > 20


def test_sampled_drafts_are_drawn_from_their_q_with_the_markov_bias(qwen3_target, tmp_path):
    """Row 0's drafts follow q_0; among runs with the same first draft, row 1's follow that run's q_1 (which
    the Markov bias of the first draft shapes: it differs between first drafts)."""
    model, _, _ = load_pair(qwen3_target)
    draft = load_draft(_checkpoint(tmp_path, qwen3_target, head_std=0.05), model)
    target = TargetAdapter(model, tuple(TAPS))
    proposer = as_proposer(draft, model)
    sequence = prompt_ids(12, seed=4)
    proposer.start(target, mx.array(sequence))
    proposer.add_context(target.forward(mx.array(sequence[:-1])[None], target.make_cache(), logits=False)[1])
    settings = SamplingSettings(temperature=1.0, top_k=12)
    anchor, position = mx.array(sequence[-1:]), len(sequence) - 1
    runs = [proposer.propose(anchor, position, 2, sampling=settings, key=mx.random.key(i)) for i in range(1500)]
    firsts = np.array([r.tokens[0].item() for r in runs])
    assert _fits(firsts, np.array(runs[0].probs[0], dtype=np.float64))
    common = np.bincount(firsts).argmax()
    same = [r for r, f in zip(runs, firsts) if f == common]
    q1 = np.array(same[0].probs[1], dtype=np.float64)
    assert _fits(np.array([r.tokens[1].item() for r in same]), q1)
    other = next(r for r, f in zip(runs, firsts) if f != common)
    assert not np.allclose(np.array(other.probs[1]), q1)  # q_1 depends on the first draft


def test_under_a_grammar_each_draft_is_chosen_before_the_next_row(markov_pair):
    """Greedy output under a schema equals mlx-lm's constrained decoding, with drafts accepted (the rows asked
    one by one, each with the draft chosen before it)."""
    model, tokenizer, draft_dir = markov_pair
    draft = load_draft(draft_dir, model)
    prompt = mx.array(prompt_ids(10, seed=2))
    processor = GrammarLogitsProcessor(tokenizer, Order)
    want = [
        r.token for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=80, logits_processors=[processor])
    ]
    got = list(stream_generate(model, draft, tokenizer, prompt, max_tokens=80, block_size=5, response_format=Order))
    assert [r.token for r in got] == want
    Order.model_validate_json("".join(r.text for r in got))
    assert any(r.from_draft and r.source == "dspark" for r in got)


def _fits(samples: np.ndarray, q: np.ndarray) -> bool:
    """Pearson's test of `samples` against the distribution `q` (bins expected fewer than 5 times pooled)."""
    q = q / q.sum()
    counts = np.bincount(samples, minlength=q.size)
    small = q * samples.size < 5
    pooled_counts = np.append(counts[~small], counts[small].sum())
    pooled = np.append(q[~small], q[small].sum())
    return chi_square_p(pooled_counts, pooled) > 1e-3
