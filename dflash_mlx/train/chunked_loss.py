"""The block loss in chunks of rows: peak memory flat in vocabulary size x rows.

The whole-batch loss (`loss.block_loss` on `model_forward.training_logits`)
holds the logits of every block row at once, plus their softmax and gradient in
the backward pass: B x K x (b - 1) x V floats several times over, gigabytes
at a real vocabulary. Here a step runs in three stages instead:

1. the drafter's forward up to the final normed hidden states of the block rows
   (small: rows x hidden), evaluated;
2. per chunk of `chunk_rows` rows: the head's logits, the weighted
   cross-entropy, the argmax hits, and the gradient of the loss with respect to
   that chunk's hidden states (backward through the frozen head), each chunk
   evaluated before the next, so at most one chunk's logits exist at a time;
3. the drafter's gradients: the backward pass from the hidden states with the
   stacked chunk gradients as the cotangent (`mx.vjp`-style, through a
   surrogate sum(h * G) whose gradient is exactly that vector-Jacobian product).

The result equals the whole-batch loss and gradients up to float rounding (a
test checks it); the price is one extra drafter forward per step, small next
to the head at large vocabularies.
"""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from .model_forward import training_hidden

LOGIT_ELEMENTS_PER_CHUNK = 1 << 25  # 32M logits = 128 MB in float32 per chunk
MIN_CHUNK_ROWS = 16


def auto_chunk_rows(vocab_size: int, elements: int = LOGIT_ELEMENTS_PER_CHUNK) -> int:
    """Rows per chunk so that one chunk holds about `elements` float32 logits (default 128 MB)."""
    return max(MIN_CHUNK_ROWS, int(elements) // max(int(vocab_size), 1))


def row_coefficients(valid: mx.array, weights: mx.array) -> tuple[mx.array, mx.array]:
    """(per-row loss coefficient [..., b-1], number of blocks with a target).

    The loss is sum(coef * ce): row k of a block weighs w_k, rows past the
    sequence end 0, normalised by the number of blocks (as `loss.block_loss`).
    """
    blocks = valid.any(axis=-1).astype(mx.float32).sum()
    coef = valid.astype(mx.float32) * weights / mx.maximum(blocks, 1.0)
    return coef, blocks


def _chunk_loss(head, targets: mx.array, coef: mx.array):
    """loss(h) of one chunk, with the argmax hits as the auxiliary output."""

    def fn(h: mx.array):
        logits = head(h).astype(mx.float32)
        picked = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
        ce = mx.logsumexp(logits, axis=-1) - picked
        hit = mx.argmax(logits, axis=-1) == targets
        return (ce * coef).sum(), hit

    return fn


def chunked_step(drafter, hooks, features, block_ids, anchors, targets, valid, weights, chunk_rows: int):
    """(loss, tau, grads) of one batch, the logits computed `chunk_rows` rows at a time.

    `tau` is the training-time acceptance proxy of `loss.accepted_prefix`
    (1 + leading argmax hits per block, mean over blocks with a target).
    """
    hidden = mx.stop_gradient(training_hidden(drafter, hooks, features, block_ids, anchors)[:, :, 1:])
    mx.eval(hidden)
    shape = hidden.shape  # [B, K, b - 1, H]
    flat = hidden.reshape(-1, shape[-1])
    coef, blocks = row_coefficients(valid, weights)
    flat_coef, flat_targets = coef.reshape(-1), targets.reshape(-1)

    def head(h):
        return drafter.logits(h, hooks)

    grads_h, hits, loss = [], [], mx.array(0.0)
    for start in range(0, flat.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        fn = _chunk_loss(head, flat_targets[rows], flat_coef[rows])
        (part, hit), g = mx.value_and_grad(fn)(flat[rows])
        loss = loss + part
        mx.eval(loss, hit, g)
        grads_h.append(g)
        hits.append(hit)
    cotangent = mx.concatenate(grads_h).reshape(shape)
    hit = mx.concatenate(hits).reshape(targets.shape) & valid
    prefix = 1 + mx.cumprod(hit.astype(mx.int32), axis=-1).sum(axis=-1)
    tau = (prefix * valid.any(axis=-1)).sum() / mx.maximum(blocks, 1.0)

    def surrogate(features, block_ids, anchors, cotangent):
        h = training_hidden(drafter, hooks, features, block_ids, anchors)[:, :, 1:]
        return (h * cotangent).sum()

    _, grads = nn.value_and_grad(drafter, surrogate)(features, block_ids, anchors, cotangent)
    return loss, tau, grads
