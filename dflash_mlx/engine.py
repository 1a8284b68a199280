"""The speculative loop: prefill, then draft -> verify -> accept -> roll back.

`speculative_cycles` is a generator of `Cycle`s (the tokens one target forward
committed), with no I/O, no detokenizing and no knowledge of EOS: the caller
stops consuming when it sees one. Acceptance is computed on the device
and the next cycle's graph is queued with `mx.async_eval` before the current
cycle is handed out, so there is one host sync per cycle. What a verify
commits (greedy or exact sampling, logits processors) is the `Acceptor`'s.
Log-probabilities are left lazy (a full-vocabulary log-softmax over every
verified row costs ~10% of a 240M-parameter verify on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Iterator

import mlx.core as mx

from .acceptance import Acceptor
from .proposers.base import Proposer
from .sampling import SamplingSettings, log_softmax
from .session import Session
from .targets.adapter import TargetAdapter
from .targets.rollback import VerifyRecord, rollback


@dataclass
class Cycle:
    """Tokens committed by one target forward, with their log-probability rows."""

    tokens: list[int]
    logprobs: mx.array  # [len(tokens), V]
    drafted: int  # how many leading tokens were proposals the target accepted
    block_size: int  # block verified (0 for the prefill's first token)
    stopped: bool = False  # the last token is a stop token: generation ends here

    @property
    def from_prefill(self) -> bool:
        return self.block_size == 0


@dataclass
class _Pending:
    """A queued draft + verify: its block size, verdict, processed rows, features and record."""

    block_size: int
    verdict: mx.array
    rows: mx.array
    features: mx.array | None
    record: VerifyRecord


def speculative_cycles(
    target: TargetAdapter,
    prompt: mx.array,
    proposer: Proposer | None,
    *,
    max_tokens: int,
    block_size: int,
    prefill_step_size: int = 2048,
    prompt_progress: Callable[[int, int], None] | None = None,
    acceptor: Acceptor | None = None,
    stop_tokens: Collection[int] = (),
    session: Session | None = None,
) -> Iterator[Cycle]:
    """Yield cycles until `max_tokens` tokens are committed (-1: no limit) or a stop token.

    The first cycle holds the token sampled from the prompt's last logits; each
    later cycle holds 1..block_size tokens. A cycle containing one of
    `stop_tokens` ends there (the tokens after it are dropped and never reach
    the caches). `session` (made with this target and proposer) keeps the caches
    for the next call; only the prompt tokens it does not hold are prefilled.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}.")
    if session is None:
        session = Session(target, proposer)
    elif session.target is not target or session.proposer is not proposer:
        raise ValueError("The session was made for another target or proposer.")
    progress = prompt_progress or (lambda done, total: None)
    acceptor = acceptor or Acceptor(SamplingSettings(), prompt)
    stop_tokens = frozenset(stop_tokens)
    prompt_ids = prompt.tolist()
    done = session.begin(prompt_ids)
    cache = session.cache
    feeds_context = proposer is not None and bool(proposer.layer_ids)

    def add_context(features: mx.array | None) -> None:
        if feeds_context:
            proposer.add_context(features)

    # Prefill exactly as mlx-lm does: chunks of all but the last token, then the last.
    total = prompt.size
    progress(done, total)
    while total - done > 1:
        n = min(prefill_step_size, total - done - 1)
        _, features = target.forward(prompt[None, done : done + n], cache)
        add_context(features)
        mx.eval([c.state for c in cache if c is not None], proposer.state() if feeds_context else [])
        done += n
        progress(done, total)
        mx.clear_cache()
    logits, features = target.forward(prompt[None, done:], cache)
    add_context(features)
    row = acceptor.process(logits[0, -1:])
    logprobs = log_softmax(row)
    anchor = acceptor.first_token(row)
    mx.eval(anchor, logprobs)
    progress(total, total)
    session.prefilled(prompt_ids)
    acceptor.commit(anchor.tolist())
    anchor_id = anchor.tolist()[0]
    yield Cycle(tokens=[anchor_id], logprobs=logprobs, drafted=0, block_size=0, stopped=anchor_id in stop_tokens)

    committed, position = 1, total

    def launch(anchor: mx.array, position: int, committed: int):
        """Queue one draft + verify; return what `finish` needs."""
        b = block_size if max_tokens < 0 else min(block_size, max_tokens - committed)
        drafts = draft_probs = None
        if b > 1 and proposer is not None:
            proposal = proposer.propose(
                anchor, position, b - 1, sampling=acceptor.draft_settings, key=acceptor.next_key()
            )
            drafts, draft_probs = proposal.tokens, proposal.probs
            verify_ids = mx.concatenate([anchor.reshape(1), drafts])
        else:
            b = 1
            verify_ids = anchor.reshape(1)
        logits, features, record = target.verify(verify_ids[None], cache)
        rows = acceptor.process(logits[0], drafts)
        verdict = acceptor.verdict(rows, drafts, draft_probs)
        mx.async_eval(verdict)
        return _Pending(b, verdict, rows, features, record)

    pending = None
    if committed != max_tokens and anchor_id not in stop_tokens:
        pending = launch(anchor, position, committed)
    try:
        while pending is not None:
            queued, pending = pending, None
            values = queued.verdict.tolist()
            accepted = values[0]
            tokens = values[1 : accepted + 2]
            stop = next((i for i, t in enumerate(tokens) if t in stop_tokens), None)
            if stop is not None:
                tokens = tokens[: stop + 1]
            kept = len(tokens)  # rows kept: the anchor and the accepted drafts before the last token
            rollback(cache, queued.record, keep=kept)
            session.fed([anchor_id] + tokens[:-1])
            if queued.features is not None:
                add_context(queued.features[:, :kept])
            acceptor.commit(tokens)
            committed += len(tokens)
            position += len(tokens)
            anchor_id = tokens[-1]
            if stop is None and (committed < max_tokens or max_tokens < 0):
                pending = launch(mx.array([anchor_id], mx.int32), position, committed)
            # Log-probabilities stay lazy: only a caller that reads them pays for them.
            logprobs = log_softmax(queued.rows[:kept])
            yield Cycle(tokens=tokens, logprobs=logprobs, drafted=min(accepted, kept), block_size=queued.block_size,
                        stopped=stop is not None)  # fmt: skip
    finally:
        if pending is not None:  # the consumer stopped early: undo the queued verify but for its anchor
            session.keep_anchor_only(pending.record, anchor_id, pending.features if feeds_context else None)
