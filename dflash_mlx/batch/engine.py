"""Batched DFlash: the rows of several requests drafted, verified in one target forward, accepted apart.

`BatchDecoder` holds active rows. A row joins with its own session (its
prompt prefilled alone, through the single-request engine, which also gives
its first token), its own `Acceptor` (sampler settings, logits processors,
seed) and its limits; its caches then move into the batch's (`ragged_cache`).
Each `step()`: the rows' blocks are drafted (one drafter forward for all, see
`drafting`),
the target verifies all rows in one forward ([B, b] ids, per-row positions
and masks), each row's acceptor judges its own rows, and each row keeps its
own accepted prefix (a ragged KV row is shortened; a Gated DeltaNet row is
replayed over its kept rows). A row that stops (a stop token, its
max_tokens) leaves: its caches go back to its session, which a prompt cache
can keep. The output of every row is what it would be served alone.

Every row of a cycle verifies the same block b (the caller's block; a row
needing fewer tokens takes its cut at acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..acceptance import Acceptor
from ..engine import speculative_cycles
from ..sampling import log_softmax
from ..session import Session
from ..targets.gated_delta import GDNRecord
from ..targets.rollback import VerifyRecord
from .drafting import propose_rows
from .ragged_cache import RaggedKVCache, batch_layer, unbatch_layer


@dataclass
class BatchRow:
    """One request in the batch."""

    uid: int
    session: Session
    acceptor: Acceptor
    max_tokens: int  # -1: no limit
    stop_tokens: frozenset
    anchor: int = 0  # the last committed token, not yet fed
    position: int = 0  # the anchor's position
    committed: int = 0
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None


@dataclass
class RowTokens:
    """What one step committed for one row."""

    uid: int
    tokens: list[int]
    logprobs: mx.array  # [len(tokens), V], lazy
    drafted: int
    block_size: int
    finish: str | None  # "stop", "length" or None


class BatchDecoder:
    """Rows of one target (and one drafter kind) decoded together; see the module docstring."""

    def __init__(self, target, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        unsupported = getattr(target.family, "run", None) is not None
        if unsupported:
            raise ValueError(f"Batched decoding does not support the {target.family_name} family yet.")
        self.target = target
        self.block_size = block_size
        self.rows: list[BatchRow] = []
        self._cache: list | None = None  # the batch's caches while rows are in it
        self._next_uid = 0

    # -- rows joining and leaving ---------------------------------------------------------------

    def insert(self, session: Session, prompt: mx.array, acceptor: Acceptor, *, max_tokens: int,
               stop_tokens=(), prefill_step_size: int = 2048) -> RowTokens:  # fmt: skip
        """Prefill a request alone and add it to the batch; returns its first token."""
        if session.model is not self.target.model:
            raise ValueError("The session was made for another target model.")
        self._unbatch()
        cycles = speculative_cycles(session.target, prompt, session.proposer, max_tokens=1, block_size=1,
                                    prefill_step_size=prefill_step_size, acceptor=acceptor,
                                    stop_tokens=stop_tokens, session=session)  # fmt: skip
        first = next(cycles)
        cycles.close()
        row = BatchRow(self._next_uid, session, acceptor, max_tokens, frozenset(stop_tokens), anchor=first.tokens[0],
                       position=prompt.size, committed=1, tokens=list(first.tokens))  # fmt: skip
        self._next_uid += 1
        finish = "stop" if first.stopped else ("length" if max_tokens == 1 else None)
        row.finish = finish
        if finish is None:
            self.rows.append(row)
        return RowTokens(row.uid, first.tokens, first.logprobs, 0, 0, finish)

    def remove(self, uid: int) -> None:
        """Take a row out (e.g. its client went away); its session keeps the tokens committed so far."""
        self._unbatch()
        self.rows = [r for r in self.rows if r.uid != uid]

    def _batch(self) -> list:
        if self._cache is None:
            per_row = [r.session.cache for r in self.rows]
            self._cache = [batch_layer([c[j] for c in per_row]) for j in range(len(per_row[0]))]
        return self._cache

    def _unbatch(self) -> None:
        """Move the batch's caches back into the rows' sessions (in place: a caller's list stays its own)."""
        if self._cache is None:
            return
        for i, row in enumerate(self.rows):
            for j, layer in enumerate(self._cache):
                row.session.cache[j] = unbatch_layer(layer, i, row.session.cache[j])
        self._cache = None

    # -- one cycle ------------------------------------------------------------------------------

    def step(self) -> list[RowTokens]:
        """One draft + verify for every row; the rows that finished leave the batch."""
        if not self.rows:
            return []
        b = self.block_size
        cache = self._batch()
        anchors = [mx.array([row.anchor], mx.int32) for row in self.rows]
        if b > 1:
            proposals = propose_rows(self.rows, b - 1)
            drafts, probs = [p.tokens for p in proposals], [p.probs for p in proposals]
            ids = [mx.concatenate([a, d]) for a, d in zip(anchors, drafts)]
        else:
            drafts = probs = [None] * len(self.rows)
            ids = anchors
        logits, features, record = self.target.verify(mx.stack(ids), cache)
        rows, verdicts = [], []
        for i, row in enumerate(self.rows):
            processed = row.acceptor.process(logits[i], drafts[i])
            rows.append(processed)
            verdicts.append(row.acceptor.verdict(processed, drafts[i], probs[i]))
        mx.eval(verdicts)
        out, keep = [], []
        for i, row in enumerate(self.rows):
            values = verdicts[i].tolist()
            accepted = values[0]
            tokens = values[1 : accepted + 2]
            room = row.max_tokens - row.committed if row.max_tokens >= 0 else len(tokens)
            tokens = tokens[:room]
            stop = next((k for k, t in enumerate(tokens) if t in row.stop_tokens), None)
            finish = None
            if stop is not None:
                tokens, finish = tokens[: stop + 1], "stop"
            elif row.max_tokens >= 0 and row.committed + len(tokens) >= row.max_tokens:
                finish = "length"
            keep.append(len(tokens))
            row.session.fed([row.anchor] + tokens[:-1])
            row.acceptor.commit(tokens)
            row.committed += len(tokens)
            row.position += len(tokens)
            row.anchor = tokens[-1]
            row.tokens.extend(tokens)
            row.finish = finish
            out.append(RowTokens(row.uid, tokens, log_softmax(rows[i][: len(tokens)]), min(accepted, len(tokens)),
                                 b, finish))  # fmt: skip
        self._rollback(cache, record, keep)
        if features is not None:
            for i, row in enumerate(self.rows):
                if row.session.proposer is not None and row.session.proposer.layer_ids:
                    row.session.proposer.add_context(features[i : i + 1, : keep[i]])
        if any(r.finish for r in self.rows):
            self._unbatch()
            self.rows = [r for r in self.rows if r.finish is None]
        return out

    def _rollback(self, cache: list, record: VerifyRecord, keep: list[int]) -> None:
        fed = record.rows
        for j, layer in enumerate(cache):
            if isinstance(layer, RaggedKVCache):
                layer.keep_rows(fed, keep)
            elif j in record.gdn:
                restore_rows(record.gdn[j], layer, keep)


def restore_rows(record: GDNRecord, cache, keep: list[int]) -> None:
    """A Gated DeltaNet batch cache as if row i had been fed only its first keep[i] rows."""
    if all(k == record.q.shape[1] for k in keep):
        return
    conv, state = [], []
    for i, n in enumerate(keep):
        row = GDNRecord(record.layer, record.conv_input[i : i + 1], record.q[i : i + 1], record.k[i : i + 1],
                        record.v[i : i + 1], record.a[i : i + 1], record.b[i : i + 1],
                        None if record.state is None else record.state[i : i + 1])  # fmt: skip
        single = [None, None]
        row.restore(single, n)
        conv.append(single[0])
        state.append(single[1])  # (keep >= 1: the anchor is always kept)
    cache[0] = mx.concatenate(conv, axis=0)
    cache[1] = mx.concatenate(state, axis=0)
