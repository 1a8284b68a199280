"""Committing a verify: rolling every layer's cache back to the accepted prefix.

A verify feeds `total` rows and keeps the first `keep`. Per cache type:
- `KVCache`: trim the rejected rows.
- `RotatingKVCache` (sliding-window layers): a multi-row update leaves the ring
  in temporal order, holding the previous window - 1 rows plus the new ones, so
  the rejected rows are exactly its last rows: cut them through the cache's own
  `state`. (mlx-lm's `trim` refuses once the ring is full and returns 0, which
  silently keeps rejected rows.) Evicted rows are never needed again: the next
  query's window starts after them.
- `ArraysCache` of a Gated DeltaNet layer: restored from the verify's record
  (`dflash_mlx.gated_delta`).
- `None`: layers that share another layer's KV cache hold nothing.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

SUPPORTED_CACHES = (KVCache, RotatingKVCache, ArraysCache)


class UnsupportedCacheError(ValueError):
    """A cache type whose rollback is not implemented: refuse rather than risk wrong output."""


def check_caches(cache: list, family: str, linear_layers: set[int]) -> None:
    for i, c in enumerate(cache):
        if c is None:
            continue
        kind = type(c)
        ok = kind in (KVCache, RotatingKVCache) or (kind is ArraysCache and i in linear_layers)
        if not ok:
            raise UnsupportedCacheError(
                f"Target model ({family}) layer {i} uses a {kind.__name__}, which dflash-mlx "
                f"cannot roll back; supported: KVCache, RotatingKVCache and the ArraysCache of "
                "Gated DeltaNet layers."
            )
        if kind is RotatingKVCache and c.keep:
            raise UnsupportedCacheError(
                f"Target model ({family}) layer {i}: rotating caches that keep leading rows "
                "(max_kv_size) are not supported."
            )


def rewind_ring(cache: RotatingKVCache, drop: int) -> None:
    """Remove the last `drop` rows written by a multi-row update."""
    keys, values, offset, keep, max_size, idx = cache.state
    if idx != keys.shape[2]:
        raise RuntimeError("A rotating cache is not in temporal order after a multi-row verify.")
    keys, values, offset, idx = keys[..., : idx - drop, :], values[..., : idx - drop, :], offset - drop, idx - drop
    if offset >= max_size > idx:
        # One row short of a full ring (only when every new row is dropped): mlx-lm
        # expects a full ring once offset >= max_size, so pad the oldest end with a
        # row outside every later query's window, the first one overwritten.
        pad = max_size - idx
        if pad != 1:  # a multi-row update keeps window - 1 older rows: at most one is missing
            raise RuntimeError(f"A rotating cache lost {pad} rows of its window in a rollback.")
        keys = mx.concatenate([mx.zeros(keys.shape[:2] + (pad, keys.shape[3]), keys.dtype), keys], axis=2)
        values = mx.concatenate([mx.zeros(values.shape[:2] + (pad, values.shape[3]), values.dtype), values], axis=2)
        idx = max_size
    cache.state = (keys, values, offset, keep, max_size, idx)


def rollback(cache: list, keep: int, total: int, gdn_records: dict) -> None:
    """Make `cache` hold only the first `keep` of the `total` rows just fed."""
    drop = total - keep
    if drop <= 0:
        return
    for i, c in enumerate(cache):
        if c is None:
            continue
        if isinstance(c, RotatingKVCache):
            rewind_ring(c, drop)
        elif isinstance(c, ArraysCache):
            gdn_records[i].restore(c, keep)
        else:
            c.trim(drop)
