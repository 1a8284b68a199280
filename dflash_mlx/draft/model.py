"""The DFlash v1 drafter as MLX modules, and its context cache.

The drafter is a short stack of Qwen3-style layers whose attention takes its
queries from the block being drafted and its keys/values from both the block
and the *context*: the target's hidden states of committed positions, fused by
`fc` + `hidden_norm`. Context K/V are cached across cycles; block rows are never
stored, so nothing in the drafter needs rolling back. Context rows committed
since the last block can be ingested by the block's own forward (`features=`):
one K/V projection over [new context rows, block] per layer instead of two.
It owns no embedding and no head: both come from the target (see
`dflash_mlx.targets.adapter.TargetAdapter`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from .config import DraftConfig
from .fused_ops import HeadProjection, rms_norm


class TargetHooks(Protocol):
    """What the drafter borrows from its target: embedding and output head."""

    def embed(self, ids: mx.array) -> mx.array: ...

    def head(self, hidden: mx.array) -> mx.array: ...


class DraftContextCache:
    """Keys and values of committed context rows for one draft layer.

    Rows are positions `start..end-1`; `max_rows` (window - 1 for a sliding
    layer, or a user bound) keeps only the most recent rows visible.
    """

    step = 256

    def __init__(self, max_rows: int | None = None):
        self.max_rows = max_rows
        self.keys = self.values = None
        self.end = 0  # absolute position of the next context row
        self._rows = 0  # rows held in the buffers

    @property
    def start(self) -> int:
        return self.end - self.visible_rows

    @property
    def visible_rows(self) -> int:
        return self._rows if self.max_rows is None else min(self._rows, self.max_rows)

    def skip(self, n: int) -> None:
        """Advance past `n` positions without storing them (they can never be seen)."""
        self.end += n

    @property
    def held_rows(self) -> int:
        """Rows in the buffers (the most recent positions), visible or not."""
        return self._rows

    def trim(self, n: int) -> None:
        """Forget the last `n` positions (at most `held_rows`)."""
        if not 0 <= n <= self._rows:
            raise ValueError(f"Cannot trim {n} context rows: {self._rows} are held.")
        self._rows -= n
        self.end -= n

    def append(self, keys: mx.array, values: mx.array) -> None:
        n = keys.shape[2]
        if self.keys is None or self._rows + n > self.keys.shape[2]:
            self._grow(keys, values, n)
        self.keys[..., self._rows : self._rows + n, :] = keys
        self.values[..., self._rows : self._rows + n, :] = values
        self._rows += n
        self.end += n

    def with_block(self, keys: mx.array, values: mx.array, commit: int = 0) -> tuple[mx.array, mx.array, int]:
        """The visible context rows followed by a block's `keys` / `values`, and the context's row count.

        The block is written into the buffers right after the held rows (which stay `held_rows`:
        the next `append` overwrites it), so a long context is not copied every cycle, as
        concatenating it with the block would. With `commit`, the first `commit` of the given rows
        are new context rows (appended, as `append` would) and the rest the block.
        """
        n = keys.shape[2]
        if self.keys is None or self._rows + n > self.keys.shape[2]:
            self._grow(keys, values, n)
        hi = self._rows + n
        self.keys[..., self._rows : hi, :] = keys
        self.values[..., self._rows : hi, :] = values
        self._rows += commit
        self.end += commit
        lo = self._rows - self.visible_rows
        return self.keys[..., lo:hi, :], self.values[..., lo:hi, :], self._rows - lo

    def fetch(self) -> tuple[mx.array, mx.array] | tuple[None, None]:
        if self.keys is None or self._rows == 0:
            return None, None
        lo = self._rows - self.visible_rows
        return self.keys[..., lo : self._rows, :], self.values[..., lo : self._rows, :]

    def broadcast(self, batch: int) -> None:
        """Share this context with `batch` independent runs (batched drafting)."""
        keys, values = self.fetch()
        if keys is not None:
            self.keys = mx.broadcast_to(keys, (batch,) + keys.shape[1:])
            self.values = mx.broadcast_to(values, (batch,) + values.shape[1:])
            self._rows = keys.shape[2]

    def _grow(self, keys: mx.array, values: mx.array, n: int) -> None:
        kept_k, kept_v = self.fetch()
        kept = 0 if kept_k is None else kept_k.shape[2]
        capacity = ((kept + n + self.step - 1) // self.step + 1) * self.step
        B, H, _, D = keys.shape
        new_k = mx.zeros((B, H, capacity, D), keys.dtype)
        new_v = mx.zeros((B, H, capacity, values.shape[-1]), values.dtype)
        if kept:
            new_k[..., :kept, :] = kept_k
            new_v[..., :kept, :] = kept_v
        self.keys, self.values, self._rows = new_k, new_v, kept

    @property
    def state(self):
        return [a for a in (self.keys, self.values) if a is not None]

    def block_mask(self, block: int, ctx_len: int, causal: bool, window: int | None):
        """What the block's queries see of [the `ctx_len` fetched context rows, the block] (`block_mask`)."""
        return block_mask(block, ctx_len, causal, window)

    def saved(self) -> tuple[list[mx.array], dict]:
        """The held rows and the positions, for saving (`restored` reads them back)."""
        held = self.keys is not None and self._rows > 0
        arrays = [self.keys[..., : self._rows, :], self.values[..., : self._rows, :]] if held else []
        return arrays, {"end": self.end, "rows": self._rows, "max_rows": self.max_rows}

    @classmethod
    def restored(cls, arrays: list[mx.array], meta: dict) -> DraftContextCache:
        cache = cls(meta["max_rows"])
        if arrays:
            cache.keys, cache.values = arrays
        cache._rows, cache.end = int(meta["rows"]), int(meta["end"])
        if (cache.keys.shape[2] if arrays else 0) != cache._rows:
            raise ValueError(f"a saved drafter context holds {cache._rows} rows but its arrays do not")
        return cache


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig, layer: int):
        super().__init__()
        dim, head_dim = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.window = config.sliding_window if config.layer_is_sliding(layer) else None
        self.causal = config.layer_is_causal(layer)

    def _queries(self, x: mx.array) -> tuple[mx.array, mx.array | None]:
        """The block's projected queries [B, L, heads * D] and an output gate (None: ungated)."""
        return self.q_proj(x), None

    def _sinks(self) -> mx.array | None:
        """A learned sink logit per head (None: no sink)."""
        return None

    def _keys_values(self, x: mx.array, heads: HeadProjection, offset: int) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1)
        return heads(self.k_proj(x), self.k_norm, offset), v.transpose(0, 2, 1, 3)

    def extend_context(self, context: mx.array, cache: DraftContextCache, heads: HeadProjection) -> None:
        """Add K/V for context rows at positions `cache.end..`."""
        if cache.max_rows is not None and context.shape[1] > cache.max_rows:
            cache.skip(context.shape[1] - cache.max_rows)
            context = context[:, -cache.max_rows :]
        cache.append(*self._keys_values(context, heads, cache.end))

    def __call__(
        self, x: mx.array, cache: DraftContextCache, heads: HeadProjection, context: mx.array | None = None
    ) -> mx.array:
        """The block `x`'s attention output; `context` (fused rows of newly committed positions, at
        `cache.end..`) is added to the cache on the way, in the same K/V projection as the block."""
        B, L, _ = x.shape
        n = 0 if context is None else context.shape[1]
        q, gate = self._queries(x)
        q = heads(q, self.q_norm, cache.end + n)
        if context is None:
            k, v, ctx_len = cache.with_block(*self._keys_values(x, heads, cache.end))
        else:
            rows = mx.concatenate([context, x], axis=1)
            k, v, ctx_len = cache.with_block(*self._keys_values(rows, heads, cache.end), commit=n)
        mask = cache.block_mask(L, ctx_len, self.causal, self.window)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask, sinks=self._sinks())
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out if gate is None else out * mx.sigmoid(gate))


