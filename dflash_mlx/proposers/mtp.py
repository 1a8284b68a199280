"""A target's own multi-token-prediction (MTP) heads as its drafter (`dflash_mlx.mtp`).

The head reads the target's final hidden state h[t] (its final norm's output,
as vLLM and mlx-vlm feed it) and the embedding of the token after it: the
adapter hands both over per committed row (`reads_final`, see
`targets.adapter`). Its context is its own small KV cache of (h[t],
embed(x[t+1])) pairs for every committed t: the rows of one batch of context
wait until the next batch (or the next draft) brings the embedding that
follows their last row, then run through stage 0 in one forward. A draft
after anchor x[p] runs the pending pairs with (h[p-1], embed(x[p])) last: its
output gives draft 1; each further draft is a chained step on the previous
step's output and draft, through stage `step % stages` (the head's
`feedback`, as vLLM feeds it), whose cache rows are cut back afterwards. The
number of drafts is the block the policy chooses, down to plain decoding.
Sampled drafts are drawn from each step's processed distribution (q), which
rejection sampling verifies exactly. A grammar gets deterministic drafts
(no `draft_logits`: a step's logits depend on the previous draft), and a
batch's rows draft one by one (no `batch_key`).
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..mtp.checkpoint import load_mtp_head
from ..mtp.head import MTPHead
from ..sampling import distribution, draw_keyed, row_keys
from .base import Proposal

MTP_BLOCK = 4  # the widest block: the anchor and up to 3 chained drafts


class MTPProposer:
    """Drafts with an `MTPHead` (its source name: "mtp")."""

    name = "mtp"
    source = "mtp"  # how commands name the drafter
    keys_per_row = True  # draws row i with key i (`proposers.base`)
    layer_ids: tuple[int, ...] = ()
    reads_final = True

    def __init__(self, head: MTPHead, block_size: int = MTP_BLOCK):
        self.drafter = head  # (what calibration keys and the acceptance history are kept for)
        self.block_size = block_size
        self.target = None
        self._caches: list | None = None
        self._pending: mx.array | None = None  # [1, n, 2H] context rows whose pairs are not in the cache yet
        self._end = 0  # the absolute position right after the last context row

    def fork(self, context: bool = False) -> MTPProposer:
        """An independent proposer on the same head: an empty context, or a copy of this one's."""
        other = MTPProposer(self.drafter, self.block_size)
        if context and self._caches is not None:
            other.target, other._caches = self.target, copy.deepcopy(self._caches)
            other._pending, other._end = self._pending, self._end
        return other

    @property
    def context_end(self) -> int:
        return self._end

    def start(self, target, prompt: mx.array, reused: int = 0) -> None:
        self.target = target
        if reused and self._caches is not None and self._rewind(reused):
            return
        self._caches = self.drafter.make_cache()
        self._pending, self._end = None, reused  # positions before `reused` were never seen: drafts get worse

    def _rewind(self, position: int) -> bool:
        """Keep the context before `position` (a session reusing a prefix): pending rows are cut, or cache
        rows trimmed (the pair at position - 1 needs a hidden state no longer held: it is skipped)."""
        waiting = 0 if self._pending is None else self._pending.shape[1]
        ingested = self._end - waiting
        if position > self._end:
            return False
        if position > ingested:
            self._pending = self._pending[:, : position - ingested]
        else:
            cache = self._caches[0]
            if not cache.is_trimmable():
                return False
            cache.trim(ingested - position + 1)
            self._pending = None
        self._end = position
        return True

    def add_context(self, features: mx.array) -> None:
        """Committed rows [1, n, ... 2H]: the pairs of the rows waiting before them are ingested now."""
        rows = features[..., -2 * self.target.hidden_size :]
        if self._pending is not None:
            self._ingest(rows[:, :1, self.target.hidden_size :])
        self._pending = rows
        self._end += rows.shape[1]

    def state(self) -> list:
        """The cache's arrays (the rows waiting for their next embedding stay lazy)."""
        return [c.state for c in self._caches or [] if not c.empty()]

    def _ingest(self, following: mx.array) -> mx.array:
        """Run the pending rows' pairs through stage 0, `following` the embedding after the last one;
        return stage 0's output rows."""
        size = self.target.hidden_size
        hidden, embeddings = self._pending[..., :size], self._pending[..., size:]
        nexts = mx.concatenate([embeddings[:, 1:], following.astype(embeddings.dtype)], axis=1)
        first = self._end - self._pending.shape[1]  # the position of the first pending row
        if first == 0 and self.drafter.layout.masks_first_position:
            nexts = mx.concatenate([mx.zeros_like(nexts[:, :1]), nexts[:, 1:]], axis=1)
        self._pending = None
        return self.drafter.forward(0, hidden, nexts, self._caches[0])

    def propose(self, anchor: mx.array, position: int, count: int, *, sampling=None, key=None) -> Proposal:
        if self._end != position:
            raise RuntimeError(f"MTP context ends at {self._end} but the anchor sits at {position}.")
        if self._pending is None:
            raise RuntimeError(f"MTP context: no hidden state for position {position - 1} (drafted there already).")
        head, target = self.drafter, self.target
        stages = len(head.stages)
        keys = row_keys(key, count)
        out = self._ingest(self.target.embed(anchor.reshape(1, 1)))[:, -1:]
        tokens, probs, chained = [], [], [0] * stages
        stage = 0
        for step in range(count):
            if step:
                previous, stage = stage, step % stages
                embedding = target.embed(tokens[-1].reshape(1, 1))
                out = head.forward(stage, head.feedback(previous, out), embedding, self._caches[stage])
                chained[stage] += 1
            token, q = _choose(head.logits(stage, out, target)[0], sampling, keys[step])
            tokens.append(token)
            probs.append(q)
        for cache, rows in zip(self._caches, chained):
            if rows:
                cache.trim(rows)
        return Proposal(
            tokens=mx.concatenate(tokens).astype(mx.int32),
            probs=None if sampling is None else mx.concatenate(probs, axis=0),
        )

    def saved_context(self) -> list[tuple[list, dict]] | None:
        """The context for a saved session: each stage's cache rows (KV caches; others start afresh when
        restored), then the rows waiting for their next embedding."""
        if self._caches is None:
            return None
        entries = []
        if all(type(c) is KVCache for c in self._caches):
            for c in self._caches:
                held = not c.empty() and c.offset > 0
                entries.append(([c.keys[..., : c.offset, :], c.values[..., : c.offset, :]] if held else [], {}))
        pending = [] if self._pending is None else [self._pending]
        return entries + [(pending, {"end": self._end})]

    def restore_context(self, target, saved: list[tuple[list, dict]]) -> None:
        """Take back a `saved_context` (the session's target adapter is `target`)."""
        *caches, (pending, meta) = saved
        self.target, self._caches = target, self.drafter.make_cache()
        if len(caches) == len(self._caches):
            for cache, (arrays, _) in zip(self._caches, caches):
                if arrays:
                    cache.keys, cache.values = arrays
                    cache.offset = arrays[0].shape[2]
        self._pending = pending[0] if pending else None
        self._end = int(meta["end"])


def _choose(logits: mx.array, sampling, key) -> tuple[mx.array, mx.array | None]:
    """A draft [1] from logits [1, V] (argmax, or a sample of q) and q [1, V] when sampled."""
    if sampling is None:
        return mx.argmax(logits, axis=-1), None
    q = distribution(logits, sampling)
    return draw_keyed(mx.log(q), key), q


def load_mtp(directory, model, dtype=None, block_size: int = MTP_BLOCK) -> MTPProposer:
    """The proposer of the MTP heads in the target's checkpoint `directory` (`mtp.checkpoint.MTPWeightsError`
    when it has none: "this checkpoint has no MTP weights; use one that keeps them")."""
    return MTPProposer(load_mtp_head(directory, model, dtype), block_size)
