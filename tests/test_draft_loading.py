"""Loading DFlash drafters: config schemas and rules, weights, errors, quantization,
the target adapter and the drafter's context cache (spec sections 2-3)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

import dflash_mlx
from helpers import MASK_ID, TINY_VOCAB
from dflash_mlx.models.block_size import default_block_size
from dflash_mlx.models.dtype import on_cpu, target_float_dtype
from dflash_mlx.draft.config import DraftConfigError, derive_target_layer_ids, parse_draft_config
from dflash_mlx.draft.load import DraftWeightsError, load_draft
from dflash_mlx.draft.model import DFlashDraftModel
from dflash_mlx.draft.pairing import PairMismatchError
from dflash_mlx.targets.adapter import TargetAdapter, UnsupportedTargetError, target_problem

PROMPT = mx.array([[40, 41, 57, 99, 120, 7, 300, 301, 12, 250]])  # S = 10 context rows
BLOCK = mx.array([17] + [MASK_ID] * 3)  # b = 4
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4)


def _features(model, ids):
    adapter = TargetAdapter(model, tuple(ids))
    return adapter.forward(PROMPT, adapter.make_cache())[1][0]  # [S, n_ids * H]


def _logits(draft, model, chunks=(10,), hooks=None, feats=None, block=BLOCK):
    """Draft logits [b - 1, V] for BLOCK after feeding the context rows in `chunks`."""
    ids = draft.config.target_layer_ids
    feats = _features(model, ids) if feats is None else feats
    cache, start = draft.make_cache(), 0
    for n in chunks:
        draft.extend_context(feats[None, start : start + n], cache)
        start += n
    out = draft(block[None], cache, hooks or TargetAdapter(model, ids))
    return np.array(out[0].astype(mx.float32))


def _variant(src, dst, config=None, weights=None):
    """A copy of the draft dir `src` with config.json / model.safetensors edited in place."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if weights:
        w = dict(mx.load(str(dst / "model.safetensors")))
        weights(w)
        mx.save_safetensors(str(dst / "model.safetensors"), w)
    return dst


def _set(**kw):  # a config edit: top-level fields
    return lambda c: c.update(kw)


def _dflash(**kw):  # a config edit: dflash_config fields
    return lambda c: c["dflash_config"].update(kw)


def _raw(qwen3_draft, **top):
    return {**json.loads((qwen3_draft / "config.json").read_text()), **top}


def test_flat_and_nested_schemas_load_identically(tiny_draft, qwen3_target, qwen3_draft, qwen3_model):
    flat = tiny_draft(qwen3_target, target_layer_ids=[1, 2], schema="flat")
    assert "block_size" not in json.loads((flat / "config.json").read_text())["dflash_config"]
    a, b = load_draft(qwen3_draft, qwen3_model), load_draft(flat, qwen3_model)
    assert a.config == b.config and a.config.block_size == 16
    pa, pb = tree_flatten(a.parameters()), tree_flatten(b.parameters())
    assert [k for k, _ in pa] == [k for k, _ in pb] and len(pa) == 2 * 11 + 3
    for (k, x), (_, y) in zip(pa, pb):
        assert x.shape == y.shape and mx.array_equal(x, y), k
    la, lb = _logits(a, qwen3_model), _logits(b, qwen3_model)
    assert la.shape == (3, TINY_VOCAB) and np.isfinite(la).all()
    np.testing.assert_array_equal(la, lb)


