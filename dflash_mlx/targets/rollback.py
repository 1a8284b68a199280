"""What each cache type can do: one table for the cache check, the rollback and the session.

A verify feeds `rows` rows and keeps the first `keep`; `VerifyRecord` is what
it leaves for `rollback(cache, record, keep)` to consume. Per cache type
(`CACHE_KINDS`, keyed by exact type; a `CacheList` is its members):
- `KVCache`, `QuantizedKVCache` (mlx-lm's `kv_bits`): trim the rejected rows;
  trimmable to any shorter prefix later.
- `ChunkedKVCache` (llama4's chunked attention): trim the rejected rows (the
  front it drops before a forward holds no row a later query reads); not
  trimmable afterwards (the dropped front is gone).
- `RotatingKVCache` (sliding-window layers): a multi-row update leaves the ring
  in temporal order, holding the previous window - 1 rows plus the new ones, so
  the rejected rows are exactly its last rows: cut them through the cache's own
  `state`. (mlx-lm's `trim` refuses once the ring is full and returns 0, which
  silently keeps rejected rows.) Evicted rows are never needed again: the next
  query's window starts after them. Not trimmable afterwards.
- `ArraysCache` (recurrent layers: conv and recurrent states): the state of a
  Gated DeltaNet layer is rebuilt from its verify's record
  (`dflash_mlx.targets.gated_delta`); any other recurrent layer is put back to
  its state before the verify and the kept rows are fed again through the
  target's own forward (`VerifyRecord.refeed`, set by the adapter). Not
  trimmable.
- `None`: layers that share another layer's KV cache hold nothing.
Any other cache class is refused (`check_caches`, at load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache


class UnsupportedCacheError(ValueError):
    """A cache type whose rollback is not implemented: refuse rather than risk wrong output."""


@dataclass
class VerifyRecord:
    """What one recorded target forward leaves for its rollback."""

    rows: int
    gdn: dict = field(default_factory=dict)  # id(layer cache) -> GDNRecord
    refeed: Callable[[int], None] | None = None  # restores every cache, then feeds the first `keep` rows


def _trim(cache, record: VerifyRecord, keep: int) -> None:
    cache.trim(record.rows - keep)


def _rewind(cache, record: VerifyRecord, keep: int) -> None:
    rewind_ring(cache, record.rows - keep)


def _restore(cache, record: VerifyRecord, keep: int) -> None:
    record.gdn[id(cache)].restore(cache, keep)


@dataclass(frozen=True)
class CacheKind:
    trimmable: bool  # can later be cut back to any shorter prefix (a session's prefix reuse)
    rollback: Callable  # (cache, record, keep) -> None
    undoes_single_row: bool = True  # a verify right after a one-row update can be undone entirely (keep=0)


CACHE_KINDS: dict[type, CacheKind] = {
    KVCache: CacheKind(trimmable=True, rollback=_trim),
    QuantizedKVCache: CacheKind(trimmable=True, rollback=_trim),
    ChunkedKVCache: CacheKind(trimmable=False, rollback=_trim),
    # a one-row update of a full ring overwrites its oldest row in place: not undoable
    RotatingKVCache: CacheKind(trimmable=False, rollback=_rewind, undoes_single_row=False),
    ArraysCache: CacheKind(trimmable=False, rollback=_restore),
}


def layer_caches(cache: list):
    """The per-layer caches of a cache list, the members of a `CacheList` in its place (None skipped)."""
    for c in cache:
        if type(c) is CacheList:
            yield from layer_caches(c.caches)
        elif c is not None:
            yield c


def trimmable(cache) -> bool:
    """A layer cache the session may cut back to a shorter prefix (None: nothing to cut)."""
    return all(CACHE_KINDS[type(c)].trimmable for c in layer_caches([cache]))


def undoes_single_row(cache) -> bool:
    """A one-row verify of this layer cache can be rolled back entirely (keep=0)."""
    return all(CACHE_KINDS[type(c)].undoes_single_row for c in layer_caches([cache]))


def held(cache) -> int | None:
    """How many positions a layer cache holds (the first member's for a `CacheList`), or None."""
    for c in layer_caches([cache]):
        if isinstance(getattr(c, "offset", None), int):
            return c.offset
    return None


def check_caches(cache: list, family: str) -> None:
    """Refuse any cache the table cannot roll back (naming the layer and the class)."""
    for i, c in enumerate(cache):
        for member in layer_caches([c]):
            if type(member) not in CACHE_KINDS:
                supported = ", ".join(sorted(k.__name__ for k in CACHE_KINDS))
                raise UnsupportedCacheError(
                    f"Target model ({family}) layer {i} uses a {type(member).__name__}, which dflash-mlx cannot "
                    f"roll back after a rejected draft; supported: {supported} (and CacheLists of them)."
                )
            if type(member) is RotatingKVCache and member.keep:
                raise UnsupportedCacheError(
                    f"Target model ({family}) layer {i}: a RotatingKVCache that keeps {member.keep} leading rows "
                    "(max_kv_size) is not supported: mlx-lm's own one-token and multi-token decoding disagree "
                    "once it wraps, so drafts could not be verified exactly. Pass max_kv_size=None."
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
    if record.refeed is not None:
        record.refeed(keep)
        return
    for c in layer_caches(cache):
        CACHE_KINDS[type(c)].rollback(c, record, keep)


def arrays_states(cache: list) -> list:
    """(cache, state) of every `ArraysCache` in `cache`, before a verify changes them (their arrays are
    replaced by a forward, never written in place)."""
    return [(c, (list(c.cache), c.left_padding, c.lengths)) for c in layer_caches(cache) if type(c) is ArraysCache]


def undo(cache: list, record: VerifyRecord, states: list) -> None:
    """Put every cache back to its state before the verify `record` describes (`states`: `arrays_states`)."""
    saved = {id(c): state for c, state in states}
    for c in layer_caches(cache):
        if id(c) in saved:
            c.cache, c.left_padding, c.lengths = list(saved[id(c)][0]), *saved[id(c)][1:]
        else:
            CACHE_KINDS[type(c)].rollback(c, record, 0)
