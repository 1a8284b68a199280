"""The drafter's normalisation and rotary steps, compiled into few ops.

On MLX's CPU backend `mx.fast.rms_norm` and `mx.fast.rope` run as their
reference graphs: ~11 and ~29 small ops per call, which cost more than the
drafter's matmuls on small models (a demo-pair block forward is bound by op
count, not arithmetic). `mx.compile` fuses each into a couple of kernels with
bit-identical results; on a GPU the fast kernels are already single ops and
compiling them changes nothing. Positions are passed as arrays, so one
compiled graph per input shape serves every offset.

Only pure functions of their inputs are compiled (weights are arguments, never
captured), so a drafter whose weights are replaced (training, `set_dtype`,
quantization) is never computed with stale ones.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE


def _rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


_compiled_rms_norm = mx.compile(_rms_norm, shapeless=True)


def rms_norm(norm: nn.RMSNorm, x: mx.array) -> mx.array:
    """`norm(x)`, compiled."""
    return _compiled_rms_norm(x, norm.weight, norm.eps)


def _heads(rope, x: mx.array, weight: mx.array, eps: float, offset: mx.array) -> mx.array:
    B, L, _ = x.shape
    h = mx.fast.rms_norm(x.reshape(B, L, -1, weight.shape[-1]), weight, eps)
    return rope(h.transpose(0, 2, 1, 3), offset=offset)


# Rotary classes whose position may be an array (others branch on it in Python).
_ARRAY_OFFSET_ROPES = (nn.RoPE, Llama3RoPE, SuScaledRoPE, YarnRoPE)


class HeadProjection:
    """Projected rows [B, L, n * D] -> heads [B, n, L, D], RMS-normed per head and rotated to
    positions `offset..`, as one compiled graph per shape (eager for rotary variants that
    need a Python position)."""

    def __init__(self, rope):
        self.rope = rope
        self._compiled = mx.compile(partial(_heads, rope)) if isinstance(rope, _ARRAY_OFFSET_ROPES) else None

    def __call__(self, x: mx.array, norm: nn.RMSNorm, offset: int | mx.array) -> mx.array:
        """`offset`: the first row's position, or one per batch row (an int32 array)."""
        if self._compiled is None:
            return _heads(self.rope, x, norm.weight, norm.eps, offset)
        if not isinstance(offset, mx.array):
            offset = mx.array(offset, mx.int32)
        return self._compiled(x, norm.weight, norm.eps, offset)
