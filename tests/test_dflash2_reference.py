"""DFlash 2 building blocks against an independent NumPy reference (spec 4).

The NumPy code below is written from the spec only:

- Grouped dynamic causal convolution: D = kernel_projection(u) reshaped
  [B, L, 2, K, G]; D0, D1 = D[..., 0, :, :], D[..., 1, :, :];
  conv(z; base, D)_t = sum_j (base[j] + D[t, j, c // group_size]) * z_{t-j}
  (z = 0 before the first row); prepare(u) = (conv(u; base[0], D0), D1);
  finish(y, D1) = conv(y; base[1], D1).
- Candidate selector: candidates = top-k ids of each row's logits, unary =
  their logits, h' = hidden_projection(hidden); walking from the anchor,
  score_i = unary[t, i] + sum_r P[pred]_r h'[t, r] S[cand[t, i]]_r; greedy
  takes the argmax, sampling draws from softmax(score / T) (q[t] = that row).

Package API assumed (``dflash_mlx.draft.dflash2``, imported inside the tests;
they skip only while that module does not exist):

- ``GroupedDynamicConv(hidden_size, kernel_size, group_size)`` with parameters
  ``base_kernel`` [2, K, H] and ``kernel_projection`` (Linear H -> 2 K G, no
  bias); ``prepare(u) -> (conv_u, D1)`` for u [B, L, H]; ``finish(y, D1)``.
- ``CandidateSelector(hidden_size, vocab_size, rank, top_k)`` with
  ``hidden_projection`` (Linear H -> R, no bias) and ``predecessor_codebook``
  / ``successor_codebook`` (Embedding V x R); ``select(hidden [g, H],
  logits [g, V], anchor, temperature=0.0, key=None) -> (path [g],
  candidates [g, k], q [g, k] or None)`` for one sequence.

Candidate order inside a row is not part of the contract: the tests compare
candidate sets, the chosen ids, and q in the order the package returns.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import MASK_ID, draft2_weight_shapes, draft_weight_shapes, make_draft2

TOL = 1e-5


def _dflash2():
    """The package module, or a skip while it has not been written yet."""
    try:
        import dflash_mlx.draft.dflash2 as mod
    except ModuleNotFoundError as e:
        if e.name == "dflash_mlx.draft.dflash2":
            pytest.skip("dflash_mlx.draft.dflash2 does not exist yet (run these tests later)")
        raise
    return mod


def _np(x) -> np.ndarray:
    return np.array(mx.array(x).astype(mx.float32))


# ------------------------------------------------------------ NumPy reference


def ref_conv(z: np.ndarray, base: np.ndarray, dyn: np.ndarray, group_size: int) -> np.ndarray:
    """conv(z; base, D): z [B, L, H], base [K, H], dyn [B, L, K, G] -> [B, L, H]."""
    z, base, dyn = (np.asarray(a, np.float64) for a in (z, base, dyn))
    k = base.shape[0]
    d_full = np.repeat(dyn, group_size, axis=-1)  # per group -> per channel
    out = np.zeros_like(z)
    for t in range(z.shape[1]):
        for j in range(min(k, t + 1)):
            out[:, t] += (base[j] + d_full[:, t, j]) * z[:, t - j]
    return out


def ref_dynamic_kernels(u, w_proj, kernel_size, group_size):
    """D0, D1 [B, L, K, G] from kernel_projection(u) reshaped [B, L, 2, K, G]."""
    b, n, h = u.shape
    d = np.asarray(u, np.float64) @ np.asarray(w_proj, np.float64).T
    d = d.reshape(b, n, 2, kernel_size, h // group_size)
    return d[:, :, 0], d[:, :, 1]


def ref_prepare(u, base_kernel, w_proj, group_size):
    d0, d1 = ref_dynamic_kernels(u, w_proj, base_kernel.shape[1], group_size)
    return ref_conv(u, base_kernel[0], d0, group_size), d1


def ref_finish(y, d1, base_kernel, group_size):
    return ref_conv(y, base_kernel[1], d1, group_size)


def ref_scores(unary_row, cand_row, pred, h_proj_row, pred_book, succ_book):
    """score_i = unary_i + sum_r P[pred]_r h'_r S[cand_i]_r (float64)."""
    pairwise = (pred_book[int(pred)] * h_proj_row) @ succ_book[np.asarray(cand_row)].T
    return np.asarray(unary_row, np.float64) + pairwise


