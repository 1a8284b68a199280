"""Who sees what in a packed training sequence: the block-diagonal attention mask.

Keys are [context rows 0..L-1, block rows]; queries are the block rows (K blocks
of b rows, block i anchored at position p_i, row j at position p_i + j). Exactly
what inference shows a block drafted at anchor p_i (spec sections 3 and 7):

- context row s is visible iff s < p_i (only target features of positions
  before the anchor exist when the block is drafted), and on a sliding layer
  also iff (p_i + j) - s < window;
- block rows of the same block are visible (all of them, or 0..j on a causal
  layer); rows of other blocks never are.
"""

from __future__ import annotations

import mlx.core as mx


def block_visibility(
    anchors: mx.array, context_len: int, block_size: int, causal: bool = False, window: int | None = None
) -> mx.array:
    """Boolean mask [B, 1, K * b, L + K * b] for anchors [B, K] over L context rows."""
    B, K = anchors.shape
    b = block_size
    j = mx.arange(b)
    q_anchor = mx.repeat(anchors, b, axis=1)[:, :, None]  # [B, Q, 1]
    q_row = mx.tile(j, K)[None, :, None]  # [1, Q, 1]
    q_block = mx.repeat(mx.arange(K), b)[None, :, None]

    s = mx.arange(context_len)[None, None, :]  # [1, 1, L]
    context = s < q_anchor
    if window is not None:
        context = context & (q_anchor + q_row - s < window)

    k_block = mx.repeat(mx.arange(K), b)[None, None, :]
    k_row = mx.tile(j, K)[None, None, :]
    own = q_block == k_block
    if causal:
        own = own & (k_row <= q_row)
    own = mx.broadcast_to(own, (B, K * b, K * b))
    return mx.concatenate([context, own], axis=-1)[:, None]
