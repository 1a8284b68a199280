"""The speculative loop: prefill, then draft -> verify -> accept -> roll back.

`speculative_cycles` is a generator of `Cycle`s (the tokens one target forward
committed), with no I/O and no detokenizing; a cycle holding a stop token ends
the generation. Acceptance is computed on the device and the next cycle's
graph is queued with `mx.async_eval` before the current cycle is handed out,
so there is one host sync per cycle (the first cycle is queued before the
prefill's token is handed out, as mlx-lm queues its second step). A
block-size policy (`policy.base`) chooses each cycle's block; b = 1 is plain
decoding, and the cycle after a b = 1 cycle or after the prefill (of any
block) is pipelined like mlx-lm's `generate_step` (built on the lazy token
before that token is read) where the caches can undo it whole should the
token be a stop token. With `lookup` a cycle may instead verify a span copied
from the context (`policy.source` chooses; the session keeps the index in step
with the committed tokens), its rows' features held for the drafter as b = 1
rows are; a run of plain steps then reads its token first where a span may
follow it. At b = 1 the drafter's context still receives every
committed position, batched and left lazy until a larger block needs it (the
prompt's too, when the first cycle is plain). What a verify commits (greedy
or exact sampling, logits processors) is the `Acceptor`'s. The policy is told
each cycle's cost on the engine's side: its launch, the wait for its verdict
and taking it in, not the caller's work while the generator is suspended nor
the launch of a cycle pipelined after it. Log-probabilities
are left lazy (a full-vocabulary log-softmax over every verified row is a
sizeable share of a verify on a CPU). An exception raised inside the
loop (a progress callback cancelling, a logits processor, Ctrl-C) hands the
session back holding only what it records (`Session.abandon`), and a
generation left open is settled when its session is used again
(`Session.opened`): a verify's rows never stay in the caches unrecorded.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection, Iterator

import mlx.core as mx

from .acceptance import Acceptor
from .policy.base import BlockPolicy, FixedBlock
from .policy.source import LookupDrafting
from .proposers.base import Proposer
from .sampling import SamplingSettings, log_softmax
from .session import Session
from .targets.adapter import TargetAdapter
from .targets.quantized_kv import KVQuantization
from .targets.rollback import VerifyRecord, rollback, undoes_single_row

CONTEXT_BATCH = 64  # rows of b = 1 features the drafter receives at once
SUPERSEDED = (
    "This generation was left open while its session was used again (a new generation on it, a reset): "
    "its caches now hold the other's state, so it cannot go on. Close a stream you stop reading (.close())."
)


@dataclass
class Cycle:
    """Tokens committed by one target forward, with their log-probability rows."""

    tokens: list[int]
    logprobs: mx.array  # [len(tokens), V]
    drafted: int  # how many leading tokens were proposals the target accepted
    block_size: int  # block verified (0 for the prefill's first token)
    stopped: bool = False  # the last token is a stop token: generation ends here
    source: str = "target"  # what drafted it: "lookup" (the context), "dflash" (the proposer), "target" (none)

    @property
    def from_prefill(self) -> bool:
        return self.block_size == 0


@dataclass
class _Pending:
    """A queued draft + verify: its block size, verdict, processed rows, features and record.

    The verdict is the `Acceptor`'s `[accepted, t_0, ..., t_{b-1}]`, or `[t_0]` for b = 1 (a plain
    step, `Acceptor.next_token`: two ops on top of the forward, where mlx-lm's greedy step has three)."""

    block_size: int
    verdict: mx.array
    rows: mx.array
    features: mx.array | None
    record: VerifyRecord
    seconds: float | None  # building and queueing it (None: not its own cost, the prefill's too)
    chosen: bool = True  # the policy chose this block (not widened for a run the grammar forces)
    source: str = "target"  # "lookup", "dflash" or "target" (b = 1)