def test_rope_theta_location_and_scaling(qwen3_draft, qwen3_model, tmp_path):
    rope = {"rope_theta": 5e5, "rope_type": "default"}
    nested = lambda c: c.update(rope_parameters=rope) or c.pop("rope_theta")  # noqa: E731
    a = load_draft(_variant(qwen3_draft, tmp_path / "a", _set(rope_theta=5e5)))
    b = load_draft(_variant(qwen3_draft, tmp_path / "b", nested))
    assert a.config.rope_theta == b.config.rope_theta == 5e5
    # rope_parameters is also kept as the scaling config (rope_type default: no scaling).
    assert b.config == a.config  # a default rope_parameters block implies no scaling
    base, la = _logits(load_draft(qwen3_draft), qwen3_model), _logits(a, qwen3_model)
    np.testing.assert_allclose(la, _logits(b, qwen3_model), atol=1e-6)
    assert np.abs(la - base).max() > 1e-3  # theta is really used
    linear = _set(rope_scaling={"rope_type": "linear", "factor": 2.0})
    lin = load_draft(_variant(qwen3_draft, tmp_path / "lin", linear))
    assert lin.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert isinstance(lin.rope, nn.RoPE) and lin.rope.scale == 0.5
    assert np.abs(_logits(lin, qwen3_model) - base).max() > 1e-3
    llama3 = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    cfg = parse_draft_config(_raw(qwen3_draft, rope_scaling=llama3))
    assert type(DFlashDraftModel(cfg).rope).__name__ == "Llama3RoPE"


def test_block_size_location(qwen3_draft):
    cfg = _raw(qwen3_draft)
    del cfg["dflash_config"]["block_size"]
    assert parse_draft_config(cfg).block_size == 16
    assert parse_draft_config(dict(cfg, block_size=8)).block_size == 8
    cfg["dflash_config"]["block_size"] = 4
    assert parse_draft_config(dict(cfg, block_size=8)).block_size == 4


@pytest.mark.parametrize(
    "extra, causal, sliding",
    [
        ({}, [False, False], [False, False]),
        (SLIDING, [True, False], [True, False]),
        (dict(SLIDING, is_causal=None), [True, False], [True, False]),
        (dict(SLIDING, is_causal=True), [True, True], [True, False]),
        (dict(SLIDING, is_causal=False), [False, False], [True, False]),
        ({"is_causal": True, "sliding_window": 4}, [True, True], [False, False]),
    ],
)
def test_layer_types_and_is_causal(qwen3_draft, extra, causal, sliding):
    cfg = parse_draft_config(_raw(qwen3_draft, **extra))
    assert [cfg.layer_is_causal(i) for i in range(2)] == causal
    assert [cfg.layer_is_sliding(i) for i in range(2)] == sliding
    attn = [layer.self_attn for layer in DFlashDraftModel(cfg).layers]
    assert [a.causal for a in attn] == causal
    assert [a.window for a in attn] == [4 if s else None for s in sliding]


@pytest.mark.parametrize(
    "extra, fragments",
    [
        ({"layer_types": SLIDING["layer_types"]}, ["'sliding_window'", "None"]),
        ({"layer_types": ["full_attention"] * 3}, ["'layer_types' has 3", "is 2"]),
        ({"layer_types": ["full_attention", "linear_attention"]}, ["'linear_attention'"]),
        ({"is_causal": "yes"}, ["'is_causal'", "'yes'"]),
        ({"architectures": ["LlamaForCausalLM"]}, ["LlamaForCausalLM", "DFlashDraftModel"]),
    ],
)
def test_config_rule_errors(qwen3_draft, extra, fragments):
    with pytest.raises(DraftConfigError) as e:
        parse_draft_config(_raw(qwen3_draft, **extra), source="SRC/config.json")
    assert str(e.value).startswith("SRC/config.json: ")
    for f in fragments:
        assert f in str(e.value)


