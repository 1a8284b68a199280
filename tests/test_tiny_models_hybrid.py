"""Checks of the hybrid (Gated DeltaNet) and sliding-window tiny targets."""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from helpers import (
    DEFAULT_SLIDING_WINDOW,
    EOS_ID,
    EXTRA_FAMILIES,
    HYBRID_FAMILIES,
    NESTED_FAMILIES,
    SLIDING_FAMILIES,
    TINY_VOCAB,
    greedy_with_margins,
    make_target,
)

PROMPT = "The cat sat on the warm window"

# model_type of config.json, and of its text_config for nested families.
MODEL_TYPES = {
    "qwen3_5": ("qwen3_5", "qwen3_5_text"),
    "qwen3_5_moe": ("qwen3_5_moe", "qwen3_5_moe_text"),
    "qwen3_next": ("qwen3_next", None),
    "llama_sliding": ("llama", None),
    "gemma3_text": ("gemma3_text", None),
    "gemma4": ("gemma4", "gemma4_text"),
    "gpt_oss": ("gpt_oss", None),
}


def _inner(model):
    """The decoder stack (gemma4's wrapper has no ``model`` attribute)."""
    return model.language_model.model if hasattr(model, "language_model") else model.model


def _generate(model, n=20):
    prompt = mx.array([5, 6, 7, 8, 9, 10, 11])
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("family", EXTRA_FAMILIES)
def test_family_loads_and_generates(tiny_target, family):
    path = tiny_target(family)
    model, tok = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    outer, nested = MODEL_TYPES[family]
    assert config["model_type"] == outer
    assert ("text_config" in config) == (nested is not None) == (family in NESTED_FAMILIES)
    text = config.get("text_config", config)
    if nested:
        assert text["model_type"] == nested
    assert config["vocab_size"] == text["vocab_size"] == TINY_VOCAB
    assert config["torch_dtype"] == "float32"
    inner = _inner(model)
    assert inner.embed_tokens.weight.shape == (TINY_VOCAB, 64)
    assert inner.embed_tokens.weight.dtype == mx.float32
    assert len(model.layers) == 4
    assert tok.eos_token_id == EOS_ID
    prompt = mx.array(tok.encode(PROMPT, add_special_tokens=False))
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=20)]
    assert len(tokens) == 20 and len(set(tokens)) > 5


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_layers_and_caches(tiny_target, family):
    model, _ = mlx_lm.load(str(tiny_target(family)))
    assert [layer.is_linear for layer in model.layers] == [True, False] * 2
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [ArraysCache, KVCache] * 2
    _generate(model, 3)


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_sliding_layers_and_caches(tiny_target, family):
    model, _ = mlx_lm.load(str(tiny_target(family)))
    cache = make_prompt_cache(model)
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache] * 2
    assert all(c.max_size == DEFAULT_SLIDING_WINDOW for c in cache[::2])
    wide, _ = mlx_lm.load(str(tiny_target(family, sliding_window=16)))
    assert [c.max_size for c in make_prompt_cache(wide)[::2]] == [16, 16]


def test_llama_sliding_is_llama_with_overrides(tiny_target):
    named = tiny_target("llama_sliding")
    types = ["sliding_attention", "full_attention"] * 2
    manual = tiny_target("llama", layer_types=types, sliding_window=8)
    for name in ("config.json", "model.safetensors"):
        assert _sha(named / name) == _sha(manual / name), name
    model, _ = mlx_lm.load(str(named))
    assert [layer.use_sliding for layer in model.model.layers] == [True, False] * 2


@pytest.mark.parametrize("family", EXTRA_FAMILIES)
def test_greedy_margins_and_variety(tiny_target, family):
    """The property the speculative == greedy tests rely on (float32)."""
    model, tok = mlx_lm.load(str(tiny_target(family)))
    prompt = tok.encode(PROMPT, add_special_tokens=False)[:7]
    tokens, gaps = greedy_with_margins(model, prompt, 200)  # >> the sliding window of 8
    assert np.percentile(gaps, 5) > 0.05
    assert gaps.min() > 1e-3
    assert len(set(tokens)) > 100 and len(set(tokens[-50:])) > 30


@pytest.mark.parametrize("family", [f for f in EXTRA_FAMILIES if f != "gpt_oss"])
def test_tied_greedy_margins_and_variety(tiny_target, family):
    model, tok = mlx_lm.load(str(tiny_target(family, tie_word_embeddings=True)))
    assert not hasattr(model, "lm_head") and not hasattr(
        getattr(model, "language_model", model), "lm_head"
    )
    prompt = tok.encode(PROMPT, add_special_tokens=False)[:7]
    tokens, gaps = greedy_with_margins(model, prompt, 200)
    assert np.percentile(gaps, 5) > 0.05
    assert gaps.min() > 1e-3
    assert len(set(tokens)) > 100 and len(set(tokens[-50:])) > 30


