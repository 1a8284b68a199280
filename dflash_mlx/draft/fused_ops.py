"""The drafter's normalisation and rotary steps with fewer ops on a CPU.

On MLX's CPU backend `mx.fast.rms_norm` and `mx.fast.rope` run as their
reference graphs of many small ops per call, which cost more than the
drafter's matmuls on small models (a demo-pair block forward is bound by op
count, not arithmetic). On a CPU, RMS norms run as one compiled graph (one
kernel JIT-compiled per machine, cached by MLX in its temporary directory) and
the plain rotary embedding (`nn.RoPE`, non-traditional) multiplies by cos/sin
tables computed once with the reference graph's own arithmetic (far fewer
ops; bit-identical on the shapes the tests cover). Compiling the rotary step
instead would cost seconds of C++ compilation at a machine's first use. On a
GPU the fast kernels are single ops and run as they are. Weights are
arguments, never captured, so a drafter whose weights are replaced (training,
`set_dtype`, quantization) is never computed with stale ones.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

TABLE_STEP = 1024  # positions the rotary tables grow by


def default_device_is_cpu() -> bool:
    """Whether ops now run on the CPU (per call: unlike `models.dtype.on_cpu`, which asks whether
    the machine has Metal, a Mac that chose the CPU counts)."""
    return mx.default_device().type == mx.DeviceType.cpu


def _rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


_compiled_rms_norm = mx.compile(_rms_norm, shapeless=True)


def rms_norm(norm: nn.RMSNorm, x: mx.array) -> mx.array:
    """`norm(x)` (compiled on a CPU)."""
    return _compiled_rms_norm(x, norm.weight, norm.eps) if default_device_is_cpu() else norm(x)


class RotaryTables:
    """`nn.RoPE` (non-traditional) as products with cos/sin tables, grown as positions need:
    x * [cos, cos] + [x2, x1] * [-sin, sin] over the rotated half-pairs (x1, x2)."""

    def __init__(self, rope: nn.RoPE):
        self.dims, self.base, self.scale = rope.dims, rope.base, rope.scale
        self.cos = self.sin = None

    def _grow(self, positions: int) -> None:
        size = -(-positions // TABLE_STEP) * TABLE_STEP
        half = self.dims // 2
        inv_freq = mx.exp(-mx.arange(half, dtype=mx.float32) * (math.log(self.base) / half))
        theta = (mx.arange(size, dtype=mx.float32) * self.scale)[:, None] * inv_freq[None]
        cos, sin = mx.cos(theta), mx.sin(theta)
        self.cos = mx.concatenate([cos, cos], axis=-1)
        self.sin = mx.concatenate([-sin, sin], axis=-1)
        mx.eval(self.cos, self.sin)

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        L = x.shape[-2]
        if self.cos is None or offset + L > self.cos.shape[0]:
            self._grow(offset + L)
        cos, sin = self.cos[offset : offset + L], self.sin[offset : offset + L]
        half, d = self.dims // 2, self.dims
        rotated = x[..., :d] * cos + mx.concatenate([x[..., half:d], x[..., :half]], axis=-1) * sin
        return rotated if d == x.shape[-1] else mx.concatenate([rotated, x[..., d:]], axis=-1)


class HeadProjection:
    """Projected rows [B, L, n * D] -> heads [B, n, L, D], RMS-normed per head and rotated to
    positions `offset..` (rotary tables on a CPU for a plain `nn.RoPE` at one offset in float32,
    else the rope module: per-row offsets of batched drafting, other rotary variants or dtypes,
    a GPU)."""

    def __init__(self, rope):
        self.rope = rope
        plain = isinstance(rope, nn.RoPE) and not rope.traditional
        self.tables = RotaryTables(rope) if plain else None

    def __call__(self, x: mx.array, norm: nn.RMSNorm, offset: int | mx.array) -> mx.array:
        """`offset`: the first row's position, or one per batch row (an int32 array)."""
        B, L, _ = x.shape
        h = rms_norm(norm, x.reshape(B, L, -1, norm.weight.shape[-1])).transpose(0, 2, 1, 3)
        tabled = self.tables is not None and h.dtype == mx.float32 and not isinstance(offset, mx.array)
        if tabled and default_device_is_cpu():
            return self.tables(h, offset)
        return self.rope(h, offset=offset)
