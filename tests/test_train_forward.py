"""Drafter training internals (spec section 7): the training forward against the
inference drafter, the block-diagonal mask, the loss weights and the batches."""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from helpers import MASK_ID, TINY_VOCAB

from dflash_mlx import load_draft
from dflash_mlx.targets.adapter import TargetAdapter
from dflash_mlx.train.batches import Sequence, build_sequences, make_batch, step_batch
from dflash_mlx.train.features import FeatureStore
from dflash_mlx.train.loss import (
    accepted_prefix,
    block_loss,
    default_decay,
    row_weights,
)
from dflash_mlx.train.masks import block_visibility
from dflash_mlx.train.model_forward import training_logits

IDS = [40, 41, 57, 99, 120, 7, 300, 301, 12, 250, 17, 33, 44, 90, 91, 92, 18, 19]
B = 4  # block size of these tests


def _features(model, layer_ids, ids=IDS):
    adapter = TargetAdapter(model, tuple(layer_ids))
    return adapter, adapter.forward(mx.array([ids]), adapter.make_cache())[1]


def _block(anchor_token: int) -> list[int]:
    return [anchor_token] + [MASK_ID] * (B - 1)


def _inference_logits(draft, adapter, feats, anchor: int, ids=IDS) -> np.ndarray:
    """What the engine's drafter computes for the block anchored at `anchor`."""
    cache = draft.make_cache()
    draft.extend_context(feats[:, :anchor], cache)
    out = draft(mx.array([_block(ids[anchor])]), cache, adapter)
    return np.array(out[0])


def _training_logits(draft, adapter, feats, anchors: list[int], ids=IDS) -> np.ndarray:
    blocks = mx.array([[t for a in anchors for t in _block(ids[a])]])
    out = training_logits(draft, adapter, feats, blocks, mx.array([anchors]))
    return np.array(out[0])  # [K, b - 1, V]


