"""A target's own MTP heads as its drafter: read from its checkpoint under the family's names, drafting exactly.

The tiny targets (tests/helpers/mtp_targets.py) keep random MTP heads in the
original checkpoints' layout for qwen3_5, qwen3_next, glm4_moe, glm4_moe_lite,
mimo, deepseek_v3 (61 small layers) and deepseek_v32; mlx-lm loads each and drops the heads,
`load_mtp` reads them back through the family's own sanitize. Random heads
draft badly: these tests check that whatever they draft, the output is
mlx-lm's, and that the drafts are what the heads compute (the trained heads'
acceptance is tests/test_mtp_training.py's).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx import batch_generate, make_session, stream_generate
from dflash_mlx.models.resolve import ModelChoiceError
from dflash_mlx.mtp.checkpoint import NO_MTP
from dflash_mlx.mtp.scan import MTPWeightsError, has_mtp_weights
from dflash_mlx.proposers.base import source_name
from dflash_mlx.proposers.mtp import MTPProposer, load_mtp
from dflash_mlx.targets.adapter import TargetAdapter
from helpers import (
    MTP_FAMILIES,
    assert_cycle_accounting,
    assert_same_stream,
    check_a_seed_fixes_the_text,
    check_keyed_drafts,
    mtp_stage_reference,
    ours,
    prompt_ids,
    reference,
    without_eos,
)

LAYERED = ("qwen3_5", "glm4_moe_lite", "mimo")  # one of each input order, feedback and attention kind
# A verify of b rows and a one-row step run different matmul kernels: the log-probabilities of the MoE and hybrid
# targets move by up to ~1.3e-4 here (qwen3_next), as in the other hybrid tests (tests/test_hybrid_sliding.py)
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def mtp_pair(mtp_target):
    """``mtp_pair(family, **kw) -> (directory, model, tokenizer, MTPProposer)`` (mlx-lm's model, shared)."""

    @functools.cache
    def get(family, **kw):
        directory = mtp_target(family, **kw)
        model, tokenizer = mlx_lm.load(str(directory))
        return directory, model, tokenizer, load_mtp(directory, model)

    return get


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mlx_lm_loads_each_target_and_the_heads_read_back_as_written(mtp_pair, family):
    directory, model, _, mtp = mtp_pair(family)
    assert has_mtp_weights(str(directory))
    head = mtp.drafter
    assert len(head.stages) == 1 and type(head.stages[0].layer) is type(model.layers[head.template])
    own, layer = mtp_stage_reference(model, family)
    stage = head.stages[0]
    read = dict(tree_flatten(stage.layer.parameters()))
    assert set(read) == set(layer)
    for name, value in layer.items():
        np.testing.assert_allclose(np.array(read[name]), np.array(value), atol=1e-6, err_msg=name)
    for role, params in own.items():  # norms as scales: Qwen's zero-centred ones shifted back
        np.testing.assert_allclose(np.array(stage[role].weight), np.array(params["weight"]), atol=1e-6, err_msg=role)
    assert ("head" in stage) == (family in ("deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite"))


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_the_adapter_hands_over_the_final_hidden_state_and_embeddings(mtp_pair, family):
    """What the heads read is the target's own: its head over the captured final hidden state gives its logits
    bit for bit, and the embeddings are its table's rows; DFlash's layer taps are unchanged beside them."""
    _, model, _, _ = mtp_pair(family)
    ids = mx.array([prompt_ids(11, seed=8)], mx.int32)
    both = TargetAdapter(model, (1, 2), final=True)
    logits, features = both.forward(ids, None)
    size = both.hidden_size
    assert features.shape[-1] == 4 * size
    assert mx.array_equal(both.head(features[..., 2 * size : 3 * size]), logits)
    assert mx.array_equal(features[..., 3 * size :], both.embed(ids))
    taps = TargetAdapter(model, (1, 2)).forward(ids, None)[1]
    assert mx.array_equal(taps, features[..., : 2 * size])


@pytest.mark.parametrize("block_size", [2, 3, 4])
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_greedy_with_random_heads_equals_mlx_lm(mtp_pair, family, block_size):
    _, model, tokenizer, mtp = mtp_pair(family)
    prompt = prompt_ids(7)
    tokens = 24 if family == "deepseek_v3" else 48
    with without_eos(tokenizer) as tok:
        want = reference(model, tok, prompt, tokens)
        got = ours(model, mtp, tok, prompt, tokens, block_size=block_size, lookup=False)
    assert_same_stream(got, want, logprob_atol=LOGPROB_ATOL)
    cycles = assert_cycle_accounting(got, block_size)
    assert block_size in [r.cycle_block_size for r in got if r.cycle_block_size]  # the heads drafted
    assert len(cycles) >= 1


def test_a_seed_fixes_the_text_with_the_heads(mtp_pair):
    _, model, tokenizer, mtp = mtp_pair("qwen3_5")
    check_a_seed_fixes_the_text(model, mtp, tokenizer, prompt_ids(7), {"temperature": 0.8, "top_k": 20})
    assert check_keyed_drafts(model, mtp, tokenizer, prompt_ids(7), {"temperature": 0.8, "top_k": 20}) > 20


def _nexts(head, target, features, anchor):
    """The embedding after each context row (the anchor's after the last), as the heads pair them."""
    size = target.hidden_size
    nexts = mx.concatenate([features[:, 1:, -size:], target.embed(anchor[None])], axis=1)
    if head.layout.masks_first_position:
        nexts = mx.concatenate([mx.zeros_like(nexts[:, :1]), nexts[:, 1:]], axis=1)
    return nexts


@pytest.mark.parametrize("family", LAYERED)
def test_drafts_are_the_heads_causal_pass_however_the_context_arrives(mtp_pair, family):
    """Context handed over in uneven batches, drafts chained, the chain cut back, more context: every first draft
    is the argmax of one causal pass of stage 0 over all the pairs, and a chained draft the pass with the first
    step's output appended."""
    _, model, _, mtp = mtp_pair(family)
    target = TargetAdapter(model, final=True)
    ids = mx.array(prompt_ids(30, seed=3), mx.int32)
    _, features = target.forward(ids[None], None, logits=False)
    proposer = mtp.fork()
    proposer.start(target, ids[:1])
    head, size = proposer.drafter, target.hidden_size
    fed = 0
    for cut in (5, 6, 13, 20, 29):
        proposer.add_context(features[:, fed:cut])
        fed = cut
        drafts = proposer.propose(ids[cut : cut + 1], cut, 2).tokens.tolist()
        hidden = features[:, :cut, -2 * size : -size]
        nexts = _nexts(head, target, features[:, :cut], ids[cut : cut + 1])
        out = head.forward(0, hidden, nexts)  # one causal pass over every pair
        assert drafts[0] == int(mx.argmax(head.logits(0, out[:, -1:], target)[0, -1]).item())
        hidden = mx.concatenate([hidden, head.feedback(0, out[:, -1:])], axis=1)
        nexts = mx.concatenate([nexts, target.embed(mx.array([drafts[:1]]))], axis=1)
        out = head.forward(0, hidden, nexts)  # the first step's output and draft appended
        assert drafts[1] == int(mx.argmax(head.logits(0, out[:, -1:], target)[0, -1]).item())


@pytest.mark.parametrize("family", ["mimo", "glm4_moe_lite"])  # (mlx-lm drops only one glm4_moe MTP layer)
def test_several_mtp_layers_take_the_chained_steps_in_turn(mtp_pair, family):
    """Two MTP layers (the config's count): step s runs layer s % 2 on its own cache; output still mlx-lm's."""
    _, model, tokenizer, mtp = mtp_pair(family, mtp_layers=2)
    assert len(mtp.drafter.stages) == 2
    own, layer = mtp_stage_reference(model, family, stage=1)
    read = dict(tree_flatten(mtp.drafter.stages[1].layer.parameters()))
    assert all(np.allclose(np.array(read[n]), np.array(v), atol=1e-6) for n, v in layer.items())
    prompt = prompt_ids(9, seed=9)
    with without_eos(tokenizer) as tok:
        got, want = ours(model, mtp, tok, prompt, 40, block_size=4), reference(model, tok, prompt, 40)
        assert_same_stream(got, want, logprob_atol=LOGPROB_ATOL)


def test_quantized_heads_load_as_the_targets_layers_do(mtp_pair):
    _, model, tokenizer, mtp = mtp_pair("qwen3_5", quantize_bits=4)
    stage = mtp.drafter.stages[0]
    quantized = [m for _, m in stage.layer.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized and all(m.bits == 4 and m.group_size == 32 for m in quantized)
    assert isinstance(stage.projection, nn.QuantizedLinear)
    prompt = prompt_ids(9, seed=2)
    with without_eos(tokenizer) as tok:
        got, want = ours(model, mtp, tok, prompt, 40, block_size=3), reference(model, tok, prompt, 40)
        assert_same_stream(got, want, logprob_atol=LOGPROB_ATOL)


def test_load_drafts_with_the_heads_where_no_drafter_is_registered(mtp_target):
    directory = mtp_target("glm4_moe")
    model, _, draft = dflash_mlx.load(str(directory))
    assert isinstance(draft, MTPProposer) and source_name(draft) == "mtp"
    assert isinstance(dflash_mlx.load(str(directory), draft="mtp")[2], MTPProposer)
    with pytest.raises(ModelChoiceError, match="draft_bits .--draft-bits. quantizes a DFlash drafter"):
        dflash_mlx.load(str(directory), draft="mtp", draft_bits=4)
    with pytest.raises(ModelChoiceError, match="a tensor-sharded target drafts with a DFlash drafter"):
        dflash_mlx.load(str(directory), shard="tensor")
    bare = mtp_target("glm4_moe", with_mtp=False)
    with pytest.raises(MTPWeightsError, match=NO_MTP):
        dflash_mlx.load(str(bare), draft="mtp")
    with pytest.raises(ModelChoiceError, match="no drafter is registered"):
        dflash_mlx.load(str(bare))


def test_a_session_continues_and_rewinds_with_the_heads(mtp_pair):
    """A chat's next turn extends the cached prefix; an edited turn cuts it (the heads' cache trimmed)."""
    _, model, tokenizer, mtp = mtp_pair("glm4_moe")
    session = make_session(model, mtp)
    first = prompt_ids(12, seed=4)
    with without_eos(tokenizer) as tok:
        reply = [r.token for r in stream_generate(model, mtp, tok, first, max_tokens=20, block_size=3, session=session)]
        follow = first + reply + prompt_ids(5, seed=5)
        edited = first[:8] + prompt_ids(6, seed=6)
        for prompt in (follow, edited):
            got = list(stream_generate(model, mtp, tok, prompt, max_tokens=24, block_size=3, session=session))
            assert_same_stream(got, reference(model, tok, prompt, 24), logprob_atol=LOGPROB_ATOL)
        assert session.reused > 0


def test_batched_rows_draft_with_the_heads_as_alone(mtp_pair):
    _, model, tokenizer, mtp = mtp_pair("qwen3_next")
    prompts = [prompt_ids(n, seed=n) for n in (5, 9, 14)]
    with without_eos(tokenizer) as tok:
        texts = batch_generate(model, mtp, tok, prompts, max_tokens=20, block_size=3).texts
        for prompt, text in zip(prompts, texts):
            assert text == "".join(r.text for r in reference(model, tok, prompt, 20))


def test_quantized_kv_and_structured_outputs_with_the_heads(mtp_pair):
    _, model, tokenizer, mtp = mtp_pair("mimo", hidden_size=128)  # head_dim 32: a quantized KV group
    prompt = prompt_ids(10, seed=7)
    kv = dict(kv_bits=4, kv_group_size=32, quantized_kv_start=4)
    with without_eos(tokenizer) as tok:  # (tokens: the log-probabilities differ as the kernels do, test_quantized_kv)
        got, want = ours(model, mtp, tok, prompt, 30, block_size=3, **kv), reference(model, tok, prompt, 30, **kv)
        assert_same_stream(got, want, logprob_atol=None)
    schema = {"type": "json_object"}
    plain = "".join(r.text for r in stream_generate(model, None, tokenizer, "a", max_tokens=24, response_format=schema))
    drafted = stream_generate(model, mtp, tokenizer, "a", max_tokens=24, block_size=3, response_format=schema)
    assert "".join(r.text for r in drafted) == plain


def test_the_mlx_lm_drop_in_loads_the_heads_and_decodes_as_mlx_lm(mtp_target):
    from dflash_mlx import mlx_lm as plugin

    directory = mtp_target("qwen3_5")
    model, tokenizer = plugin.load(str(directory))
    assert isinstance(plugin.remembered_draft(model), MTPProposer)
    want = mlx_lm.generate(model, tokenizer, "the cat", max_tokens=24)
    assert plugin.generate(model, tokenizer, "the cat", max_tokens=24) == want


def test_train_arch_mtp_refuses_the_dflash_drafters_own_options(tmp_path):
    from helpers.train_cli import run_train

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    for flag, value in (("--draft-layers", "2"), ("--init", "x"), ("--target-layers", "1")):
        code, output = run_train(
            "--arch", "mtp", "--model", tmp_path, "--data", data, "--out", tmp_path / "o", flag, value
        )
        assert code == 1 and f"{flag} is for DFlash and DSpark drafters, not --arch mtp" in " ".join(output.split())
    code, output = run_train(
        "--arch", "mtp", "--model", tmp_path, "--data", data, "--out", tmp_path / "o", "--markov-rank", "8"
    )
    assert code == 1 and "it needs --arch dspark, not --arch mtp" in " ".join(output.split())
    code, output = run_train("--arch", "eagle", "--model", tmp_path, "--data", data, "--out", tmp_path / "o")
    assert code == 1 and "--arch must be one of dflash, dspark, mtp" in " ".join(output.split())
