"""What each cache type can do: one table for the cache check, the rollback and the session.

A verify feeds `rows` rows and keeps the first `keep`; `VerifyRecord` is what
it leaves for `rollback(cache, record, keep)` to consume. Per cache type
(`CACHE_KINDS`, keyed by exact type):
- `KVCache`: trim the rejected rows; trimmable to any shorter prefix later.
- `RotatingKVCache` (sliding-window layers): a multi-row update leaves the ring
  in temporal order, holding the previous window - 1 rows plus the new ones, so
  the rejected rows are exactly its last rows: cut them through the cache's own
  `state`. (mlx-lm's `trim` refuses once the ring is full and returns 0, which
  silently keeps rejected rows.) Evicted rows are never needed again: the next
  query's window starts after them. Not trimmable afterwards.
- `ArraysCache` of a Gated DeltaNet layer: restored from the verify's
  per-layer record (`dflash_mlx.targets.gated_delta`). Not trimmable.
- `None`: layers that share another layer's KV cache hold nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache


class UnsupportedCacheError(ValueError):
    """A cache type whose rollback is not implemented: refuse rather than risk wrong output."""


@dataclass
class VerifyRecord:
    """What one recorded target forward leaves for its rollback."""

    rows: int
    gdn: dict = field(default_factory=dict)  # layer index -> GDNRecord


def _trim(cache, layer: int, record: VerifyRecord, keep: int) -> None:
    cache.trim(record.rows - keep)


def _rewind(cache, layer: int, record: VerifyRecord, keep: int) -> None:
    rewind_ring(cache, record.rows - keep)


def _restore(cache, layer: int, record: VerifyRecord, keep: int) -> None:
    record.gdn[layer].restore(cache, keep)


@dataclass(frozen=True)
class CacheKind:
    trimmable: bool  # can later be cut back to any shorter prefix (a session's prefix reuse)
    rollback: Callable  # (cache, layer index, record, keep) -> None
    linear_only: bool = False  # only valid in Gated DeltaNet layers
    undoes_single_row: bool = True  # a verify right after a one-row update can be undone entirely (keep=0)


CACHE_KINDS: dict[type, CacheKind] = {
    KVCache: CacheKind(trimmable=True, rollback=_trim),
    # a one-row update of a full ring overwrites its oldest row in place: not undoable
    RotatingKVCache: CacheKind(trimmable=False, rollback=_rewind, undoes_single_row=False),
    ArraysCache: CacheKind(trimmable=False, rollback=_restore, linear_only=True),
}


def trimmable(cache) -> bool:
    """A layer cache the session may cut back to a shorter prefix (None: nothing to cut)."""
    return cache is None or CACHE_KINDS[type(cache)].trimmable


def undoes_single_row(cache) -> bool:
    """A one-row verify of this layer cache can be rolled back entirely (keep=0)."""
    return cache is None or CACHE_KINDS[type(cache)].undoes_single_row


def check_caches(cache: list, family: str, linear_layers: set[int]) -> None:
    """Refuse any cache the table cannot roll back (naming the layer and the type)."""
    for i, c in enumerate(cache):
        if c is None:
            continue
        kind = CACHE_KINDS.get(type(c))
        if kind is None or (kind.linear_only and i not in linear_layers):
            raise UnsupportedCacheError(
                f"Target model ({family}) layer {i} uses a {type(c).__name__}, which dflash-mlx "
                f"cannot roll back; supported: KVCache, RotatingKVCache and the ArraysCache of "
                "Gated DeltaNet layers."
            )
        if type(c) is RotatingKVCache and c.keep:
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


def rollback(cache: list, record: VerifyRecord, keep: int) -> None:
    """Make `cache` hold only the first `keep` of the `record.rows` rows its verify fed."""
    if not 0 <= keep <= record.rows:
        raise ValueError(f"keep must be in [0, {record.rows}], got {keep}.")
    if keep == record.rows:
        return
    for i, c in enumerate(cache):
        if c is not None:
            CACHE_KINDS[type(c)].rollback(c, i, record, keep)