def test_scales_and_softcap(qwen3_draft, qwen3_model, tmp_path):
    load = lambda name, edit: load_draft(_variant(qwen3_draft, tmp_path / name, edit))  # noqa: E731
    base = load_draft(qwen3_draft)
    raw = _logits(base, qwen3_model)
    assert np.abs(raw).max() > 4.0
    assert (mult := load("mult", _dflash(output_multiplier=0.25))).config.output_multiplier == 0.25
    np.testing.assert_allclose(_logits(mult, qwen3_model), 0.25 * raw, rtol=1e-6, atol=1e-6)
    cap = load("cap", _dflash(final_logit_softcapping=2.0))
    top = load("top", _set(final_logit_softcapping=2.0))
    assert cap.config.final_logit_softcapping == top.config.final_logit_softcapping == 2.0
    capped = _logits(cap, qwen3_model)
    assert np.abs(capped).max() <= 2.0 + 1e-6 and np.abs(capped).max() > 1.9
    np.testing.assert_allclose(capped, 2.0 * np.tanh(raw / 2.0), atol=1e-5)
    np.testing.assert_array_equal(capped, _logits(top, qwen3_model))
    both = load("both", _dflash(output_multiplier=0.25, final_logit_softcapping=2.0))
    np.testing.assert_allclose(_logits(both, qwen3_model), 2.0 * np.tanh(0.25 * raw / 2.0), atol=1e-5)
    scaled = load("emb", _dflash(input_embedding_scale=3.0))
    assert scaled.config.input_embedding_scale == 3.0
    adapter = TargetAdapter(qwen3_model, base.config.target_layer_ids)  # unscaled, on a 3x table:
    hooks = SimpleNamespace(embed=lambda ids: adapter.embed(ids) * 3.0, head=adapter.head)
    got = _logits(scaled, qwen3_model)
    np.testing.assert_allclose(got, _logits(base, qwen3_model, hooks=hooks), atol=1e-5)
    assert np.abs(got - raw).max() > 1e-3


def test_target_layer_ids_derivation(qwen3_draft):
    cfg = _raw(qwen3_draft, num_hidden_layers=5, num_target_layers=36)
    del cfg["dflash_config"]["target_layer_ids"]
    assert parse_draft_config(cfg).target_layer_ids == (1, 9, 17, 25, 33)  # Qwen3-4B
    assert parse_draft_config(dict(cfg, num_target_layers=64)).target_layer_ids == (1, 16, 31, 46, 61)
    assert derive_target_layer_ids(1, 36) == (18,)
    cfg2 = dict(cfg, num_hidden_layers=3, num_target_layers=12)
    assert parse_draft_config(cfg2).target_layer_ids == derive_target_layer_ids(3, 12) == (1, 5, 9)
    assert derive_target_layer_ids(2, 2) == (1, 0)  # tiny targets stay in range
    with pytest.raises(DraftConfigError, match="target_layer_ids"):
        parse_draft_config({**cfg, "dflash_config": {**cfg["dflash_config"], "target_layer_ids": [True, 2]}})
    del cfg["num_target_layers"]
    with pytest.raises(DraftConfigError, match=r"target_layer_ids.*num_target_layers"):
        parse_draft_config(cfg)


def test_derived_duplicate_layer_ids(qwen3_draft, qwen3_model, tmp_path):
    drop = lambda c: c["dflash_config"].pop("target_layer_ids")  # noqa: E731
    draft = load_draft(_variant(qwen3_draft, tmp_path / "derived", drop), qwen3_model)
    assert draft.config.target_layer_ids == derive_target_layer_ids(2, 4) == (1, 1)
    one = _features(qwen3_model, (1,))
    np.testing.assert_array_equal(np.array(_features(qwen3_model, (1, 1))), np.array(mx.concatenate([one, one], -1)))


def test_extra_embedding_and_head_keys_are_ignored(tiny_draft, qwen3_target, qwen3_draft, qwen3_model):
    extra = tiny_draft(qwen3_target, target_layer_ids=[1, 2], extra_keys=["embed_tokens.weight", "lm_head.weight"])
    assert "lm_head.weight" in mx.load(str(extra / "model.safetensors"))
    draft = load_draft(extra, qwen3_model)
    names = [k for k, _ in tree_flatten(draft.parameters())]
    assert not any("embed" in k or "lm_head" in k for k in names)
    np.testing.assert_array_equal(_logits(draft, qwen3_model), _logits(load_draft(qwen3_draft), qwen3_model))


