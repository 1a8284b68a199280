"""The drafter's training-time forward: many blocks of one sequence in one pass.

Inference drafts one block against a context cache (`DFlashDraftModel.__call__`).
Training packs K blocks per sequence and shows each block only its own context
(`dflash_mlx.train.masks`), so it runs the drafter's own submodules (fc,
hidden_norm, q/k/v/o projections, q/k norms, RoPE, MLP, norms) with an explicit
mask instead of the cache. The computation per block is the inference one:
context rows get RoPE at their absolute positions 0..L-1, block rows of the
block anchored at p at p..p+b-1 (RoPE takes one offset per block: blocks are
folded into the batch axis for it). The target's embedding and head are used
through `TargetHooks` and receive no gradient (only the drafter is trained).
"""

from __future__ import annotations

import mlx.core as mx

from ..draft.dspark_config import DSparkConfig
from ..draft.model import DFlashDraftModel, TargetHooks
from .masks import block_visibility


class UnsupportedDrafterError(ValueError):
    """Training supports DFlash v1 drafters and DeepSpec's qwen3 DSpark drafters only."""


def _blocks_to_batch(x: mx.array, K: int, b: int) -> mx.array:
    """[B, K*b, heads, D] -> [B*K, heads, b, D]: blocks folded into the batch axis."""
    B = x.shape[0]
    return x.reshape(B * K, b, *x.shape[2:]).transpose(0, 2, 1, 3)


def _batch_to_blocks(x: mx.array, B: int) -> mx.array:
    """[B*K, heads, b, D] -> [B, heads, K*b, D]."""
    BK, H, b, D = x.shape
    K = BK // B
    return x.reshape(B, K, H, b, D).transpose(0, 2, 1, 3, 4).reshape(B, H, K * b, D)


def _attention(attn, x: mx.array, context: mx.array, anchors: mx.array, mask: mx.array, rope) -> mx.array:
    """One DraftAttention over packed blocks x [B, K*b, H] and context [B, L, H]."""
    B, Q, _ = x.shape
    K = anchors.shape[1]
    b = Q // K
    offsets = anchors.reshape(-1)
    q = attn.q_norm(attn.q_proj(x).reshape(B, Q, attn.n_heads, -1))
    q = _batch_to_blocks(rope(_blocks_to_batch(q, K, b), offset=offsets), B)
    k = attn.k_norm(attn.k_proj(x).reshape(B, Q, attn.n_kv_heads, -1))
    k = _batch_to_blocks(rope(_blocks_to_batch(k, K, b), offset=offsets), B)
    v = _batch_to_blocks(_blocks_to_batch(attn.v_proj(x).reshape(B, Q, attn.n_kv_heads, -1), K, b), B)

    L = context.shape[1]
    ck = attn.k_norm(attn.k_proj(context).reshape(B, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    cv = attn.v_proj(context).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    ck = rope(ck, offset=0)
    keys = mx.concatenate([ck, k], axis=2)
    values = mx.concatenate([cv, v], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, Q, -1))


def check_trainable(drafter) -> None:
    """Refuse the drafters this forward does not train: DFlash 2, and DSpark drafters other than DeepSpec's
    plain qwen3 heads over the full vocabulary that predict from the anchor's slot."""
    config = drafter.config
    if getattr(config, "is_dflash2", False):
        raise UnsupportedDrafterError(
            "Training DFlash 2 drafters (DFlash2DraftModel) is not supported: train a DFlashDraftModel (v1)."
        )
    if isinstance(config, DSparkConfig):
        problems = [
            what
            for what, bad in (
                (f"a {config.backbone} backbone (qwen3 only)", config.backbone != "qwen3"),
                ("an attention sink", config.attention_sink),
                ("a reduced draft vocabulary", config.draft_vocab_size is not None),
                (f"logits_start {config.logits_start} (0 only: the anchor's slot predicts)", config.logits_start != 0),
            )
            if bad
        ]
        if problems:
            raise UnsupportedDrafterError(f"Training this DSpark drafter is not supported: {', '.join(problems)}.")


def training_hidden(
    drafter: DFlashDraftModel,
    hooks: TargetHooks,
    features: mx.array,
    block_ids: mx.array,
    anchors: mx.array,
) -> mx.array:
    """Final normed hidden states [B, K, b, H] of every block row.

    features [B, L, n_ids * H]: the target's captured layer outputs at positions
    0..L-1 (row s is visible to a block iff s < its anchor); block_ids [B, K*b];
    anchors [B, K].
    """
    check_trainable(drafter)
    B, Q = block_ids.shape
    K = anchors.shape[1]
    b = Q // K
    if K * b != Q:
        raise ValueError(f"block_ids has {Q} rows, not a multiple of the {K} anchors.")
    context = drafter.hidden_norm(drafter.fc(features))
    L = context.shape[1]
    masks: dict = {}
    h = drafter.embed(block_ids, hooks)
    for layer in drafter.layers:
        attn = layer.self_attn
        key = (attn.causal, attn.window)
        if key not in masks:
            masks[key] = block_visibility(anchors, L, b, causal=attn.causal, window=attn.window)
        h = h + _attention(attn, layer.input_layernorm(h), context, anchors, masks[key], drafter.rope)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h).reshape(B, K, b, -1)


def training_logits(
    drafter: DFlashDraftModel,
    hooks: TargetHooks,
    features: mx.array,
    block_ids: mx.array,
    anchors: mx.array,
) -> mx.array:
    """Draft logits [B, K, b - 1, V] of block rows 1..b-1 (anchor rows dropped)."""
    hidden = training_hidden(drafter, hooks, features, block_ids, anchors)
    return drafter.logits(hidden[:, :, 1:], hooks)
