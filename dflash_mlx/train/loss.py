"""The drafter's training loss (spec section 7): row weights and the weighted cross-entropy.

Block row k (k = 1..b-1; row 0 is the clean anchor) predicts the token k places
after the anchor and is weighted w_k = exp(-(k - 1) / c) / sum_j w_j: early rows
matter most, since a draft is only accepted up to its first miss. Public trainers
use c = 7 for b = 16, 5 for b = 10 and 4 for b = 8; `default_decay` interpolates
between those (and extrapolates linearly, never below 1).
"""

from __future__ import annotations

import math
from itertools import pairwise

import mlx.core as mx

# (block size, decay c) used by public DFlash trainers.
KNOWN_DECAYS = ((8, 4.0), (10, 5.0), (16, 7.0))
MIN_DECAY = 1.0


def default_decay(block_size: int) -> float:
    """The decay constant c for `block_size`: the known values, piecewise-linear between."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 to train a drafter, got {block_size}.")
    segments = list(pairwise(KNOWN_DECAYS))
    # The first segment reaching block_size, else the last one (linear extrapolation).
    (b0, c0), (b1, c1) = next((s for s in segments if block_size <= s[1][0]), segments[-1])
    return max(MIN_DECAY, c0 + (c1 - c0) * (block_size - b0) / (b1 - b0))


def row_weights(block_size: int, decay: float | None = None) -> mx.array:
    """Normalised weights [b - 1] of block rows 1..b-1."""
    c = default_decay(block_size) if decay is None else float(decay)
    if not c > 0 or not math.isfinite(c):
        raise ValueError(f"The loss decay must be a positive number, got {decay!r}.")
    w = [math.exp(-k / c) for k in range(block_size - 1)]
    total = sum(w)
    return mx.array([x / total for x in w], dtype=mx.float32)


def block_loss(logits: mx.array, targets: mx.array, valid: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
    """Weighted cross-entropy of blocks, averaged over blocks with at least one target.

    logits [..., b-1, V], targets/valid [..., b-1], weights [b-1] (normalised).
    Rows whose target lies past the sequence end (valid False) count 0, and the
    other rows of that block keep their weights. Returns (loss, number of blocks).
    """
    logits = logits.astype(mx.float32)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    ce = mx.logsumexp(logits, axis=-1) - picked
    valid_f = valid.astype(mx.float32)
    per_block = (ce * valid_f * weights).sum(axis=-1)
    blocks = valid.any(axis=-1).astype(mx.float32).sum()
    return per_block.sum() / mx.maximum(blocks, 1.0), blocks


def accepted_prefix(logits: mx.array, targets: mx.array, valid: mx.array) -> mx.array:
    """Per block, 1 + the number of leading rows whose argmax is the target.

    What greedy verification would commit for that block if the target's own
    continuation were the training sequence: a training-time proxy of the mean
    acceptance length (blocks cut by the sequence end are capped there).
    """
    hit = (mx.argmax(logits, axis=-1) == targets) & valid
    return 1 + mx.cumprod(hit.astype(mx.int32), axis=-1).sum(axis=-1)