CONV = "layers.0.attention_conv.base_kernel"  # a DFlash 2 tensor
BAD_CHECKPOINTS = {
    "no-mask": (
        dict(config=lambda c: c["dflash_config"].pop("mask_token_id")),
        DraftConfigError,
        ["'dflash_config.mask_token_id' is required", "{dir}/config.json"],
    ),
    "mask-beyond-draft-vocab": (
        dict(config=_dflash(mask_token_id=600)),
        DraftConfigError,
        ["'dflash_config.mask_token_id' is 600", "vocabulary of 512"],
    ),
    "mask-beyond-target-vocab": (
        dict(config=lambda c: (_set(vocab_size=1000)(c), _dflash(mask_token_id=600)(c))),
        PairMismatchError,
        ["mask_token_id is 600", "512"],
    ),
    "vocab": (dict(config=_set(vocab_size=1000)), PairMismatchError, ["vocab_size is 1000", "the target has 512"]),
    "missing-tensor": (
        dict(weights=lambda w: w.pop("layers.1.mlp.up_proj.weight")),
        DraftWeightsError,
        ["missing tensors [layers.1.mlp.up_proj.weight]"],
    ),
    "unexpected-tensor": (
        dict(weights=lambda w: w.update({CONV: mx.zeros((2, 2, 64))})),
        DraftWeightsError,
        [f"unexpected tensors [{CONV}]"],
    ),
    "shape": (
        dict(weights=lambda w: w.update({"fc.weight": mx.zeros((64, 64))})),
        DraftWeightsError,
        ["'fc.weight'", "(64, 64)", "(64, 128)"],
    ),
    "dflash2-without-fields": (
        dict(config=_set(architectures=["DFlash2DraftModel"])),
        DraftConfigError,
        ["DFlash2DraftModel", "conv_kernel_size"],
    ),
    "dflash2-config-on-v1-weights": (
        dict(
            config=lambda c: (
                _set(architectures=["DFlash2DraftModel"])(c),
                _dflash(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)(c),
            )
        ),
        DraftWeightsError,
        ["missing tensors", "attention_conv", "DFlash2DraftModel"],
    ),
    "conflicting-num-target-layers": (
        dict(config=_set(num_target_layers=6)),
        PairMismatchError,
        ["num_target_layers is 6", "has 4"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoints(case, qwen3_draft, qwen3_target, qwen3_model, tmp_path):
    edits, exc, fragments = BAD_CHECKPOINTS[case]
    path = _variant(qwen3_draft, tmp_path / case, **edits)
    with pytest.raises(exc) as e:
        load_draft(path, qwen3_model, target_name="TINY-TARGET")
    msg = str(e.value)
    for f in fragments:
        assert f.format(dir=path) in msg, msg
    if exc is PairMismatchError:
        assert f"Draft '{path}'" in msg and "target 'TINY-TARGET'" in msg


def _truncate(d):
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])


FILE_ERRORS = {
    "truncated": (_truncate, DraftWeightsError, "cannot read the safetensors file", "model.safetensors"),
    "no-config": (lambda d: (d / "config.json").unlink(), DraftConfigError, "no config.json", ""),
    "no-safetensors": (lambda d: (d / "model.safetensors").unlink(), DraftWeightsError, "no *.safetensors files", ""),
    "bad-json": (
        lambda d: (d / "config.json").write_text('{"hidden_size": 64,'),
        DraftConfigError,
        "not valid JSON",
        "config.json",
    ),
}


@pytest.mark.parametrize("case", sorted(FILE_ERRORS))
def test_file_errors(case, qwen3_draft, tmp_path):
    damage, exc, phrase, file = FILE_ERRORS[case]
    path = _variant(qwen3_draft, tmp_path / case)
    damage(path)
    with pytest.raises(exc) as e:
        load_draft(path)
    assert phrase in str(e.value) and str(path / file) in str(e.value), str(e.value)


def test_pair_mismatches(tiny_target, tiny_draft, qwen3_target, qwen3_model):
    beyond = tiny_draft(qwen3_target, target_layer_ids=[1, 7])
    with pytest.raises(PairMismatchError) as e:
        load_draft(beyond, qwen3_model, target_name=str(qwen3_target))
    msg = str(e.value)
    for f in [str(beyond), str(qwen3_target), "target_layer_ids", "[1, 7]", "4 layers", "[7]"]:
        assert f in msg, msg
    narrow = tiny_draft(tiny_target("qwen3", hidden_size=32), target_layer_ids=[1, 2])
    assert load_draft(narrow).config.hidden_size == 32
    with pytest.raises(PairMismatchError) as e:
        load_draft(narrow, qwen3_model)
    for f in ["hidden_size is 32 in the draft", "the target has 64", str(narrow), "qwen3"]:
        assert f in str(e.value), str(e.value)


def test_quantized_draft_and_block_size_cap(tiny_target, qwen3_draft, qwen3_model):
    base = load_draft(qwen3_draft)
    n_linear = sum(isinstance(m, nn.Linear) for _, m in base.named_modules())
    assert n_linear == 1 + 2 * 7
    assert default_block_size(qwen3_model, base) == 16
    ref = _logits(base, qwen3_model)
    for bits in (4, 8):
        q = load_draft(qwen3_draft, bits=bits, group_size=32)
        ql = [m for _, m in q.named_modules() if isinstance(m, nn.QuantizedLinear)]
        assert len(ql) == n_linear and {(m.bits, m.group_size) for m in ql} == {(bits, 32)}
        assert default_block_size(qwen3_model, q) == (5 if bits == 4 else 16)
        if bits == 8:
            diff = np.abs(_logits(q, qwen3_model) - ref).max()
            assert 0 < diff < 0.02 * np.abs(ref).max()
    for bits, expected in ((4, 5), (8, 16)):
        qt = mlx_lm.load(str(tiny_target("qwen3", quantize_bits=bits)))[0]
        assert default_block_size(qt, base) == expected


def test_load_pairs_local_dirs_and_casts_draft(tiny_target, tiny_draft, qwen3_target, qwen3_draft):
    bf16 = tiny_target("qwen3", dtype="bfloat16")
    draft_dir = tiny_draft(bf16, target_layer_ids=[1, 2])
    model, tok, draft = dflash_mlx.load(bf16, draft_dir)
    assert isinstance(draft, DFlashDraftModel) and draft.config.target_layer_ids == (1, 2)
    assert tok.encode("the cat") and hasattr(model, "layers")
    computed = mx.float32 if on_cpu() else mx.bfloat16  # the one CPU dtype rule (models.loading)
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {computed}
    assert {v.dtype for _, v in tree_flatten(draft.parameters())} == {computed}
    nested = tiny_target("gemma4", dtype="bfloat16")  # its Model has no `.model`: found via language_model
    cast = dflash_mlx.load(nested, tiny_draft(nested, target_layer_ids=[1, 2]))[2]
    assert {v.dtype for _, v in tree_flatten(cast.parameters())} == {computed}
    assert target_float_dtype(mlx_lm.load(str(nested))[0]) == mx.bfloat16  # found through language_model
    f32 = dflash_mlx.load(qwen3_target, qwen3_draft)[2]
    assert {v.dtype for _, v in tree_flatten(f32.parameters())} == {mx.float32}
    with pytest.raises(ValueError, match="draft=") as e:
        dflash_mlx.load(qwen3_target)
    assert str(qwen3_target) in str(e.value)


def test_a_family_outside_any_table_runs_and_an_unknown_cache_class_is_refused(tiny_target):
    """No family whitelist: phi3 (no entry anywhere) gets an adapter; a target whose caches include a class
    the rollback table does not know is refused when its adapter is made, naming the layer and the class."""
    from mlx_lm.models import phi3, qwen3
    from mlx_lm.models.cache import ConcatenateKVCache

    args = phi3.ModelArgs(
        model_type="phi3",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=64,
    )
    assert TargetAdapter(phi3.Model(args), (0,)).family_name == "phi3" and target_problem(phi3.Model(args)) is None

    class ConcatenatingQwen3(qwen3.Model):  # a model of the test's own, not an mlx-lm class changed
        def make_cache(self):
            return [ConcatenateKVCache() for _ in self.layers]

    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=64,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_theta=1e4,
        head_dim=16,
        tie_word_embeddings=True,
    )
    with pytest.raises(UnsupportedTargetError, match="layer 0 uses a ConcatenateKVCache"):
        TargetAdapter(ConcatenatingQwen3(args))
    assert "ConcatenateKVCache" in target_problem(ConcatenatingQwen3(args))


