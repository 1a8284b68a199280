"""Checks of the tiny on-disk model builders in tests/helpers/ (and of its ``without_eos`` copy)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step, stream_generate

from helpers import (
    BOS_ID,
    BOS_TOKEN,
    EOS_ID,
    EOS_TOKEN,
    FAMILIES,
    IM_END_ID,
    IM_END_TOKEN,
    IM_START_ID,
    IM_START_TOKEN,
    MASK_ID,
    PAD_ID,
    TINY_VOCAB,
    derive_target_layer_ids,
    greedy_with_margins,
    make_target,
    reference,
    without_eos,
)

PROMPT = "The cat sat on the warm window"
TEXT = "Hello, World! 123 the quick brown fox; x = [1, 2]\n\tdone ~`|{}"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_specials_roundtrip_and_template(tiny_tokenizer, add_bos):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer(add_bos=add_bos))
    assert len(tok) == TINY_VOCAB
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == EOS_ID
    assert tok.pad_token_id == PAD_ID
    assert tok.mask_token_id == MASK_ID
    assert tok.convert_tokens_to_ids([IM_START_TOKEN, IM_END_TOKEN]) == [
        IM_START_ID,
        IM_END_ID,
    ]
    ids = tok.encode(TEXT)
    if add_bos:
        assert tok.bos_token == BOS_TOKEN
        assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    else:
        assert tok.bos_token is None and BOS_ID not in ids
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert tok.decode(tok.encode(TEXT, add_special_tokens=False)) == TEXT
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat == (BOS_TOKEN if add_bos else "") + expected


def test_tokenizer_is_deterministic_across_processes(tiny_tokenizer, tmp_path):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from helpers.tokenizer import make_tokenizer;"
        "from pathlib import Path; make_tokenizer(Path(sys.argv[2]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    tests_dir = str(Path(__file__).resolve().parent)
    subprocess.run([sys.executable, "-c", code, tests_dir, str(tmp_path)], env=env, check=True)
    here = tiny_tokenizer(add_bos=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert _sha(tmp_path / name) == _sha(here / name), name


def test_bos_rule_of_stream_generate(tiny_target):
    model, tok = mlx_lm.load(str(tiny_target("llama", add_bos=True)))
    assert tok.bos_token == BOS_TOKEN
    body = tok.encode(PROMPT, add_special_tokens=False)
    # A string prompt without BOS gets one; one starting with BOS gets no second.
    for prompt in (PROMPT, BOS_TOKEN + PROMPT):
        first = next(iter(stream_generate(model, tok, prompt, max_tokens=1)))
        assert first.prompt_tokens == len(body) + 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat.startswith(BOS_TOKEN)


# --------------------------------------------------------------------- target


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_generates(tiny_target, family):
    path = tiny_target(family)
    model, tok = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family  # mistral stays "mistral" on disk
    assert config["vocab_size"] == TINY_VOCAB
    assert model.model.embed_tokens.weight.shape == (TINY_VOCAB, 64)
    assert model.model.embed_tokens.weight.dtype == mx.float32
    assert len(model.model.layers) == 4
    assert tok.eos_token_id == EOS_ID
    prompt = mx.array(tok.encode(PROMPT, add_special_tokens=False))
    tokens = [int(t) for t, _ in generate_step(prompt, model, max_tokens=20)]
    assert len(tokens) == 20 and len(set(tokens)) > 5


def test_target_is_deterministic_and_seeded(tiny_target, tmp_path):
    a = tiny_target("qwen3")
    b = make_target(tmp_path / "again", "qwen3")
    c = tiny_target("qwen3", seed=5)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tied", [False, True])
def test_greedy_margins_and_variety(tiny_target, family, tied):
    """The property the speculative == greedy tests rely on (float32)."""
    model, tok = mlx_lm.load(str(tiny_target(family, tie_word_embeddings=tied)))
    prompt = tok.encode(PROMPT, add_special_tokens=False)[:7]
    tokens, gaps = greedy_with_margins(model, prompt, 200)
    assert np.percentile(gaps, 5) > 0.03
    assert gaps.min() > 1e-4
    assert len(set(tokens)) > 40 and len(set(tokens[-50:])) > 5


@pytest.mark.parametrize(
    "family,dtype,bits",
    [
        ("qwen3", "bfloat16", None),
        ("llama", "bfloat16", None),
        ("qwen3", "float32", 4),
        ("qwen3", "float32", 8),
        ("qwen2", "bfloat16", 4),
        ("qwen3_moe", "float32", 4),
        ("qwen3_moe", "bfloat16", 8),
    ],
)
def test_dtype_and_quantized_variants_load(tiny_target, family, dtype, bits):
    path = tiny_target(family, dtype=dtype, quantize_bits=bits)
    model, _ = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == dtype
    q_proj = model.model.layers[0].self_attn.q_proj
    if bits is None:
        assert "quantization" not in config
        assert q_proj.weight.dtype == getattr(mx, dtype)
    else:
        assert config["quantization"]["bits"] == bits
        assert config["quantization"]["group_size"] == 32
        assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.bits == bits
        assert q_proj.scales.dtype == getattr(mx, dtype)
    tokens = [int(t) for t, _ in generate_step(mx.array([5, 6, 7]), model, max_tokens=8)]
    assert len(tokens) == 8


def test_sliding_window_override(tiny_target):
    types = ["sliding_attention", "full_attention"] * 2
    model, _ = mlx_lm.load(
        str(tiny_target("llama", layer_types=types, sliding_window=8))
    )
    assert [layer.use_sliding for layer in model.model.layers] == [True, False] * 2
    tokens = [int(t) for t, _ in generate_step(mx.array([5, 6, 7]), model, max_tokens=20)]
    assert len(tokens) == 20


# ---------------------------------------------------------------------- draft


def _expected_draft_shapes(n_layers, n_ids, h=64, heads=4, kv=2, hd=16, inter=128):
    shapes = {"fc.weight": (h, n_ids * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(n_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        shapes[p + "self_attn.q_proj.weight"] = (heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def test_draft_keys_shapes_and_config(qwen3_target, qwen3_draft):
    weights = mx.load(str(qwen3_draft / "model.safetensors"))
    expected = _expected_draft_shapes(2, 2)
    assert set(weights) == set(expected)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert all(v.dtype == mx.float32 for v in weights.values())
    norm = np.array(weights["layers.0.input_layernorm.weight"])
    assert np.abs(norm - 1).max() < 0.5 and norm.std() > 0
    fc = np.array(weights["fc.weight"])
    assert 0.5 < fc.std() * np.sqrt(fc.shape[1]) < 2

    cfg = json.loads((qwen3_draft / "config.json").read_text())
    target_cfg = json.loads((qwen3_target / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["hidden_size"] == target_cfg["hidden_size"]
    assert cfg["vocab_size"] == target_cfg["vocab_size"]
    assert cfg["num_target_layers"] == target_cfg["num_hidden_layers"] == 4
    assert cfg["num_hidden_layers"] == 2 and cfg["attention_bias"] is False
    assert cfg["rope_theta"] == 10000 and "rope_parameters" not in cfg
    assert cfg["dflash_config"] == {
        "mask_token_id": MASK_ID,
        "target_layer_ids": [1, 2],
        "block_size": 16,
    }
    assert "block_size" not in cfg
    for key in ("layer_types", "sliding_window", "is_causal"):
        assert key not in cfg


def test_draft_flat_and_nested_differ_only_in_block_size(tiny_draft, qwen3_target):
    nested = tiny_draft(qwen3_target, block_size=8)
    flat = tiny_draft(qwen3_target, block_size=8, schema="flat")
    assert _sha(nested / "model.safetensors") == _sha(flat / "model.safetensors")
    n_cfg = json.loads((nested / "config.json").read_text())
    f_cfg = json.loads((flat / "config.json").read_text())
    assert n_cfg["dflash_config"].pop("block_size") == 8
    assert f_cfg.pop("block_size") == 8
    assert n_cfg == f_cfg


def test_draft_default_layer_ids_follow_spec(tiny_target, tiny_draft):
    target = tiny_target("qwen3", num_layers=8)
    cfg = json.loads((tiny_draft(target, num_layers=3) / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    weights = mx.load(str(tiny_draft(target, num_layers=3) / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 3 * 64)


def test_draft_options_extras_and_overrides(tiny_draft, qwen3_target, qwen3_draft):
    path = tiny_draft(
        qwen3_target,
        target_layer_ids=[1, 2],
        dtype="bfloat16",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        is_causal=False,
        input_embedding_scale=2.0,
        output_multiplier=0.5,
        final_logit_softcapping=20.0,
        rope_in_parameters=True,
        extra_keys=("embed_tokens.weight", "lm_head.weight"),
        custom_note="top-level override",
        num_target_layers=99,
    )
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_parameters"] == {"rope_theta": 10000, "rope_type": "default"}
    assert "rope_theta" not in cfg
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == 4 and cfg["is_causal"] is False
    d = cfg["dflash_config"]
    assert (d["input_embedding_scale"], d["output_multiplier"]) == (2.0, 0.5)
    assert d["final_logit_softcapping"] == 20.0
    assert cfg["custom_note"] == "top-level override"
    assert cfg["num_target_layers"] == 99  # overrides win, to build broken configs

    weights = mx.load(str(path / "model.safetensors"))
    plain = mx.load(str(qwen3_draft / "model.safetensors"))
    assert set(weights) == set(plain) | {"embed_tokens.weight", "lm_head.weight"}
    assert weights["lm_head.weight"].shape == (TINY_VOCAB, 64)
    for key, value in plain.items():  # extras leave the real weights unchanged
        assert weights[key].dtype == mx.bfloat16
        assert mx.array_equal(weights[key], value.astype(mx.bfloat16)), key


def test_derive_target_layer_ids():
    assert derive_target_layer_ids(5, 36) == [1, 9, 17, 25, 33]  # Qwen3-4B draft
    assert derive_target_layer_ids(5, 64) == [1, 16, 31, 46, 61]  # Qwen3.5 drafts
    assert derive_target_layer_ids(1, 36) == [18]
    assert derive_target_layer_ids(2, 6) == [1, 3]
    for n in range(1, 6):
        for big_n in range(1, 10):
            ids = derive_target_layer_ids(n, big_n)
            assert len(ids) == n and all(0 <= i < big_n for i in ids)


# ------------------------------------------------------------- shared fixtures


def test_without_eos_is_a_copy_and_the_shared_tokenizer_keeps_its_eos(tiny_pair):
    model, tokenizer, _ = tiny_pair("qwen3")
    prompt = tokenizer.encode(PROMPT)
    with without_eos(tokenizer) as tok:
        assert tok is not tokenizer and tok.eos_token_ids == set()
        assert tokenizer.eos_token_ids == {EOS_ID}
        long = reference(model, tok, prompt, 80)  # never stops early; its detokenizer still works
    assert len(long) == 80 and long[-1].finish_reason == "length"
    assert "".join(r.text for r in long) == tokenizer.decode([r.token for r in long])
    assert tiny_pair("qwen3")[1] is tokenizer and tokenizer.eos_token_ids == {EOS_ID}
