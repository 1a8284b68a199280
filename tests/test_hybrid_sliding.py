"""Hybrid (Gated DeltaNet) and sliding-window targets: exact rollback, lossless output.

Windows are 8 in the fixtures, so 150-200 generated tokens fill and wrap every
ring cache many times, and blocks of 16 overflow a window within one verify.
"""

from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from dflash_mlx import stream_generate
from dflash_mlx.models.block_size import default_block_size
from dflash_mlx.targets.rollback import UnsupportedCacheError, check_caches, rollback
from dflash_mlx.targets.adapter import TargetAdapter
from helpers import assert_same_stream, check_lossless, prompt_ids, run_both, without_eos

HYBRID = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
SLIDING = ["llama_sliding", "gemma3_text", "gpt_oss", "gemma4"]
FAMILIES = HYBRID + SLIDING
FLOAT32_ONLY = {"qwen3_5_moe", "qwen3_next", "gpt_oss"}  # MoE gather kernels on MLX's CPU


@pytest.mark.parametrize("block_size", [2, 5, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_random_drafter_and_oracle_equal_mlx_lm(tiny_pair, family, block_size):
    model, tokenizer, draft = tiny_pair(family)
    prompt = prompt_ids(40, seed=5)
    check_lossless(model, tokenizer, draft, prompt, 160, block_size, logprob_atol=1e-3)


@pytest.mark.parametrize("block_size", [2, 16])
def test_gemma4_with_kv_sharing_and_per_layer_inputs(tiny_pair, block_size):
    model, tokenizer, draft = tiny_pair("gemma4", num_kv_shared_layers=2, hidden_size_per_layer_input=8)
    assert len(TargetAdapter(model).make_cache()) == 2  # the shared layers own no cache
    prompt = prompt_ids(40, seed=12)
    check_lossless(model, tokenizer, draft, prompt, 120, block_size, logprob_atol=1e-3)


@pytest.mark.parametrize("prompt_len", [1, 650])
@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_lengths_with_chunked_prefill(tiny_pair, family, prompt_len):
    model, tokenizer, draft = tiny_pair(family)
    prompt = prompt_ids(prompt_len, seed=6)
    check_lossless(model, tokenizer, draft, prompt, 60, 5, logprob_atol=1e-3, prefill_step_size=256)


@pytest.mark.slow  # the dtype and quantization matrix: the full suite
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in FLOAT32_ONLY])
def test_bfloat16(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family, dtype="bfloat16")
    prompt = prompt_ids(40, seed=7)
    with without_eos(tokenizer) as tok:
        for block_size in (5, 16):
            for proposer in (draft, "oracle"):
                got, want = run_both(model, tok, proposer, prompt, 100, block_size)
                assert_same_stream(got, want, logprob_atol=None)


@pytest.mark.slow  # the dtype and quantization matrix: the full suite
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "gemma3_text", "llama_sliding"])
def test_quantized(tiny_pair, family, bits, group_size):
    model, tokenizer, draft = tiny_pair(family, quantize_bits=bits, quantize_group_size=group_size)
    assert default_block_size(model, draft) == (5 if bits == 4 else draft.config.block_size)
    prompt = prompt_ids(40, seed=8)
    check_lossless(model, tokenizer, draft, prompt, 100, 16, logprob_atol=None)


@pytest.mark.slow  # the dtype and quantization matrix: the full suite
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt_oss"])
def test_mxfp4_targets(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family, quantize_bits=4, quantize_mode="mxfp4")
    assert default_block_size(model, draft) == 5
    prompt = prompt_ids(40, seed=8)
    check_lossless(model, tokenizer, draft, prompt, 80, 5, logprob_atol=None)


@pytest.mark.slow  # the dtype and quantization matrix: the full suite
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "gpt_oss"])
def test_quantized_moe_in_bfloat16(tiny_pair, family):
    model, tokenizer, draft = tiny_pair(family, dtype="bfloat16", quantize_bits=4)
    prompt = prompt_ids(40, seed=8)
    check_lossless(model, tokenizer, draft, prompt, 80, 5, logprob_atol=None)