DRAFT_VARIANTS = {
    "default": {},
    "sliding_causal": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "all_causal": {"is_causal": True},
    "scaled": {
        "input_embedding_scale": 0.5,
        "output_multiplier": 0.7,
        "final_logit_softcapping": 20.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
}


@pytest.mark.parametrize("variant", sorted(DRAFT_VARIANTS))
def test_training_forward_equals_inference_drafter(tiny_draft, qwen3_target, qwen3_model, variant):
    draft_dir = tiny_draft(qwen3_target, target_layer_ids=[1, 2], block_size=B, **DRAFT_VARIANTS[variant])
    draft = load_draft(draft_dir, qwen3_model)
    adapter, feats = _features(qwen3_model, [1, 2])
    anchors = [3, 9, 14]
    packed = _training_logits(draft, adapter, feats, anchors)
    assert packed.shape == (3, B - 1, TINY_VOCAB)
    for i, a in enumerate(anchors):
        expected = _inference_logits(draft, adapter, feats, a)
        assert np.abs(expected).max() > 1.0  # non-trivial logits
        np.testing.assert_allclose(_training_logits(draft, adapter, feats, [a])[0], expected, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(packed[i], expected, atol=1e-5, rtol=1e-5)


def test_block_visibility_matrix():
    mask = np.array(block_visibility(mx.array([[2, 4]]), context_len=5, block_size=2))[0, 0]
    expected = np.array(
        [  # context 0..4 | block 0 rows | block 1 rows
            [1, 1, 0, 0, 0, 1, 1, 0, 0],  # anchor 2, row 0
            [1, 1, 0, 0, 0, 1, 1, 0, 0],  # anchor 2, row 1
            [1, 1, 1, 1, 0, 0, 0, 1, 1],  # anchor 4, row 0
            [1, 1, 1, 1, 0, 0, 0, 1, 1],
        ],
        bool,
    )
    np.testing.assert_array_equal(mask, expected)
    causal = np.array(block_visibility(mx.array([[2, 4]]), 5, 2, causal=True, window=3))[0, 0]
    expected[0, 6] = expected[2, 8] = False  # row 0 no longer sees row 1 of its block
    expected[1, 0] = False  # position 3 - 0 >= window 3
    expected[2, :2] = False  # position 4: sees 2, 3 only
    expected[3, :3] = False  # position 5: sees 3 only
    np.testing.assert_array_equal(causal, expected)


def test_blocks_see_only_their_own_context_and_block(qwen3_draft, qwen3_model):
    """Perturb what a block must not see: its logits must not move; perturb what it
    must see: they must move (so the test fails if the mask leaked or blocked)."""
    draft = load_draft(qwen3_draft, qwen3_model)
    adapter, feats = _features(qwen3_model, [1, 2])
    anchors = [4, 9, 14]
    base = _training_logits(draft, adapter, feats, anchors)

    later = feats.at[:, 9:].add(5.0)  # positions >= anchor 9 (and >= 14)
    moved = _training_logits(draft, adapter, later, anchors)
    np.testing.assert_array_equal(moved[:2], base[:2])  # blocks at 4 and 9 see none of it
    assert np.abs(moved[2] - base[2]).max() > 1e-3  # the block at 14 sees 9..13

    ids = list(IDS)
    ids[4], ids[14] = 200, 201  # the anchor tokens of blocks 0 and 2
    other = _training_logits(draft, adapter, feats, anchors, ids)
    np.testing.assert_array_equal(other[1], base[1])
    assert np.abs(other[0] - base[0]).max() > 1e-3 and np.abs(other[2] - base[2]).max() > 1e-3

    # A block's own context ends right before its anchor: position anchor - 1 is seen.
    edge = _training_logits(draft, adapter, feats.at[:, 8].add(5.0), anchors)
    np.testing.assert_array_equal(edge[0], base[0])
    assert np.abs(edge[1] - base[1]).max() > 1e-3


def test_decay_constants_and_row_weights():
    assert [default_decay(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    decays = [default_decay(b) for b in range(2, 40)]
    assert all(x <= y for x, y in itertools.pairwise(decays)) and min(decays) >= 1.0
    assert default_decay(9) == 4.5 and default_decay(13) == 6.0
    w = np.array(row_weights(16))
    expected = np.exp(-np.arange(15) / 7.0)
    np.testing.assert_allclose(w, expected / expected.sum(), rtol=1e-6)
    halves = np.exp(-np.arange(7) / 2.0)
    np.testing.assert_allclose(np.array(row_weights(8, decay=2.0)), halves / halves.sum(), rtol=1e-6)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        default_decay(1)
    with pytest.raises(ValueError, match="positive"):
        row_weights(8, decay=0.0)


def test_block_loss_matches_a_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5, 11)).astype(np.float32)  # [B, K, b-1, V]
    targets = rng.integers(0, 11, size=(2, 3, 5))
    valid = np.ones((2, 3, 5), bool)
    valid[0, 1, 3:] = False  # a block cut by the sequence end
    valid[1, 2] = False  # a padding block
    w = np.array(row_weights(6))
    loss, blocks = block_loss(mx.array(logits), mx.array(targets), mx.array(valid), mx.array(w))

    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    expected = (ce * valid * w).sum() / 5  # 5 blocks hold targets
    assert int(blocks.item()) == 5
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)

    # Logits of ignored rows do not matter.
    changed = logits.copy()
    changed[0, 1, 3:] += rng.normal(size=(2, 11)) * 10
    changed[1, 2] += 3.0
    again, _ = block_loss(mx.array(changed), mx.array(targets), mx.array(valid), mx.array(w))
    assert again.item() == pytest.approx(loss.item(), rel=1e-6)


def test_accepted_prefix():
    V = 6
    targets = mx.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    preds = np.array([[1, 2, 3], [1, 5, 3], [0, 2, 3]])
    logits = mx.array(np.eye(V, dtype=np.float32)[preds])
    valid = mx.array([[True, True, True], [True, True, True], [True, True, True]])
    assert accepted_prefix(logits, targets, valid).tolist() == [4, 2, 1]
    cut = mx.array([[True, True, False], [True, True, True], [True, True, True]])
    assert accepted_prefix(logits, targets, cut).tolist()[0] == 3


def test_batches_pack_blocks_and_targets():
    seq = Sequence(ids=tuple(range(100, 112)), prompt_len=5)  # response 105..111
    batch = make_batch([seq, Sequence(ids=(7, 8, 9), prompt_len=1)], [[5, 9, 10], [1]], 4, mask_id=3)
    assert batch.ids.shape == (2, 12) and batch.lengths == [12, 3]
    assert batch.block_ids.tolist()[0] == [105, 3, 3, 3, 109, 3, 3, 3, 110, 3, 3, 3]
    assert batch.block_ids.tolist()[1][:4] == [8, 3, 3, 3]
    assert batch.anchors.tolist() == [[5, 9, 10], [1, 0, 0]]
    assert batch.targets.tolist()[0][1] == [110, 111, 0] and batch.valid.tolist()[0][1] == [True, True, False]
    assert batch.targets.tolist()[1][0] == [9, 0, 0] and batch.valid.tolist()[1][0] == [True, False, False]
    assert not np.array(batch.valid)[1, 1:].any()  # padding blocks
    with pytest.raises(ValueError, match="outside the response"):
        make_batch([seq], [[4]], 4, mask_id=3)  # a prompt position
    with pytest.raises(ValueError, match="outside the response"):
        make_batch([seq], [[11]], 4, mask_id=3)  # the last token has nothing to predict


def test_step_batches_are_deterministic_and_cover_the_data():
    prompts = [[1, 2, 3]] * 10
    responses = [[10 + i] * (i % 6) for i in range(10)]
    seqs, dropped = build_sequences(prompts, responses, max_length=7)
    assert dropped == 4 and all(len(s.ids) <= 7 for s in seqs)  # responses of length 0 and 1
    kw = {"batch_size": 2, "anchors_per_seq": 3, "block_size": 4, "mask_id": 3, "seed": 5}
    a = step_batch(4, seqs, **kw)
    b = step_batch(4, seqs, **kw)
    assert a[0] == b[0] and a[1].anchors.tolist() == b[1].anchors.tolist()
    epoch = sorted(i for s in range(3) for i in step_batch(s, seqs, **kw)[0])
    assert epoch == list(range(6))  # 3 batches of 2 cover the 6 sequences once
    assert [step_batch(s, seqs, **kw)[0] for s in range(3)] != [step_batch(s, seqs, **kw)[0] for s in range(3, 6)]
    for step in range(6):
        idx, batch = step_batch(step, seqs, **kw)
        for row, i in enumerate(idx):
            anchors = [p for p, ok in zip(batch.anchors.tolist()[row], np.array(batch.valid)[row, :, 0]) if ok]
            assert anchors and all(p in seqs[i].anchor_range for p in anchors)
            assert len(set(anchors)) == len(anchors) <= 3


def test_feature_store_caches_on_disk(qwen3_model, tmp_path):
    adapter = TargetAdapter(qwen3_model, (1, 2))
    seqs = [Sequence(ids=tuple(IDS), prompt_len=4), Sequence(ids=tuple(IDS[:9]), prompt_len=4)]
    batch = make_batch(seqs, [[5, 9], [5]], B, mask_id=MASK_ID)
    online = np.array(FeatureStore(adapter).batch_features([0, 1], batch, seqs))
    _, whole = _features(qwen3_model, [1, 2])
    np.testing.assert_allclose(online[0], np.array(whole[0]), atol=1e-5)  # right padding changes nothing
    _, short = _features(qwen3_model, [1, 2], IDS[:9])
    np.testing.assert_allclose(online[1, :9], np.array(short[0]), atol=1e-5)

    store = FeatureStore(adapter, tmp_path / "features")
    first = np.array(store.batch_features([0, 1], batch, seqs))
    assert (store.misses, store.hits) == (2, 0) and len(list((tmp_path / "features").iterdir())) == 2
    again = np.array(store.batch_features([0, 1], batch, seqs))
    assert (store.misses, store.hits) == (2, 2)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(first[0], online[0], rtol=2e-2, atol=2e-2 * np.abs(online).max())  # bfloat16
    assert not first[1, 9:].any()  # padding rows stay zero
    other = [Sequence(ids=tuple(IDS[1:]), prompt_len=4), seqs[1]]  # index 0 now holds other ids
    store.batch_features([0, 1], make_batch(other, [[5], [5]], B, mask_id=MASK_ID), other)
    assert (store.misses, store.hits) == (3, 3)  # stale features are never read


def test_a_step_trains_the_drafter_only(qwen3_model, tmp_path):
    from mlx.utils import tree_flatten

    from dflash_mlx.train.new_drafter import drafter_config, new_drafter
    from dflash_mlx.train.options import TrainOptions
    from dflash_mlx.train.trainer import StepRunner, make_optimizer

    options = TrainOptions(
        model="t",
        data="d",
        out="o",
        steps=10,
        block_size=B,
        draft_layers=1,
        batch_size=2,
        anchors_per_seq=4,
        lr=1e-2,
        target_layers=[1, 2],
    )
    config = drafter_config(qwen3_model, num_layers=1, block_size=B, mask_token_id=MASK_ID, target_layer_ids=[1, 2])
    draft = new_drafter(config)
    target = TargetAdapter(qwen3_model, (1, 2))
    before_target = {k: np.array(v) for k, v in tree_flatten(qwen3_model.parameters())}
    before_draft = {k: np.array(v) for k, v in tree_flatten(draft.parameters())}
    seqs = [Sequence(ids=tuple(IDS), prompt_len=6), Sequence(ids=tuple(IDS[3:]), prompt_len=2)]
    runner = StepRunner(draft, target, FeatureStore(target), make_optimizer(options), options)
    rows = [runner(step, seqs, MASK_ID, 0) for step in range(3)]
    assert all(np.isfinite(r["loss"]) and r["tokens"] == len(IDS) * 2 - 3 for r in rows)
    for key, value in tree_flatten(qwen3_model.parameters()):
        np.testing.assert_array_equal(np.array(value), before_target[key], err_msg=key)
    changed = [k for k, v in tree_flatten(draft.parameters()) if not np.array_equal(np.array(v), before_draft[k])]
    assert sorted(changed) == sorted(before_draft)  # every drafter tensor moved