class _DrafterContext:
    """Target features of committed positions on their way to the proposer, in order.

    Rows are handed over at once, except those of b = 1 cycles, which wait
    (lazily) until a larger block needs the context or CONTEXT_BATCH gathered:
    one batched context update instead of one per token.
    """

    def __init__(self, proposer: Proposer | None):
        self.proposer = proposer if proposer is not None and proposer.layer_ids else None
        self._waiting: list[mx.array] = []
        self._rows = 0

    def add(self, features: mx.array | None, wait: bool = False) -> None:
        if self.proposer is None or features is None:
            return
        self._waiting.append(features)
        self._rows += features.shape[1]
        if not wait or self._rows >= CONTEXT_BATCH:
            self.flush()

    def flush(self) -> None:
        if self._waiting:
            w = self._waiting
            self.proposer.add_context(w[0] if len(w) == 1 else mx.concatenate(w, axis=1))
            self._waiting, self._rows = [], 0

    def state(self) -> list:
        return self.proposer.state() if self.proposer is not None else []


def speculative_cycles(
    target: TargetAdapter,
    prompt: mx.array,
    proposer: Proposer | None,
    *,
    max_tokens: int,
    block_size: int | BlockPolicy,
    prefill_step_size: int = 2048,
    prompt_progress: Callable[[int, int], None] | None = None,
    acceptor: Acceptor | None = None,
    stop_tokens: Collection[int] = (),
    session: Session | None = None,
    kv: KVQuantization | None = None,
    lookup: bool = False,
) -> Iterator[Cycle]:
    """Yield cycles until `max_tokens` tokens are committed (-1: no limit) or a stop token.

    The first cycle holds the token sampled from the prompt's last logits; each
    later cycle holds 1..b tokens, b chosen by `block_size` (an integer: that
    block every cycle; a `BlockPolicy`: its choice per cycle). A cycle
    containing one of `stop_tokens` ends there (the tokens after it are
    dropped and never reach the caches). `session` (made with this target and
    proposer) keeps the caches for the next call; only the prompt tokens it
    does not hold are prefilled. `lookup`: a cycle may verify a span copied from the context instead
    of the proposer's block (`policy.source`; with a proposer, not under a grammar). `kv` quantizes the
    KV caches as mlx-lm's `kv_bits` does (`targets.quantized_kv`: when mlx-lm would, and no verify
    crosses that point unquantized).
    """
    # duck-typed: isinstance() against a runtime-checkable Protocol is slow, and this runs every call
    policy = block_size if hasattr(block_size, "choose") else FixedBlock(block_size)
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
    context = _DrafterContext(proposer)
    looks_up = lookup and proposer is not None and acceptor.constraint is None
    index = session.lookup_index(prompt_ids) if looks_up else None
    sources = (
        None
        if index is None
        else LookupDrafting(policy, index, learns=acceptor.settings.greedy, shared=not acceptor.seeded)
    )

    def room(committed: int, position: int) -> int:
        """The widest block the next cycle may verify."""
        limit = policy.max_block if max_tokens < 0 else min(policy.max_block, max_tokens - committed)
        if kv is not None and (rows := kv.rows_allowed(position)) is not None:
            limit = min(limit, rows)
        return limit

    def choose(committed: int, position: int) -> int:
        return 1 if proposer is None else policy.choose(room(committed, position))

    def plan(committed: int, position: int) -> tuple[int, list[int] | None]:
        """The next cycle's block and lookup span (None: the proposer's block, or b = 1)."""
        if sources is None:
            return choose(committed, position), None
        return sources.choose(room(committed, position))

    def chainable() -> bool:
        """Whether the next cycle may be built before its anchor is read: not where a lookup may fire."""
        return chains and (sources is None or not sources.may_fire())

    def commit(tokens: list[int]) -> None:
        acceptor.commit(tokens)
        if index is not None:
            index.extend(tokens)

    queue: deque[_Pending] = deque()
    total = prompt.size

    def launch(anchor: mx.array, position: int, committed: int, b: int, span: list[int] | None = None) -> _Pending:
        """Queue one draft + verify of block b (wider where a grammar forces a longer run: free drafts), the
        drafts `span` when given (a lookup's: a point mass, q one-hot)."""
        began = time.perf_counter()
        drafts = draft_probs = None
        chosen = b
        if proposer is not None and acceptor.constraint is not None:
            b = max(b, acceptor.constraint.forced_block(room(committed, position)))
        if span:
            drafts = mx.array(span, mx.int32)
            verify_ids = mx.concatenate([anchor.reshape(1), drafts])
        elif b > 1:
            context.flush()
            proposal = acceptor.propose(proposer, anchor, position, b - 1)
            drafts, draft_probs = proposal.tokens, proposal.probs
            verify_ids = mx.concatenate([anchor.reshape(1), drafts])
        else:
            verify_ids = anchor.reshape(1)
        if kv is not None:
            kv.convert(cache)
        logits, features, record = target.verify(verify_ids[None], cache)
        rows = acceptor.process(logits[0], drafts)
        verdict = acceptor.verdict(rows, drafts, draft_probs) if b > 1 else acceptor.next_token(rows)
        mx.async_eval(verdict)
        source = "lookup" if span else "dflash" if b > 1 else "target"
        return _Pending(b, verdict, rows, features, record, time.perf_counter() - began, b == chosen, source)

    settled = False

    def settle() -> None:
        """Keep only what was committed: undo the queued verify but for its anchor (the consumer stopped
        early, or the session is wanted by something else while this generation is open)."""
        nonlocal settled
        if settled:
            return
        settled = True
        context.flush()
        if queue:
            pending = queue.popleft()
            session.keep_anchor_only(pending.record, anchor_id, pending.features if context.proposer else None)
            queue.clear()

    session.opened(settle)

    def undo_chained() -> None:
        """Undo whole the cycles built on a token that turned out to be a stop token (`chains`: the
        caches can)."""
        while queue:
            rollback(cache, queue.pop().record, keep=0)

    try:
        logits = _prefill(target, prompt, done, cache, context, prefill_step_size, progress, kv)
        row = acceptor.process(logits[0, -1:])
        logprobs = log_softmax(row)
        anchor = acceptor.next_token(row)
        committed, position = 1, total
        # The prefill leaves the drafter's ingestion of the prompt lazy (`Proposer.state`): it runs with the
        # prompt's last row when the first cycle drafts, and waits for a block that needs it when that
        # cycle is a plain step (a drafter at b = 1 through the whole reply never runs it).
        # b = 1 steps are chained on the lazy token when nothing needs it on the host first
        # (logits processors read the history, a grammar follows it, a lookup may draft after it) and the
        # caches can undo a step past a stop token.
        chains = acceptor.raw_logits and all(undoes_single_row(c) for c in cache)
        early = chainable()  # (asked once: a lookup counts the matches it passes by)
        planned = None  # the first cycle's (block, span) when chosen before its anchor is read
        if committed != max_tokens and (sources is None or early):
            planned = (choose(committed, position), None)
        mx.async_eval(anchor, context.state() if planned and planned[0] > 1 else [])  # log-probabilities stay lazy
        session.prefilled(prompt_ids)  # before a verify updates the caches (its checkpoint copies the state)

        # The first cycle is queued before the first token is handed out, as mlx-lm queues its second
        # step, and built on the lazy token (its graph built while the prompt's last row computes) when
        # the caches can undo it should that token be a stop token.
        if early and planned:
            queue.append(launch(anchor, position, committed, *planned))
        anchor_id = anchor.item()
        progress(total, total)
        commit([anchor_id])
        stopped = anchor_id in stop_tokens
        if stopped:
            undo_chained()
        elif not queue and committed != max_tokens:
            queue.append(launch(anchor, position, committed, *(planned or plan(committed, position))))
        if queue:  # (its cost is not the block's alone: chained, its queueing waited for the prefill)
            queue[0].seconds = None
        first = Cycle(tokens=[anchor_id], logprobs=logprobs, drafted=0, block_size=0, stopped=stopped)
        yield first
        if settled:
            raise RuntimeError(SUPERSEDED)
        while queue:
            queued = queue.popleft()
            if queued.block_size == 1:
                context.add(queued.features, wait=True)  # its one row is the anchor, committed
            remaining = max_tokens < 0 or committed + 1 < max_tokens
            if queued.block_size == 1 and remaining and not queue and chainable():
                # a b = 1 cycle commits exactly one token: the next cycle (any block) can be built on it unread
                queue.append(launch(queued.verdict, position + 1, committed + 1, choose(committed + 1, position + 1)))
            waited = time.perf_counter()
            values = queued.verdict.tolist()
            if queued.block_size > 1:
                accepted = values[0]
                tokens = values[1 : accepted + 2]
            else:  # a plain step's verdict is its token alone
                accepted, tokens = 0, values
            stop = next((i for i, t in enumerate(tokens) if t in stop_tokens), None)
            if stop is not None:
                tokens = tokens[: stop + 1]
                undo_chained()
            kept = len(tokens)  # rows kept: the anchor and the accepted drafts before the last token
            lookup_cycle = queued.source == "lookup"
            if queued.block_size > 1:
                rollback(cache, queued.record, keep=kept)  # (a lookup cycle's rows wait, as plain steps' do)
                context.add(queued.features[:, :kept] if queued.features is not None else None, wait=lookup_cycle)
            session.fed([anchor_id] + tokens[:-1])
            commit(tokens)
            # the cycle's cost on the engine's side: building and queueing it, waiting for its verdict
            # and taking it in (not the caller's work while the generator is suspended, nor the launch
            # of a cycle queued before this one was read, which is that cycle's)
            seconds = None if queued.seconds is None else queued.seconds + time.perf_counter() - waited
            if lookup_cycle:
                sources.observe(queued.block_size, accepted if stop is None else None, seconds)
            elif queued.chosen:
                policy.observe(queued.block_size, accepted if stop is None else None, seconds)
            committed += len(tokens)
            position += len(tokens)
            anchor_id = tokens[-1]
            if not queue and stop is None and (committed < max_tokens or max_tokens < 0):
                queue.append(launch(mx.array([anchor_id], mx.int32), position, committed, *plan(committed, position)))
            # Log-probabilities stay lazy: only a caller that reads them pays for them.
            logprobs = log_softmax(queued.rows[:kept])
            yield Cycle(
                tokens=tokens,
                logprobs=logprobs,
                drafted=min(accepted, kept),
                block_size=queued.block_size,
                stopped=stop is not None,
                source=queued.source,
            )
            if settled:
                raise RuntimeError(SUPERSEDED)
    except GeneratorExit:  # the consumer stopped early (below)
        raise
    except BaseException:  # raised in here (a progress callback, a logits processor, Ctrl-C): the caches
        if not settled:  # may hold rows past what the session records (a prefill chunk, a verify)
            settled = True
            queue.clear()
            context.flush()
            session.abandon()
        raise
    finally:
        settle()
        session.closed(settle)


def _prefill(target, prompt, done, cache, context, step, progress, kv) -> mx.array:
    """Feed the prompt from `done` on exactly as mlx-lm does (chunks of all but the last token, each
    evaluated, then the last, left lazy; `kv` quantizing between them); return the last forward's logits."""
    total = prompt.size
    progress(done, total)
    while total - done > 1:
        n = min(step, total - done - 1)
        if kv is not None:
            kv.convert(cache)
        _, features = target.forward(prompt[None, done : done + n], cache, logits=False)
        context.add(features)
        mx.eval([c.state for c in cache if c is not None], context.state())
        done += n
        progress(done, total)
        mx.clear_cache()
    if kv is not None:
        kv.convert(cache)
    logits, features = target.forward(prompt[None, done:], cache)
    context.add(features)
    return logits
