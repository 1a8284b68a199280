"""The speculative loop for one request: prefill, then draft -> verify -> accept -> roll back.

`speculative_cycles` yields `Cycle`s (the tokens one target forward
committed), with no I/O and no detokenizing; a cycle holding a stop token ends
the generation. A `SpeculativeLoop` runs it in named steps: `prefill`,
`first_cycle` (the prompt's token), `launch` (draft and queue a verify),
`take` (read a verdict, roll back, commit) and `settle`. What each cycle
drafts and how wide is the `planner.CyclePlanner`'s, the one place this loop
and the batched one (`batch.engine`) ask; its block policy decides.

Acceptance is computed on the device and the next cycle's graph is queued
with `mx.async_eval` before the current cycle is handed out, so there is one
host sync per cycle (the first cycle is queued before the prefill's token is
handed out, as mlx-lm queues its second step). b = 1 is plain decoding, and
the cycle after a b = 1 cycle or after the prefill (of any block) is
pipelined like mlx-lm's `generate_step` (built on the lazy token before that
token is read) where the caches can undo it whole should the token be a stop
token and no span source wants the token first. At b = 1 and in span cycles
the drafter's context still receives every committed position, batched and
left lazy until a drafted block needs it. What a verify commits (greedy or
exact sampling, logits processors) is the `Acceptor`'s. The policy is told
each cycle's cost on the engine's side: its launch, the wait for its verdict
and taking it in, not the caller's work while the generator is suspended nor
the launch of a cycle pipelined after it. Log-probabilities are left lazy (a
full-vocabulary log-softmax over every verified row is a sizeable share of a
verify on a CPU). An exception raised inside the loop (a progress callback
cancelling, a logits processor, Ctrl-C) hands the session back holding only
what it records (`Session.abandon`), and a generation left open is settled
when its session is used again (`Session.opened`): a verify's rows never stay
in the caches unrecorded.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection, Iterator

import mlx.core as mx

from .acceptance import Acceptor
from .planner import CyclePlanner, Plan
from .policy.base import BlockPolicy, FixedBlock
from .proposers.base import Proposer
from .sampling import SamplingSettings, log_softmax
from .session import Session
from .targets.adapter import TargetAdapter
from .targets.quantized_kv import KVQuantization
from .targets.rollback import VerifyRecord, rollback, undoes_single_row

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
    source: str = "target"  # what drafted its accepted drafts: a source's name, "target" for none

    @property
    def from_prefill(self) -> bool:
        return self.block_size == 0


@dataclass
class _Pending:
    """A queued draft + verify: its plan, verdict, processed rows, features and record.

    The verdict is the `Acceptor`'s `[accepted, t_0, ..., t_{b-1}]`, or `[t_0]` for b = 1 (a plain
    step, `Acceptor.next_token`: two ops on top of the forward, where mlx-lm's greedy step has three)."""

    plan: Plan
    verdict: mx.array
    rows: mx.array
    features: mx.array | None
    record: VerifyRecord
    seconds: float | None  # building and queueing it (None: not its own cost, the prefill's too)


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
    suffix=None,
) -> Iterator[Cycle]:
    """Yield cycles until `max_tokens` tokens are committed (-1: no limit) or a stop token.

    The first cycle holds the token sampled from the prompt's last logits; each
    later cycle holds 1..b tokens, b chosen by `block_size` (an integer: that
    block every cycle; a `BlockPolicy`: its choice per cycle). A cycle
    containing one of `stop_tokens` ends there (the tokens after it are
    dropped and never reach the caches). `session` (made with this target and
    proposer) keeps the caches for the next call; only the prompt tokens it
    does not hold are prefilled. `lookup`: a cycle may verify a span copied from the context instead
    of the proposer's block (with a proposer, not under a grammar); so may a span from `suffix` (a
    `proposers.suffix.SuffixIndex`: what earlier generations produced; it records this one). `kv`
    quantizes the KV caches as mlx-lm's `kv_bits` does (`targets.quantized_kv`: when mlx-lm would, and
    no verify crosses that point unquantized).
    """
    loop = SpeculativeLoop(
        target,
        prompt,
        proposer,
        max_tokens=max_tokens,
        block_size=block_size,
        prefill_step_size=prefill_step_size,
        prompt_progress=prompt_progress,
        acceptor=acceptor,
        stop_tokens=stop_tokens,
        session=session,
        kv=kv,
        lookup=lookup,
        suffix=suffix,
    )
    yield from loop.cycles()