def test_adapter_forward_matches_model_and_layer_outputs(qwen3_model):
    adapter = TargetAdapter(qwen3_model, (2, 0))
    logits, feats = adapter.forward(PROMPT, adapter.make_cache())
    ref = qwen3_model(PROMPT, cache=make_prompt_cache(qwen3_model))
    np.testing.assert_allclose(np.array(logits), np.array(ref), atol=1e-5, rtol=1e-5)
    h, outs = qwen3_model.model.embed_tokens(PROMPT), []
    for layer in qwen3_model.model.layers:
        h = layer(h, "causal", None)
        outs.append(h)
    assert feats.shape == (1, 10, 2 * 64)
    expected = np.concatenate([np.array(outs[2]), np.array(outs[0])], axis=-1)
    np.testing.assert_allclose(np.array(feats), expected, atol=1e-5)
    cache = adapter.make_cache()  # the same features when fed in two steps
    parts = [adapter.forward(PROMPT[:, :6], cache)[1], adapter.forward(PROMPT[:, 6:], cache)[1]]
    np.testing.assert_allclose(np.array(mx.concatenate(parts, 1)), expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["full", "causal", "sliding"])
def test_context_cache_and_incremental_context(kind, tiny_draft, qwen3_target, qwen3_model):
    extra = {"full": {}, "causal": {"is_causal": True}, "sliding": SLIDING}[kind]
    draft = load_draft(tiny_draft(qwen3_target, target_layer_ids=[1, 2], **extra), qwen3_model)
    adapter, cache = TargetAdapter(qwen3_model, (1, 2)), draft.make_cache()
    draft.extend_context(_features(qwen3_model, (1, 2))[None], cache)
    first = np.array(draft(BLOCK[None], cache, adapter))
    for c, n in zip(cache, [3 if kind == "sliding" else 10, 10]):
        assert c.end == 10 and c.visible_rows == n and c.start == 10 - n
        assert c.fetch()[0].shape == c.fetch()[1].shape == (1, 2, n, 16)
    np.testing.assert_array_equal(first, np.array(draft(BLOCK[None], cache, adapter)))
    assert [c.end for c in cache] == [10, 10]  # the block left no trace
    whole = _logits(draft, qwen3_model)
    np.testing.assert_allclose(whole[None], first, atol=1e-6)
    for chunks in [(2, 5, 3), (1,) * 10, (9, 1)]:
        np.testing.assert_allclose(_logits(draft, qwen3_model, chunks), whole, atol=1e-5, rtol=1e-5)
    # Long random contexts: buffer growth (> 256 rows) keeps the earlier rows intact.
    feats = mx.random.normal((800, 128), key=mx.random.key(0))
    np.testing.assert_allclose(
        _logits(draft, qwen3_model, (500, 299, 1), feats=feats),
        _logits(draft, qwen3_model, (800,), feats=feats),
        atol=1e-5,
        rtol=1e-5,
    )


