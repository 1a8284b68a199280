"""The frozen target's hidden features for a training batch, online or from a disk cache.

`TargetAdapter.forward` runs the target's own layers and returns the outputs of
the layers the drafter reads, concatenated ([B, L, n_ids * H]). Long sequences
are fed `chunk` tokens at a time through one KV cache (as a prefill would be),
each chunk evaluated before the next, so the target's attention never holds
L x L scores and its activations exist for one chunk only. Sequences are
right-padded, so padding never changes the features of real positions (causal
target). The result is wrapped in `mx.stop_gradient`: the target is never trained.

`FeatureStore` optionally keeps each sequence's features on disk (bfloat16
safetensors, one file per sequence, written atomically) so later epochs skip the
target forward. Files are keyed by the sequence's index and a hash of its token
ids and the layer ids, so a changed data set never reads stale features.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import mlx.core as mx

from ..targets.adapter import TargetAdapter
from ..utils.io import save_safetensors_atomic
from .batches import TrainBatch


def target_features(target: TargetAdapter, ids: mx.array, chunk: int | None = None) -> mx.array:
    """Features [B, L, n_ids * H] (float32) of the right-padded batch `ids` [B, L].

    `chunk` tokens per target forward (None: the whole sequence at once).
    """
    L = ids.shape[1]
    chunk = chunk or L
    cache = target.make_cache()
    parts = []
    for start in range(0, L, chunk):
        _, features = target.forward(ids[:, start : start + chunk], cache, logits=False)
        part = mx.stop_gradient(features.astype(mx.float32))
        if L > chunk:
            mx.eval(part)
        parts.append(part)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


class FeatureStore:
    """Per-sequence feature files under `root` (None: no caching, always online)."""

    def __init__(self, target: TargetAdapter, root: Path | None = None, chunk: int | None = None):
        self.target, self.chunk = target, chunk
        self.root = Path(root) if root is not None else None
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def _path(self, index: int, ids: tuple[int, ...]) -> Path:
        digest = hashlib.sha1(repr((ids, self.target.layer_ids)).encode()).hexdigest()[:16]
        return self.root / f"{index:07d}-{digest}.safetensors"

    def batch_features(self, indices: list[int], batch: TrainBatch, seqs) -> mx.array:
        """Features [B, L, F] for `batch` (whose rows are the sequences `indices`)."""
        if self.root is None:
            self.misses += len(indices)
            return target_features(self.target, batch.ids, self.chunk)
        paths = [self._path(i, s.ids) for i, s in zip(indices, seqs)]
        missing = [r for r, p in enumerate(paths) if not p.exists()]
        if missing:
            rows = batch.ids[mx.array(missing)][:, : max(batch.lengths[r] for r in missing)]
            fresh = target_features(self.target, rows, self.chunk)
            mx.eval(fresh)
            for j, r in enumerate(missing):
                save_safetensors_atomic(paths[r], {"features": fresh[j, : batch.lengths[r]].astype(mx.bfloat16)})
        self.misses += len(missing)
        self.hits += len(indices) - len(missing)
        L = batch.ids.shape[1]
        rows = []
        for r, p in enumerate(paths):
            f = mx.load(str(p))["features"].astype(mx.float32)
            rows.append(mx.pad(f, [(0, L - f.shape[0]), (0, 0)]))
        return mx.stop_gradient(mx.stack(rows))