def ref_topk_sets(logits: np.ndarray, k: int) -> list:
    return [set(np.argsort(-row, kind="stable")[:k].tolist()) for row in logits]


def ref_greedy(hidden, logits, anchor, w_hidden, pred_book, succ_book, k):
    """The greedy walk: (path, candidate rows, chosen scores, top-1 minus top-2 gaps)."""
    hidden, logits = np.asarray(hidden, np.float64), np.asarray(logits, np.float64)
    pred_book, succ_book = np.asarray(pred_book, np.float64), np.asarray(succ_book, np.float64)
    h_proj = hidden @ np.asarray(w_hidden, np.float64).T
    pred, path, cands, chosen, gaps = int(anchor), [], [], [], []
    for t in range(logits.shape[0]):
        cand = np.argsort(-logits[t], kind="stable")[:k]
        score = ref_scores(logits[t, cand], cand, pred, h_proj[t], pred_book, succ_book)
        order = np.argsort(-score)
        pred = int(cand[order[0]])
        path.append(pred)
        cands.append(cand)
        chosen.append(score[order[0]])
        gaps.append(score[order[0]] - score[order[1]])
    return np.array(path), np.array(cands), np.array(chosen), np.array(gaps)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# ------------------------------------------------------------------ helpers


def _make_conv(mod, h, k, group, seed):
    """A GroupedDynamicConv with random weights whose dynamic part matters."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((2, k, h)).astype(np.float32) * 0.3
    base[:, 0] += 1.0
    w_proj = (rng.standard_normal((2 * k * (h // group), h)) * 0.3 / np.sqrt(h)).astype(np.float32)
    conv = mod.GroupedDynamicConv(h, k, group)
    conv.load_weights(
        [("base_kernel", mx.array(base)), ("kernel_projection.weight", mx.array(w_proj))],
        strict=True,
    )
    return conv, base, w_proj


def _make_selector(mod, h, v, r, k, seed):
    rng = np.random.default_rng(seed)
    w_hidden = (rng.standard_normal((r, h)) * 0.5).astype(np.float32)
    pred_book = (rng.standard_normal((v, r)) * 0.5).astype(np.float32)
    succ_book = (rng.standard_normal((v, r)) * 0.5).astype(np.float32)
    sel = mod.CandidateSelector(h, v, r, k)
    sel.load_weights(
        [
            ("hidden_projection.weight", mx.array(w_hidden)),
            ("predecessor_codebook.weight", mx.array(pred_book)),
            ("successor_codebook.weight", mx.array(succ_book)),
        ],
        strict=True,
    )
    return sel, w_hidden, pred_book, succ_book


def _selector_inputs(g, h, v, seed):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((g, h)).astype(np.float32)  # like a normed hidden
    logits = (rng.standard_normal((g, v)) * 3.0).astype(np.float32)
    return hidden, logits


# ------------------------------------------------------- grouped dynamic conv

CONV_CASES = [(64, 2, 16), (32, 3, 8)]


@pytest.mark.parametrize("h,k,group", CONV_CASES)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("length", [1, 7])
def test_conv_prepare_finish_match_numpy(h, k, group, batch, length):
    mod = _dflash2()
    conv, base, w_proj = _make_conv(mod, h, k, group, seed=h * 100 + k)
    rng = np.random.default_rng([batch, length, h])
    u = rng.standard_normal((batch, length, h)).astype(np.float32)
    y = rng.standard_normal((batch, length, h)).astype(np.float32)

    out_u, d1 = conv.prepare(mx.array(u))
    ref_u, ref_d1 = ref_prepare(u, base, w_proj, group)
    assert tuple(out_u.shape) == (batch, length, h)
    np.testing.assert_allclose(_np(out_u), ref_u, atol=TOL, rtol=0)
    assert d1.size == ref_d1.size, (d1.shape, ref_d1.shape)
    np.testing.assert_allclose(_np(d1).reshape(ref_d1.shape), ref_d1, atol=TOL, rtol=0)

    out_y = conv.finish(mx.array(y), d1)
    assert tuple(out_y.shape) == (batch, length, h)
    np.testing.assert_allclose(_np(out_y), ref_finish(y, ref_d1, base, group), atol=TOL, rtol=0)


def test_conv_is_causal_and_rows_independent_across_batch():
    """Row t depends on rows <= t only; batch rows do not mix."""
    mod = _dflash2()
    h, k, group = 64, 2, 16
    conv, _, _ = _make_conv(mod, h, k, group, seed=7)
    u = np.random.default_rng(3).standard_normal((2, 6, h)).astype(np.float32)
    out, d1 = conv.prepare(mx.array(u))
    fin = conv.finish(mx.array(u), d1)
    u2 = u.copy()
    u2[0, 4:] += 1.0  # change the future of sequence 0
    out2, d1b = conv.prepare(mx.array(u2))
    fin2 = conv.finish(mx.array(u2), d1b)
    np.testing.assert_allclose(_np(out2)[0, :4], _np(out)[0, :4], atol=TOL, rtol=0)
    np.testing.assert_allclose(_np(fin2)[0, :4], _np(fin)[0, :4], atol=TOL, rtol=0)
    np.testing.assert_allclose(_np(out2)[1], _np(out)[1], atol=TOL, rtol=0)
    assert np.abs(_np(out2)[0, 4:] - _np(out)[0, 4:]).max() > 1e-2


def test_conv_dynamic_kernel_is_shared_within_a_group():
    """With base = 0 and one nonzero projection row, exactly one group responds."""
    mod = _dflash2()
    h, k, group = 32, 2, 8
    conv = mod.GroupedDynamicConv(h, k, group)
    w = np.zeros((2 * k * (h // group), h), np.float32)
    # Row index in the [2, K, G] layout: (branch 0, tap 0, group 2).
    w[0 * k * (h // group) + 0 * (h // group) + 2, 0] = 1.0
    conv.load_weights(
        [("base_kernel", mx.zeros((2, k, h))), ("kernel_projection.weight", mx.array(w))],
        strict=True,
    )
    u = np.ones((1, 1, h), np.float32)
    out, _ = conv.prepare(mx.array(u))
    expect = np.zeros(h)
    expect[2 * group : 3 * group] = 1.0
    np.testing.assert_allclose(_np(out)[0, 0], expect, atol=TOL, rtol=0)


# --------------------------------------------------------- candidate selector

SEL_H, SEL_V, SEL_R, SEL_K = 32, 64, 8, 4


@pytest.mark.parametrize("g", [1, 5, 15])
@pytest.mark.parametrize("anchor_kind", ["int", "array"])
def test_selector_greedy_matches_numpy_walk(g, anchor_kind):
    mod = _dflash2()
    sel, w_hidden, pbook, sbook = _make_selector(mod, SEL_H, SEL_V, SEL_R, SEL_K, seed=11)
    hidden, logits = _selector_inputs(g, SEL_H, SEL_V, seed=g)
    anchor = 17
    ref_path, _, ref_chosen, gaps = ref_greedy(hidden, logits, anchor, w_hidden, pbook, sbook, SEL_K)
    assert gaps.min() > 1e-3, "reference has a near tie; pick another seed"
    # The pairwise term must matter here, else the test cannot catch its bugs.
    assert (ref_path != logits.argmax(-1)).any() or g == 1

    a = anchor if anchor_kind == "int" else mx.array(anchor)
    path, cands, q = sel.select(mx.array(hidden), mx.array(logits), a)
    assert q is None
    path, cands = _np(path).astype(np.int64), _np(cands).astype(np.int64)
    assert path.shape == (g,) and cands.shape == (g, SEL_K)
    np.testing.assert_array_equal(path, ref_path)
    assert [set(r.tolist()) for r in cands] == ref_topk_sets(logits, SEL_K)

    # The chosen id's score, recomputed along the returned path, is the row max.
    h_proj = hidden.astype(np.float64) @ w_hidden.T.astype(np.float64)
    pred = anchor
    for t in range(g):
        score = ref_scores(logits[t, cands[t]], cands[t], pred, h_proj[t], pbook, sbook)
        chosen = score[list(cands[t]).index(path[t])]
        assert abs(chosen - ref_chosen[t]) <= TOL
        assert chosen == score.max()
        pred = path[t]


def test_selector_greedy_depends_on_anchor():
    """The first choice uses P[anchor]: some anchors change the path."""
    mod = _dflash2()
    sel, w_hidden, pbook, sbook = _make_selector(mod, SEL_H, SEL_V, SEL_R, SEL_K, seed=11)
    hidden, logits = _selector_inputs(3, SEL_H, SEL_V, seed=5)
    paths = set()
    for anchor in range(0, SEL_V, 4):
        ref_path = ref_greedy(hidden, logits, anchor, w_hidden, pbook, sbook, SEL_K)[0]
        path, _, _ = sel.select(mx.array(hidden), mx.array(logits), anchor)
        np.testing.assert_array_equal(_np(path).astype(np.int64), ref_path)
        paths.add(tuple(ref_path))
    assert len(paths) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("g", [1, 6])
def test_selector_sampling_q_rows_match_numpy(temperature, g):
    mod = _dflash2()
    sel, w_hidden, pbook, sbook = _make_selector(mod, SEL_H, SEL_V, SEL_R, SEL_K, seed=23)
    hidden, logits = _selector_inputs(g, SEL_H, SEL_V, seed=100 + g)
    anchor = 9
    h_proj = hidden.astype(np.float64) @ w_hidden.T.astype(np.float64)
    for key_seed in range(3):
        path, cands, q = sel.select(
            mx.array(hidden),
            mx.array(logits),
            anchor,
            temperature=temperature,
            key=mx.random.key(key_seed),
        )
        assert q is not None
        path, cands, q = _np(path).astype(np.int64), _np(cands).astype(np.int64), _np(q)
        assert path.shape == (g,) and cands.shape == (g, SEL_K) and q.shape == (g, SEL_K)
        assert [set(r.tolist()) for r in cands] == ref_topk_sets(logits, SEL_K)
        np.testing.assert_allclose(q.sum(-1), 1.0, atol=TOL, rtol=0)
        pred = anchor
        for t in range(g):
            assert path[t] in cands[t]
            score = ref_scores(logits[t, cands[t]], cands[t], pred, h_proj[t], pbook, sbook)
            np.testing.assert_allclose(q[t], _softmax(score / temperature), atol=TOL, rtol=0)
            pred = path[t]


def test_selector_sampling_is_deterministic_per_key():
    mod = _dflash2()
    sel, *_ = _make_selector(mod, SEL_H, SEL_V, SEL_R, SEL_K, seed=23)
    hidden, logits = _selector_inputs(8, SEL_H, SEL_V, seed=1)
    runs = [
        _np(sel.select(mx.array(hidden), mx.array(logits), 2, temperature=1.0, key=mx.random.key(s))[0]) for s in (5, 5)
    ]
    np.testing.assert_array_equal(runs[0], runs[1])


def test_selector_sampling_frequencies_follow_q():
    """First-row draws over many keys follow q[0] (loose binomial bound)."""
    mod = _dflash2()
    sel, *_ = _make_selector(mod, SEL_H, SEL_V, SEL_R, SEL_K, seed=31)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, SEL_H)).astype(np.float32) * 0.1
    logits = (rng.standard_normal((1, SEL_V)) * 0.5).astype(np.float32)  # flat-ish q
    n = 600
    counts, q_ref = {}, None
    for s in range(n):
        path, cands, q = sel.select(mx.array(hidden), mx.array(logits), 4, temperature=1.0, key=mx.random.key(s))
        tok = int(_np(path)[0])
        counts[tok] = counts.get(tok, 0) + 1
        if q_ref is None:
            q_ref = dict(zip(_np(cands)[0].astype(np.int64).tolist(), _np(q)[0].tolist()))
    assert set(counts) <= set(q_ref)
    for tok, p in q_ref.items():
        sd = np.sqrt(n * p * (1 - p))
        assert abs(counts.get(tok, 0) - n * p) <= 5 * sd + 1, (tok, counts, q_ref)


# ------------------------------------------------------------------ fixture


@pytest.fixture(scope="module")
def draft2_dir(tmp_path_factory, qwen3_target):
    return make_draft2(tmp_path_factory.mktemp("draft2") / "d", qwen3_target, target_layer_ids=[1, 2])


def test_fixture_config_fields(draft2_dir):
    cfg = json.loads((draft2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["is_causal"] is False
    assert cfg["layer_types"] == ["sliding_attention"] * cfg["num_hidden_layers"] == ["sliding_attention"] * 2
    assert cfg["sliding_window"] == 8
    assert cfg["rope_theta"] == 500000.0
    d = cfg["dflash_config"]
    assert d == {
        "mask_token_id": MASK_ID,
        "target_layer_ids": [1, 2],
        "block_size": 16,
        "output_multiplier": 0.19611613513818404,
        "final_logit_softcapping": 20.0,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
    }


def test_fixture_keys_and_shapes(draft2_dir):
    cfg = json.loads((draft2_dir / "config.json").read_text())
    w = mx.load(str(draft2_dir / "model.safetensors"))
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    d = cfg["dflash_config"]
    k, group, r = d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"]
    expected = dict(draft_weight_shapes(cfg))
    for i in range(n):
        for conv in ("attention_conv", "mlp_conv"):
            expected[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
            expected[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * (h // group), h)
    expected["candidate_selector.hidden_projection.weight"] = (r, h)
    expected["candidate_selector.predecessor_codebook"] = (v, r)
    expected["candidate_selector.successor_codebook"] = (v, r)
    assert {key: tuple(a.shape) for key, a in w.items()} == expected
    assert expected == {**draft_weight_shapes(cfg), **draft2_weight_shapes(cfg)}
    assert not any(key.endswith("codebook.weight") for key in w)
    assert all(a.dtype == mx.float32 for a in w.values())
    # Concrete numbers for the default fixture (hidden 64, group 16, K 2, R 8).
    assert expected["layers.0.mlp_conv.kernel_projection.weight"] == (16, 64)
    assert expected["candidate_selector.successor_codebook"] == (512, 8)


def test_fixture_v1_part_equals_make_draft(draft2_dir, qwen3_draft):
    w2 = mx.load(str(draft2_dir / "model.safetensors"))
    w1 = mx.load(str(qwen3_draft / "model.safetensors"))
    assert set(w1) < set(w2)
    for key, a in w1.items():
        assert mx.array_equal(a, w2[key]), key


def test_fixture_v2_init_scales(draft2_dir):
    w = {k: np.array(a) for k, a in mx.load(str(draft2_dir / "model.safetensors")).items()}
    base = w["layers.0.attention_conv.base_kernel"]
    assert abs(base[:, 0].mean() - 1.0) < 0.05 and base[:, 0].std() < 0.1
    assert abs(base[:, 1].mean()) < 0.1 and 0.15 < base[:, 1].std() < 0.5
    assert w["layers.1.mlp_conv.kernel_projection.weight"].std() < 0.01
    assert 0.4 < w["candidate_selector.predecessor_codebook"].std() < 0.6
    assert not np.array_equal(w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"])


def test_fixture_overrides_and_bfloat16(tmp_path, qwen3_target):
    out = make_draft2(
        tmp_path / "d",
        qwen3_target,
        dtype="bfloat16",
        selector_rank=4,
        selector_top_k=2,
        conv_kernel_size=3,
        conv_group_size=8,
        architectures=["DFlashDraftModel"],
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["torch_dtype"] == "bfloat16"
    w = mx.load(str(out / "model.safetensors"))
    assert all(a.dtype == mx.bfloat16 for a in w.values())
    assert w["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 3 * 8, 64)
    assert w["candidate_selector.hidden_projection.weight"].shape == (4, 64)


def test_fixture_weights_load_into_package_modules(draft2_dir):
    """The checkpoint tensors fit the package modules (codebooks renamed to .weight)."""
    mod = _dflash2()
    cfg = json.loads((draft2_dir / "config.json").read_text())
    d, h, v = cfg["dflash_config"], cfg["hidden_size"], cfg["vocab_size"]
    w = mx.load(str(draft2_dir / "model.safetensors"))
    conv = mod.GroupedDynamicConv(h, d["conv_kernel_size"], d["conv_group_size"])
    prefix = "layers.0.attention_conv."
    conv.load_weights([(k[len(prefix) :], a) for k, a in w.items() if k.startswith(prefix)], strict=True)
    sel = mod.CandidateSelector(h, v, d["selector_rank"], d["selector_top_k"])
    prefix = "candidate_selector."
    items = []
    for k, a in w.items():
        if k.startswith(prefix):
            k = k[len(prefix) :]
            items.append((k if k.endswith(".weight") else k + ".weight", a))
    sel.load_weights(items, strict=True)