def test_gpt_oss_cannot_be_tied(tmp_path):
    with pytest.raises(ValueError, match="untied"):
        make_target(tmp_path, "gpt_oss", tie_word_embeddings=True)


def test_hybrid_rejects_sliding_window(tmp_path):
    with pytest.raises(ValueError, match="sliding"):
        make_target(tmp_path, "qwen3_5", sliding_window=8)


@pytest.mark.parametrize("family", EXTRA_FAMILIES)
def test_block_forward_matches_one_at_a_time(tiny_target, family):
    """A 16-token verify-style forward after 40 tokens (sliding windows have
    wrapped) gives the logits of feeding the tokens one at a time: bit-identical
    for the hybrids here, within ~1e-4 for sliding layers (the rotating buffer
    orders keys differently), and always the same argmax."""
    model, _ = mlx_lm.load(str(tiny_target(family)))
    rng = np.random.default_rng(0)
    prefix, block = rng.integers(5, TINY_VOCAB, 40), rng.integers(5, TINY_VOCAB, 16)
    one = make_prompt_cache(model)
    model(mx.array(prefix)[None], cache=one)
    rows = mx.stack([model(mx.array([[int(t)]]), cache=one)[0, -1] for t in block])
    many = make_prompt_cache(model)
    model(mx.array(prefix)[None], cache=many)
    blk = model(mx.array(block)[None], cache=many)[0]
    a, b = np.array(rows), np.array(blk)
    assert np.abs(a - b).max() < 1e-3
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize(
    "family,dtype,bits,group",
    [
        ("qwen3_5", "bfloat16", None, 32),
        ("qwen3_5", "float32", 4, 32),
        ("qwen3_5_moe", "bfloat16", 4, 32),
        ("qwen3_5_moe", "float32", 8, 64),
        ("qwen3_next", "bfloat16", 8, 32),
        ("qwen3_next", "float32", 4, 64),
        ("llama_sliding", "bfloat16", None, 32),
        ("llama_sliding", "bfloat16", 4, 32),
        ("gemma3_text", "bfloat16", None, 32),
        ("gemma3_text", "float32", 8, 32),
        ("gemma4", "bfloat16", None, 32),
        ("gemma4", "bfloat16", 4, 64),
        ("gpt_oss", "float32", 4, 32),
        ("gpt_oss", "bfloat16", 8, 32),
    ],
)
def test_dtype_and_quantized_variants_run(tiny_target, family, dtype, bits, group):
    path = tiny_target(family, dtype=dtype, quantize_bits=bits, quantize_group_size=group)
    model, _ = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == dtype
    q_proj = model.layers[1].self_attn.q_proj  # layer 1 is full attention everywhere
    if bits is None:
        assert "quantization" not in config
        assert q_proj.weight.dtype == getattr(mx, dtype)
    else:
        assert config["quantization"]["bits"] == bits
        assert config["quantization"]["group_size"] == group
        assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == bits
        assert q_proj.group_size == group and q_proj.scales.dtype == getattr(mx, dtype)
    if family.startswith("qwen3_5"):  # like mlx_lm.convert: A_log stays float32
        assert model.layers[0].linear_attn.A_log.dtype == mx.float32
    assert len(_generate(model)) == 20


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next", "gpt_oss"])
def test_unquantized_bfloat16_moe_loads(tiny_target, family):
    """It loads; on the mlx CPU backend it cannot run (GatherMM is float32-only)."""
    model, _ = mlx_lm.load(str(tiny_target(family, dtype="bfloat16")))
    try:
        _generate(model, 2)
    except RuntimeError as e:
        assert mx.default_device() == mx.cpu and "GatherMM" in str(e)


def test_hybrid_is_deterministic_and_seeded(tiny_target, tmp_path):
    a = tiny_target("qwen3_5")
    b = make_target(tmp_path / "again", "qwen3_5")
    c = tiny_target("qwen3_5", seed=5)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")


@pytest.mark.parametrize("family", NESTED_FAMILIES)
def test_draft_reads_nested_target_config(tiny_target, tiny_draft, family):
    target = tiny_target(family)
    cfg = json.loads((tiny_draft(target) / "config.json").read_text())
    assert cfg["num_target_layers"] == 4 and cfg["hidden_size"] == 64
    assert cfg["vocab_size"] == TINY_VOCAB and cfg["head_dim"] == 16
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 1]
