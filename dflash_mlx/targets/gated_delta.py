"""Gated DeltaNet layers run by us, so a verify can be rolled back exactly.

Hybrid targets (Qwen3.5/3.6, Qwen3-Next) keep, per linear-attention layer, a
conv state (the last K-1 mixed q/k/v inputs) and a recurrent state in an
`ArraysCache`; neither can be trimmed. In the adapter's view of the target
such a layer's GatedDeltaNet module is a `Recording`: mlx-lm's own module,
except while a verify is recorded, when `gated_delta_forward` computes what
mlx-lm's GatedDeltaNet module computes, with the same submodules and the same
ops in the same order (so outputs are identical), and, when given a `GDNRecord`,
keeps what a rollback needs: the initial recurrent state, the conv input and
the per-step q/k/v/a/b. `GDNRecord.restore` then rebuilds the cache as if
only the first `n` rows had been fed: the conv state is a slice of the conv
input and the recurrent state is the recurrence replayed over `n` steps,
which is cheap next to the layer's projections (no matmul is redone).
A tensor-sharded layer (mlx-lm's qwen3_5 `shard()`) holds its rank's heads:
the record and the replay are per rank, and the output is summed over the
ranks as mlx-lm's layer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk


@dataclass
class GDNRecord:
    """What one verify fed through one Gated DeltaNet layer."""

    layer: nn.Module
    conv_input: mx.array  # [B, K-1+S, conv_dim]
    q: mx.array
    k: mx.array
    v: mx.array
    a: mx.array
    b: mx.array
    state: mx.array | None  # recurrent state before the verify

    def restore(self, cache, n: int) -> None:
        """Set `cache` to the state after feeding only the first `n` rows."""
        kernel = self.layer.conv_kernel_size
        cache[0] = mx.contiguous(self.conv_input[:, n : n + kernel - 1, :])
        if n == 0:
            cache[1] = self.state
            return
        _, cache[1] = gated_delta_update(
            self.q[:, :n],
            self.k[:, :n],
            self.v[:, :n],
            self.a[:, :n],
            self.b[:, :n],
            self.layer.A_log,
            self.layer.dt_bias,
            self.state,
            None,
            use_kernel=not self.layer.training,
        )


def _project(layer: nn.Module, x: mx.array):
    """Mixed q/k/v (pre-conv), z, b, a for either mlx-lm GatedDeltaNet variant."""
    B, S, _ = x.shape
    if hasattr(layer, "in_proj_qkvz"):  # qwen3_next
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return qkv, z, b, a
    qkv = layer.in_proj_qkv(x)  # qwen3_5 / qwen3_5_moe
    z = layer.in_proj_z(x).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return qkv, z, layer.in_proj_b(x), layer.in_proj_a(x)


def gated_delta_forward(layer: nn.Module, x: mx.array, mask, cache, records: list | None) -> mx.array:
    """mlx-lm's GatedDeltaNet forward for one unpadded sequence, optionally recorded."""
    if cache is not None and cache.lengths is not None:
        raise NotImplementedError("Batched (length-tracked) GatedDeltaNet caches are not supported.")
    B, S, _ = x.shape
    qkv, z, b, a = _project(layer, x)
    if cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, layer.conv_kernel_size - 1, layer.conv_dim), dtype=x.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    if cache is not None:
        cache[0] = mx.contiguous(conv_input[:, -(layer.conv_kernel_size - 1) :, :])
    conv_out = nn.silu(layer.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    state = cache[1] if cache else None
    q, k = normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    if records is not None:
        records.append(GDNRecord(layer, conv_input, q, k, v, a, b, state))
    out, state = gated_delta_update(
        q, k, v, a, b, layer.A_log, layer.dt_bias, state, mask, use_kernel=not layer.training
    )
    if cache is not None:
        cache[1] = state
        cache.advance(S)
    out = layer.out_proj(layer.norm(out, z).reshape(B, S, -1))
    group = getattr(layer, "sharding_group", None)  # tensor-sharded heads: sum the ranks' parts, as mlx-lm does
    return out if group is None else mx.distributed.all_sum(out, group=group)


def gated_delta_child(layer: nn.Module) -> str | None:
    """The name of `layer`'s mlx-lm GatedDeltaNet module (qwen3_5 or qwen3_next kind), or None."""
    for name, child in layer.items():
        if (
            isinstance(child, nn.Module)
            and hasattr(child, "A_log")
            and hasattr(child, "conv1d")
            and (hasattr(child, "in_proj_qkvz") or hasattr(child, "in_proj_qkv"))
        ):
            return name
    return None


class Recording:
    """A GatedDeltaNet module that records its verify for the rollback (`recording()`: the record in
    progress, or None: mlx-lm's own module runs). The record is keyed by the layer cache's identity."""

    __slots__ = ("module", "recording")

    def __init__(self, module: nn.Module, recording):
        self.module, self.recording = module, recording

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        record = self.recording()
        if record is None or cache is None:
            return self.module(x, mask, cache)
        records: list = []
        out = gated_delta_forward(self.module, x, mask, cache, records)
        record.gdn[id(cache)] = records[0]
        return out

    def __getattr__(self, name: str):
        return getattr(self.module, name)