class SpeculativeLoop:
    """One generation's loop state and its steps (see the module docstring)."""

    def __init__(
        self,
        target,
        prompt,
        proposer,
        *,
        max_tokens,
        block_size,
        prefill_step_size,
        prompt_progress,
        acceptor,
        stop_tokens,
        session,
        kv,
        lookup,
        suffix=None,
    ):
        # duck-typed: isinstance() against a runtime-checkable Protocol is slow, and this runs every call
        policy = block_size if hasattr(block_size, "choose") else FixedBlock(block_size)
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}.")
        if session is None:
            session = Session(target, proposer)
        elif session.target is not target or session.proposer is not proposer:
            raise ValueError("The session was made for another target or proposer.")
        self.target, self.prompt, self.session, self.kv = target, prompt, session, kv
        self.max_tokens, self.prefill_step_size = max_tokens, prefill_step_size
        self.progress = prompt_progress or (lambda done, total: None)
        self.acceptor = acceptor = acceptor or Acceptor(SamplingSettings(), prompt)
        self.stop_tokens = frozenset(stop_tokens)
        self.prompt_ids = prompt.tolist()
        self.done = session.begin(self.prompt_ids)
        self.cache = session.cache
        spans = session.span_sources(self.prompt_ids, acceptor, lookup=lookup, suffix=suffix)
        self.planner = CyclePlanner(policy, proposer, acceptor, max_tokens=max_tokens, kv=kv, spans=spans)
        self.queue: deque[_Pending] = deque()
        self.settled = False
        self.chains = False  # plain steps may be built on their token unread (set after the prefill)
        self.committed = self.position = self.anchor_id = 0

    # -- the generator ----------------------------------------------------------------------------

    def cycles(self) -> Iterator[Cycle]:
        self.session.opened(self.settle)
        try:
            yield self.first_cycle()
            self._check_open()
            while self.queue:
                yield self.take(self.queue.popleft())
                self._check_open()
        except GeneratorExit:  # the consumer stopped early (below)
            raise
        except BaseException:  # raised in here (a progress callback, a logits processor, Ctrl-C): the caches
            if not self.settled:  # may hold rows past what the session records (a prefill chunk, a verify)
                self.settled = True
                self.queue.clear()
                self.planner.context.flush()
                self.session.abandon()
            raise
        finally:
            self.settle()
            self.session.closed(self.settle)

    def _check_open(self) -> None:
        if self.settled:
            raise RuntimeError(SUPERSEDED)

    def chainable(self) -> bool:
        """Whether the next cycle may be built before its anchor is read: not where a span may follow."""
        return self.chains and not self.planner.reads_anchor()

    # -- the steps --------------------------------------------------------------------------------

    def prefill(self) -> mx.array:
        """Feed the prompt from what the session held on exactly as mlx-lm does (chunks of all but the
        last token, each evaluated, then the last, left lazy; `kv` quantizing between them); return the
        last forward's logits."""
        prompt, cache, kv, planner = self.prompt, self.cache, self.kv, self.planner
        done, total = self.done, prompt.size
        self.progress(done, total)
        while total - done > 1:
            n = min(self.prefill_step_size, total - done - 1)
            if kv is not None:
                kv.convert(cache)
            _, features = self.target.forward(prompt[None, done : done + n], cache, logits=False)
            planner.feed(features)
            mx.eval([c.state for c in cache if c is not None], planner.context.state())
            done += n
            self.progress(done, total)
            mx.clear_cache()
        if kv is not None:
            kv.convert(cache)
        logits, features = self.target.forward(prompt[None, done:], cache)
        planner.feed(features)
        return logits

    def first_cycle(self) -> Cycle:
        """The prefill and the token after the prompt, with the first cycle queued behind it.

        The prefill leaves the drafter's ingestion of the prompt lazy (`Proposer.state`): it runs with the
        prompt's last row when the first cycle drafts, and waits for a block that needs it when that cycle
        is a plain step. The first cycle is queued before the first token is handed out, as mlx-lm queues
        its second step, and built on the lazy token (its graph built while the prompt's last row
        computes) where the caches can undo it should that token be a stop token and no span source
        wants the token first (logits processors read the history, a grammar follows it)."""
        acceptor, planner, total = self.acceptor, self.planner, self.prompt.size
        row = acceptor.process(self.prefill()[0, -1:])
        logprobs = log_softmax(row)
        anchor = acceptor.next_token(row, total - 1)
        self.committed, self.position = 1, total
        self.chains = acceptor.raw_logits and all(undoes_single_row(c) for c in self.cache)
        early = self.chainable()  # (asked once: a span source counts the matches it passes by)
        planned = None  # the first cycle's plan when chosen before its anchor is read
        if self.committed != self.max_tokens and (not planner.reads_text or early):
            planned = planner.plan_unread(self.committed, self.position)
        mx.async_eval(anchor, planner.context.state() if planned and planned.width > 1 else [])
        self.session.prefilled(self.prompt_ids)  # before a verify updates the caches (its checkpoint copies them)
        if early and planned:
            self.queue.append(self.launch(anchor, self.position, self.committed, planned))
        self.anchor_id = anchor_id = anchor.item()
        self.progress(total, total)
        planner.commit([anchor_id])
        stopped = anchor_id in self.stop_tokens
        if stopped:
            self._undo_chained()
        elif not self.queue and self.committed != self.max_tokens:
            plan = planned or planner.plan(self.committed, self.position)
            self.queue.append(self.launch(anchor, self.position, self.committed, plan))
        if self.queue:  # (its cost is not the block's alone: chained, its queueing waited for the prefill)
            self.queue[0].seconds = None
        return Cycle(tokens=[anchor_id], logprobs=logprobs, drafted=0, block_size=0, stopped=stopped)

    def launch(self, anchor: mx.array, position: int, committed: int, plan: Plan) -> _Pending:
        """Draft and queue one verify of `plan` (widened where a grammar forces a longer run)."""
        began = time.perf_counter()
        acceptor, planner = self.acceptor, self.planner
        plan = planner.widened(plan, committed, position)
        proposal = planner.draft(plan, anchor, position)
        drafts = draft_probs = None
        if proposal is not None:
            drafts, draft_probs = proposal.tokens, proposal.probs
            verify_ids = mx.concatenate([anchor.reshape(1), drafts])
        else:
            verify_ids = anchor.reshape(1)
        if self.kv is not None:
            self.kv.convert(self.cache)
        logits, features, record = self.target.verify(verify_ids[None], self.cache)
        rows = acceptor.process(logits[0], drafts)
        if plan.width > 1:
            verdict = acceptor.verdict(rows, drafts, draft_probs, position)
        else:
            verdict = acceptor.next_token(rows, position)
        mx.async_eval(verdict)
        return _Pending(plan, verdict, rows, features, record, time.perf_counter() - began)

    def take(self, queued: _Pending) -> Cycle:
        """Read a queued verdict (chaining the next plain step first where it may), keep what it
        committed, and queue the next cycle."""
        planner, width = self.planner, queued.plan.width
        if width == 1:
            planner.feed(queued.features, wait=True)  # its one row is the anchor, committed
            remaining = self.max_tokens < 0 or self.committed + 1 < self.max_tokens
            if remaining and not self.queue and self.chainable():
                # a b = 1 cycle commits exactly one token: the next cycle (any block) can be built on it unread
                c, p = self.committed + 1, self.position + 1
                self.queue.append(self.launch(queued.verdict, p, c, planner.plan_unread(c, p)))
        waited = time.perf_counter()
        values = queued.verdict.tolist()
        accepted, tokens = (values[0], values[1 : values[0] + 2]) if width > 1 else (0, values)
        stop = next((i for i, t in enumerate(tokens) if t in self.stop_tokens), None)
        if stop is not None:
            tokens = tokens[: stop + 1]
            self._undo_chained()
        kept = len(tokens)  # rows kept: the anchor and the accepted drafts before the last token
        if width > 1:
            rollback(self.cache, queued.record, keep=kept)
            features = queued.features[:, :kept] if queued.features is not None else None
            planner.feed(features, wait=queued.plan.spans)  # (a span cycle's rows wait, as plain steps' do)
        self.session.fed([self.anchor_id] + tokens[:-1])
        planner.commit(tokens)
        # the cycle's cost on the engine's side: building and queueing it, waiting for its verdict and taking
        # it in (not the caller's work while the generator is suspended, nor the launch of a cycle queued
        # before this one was read, which is that cycle's)
        seconds = None if queued.seconds is None else queued.seconds + time.perf_counter() - waited
        planner.observe(queued.plan, accepted if stop is None else None, seconds)
        self.committed += len(tokens)
        self.position += len(tokens)
        self.anchor_id = tokens[-1]
        more = self.committed < self.max_tokens or self.max_tokens < 0
        if not self.queue and stop is None and more:
            plan = planner.plan(self.committed, self.position)
            self.queue.append(self.launch(mx.array([self.anchor_id], mx.int32), self.position, self.committed, plan))
        source = queued.plan.name if width > 1 else "target"
        # Log-probabilities stay lazy: only a caller that reads them pays for them.
        logprobs = log_softmax(queued.rows[:kept])
        return Cycle(tokens, logprobs, min(accepted, kept), width, stop is not None, source)

    def settle(self) -> None:
        """Keep only what was committed: undo the queued verify but for its anchor (the consumer stopped
        early, or the session is wanted by something else while this generation is open)."""
        if self.settled:
            return
        self.settled = True
        context = self.planner.context
        context.flush()
        if self.queue:
            pending = self.queue.popleft()
            features = pending.features if context.proposer else None
            self.session.keep_anchor_only(pending.record, self.anchor_id, features)
            self.queue.clear()

    def _undo_chained(self) -> None:
        """Undo whole the cycles built on a token that turned out to be a stop token (`chains`: the caches
        can)."""
        while self.queue:
            rollback(self.cache, self.queue.pop().record, keep=0)