def test_drafting_writes_the_block_after_the_context_and_leaves_it_intact(tiny_draft, qwen3_target, qwen3_model):
    """The block's keys and values go into the context buffers right after the held rows (no copy of
    the context per cycle): drafting leaves the held rows and positions as they were, a later append
    overwrites the block, and a context that fills its buffer exactly makes room for the block."""
    draft = load_draft(tiny_draft(qwen3_target, target_layer_ids=[1, 2]), qwen3_model)
    adapter = TargetAdapter(qwen3_model, (1, 2))
    feats = mx.random.normal((520, 128), key=mx.random.key(1))
    cache = draft.make_cache()
    draft.extend_context(feats[None, :256], cache)
    draft.extend_context(feats[None, 256:512], cache)
    assert cache[0].keys.shape[2] == cache[0].held_rows == 512  # full: the block needs a larger buffer
    held = [np.array(c.fetch()[0]) for c in cache]
    first = np.array(draft(BLOCK[None], cache, adapter))
    np.testing.assert_allclose(first[0], _logits(draft, qwen3_model, (512,), feats=feats[:512]), atol=1e-5, rtol=1e-5)
    for c, h in zip(cache, held):
        assert c.end == c.held_rows == 512
        np.testing.assert_array_equal(np.array(c.fetch()[0]), h)
    np.testing.assert_array_equal(np.array(draft(BLOCK[None], cache, adapter)), first)
    draft.extend_context(feats[None, 512:], cache)  # over the block's rows
    np.testing.assert_allclose(
        np.array(draft(BLOCK[None], cache, adapter))[0],
        _logits(draft, qwen3_model, (520,), feats=feats),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("kind", ["full", "causal", "sliding", "bounded"])
@pytest.mark.parametrize("split", [7, 3])  # sliding at 3: more fused rows (7) than the window shows (3)
def test_a_block_ingests_the_newest_context_rows_in_its_own_forward(kind, split, tiny_draft, qwen3_target, qwen3_model):
    """`draft(block, cache, hooks, features)` = ingesting `features` with `extend_context`, then the
    block: the same logits, the same cache (positions, visible rows, keys and values), and a later
    block sees the same context."""
    extra = {"full": {}, "causal": {"is_causal": True}, "sliding": SLIDING, "bounded": {}}[kind]
    draft = load_draft(tiny_draft(qwen3_target, target_layer_ids=[1, 2], **extra), qwen3_model)
    adapter, feats = TargetAdapter(qwen3_model, (1, 2)), _features(qwen3_model, (1, 2))[None]
    bound = 5 if kind == "bounded" else None
    apart, fused = draft.make_cache(bound), draft.make_cache(bound)
    draft.extend_context(feats[:, :split], apart)
    draft.extend_context(feats[:, split:], apart)
    want = np.array(draft(BLOCK[None], apart, adapter))
    draft.extend_context(feats[:, :split], fused)
    got = np.array(draft(BLOCK[None], fused, adapter, feats[:, split:]))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for a, f in zip(apart, fused):
        assert f.end == a.end == 10 and (f.visible_rows, f.start) == (a.visible_rows, a.start)
        for x, y in zip(f.fetch(), a.fetch()):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.array(draft(BLOCK[None], fused, adapter)), want, atol=1e-5, rtol=1e-5)


def test_sliding_window_rule(tiny_draft, qwen3_target, qwen3_model):
    """Context key visible iff query_pos - key_pos < window. One causal layer, window 4, block
    [anchor, mask] after 10 rows: row 1 sees the last 2 context rows only, like a full layer fed
    just those 2 rows (RoPE is relative); a window nobody reaches changes nothing."""

    def run(feats=None, **kw):
        path = tiny_draft(qwen3_target, num_layers=1, target_layer_ids=[2], is_causal=True, **kw)
        chunks = (10,) if feats is None else (len(feats),)
        return _logits(load_draft(path), qwen3_model, chunks, feats=feats, block=BLOCK[:2])

    feats = _features(qwen3_model, (2,))
    sliding = dict(layer_types=["sliding_attention"], sliding_window=4)
    np.testing.assert_allclose(run(**sliding), run(feats[-2:]), atol=1e-5)
    assert np.abs(run(**sliding) - run(feats[-3:])).max() > 1e-4
    np.testing.assert_allclose(run(**dict(sliding, sliding_window=64)), run(), atol=1e-6)
