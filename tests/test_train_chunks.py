"""Memory-bounded training pieces: the loss in chunks of rows and the anchors in groups
equal the whole-batch loss (value and gradients), target features computed in chunks equal one forward, anchors
spread over long responses, and replay batches mixing two pools."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
import helpers as tm
from mlx.utils import tree_flatten

from dflash_mlx.targets.adapter import TargetAdapter
from dflash_mlx.train.batches import Sequence, make_batch, mixed_step_indices, sample_anchors
from dflash_mlx.train.chunked_loss import auto_chunk_rows, chunked_step
from dflash_mlx.train.features import target_features
from dflash_mlx.train.new_drafter import drafter_config, new_drafter
from dflash_mlx.train.options import TrainOptions
from dflash_mlx.train.step import StepRunner, auto_anchor_chunk, memory_budgets

B = 4


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_chunked_loss_equals_the_whole_batch_loss(qwen3_target, softcap):
    model = mlx_lm.load(str(qwen3_target))[0]
    config = drafter_config(model, num_layers=2, block_size=B, mask_token_id=tm.MASK_ID, target_layer_ids=[1, 2])
    if softcap:
        config["dflash_config"].update(final_logit_softcapping=softcap, output_multiplier=0.5)
    mx.random.seed(0)
    draft = new_drafter(config)
    target = TargetAdapter(model, (1, 2))
    rng = np.random.default_rng(0)
    seqs = [Sequence(tuple(int(t) for t in rng.integers(5, 500, n)), 3) for n in (20, 13)]
    batch = make_batch(seqs, [[3, 7, 11, 17], [4, 10, 11]], B, tm.MASK_ID)  # one block cut by the end
    features = target_features(target, batch.ids)
    options = TrainOptions(model="t", data="d", out="o", block_size=B, draft_layers=2)
    whole = StepRunner(draft, target, None, None, options)
    loss, tau, grads = whole.loss_and_grads(features, batch)
    assert batch.targets.size > 7
    for rows in (1, 7, batch.targets.size - 1):
        c_loss, c_tau, c_grads = chunked_step(
            draft, target, features, batch.block_ids, batch.anchors, batch.targets, batch.valid, whole.weights, rows
        )
        assert c_loss.item() == pytest.approx(loss.item(), rel=1e-5)
        assert c_tau.item() == pytest.approx(tau.item(), rel=1e-6)
        flat, c_flat = dict(tree_flatten(grads)), dict(tree_flatten(c_grads))
        assert flat.keys() == c_flat.keys()
        for key in flat:
            np.testing.assert_allclose(np.array(c_flat[key]), np.array(flat[key]), rtol=1e-4, atol=1e-6, err_msg=key)
    for group, rows in ((1, None), (3, None), (2, 5)):  # anchors in groups (and rows in chunks): the same
        options = TrainOptions(model="t", data="d", out="o", block_size=B, anchor_chunk=group, loss_chunk_rows=rows)
        g_loss, g_tau, g_grads = StepRunner(draft, target, None, None, options).loss_and_grads(features, batch)
        assert g_loss.item() == pytest.approx(loss.item(), rel=1e-5) and g_tau.item() == pytest.approx(tau.item())
        g_flat = dict(tree_flatten(g_grads))
        for key in flat:
            np.testing.assert_allclose(np.array(g_flat[key]), np.array(flat[key]), rtol=1e-4, atol=1e-6, err_msg=key)
    assert auto_anchor_chunk(draft, 2, 4, B, 20) == 4 and auto_anchor_chunk(draft, 8, 32, 16, 10**6) == 1
    small = TrainOptions(model="t", data="d", out="o", block_size=B, draft_layers=2, loss_chunk_rows=5)
    chunked_runner = StepRunner(draft, target, None, None, small)
    assert chunked_runner.chunk_rows == 5 and whole.chunk_rows == auto_chunk_rows(tm.TINY_VOCAB)
    assert auto_chunk_rows(151_936) * 151_936 <= 1 << 25 and auto_chunk_rows(10**9) == 16
    assert memory_budgets(None) == (1 << 25, 1 << 30) and memory_budgets(100.0) == (1 << 25, 1 << 30)
    assert memory_budgets(1.0) == (31_250_000, 250_000_000)
    tight = TrainOptions(model="t", data="d", out="o", block_size=B, max_memory_gb=0.01)
    limited = StepRunner(draft, target, None, None, tight)
    assert limited.chunk_rows == 312_500 // tm.TINY_VOCAB and limited.attention_bytes == 2_500_000


@pytest.mark.parametrize("family", ["qwen3", "llama_sliding", "qwen3_5"])
def test_features_in_chunks_equal_one_forward(tiny_target, family):
    model = mlx_lm.load(str(tiny_target(family)))[0]
    target = TargetAdapter(model, (1, 2))
    ids = mx.array(np.random.default_rng(1).integers(5, 500, (2, 29)).astype(np.int32))
    whole = np.array(target_features(target, ids))
    for chunk in (5, 8, 16):  # float32 summed in another order (the matmuls' blocking, the gated-delta recurrence's
        # chunks): the error scales with the values (1.8e-5 relative at 1.2 seen on one OpenBLAS thread)
        got = np.array(target_features(target, ids, chunk))
        np.testing.assert_allclose(got, whole, rtol=1e-4, atol=2e-5, err_msg=str(chunk))


def test_anchors_spread_over_a_long_response():
    seq = Sequence(ids=tuple(range(1000)), prompt_len=200)
    rng = np.random.default_rng(0)
    for _ in range(20):
        anchors = sample_anchors(rng, seq, 8)
        assert len(anchors) == 8 and anchors == sorted(set(anchors))
        spans = [(a - 200) * 8 // 799 for a in anchors]  # 799 anchor positions, 8 spans
        assert spans == list(range(8))
    short = Sequence(ids=tuple(range(12)), prompt_len=4)
    assert sample_anchors(rng, short, 8) == list(range(4, 11))
    assert sample_anchors(rng, short, 7) == list(range(4, 11))


def test_replay_batches_mix_two_pools():
    new, old = 10, 6
    seen_new, seen_old = set(), set()
    for step in range(10):
        idx = mixed_step_indices(step, new + old, 4, seed=3, num_replay=old, replay_per_batch=1)
        assert len(idx) == 4 and sum(i >= new for i in idx) == 1 and len(set(idx)) == 4
        seen_new |= {i for i in idx if i < new}
        seen_old |= {i for i in idx if i >= new}
    assert seen_new == set(range(new)) and seen_old == set(range(new, new + old))
    assert mixed_step_indices(2, 16, 4, seed=3) == mixed_step_indices(2, 16, 4, seed=3, num_replay=0)