def test_mlx_lm_speculative_decoding_diverges_on_full_ring_caches_but_we_do_not(tiny_pair, tiny_target):
    """mlx-lm's trim returns 0 once a ring cache is full, so rejected tokens stay."""
    model, tokenizer, draft = tiny_pair("llama_sliding")
    other, _ = mlx_lm_load(str(tiny_target("llama", seed=7)))  # a draft model it will reject
    prompt = prompt_ids(40, seed=9)
    with without_eos(tokenizer) as tok:
        plain = [r.token for r in mlx_lm_stream_generate(model, tok, mx.array(prompt), max_tokens=120)]
        theirs = [
            r.token
            for r in mlx_lm_stream_generate(
                model, tok, mx.array(prompt), max_tokens=120, draft_model=other, num_draft_tokens=3
            )
        ]
        ours = [r.token for r in stream_generate(model, draft, tok, prompt, max_tokens=120, block_size=4)]
    assert ours == plain
    if theirs == plain:
        pytest.skip("this mlx-lm's speculative decoding no longer diverges on full ring caches")
    assert theirs != plain


@pytest.mark.parametrize("family", HYBRID)
def test_gated_delta_rollback_equals_feeding_only_the_kept_rows(tiny_pair, family):
    model, _, _ = tiny_pair(family)
    target = TargetAdapter(model)
    ids = mx.array([prompt_ids(30, seed=10)])
    for keep in (0, 1, 4, 7):
        fed, verified = target.make_cache(), target.make_cache()
        target.forward(ids[:, :20], fed)
        target.forward(ids[:, :20], verified)
        target.forward(ids[:, 20 : 20 + keep], fed) if keep else None
        _, _, record = target.verify(ids[:, 20:28], verified)
        rollback(verified, record, keep)
        linear = 0
        for a, b in zip(fed, verified):
            if isinstance(a, ArraysCache):
                linear += 1
                for x, y in zip(a.cache, b.cache):
                    np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5)
            else:
                assert a.offset == b.offset
        assert linear == len(target.gated_delta_layers) > 0 and not target.refeeds
        # The next step sees exactly what plain feeding would.
        la, _ = target.forward(ids[:, 28:30], fed)
        lb, _ = target.forward(ids[:, 28:30], verified)
        np.testing.assert_allclose(np.array(la), np.array(lb), atol=1e-4)


@pytest.mark.parametrize("family", SLIDING)
def test_ring_rollback_when_full_and_when_overflowing(tiny_pair, family):
    model, _, _ = tiny_pair(family)
    target = TargetAdapter(model)
    ids = mx.array([prompt_ids(60, seed=11)])
    for start, rows, keep in [(20, 16, 3), (20, 3, 1), (5, 6, 2), (3, 16, 16), (20, 16, 0)]:
        fed, verified = target.make_cache(), target.make_cache()
        for c in (fed, verified):
            target.forward(ids[:, :start], c)
        if keep:
            target.forward(ids[:, start : start + keep], fed)
        _, _, record = target.verify(ids[:, start : start + rows], verified)
        rollback(verified, record, keep)
        assert any(isinstance(c, RotatingKVCache) for c in verified)
        for a, b in zip(fed, verified):
            assert a.offset == b.offset
        for step in range(3):  # one-row and multi-row steps afterwards
            n = 1 if step != 1 else 4
            at = start + keep + (0 if step == 0 else 1 if step == 1 else 5)
            la, _ = target.forward(ids[:, at : at + n], fed)
            lb, _ = target.forward(ids[:, at : at + n], verified)
            np.testing.assert_allclose(np.array(la), np.array(lb), atol=1e-4)


def test_unsupported_cache_types_are_refused():
    """Every cache class mlx-lm's models make rolls back (the table); others are refused by name."""
    with pytest.raises(UnsupportedCacheError, match="layer 1 uses a ConcatenateKVCache"):
        check_caches([KVCache(), ConcatenateKVCache()], "qwen3")
    with pytest.raises(UnsupportedCacheError, match="BatchKVCache"):
        check_caches([CacheList(KVCache(), BatchKVCache([0]))], "deepseek_v32")
    with pytest.raises(UnsupportedCacheError, match="max_kv_size"):
        check_caches([RotatingKVCache(max_size=16, keep=4)], "llama")
    check_caches(
        [
            ArraysCache(2),
            RotatingKVCache(max_size=8),
            QuantizedKVCache(),
            ChunkedKVCache(8),
            CacheList(KVCache(), KVCache()),
            None,
        ],
        "any",
    )
