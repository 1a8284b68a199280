"""Prefilling several new requests in one target forward.

Fresh sessions (nothing cached) are prefilled together, the way the
single-request engine prefills one (all prompt tokens but the last, then the
last, which gives the first token): their prompts, padded at the end to the
longest, go through one forward on a ragged batch cache; each row then keeps
its own length (a Gated DeltaNet row is replayed over its own tokens, as a
rollback does) and its drafter gets the features of its own positions. The
rows' caches are then handed back to their sessions. A session that already
holds a prefix of its prompt, a prompt longer than the prefill step, or a
prompt of one token is prefilled alone by the engine (`BatchDecoder.insert`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..proposers.base import reads_features
from ..sampling import log_softmax
from .ragged_cache import RaggedKVCache, keep_rows, unbatch_layer


def _empty_batch(like: list, rows: int) -> list:
    out = []
    for c in like:
        if c is None:
            out.append(None)
        elif isinstance(c, ArraysCache):
            out.append(ArraysCache(size=len(c.cache)))
        else:
            layer = RaggedKVCache()
            layer.lengths = [0] * rows
            out.append(layer)
    return out


def _feed(target, ids: list[list[int]], cache: list, logits: bool = True) -> tuple[mx.array | None, mx.array | None]:
    """One forward of rows padded at the end; each row keeps only its own tokens (`logits=False`: no head,
    as `TargetAdapter.forward`)."""
    width = max(len(r) for r in ids)
    padded = mx.array([r + [r[-1]] * (width - len(r)) for r in ids], mx.int32)
    logits, features, record = target.verify(padded, cache, logits)
    keep_rows(cache, record, [len(r) for r in ids])
    return logits, features


def prefill_together(target, sessions: list, prompts: list[list[int]], acceptors: list) -> list[tuple[int, mx.array]]:
    """Prefill fresh sessions together; returns each row's (first token, its log-probability row)."""
    for session, prompt in zip(sessions, prompts):
        if session.begin(prompt) != 0:
            raise ValueError("prefill_together takes sessions that hold nothing of their prompts.")
    cache = _empty_batch(sessions[0].cache, len(sessions))
    feeds = [reads_features(s.proposer) for s in sessions]
    _, features = _feed(target, [p[:-1] for p in prompts], cache, logits=False)
    for i, (session, prompt) in enumerate(zip(sessions, prompts)):
        if feeds[i]:
            session.proposer.add_context(features[i : i + 1, : len(prompt) - 1])
    logits, features = _feed(target, [p[-1:] for p in prompts], cache)
    firsts = []
    for i, (session, acceptor) in enumerate(zip(sessions, acceptors)):
        if feeds[i]:
            session.proposer.add_context(features[i : i + 1, :1])
        row = acceptor.process(logits[i, -1:])
        firsts.append((acceptor.next_token(row, len(prompts[i]) - 1), log_softmax(row)))
    mx.eval([f for f, _ in firsts], [c.state for c in cache if c is not None])
    out = []
    for i, (session, prompt, acceptor) in enumerate(zip(sessions, prompts, acceptors)):
        for j, layer in enumerate(cache):
            session.cache[j] = unbatch_layer(layer, i, session.cache[j])
        session.prefilled(prompt)
        token = firsts[i][0].tolist()[0]
        acceptor.commit([token])
        follow = getattr(session.proposer, "commit", None)  # (a proposer that follows the text, as a planner tells it)
        if follow is not None:
            follow([token])
        out.append((token, firsts[i][1]))
    return out
