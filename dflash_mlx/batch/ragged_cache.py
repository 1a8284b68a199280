"""Per-layer caches of a batch whose rows hold different numbers of tokens.

A batched verify feeds every row the same number of rows N, but each row
keeps its own number of them, so rows drift apart in length. mlx-lm's batch
caches keep rows aligned (left padding, one write position for all), so
instead `RaggedKVCache` keeps a length per row: a row's new keys are written
at its own end, its RoPE offset is its own length, and its mask hides the
positions past its end; a rollback only shortens a row (`keep_rows`), the
stale keys behind its end are masked until overwritten. It is duck-typed like
mlx-lm's caches (`offset`, `update_and_fetch`, `make_mask`, `state`), so the
target's own attention layers run on it unchanged.

A sliding-window layer's row is kept whole (its mask applies the window), so
its memory grows with the row like a full-attention layer's; Gated DeltaNet
rows are plain `ArraysCache` batches (every row feeds N rows: no padding).
`batch_layer` / `unbatch_layer` move one request's mlx-lm caches (`KVCache`, `RotatingKVCache`,
the `ArraysCache` of a Gated DeltaNet layer) into a batch row and back;
`keep_rows` cuts every row back to its own kept prefix after a forward.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..targets.adapter import TargetAdapter, UnsupportedTargetError
from ..targets.gated_delta import GDNRecord

STEP = 256  # rows of key/value storage added at a time, as mlx-lm's KVCache does


class RaggedKVCache:
    """Keys and values [B, heads, capacity, dim] with a length per row."""

    def __init__(self):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths: list[int] = []

    @property
    def offset(self) -> mx.array:
        """Each row's position of its next key (the RoPE offset of its next query)."""
        return mx.array(self.lengths, dtype=mx.int32)

    def _reserve(self, end: int, like_keys: mx.array, like_values: mx.array) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if end <= capacity:
            return
        grow = ((end - capacity + STEP - 1) // STEP) * STEP
        B, h, _, dk = like_keys.shape
        new_k = mx.zeros((B, h, grow, dk), like_keys.dtype)
        new_v = mx.zeros((B, h, grow, like_values.shape[3]), like_values.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys, new_k], axis=2)
            self.values = mx.concatenate([self.values, new_v], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        end = max(self.lengths) + n
        self._reserve(end, keys, values)
        if len(set(self.lengths)) == 1:
            start = self.lengths[0]
            self.keys[..., start : start + n, :] = keys
            self.values[..., start : start + n, :] = values
        else:  # one scatter per array: row i's new keys at its own positions
            at = (mx.array(self.lengths)[:, None] + mx.arange(n)[None])[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(at, keys.shape), keys, axis=2)
            self.values = mx.put_along_axis(self.values, mx.broadcast_to(at, values.shape), values, axis=2)
        self.lengths = [length + n for length in self.lengths]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Every row's keys and values up to the longest row (what KV-sharing layers read, as of mlx-lm's caches)."""
        end = max(self.lengths)
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs) -> mx.array:
        """[B, 1, N, max length + N]: row i's query j sees its positions up to its own, in its window."""
        width = max(self.lengths) + N
        queries = mx.array(self.lengths)[:, None, None, None] + mx.arange(N)[None, None, :, None]
        positions = mx.arange(width)[None, None, None, :]
        mask = positions <= queries
        if window_size is not None:
            mask = mask & (positions > queries - window_size)
        return mask

    def keep_rows(self, fed: int, keep: list[int]) -> None:
        """After an update of `fed` rows, row i keeps only the first keep[i] of them."""
        self.lengths = [length - fed + k for length, k in zip(self.lengths, keep)]

    @property
    def state(self):
        return [] if self.keys is None else [self.keys, self.values]

    def is_trimmable(self) -> bool:
        return False

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # -- rows in and out --------------------------------------------------------------------------

    @classmethod
    def from_rows(cls, rows: list[tuple[mx.array, mx.array, int]]) -> "RaggedKVCache":
        """A batch of (keys [1, h, n, d], values, absolute length) rows; keys end at the row's length."""
        cache = cls()
        cache.lengths = [length for _, _, length in rows]
        end = max(cache.lengths)
        k0, v0, _ = rows[0]
        B = len(rows)
        keys = mx.zeros((B, k0.shape[1], end, k0.shape[3]), k0.dtype)
        values = mx.zeros((B, v0.shape[1], end, v0.shape[3]), v0.dtype)
        for i, (k, v, length) in enumerate(rows):
            n = k.shape[2]
            keys[i : i + 1, :, length - n : length, :] = k
            values[i : i + 1, :, length - n : length, :] = v
        cache.keys, cache.values = keys, values
        return cache

    def row(self, i: int, last: int | None = None) -> tuple[mx.array, mx.array]:
        """Row i's keys and values up to its length (only its `last` positions when given)."""
        end = self.lengths[i]
        start = 0 if last is None else max(0, end - last)
        return self.keys[i : i + 1, :, start:end, :], self.values[i : i + 1, :, start:end, :]