def block_mask(block: int, ctx_len: int, causal: bool, window: int | None):
    """Visibility of [context rows, block rows] for the block's queries.

    Context is contiguous and ends right before the block, so query j sits
    `ctx_len + j` rows after the first context key: a context key is visible
    iff that distance is < window. Block keys: all, or 0..j when causal.
    """
    if window is None or ctx_len + block <= window:
        return "causal" if causal else None
    return _sliding_mask(block, ctx_len, causal, window)


@lru_cache(maxsize=64)
def _sliding_mask(block: int, ctx_len: int, causal: bool, window: int) -> mx.array:
    q = mx.arange(ctx_len, ctx_len + block)[:, None]
    k = mx.arange(ctx_len + block)[None]
    in_block = k >= ctx_len
    visible_block = (in_block & (k <= q)) if causal else in_block
    return visible_block | (~in_block & (q - k < window))


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig, layer: int):
        super().__init__()
        self.self_attn = DraftAttention(config, layer)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(
        self, x: mx.array, cache: DraftContextCache, heads: HeadProjection, context: mx.array | None = None
    ) -> mx.array:
        h = x + self.self_attn(rms_norm(self.input_layernorm, x), cache, heads, context)
        return h + self.mlp(rms_norm(self.post_attention_layernorm, h))


class DFlashDraftModel(nn.Module):
    """DFlash v1 drafter (spec section 3)."""

    layer_class = DraftLayer

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.heads = HeadProjection(self.rope)

    def make_cache(self, max_context: int | None = None) -> list[DraftContextCache]:
        """One context cache per layer; sliding layers keep window - 1 rows."""
        caches = []
        for layer in self.layers:
            window = layer.self_attn.window
            bounds = [b for b in (max_context, window and window - 1) if b]
            caches.append(DraftContextCache(min(bounds) if bounds else None))
        return caches

    def fuse_context(self, features: mx.array) -> mx.array:
        """The context rows [B, S, H] of target features [B, S, n_ids * H]."""
        return rms_norm(self.hidden_norm, self.fc(features))

    def extend_context(self, features: mx.array, cache: list[DraftContextCache]) -> None:
        """Ingest target features [B, S, n_ids * H] of newly committed positions."""
        context = self.fuse_context(features)
        for layer, c in zip(self.layers, cache):
            layer.self_attn.extend_context(context, c, self.heads)

    def embed(self, block_ids: mx.array, target: TargetHooks) -> mx.array:
        """The block's input rows: the target's embedding (times `input_embedding_scale`)."""
        h = target.embed(block_ids)
        scale = self.config.input_embedding_scale
        return h if scale == 1.0 else h * scale

    def hidden_states(
        self, block_ids: mx.array, cache, target: TargetHooks, features: mx.array | None = None
    ) -> mx.array:
        """Final normed hidden states of block rows 1.. (the anchor row dropped). `features` (target
        features of positions committed right before the block) are ingested by the same forward."""
        h = self.embed(block_ids, target)
        context = None if features is None else self.fuse_context(features)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c, self.heads, context)
        return rms_norm(self.norm, h[:, 1:])

    def logits(self, hidden: mx.array, target: TargetHooks) -> mx.array:
        logits = target.head(hidden)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def __call__(self, block_ids: mx.array, cache, target: TargetHooks, features: mx.array | None = None) -> mx.array:
        """Draft logits [B, b - 1, V] for the block `[anchor, mask, ...]` (`features`: see `hidden_states`)."""
        return self.logits(self.hidden_states(block_ids, cache, target, features), target)