def _kv_row(cache) -> tuple[mx.array, mx.array, int]:
    """(keys, values, absolute length) of a request's KVCache or RotatingKVCache, in temporal order."""
    if isinstance(cache, RotatingKVCache):
        keys, values = cache.state[0], cache.state[1]
        order = cache._temporal_order  # (a ring after single-row updates is rotated)
        keys, values = order(keys), order(values)
        held = min(cache.offset, keys.shape[2])
        return keys[..., -held:, :], values[..., -held:, :], cache.offset
    keys, values, offset = cache.state
    return keys[..., :offset, :], values[..., :offset, :], offset


def batch_problem(model) -> str | None:
    """Why a batch cannot decode this target's rows together, or None: it batches KV, sliding-window
    and Gated DeltaNet caches only (other recurrent layers would be fed their kept rows again)."""
    try:
        target = TargetAdapter(model)
    except UnsupportedTargetError as e:
        return str(e)
    if not target.family.batches:
        return f"batched decoding does not support the {target.family_name} family (its positions)"
    kinds = {type(c) for c in target.make_cache()}
    if target.refeeds or not kinds <= {KVCache, RotatingKVCache, ArraysCache, type(None)}:
        names = ", ".join(sorted(k.__name__ for k in kinds - {type(None)}))
        return f"batched decoding does not support the {target.family_name} family's caches ({names}) yet"
    return None


def batch_layer(caches: list):
    """One layer's batch cache from each row's cache of that layer."""
    first = caches[0]
    if first is None:
        return None
    if isinstance(first, (KVCache, RotatingKVCache)):
        return RaggedKVCache.from_rows([_kv_row(c) for c in caches])
    if isinstance(first, ArraysCache):
        batch = ArraysCache(size=len(first.cache))
        batch.cache = [mx.concatenate([c.cache[j] for c in caches], axis=0) for j in range(len(first.cache))]
        return batch
    raise TypeError(f"cannot batch a {type(first).__name__}")


def unbatch_layer(batch, i: int, like):
    """Row i of a batch layer as a cache of the request's own type (`like`: its original cache)."""
    if batch is None:
        return None
    if isinstance(like, RotatingKVCache):
        keys, values = batch.row(i, last=like.max_size)
        out = RotatingKVCache(max_size=like.max_size, keep=like.keep)
        out.state = (keys, values, batch.lengths[i], like.keep, like.max_size, keys.shape[2])
        return out
    if isinstance(like, KVCache):
        keys, values = batch.row(i)
        out = KVCache()
        out.state = (keys, values, batch.lengths[i])
        return out
    out = ArraysCache(size=len(batch.cache))
    out.cache = [c[i : i + 1] for c in batch.cache]
    return out


def keep_rows(cache: list, record, keep: list[int]) -> None:
    """After a forward of `record.rows` rows, row i of every batch layer keeps only its first keep[i]."""
    for j, layer in enumerate(cache):
        if isinstance(layer, RaggedKVCache):
            layer.keep_rows(record.rows, keep)
        elif id(layer) in record.gdn:
            restore_rows(record.gdn[id(layer)], layer, keep)


def restore_rows(record: GDNRecord, cache, keep: list[int]) -> None:
    """A Gated DeltaNet batch cache as if row i had been fed only its first keep[i] rows."""
    if all(k == record.q.shape[1] for k in keep):
        return
    conv, state = [], []
    for i, n in enumerate(keep):
        row = GDNRecord(
            record.layer,
            record.conv_input[i : i + 1],
            record.q[i : i + 1],
            record.k[i : i + 1],
            record.v[i : i + 1],
            record.a[i : i + 1],
            record.b[i : i + 1],
            None if record.state is None else record.state[i : i + 1],
        )
        single = [None, None]
        row.restore(single, n)
        conv.append(single[0])
        state.append(single[1])  # (keep >= 1: the anchor is always kept)
    cache[0] = mx.concatenate(conv, axis=0)
    cache[1] = mx.concatenate(state, axis=0)
