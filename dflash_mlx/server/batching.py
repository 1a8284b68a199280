"""Serving concurrent requests together: the worker's loop over a `batch.engine.BatchDecoder`.

With ``--decode-concurrency N`` (N > 1) the generation worker runs this loop
instead of serving one request at a time. Up to N requests decode as rows of
one batch: each step drafts every row's block in one drafter forward and
verifies all rows in one target forward (the block chosen for the batch,
plain batched decoding included, unless the server fixes it; a request's
``num_draft_tokens`` caps its own row). Each request keeps what it has when
served alone: its session from the prompt cache (taken when it joins, put
back when it leaves), its sampler settings, processors, seed and grammar, its stop
sequences (`stops.StopText`), logprobs and cancellation (a request whose
client went away leaves the batch at the next step, or between its prompt's
prefill chunks; its session, holding what it computed, goes back to the prompt
cache). Its output is what it would be served alone.

Between steps the loop takes new requests off the queue (prepared in their
handlers' threads: `prompts`). A prompt longer than one prefill chunk
(``--prefill-step-size``) is prefilled a chunk per step (at the chunk
boundaries the single-request engine uses), so it does not stall the rows
already decoding; fresh short prompts join together in one padded prefill. A
request joins only when its caches fit in the worker's byte budget
(`budget`) beside the active rows and what the server keeps (the new row: its
prompt plus max_tokens, at the worker's `limits.Footprint`; the least recently
used of the prompt cache, stored responses and grammars are evicted first);
else it waits for a row to leave. (One that could not fit even alone was
refused by `prompts`.)

Failures stay where they happen: an exception in one request's own stage
(admitting it, its own prefill, handing out its tokens, filing its session)
ends that request, answered by its cause as in the one-at-a-time worker
(`events.failure`: a grammar that fails mid-output is its 400, in the decoder
too, where it ends that row alone), and leaves the other rows decoding; one in
a forward rows share (a joint prefill, the batch's verify) fails the requests
in it with 500; the loop then goes on with the rest.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ..acceptance import Acceptor
from ..batch.generate import RowStream, batch_decoder
from ..sampling import SamplingSettings
from ..session import Session
from ..stats import RunStats
from .errors import RequestError
from .events import CANCELLED, GENERATION_ERRORS, Failed, Finished, Started, Token, dflash_object, failure
from .stops import StopText


@dataclass
class _Row:
    """One request in (or about to join) the batch."""

    job: object  # worker.Job
    prompt: list[int]
    session: Session
    acceptor: Acceptor
    max_tokens: int
    max_block: int | None
    stats: RunStats
    stopper: StopText
    stream: RowStream | None = None
    cached: int = 0  # prompt tokens its session held when it was taken from the prompt cache
    state: str = "normal"  # the reply's first channel (`prompts.Prepared`)
    uid: int | None = None
    widest: int = 1  # the most rows it shared a step with (itself included)


class BatchedServing:
    """The batched loop of one `worker.GenerationWorker` (its queue, prompt cache and events)."""

    def __init__(self, worker, concurrency: int, *, prefill_step_size: int = 2048):
        if concurrency < 1:
            raise ValueError(f"decode_concurrency must be >= 1, got {concurrency}.")
        self.worker, self.concurrency, self.prefill_step_size = worker, concurrency, prefill_step_size
        self.decoder = None
        self.rows: dict[int, _Row] = {}  # uid -> row in the decoder
        self.waiting: list[_Row] = []  # admitted, not yet in the decoder (prefilling or waiting for room)

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve until the worker's queue yields its end (None); active requests are finished first."""
        stopping = False
        while True:
            idle = not self.rows and not self.waiting
            if stopping and idle:
                return
            try:
                while len(self.rows) + len(self.waiting) < self.concurrency and not stopping:
                    job = self.worker.next_job(wait=idle)
                    idle = False
                    if job is None:
                        stopping = True
                    else:
                        self._admit(job)
            except queue.Empty:
                pass
            self._drop_cancelled()
            self._prefill_chunk()
            self._join()
            self._step()

    def abort(self, message: str) -> None:
        """Fail every request in the loop (its state is unknown after an unexpected fault) and start
        with a new decoder."""
        for row in [*self.rows.values(), *self.waiting]:
            self._fail(row, Failed(500, message))
        self.rows, self.waiting, self.decoder = {}, [], None

    def _admit(self, job) -> None:
        worker = self.worker
        if worker.stopping:
            job.events.put(Failed(503, "the server is shutting down"))
            return
        worker.running(job, True)
        try:
            self.waiting.append(self._row(job))
        except Exception as e:
            if not isinstance(e, (*GENERATION_ERRORS, RequestError)):
                logging.exception("Admitting a request failed")
            job.events.put(failure(e, job.request))
            worker.running(job, False)

    def _row(self, job) -> _Row:
        """The job's row (prepared in its handler's thread, else here)."""
        worker, req = self.worker, job.request
        prepared = job.prepared or worker.prepare(req)
        prompt, max_tokens, grammar = prepared.prompt, prepared.max_tokens, prepared.grammar
        max_block = None if req.num_draft_tokens is None else req.num_draft_tokens + 1
        adaptive = worker.adaptive and max_block is None
        block = max_block or worker.block_size
        settings = SamplingSettings(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p)
        xtc = (req.xtc_probability, req.xtc_threshold, sorted(worker.tokenizer.eos_token_ids))
        acceptor = Acceptor(
            settings,
            mx.array(prompt, mx.int32),
            make_logits_processors(**req.processors) or None,
            req.seed,
            xtc=xtc if req.xtc_probability else None,
            constraint=grammar.constraint() if grammar else None,
        )
        session = worker.sessions.take(prompt)
        stats = RunStats(block_size=block, adaptive=adaptive)
        return _Row(
            job,
            prompt,
            session,
            acceptor,
            max_tokens,
            max_block,
            stats,
            StopText(req.stop),
            cached=session.usable_prefix(prompt),
            state=prepared.state,
        )

    # -- joining ----------------------------------------------------------------------------------

    def _prefill_chunk(self) -> None:
        """One chunk of the first waiting prompt that needs more than one (so a cancelled request leaves
        between chunks, and the others decode on)."""
        for row in self.waiting:
            if self._needs_chunks(row):
                if not self._fits(row):
                    return
                held = row.session.usable_prefix(row.prompt)
                try:
                    row.session.hold(row.prompt[: held + self.prefill_step_size])
                except Exception as e:
                    self.waiting.remove(row)
                    self._fail(row, failure(e, row.job.request))
                return

    def _needs_chunks(self, row: _Row) -> bool:
        """Whether the rest of the row's prompt takes more than one prefill chunk (as the engine
        prefills: all but the last token in chunks, then the last)."""
        return len(row.prompt) - row.session.usable_prefix(row.prompt) - 1 > self.prefill_step_size

    def _join(self) -> None:
        ready = []
        for row in list(self.waiting):
            if self._needs_chunks(row) or not self._fits(row, ready):
                continue
            ready.append(row)
            self.waiting.remove(row)
        if not ready:
            return
        if self.decoder is None:
            try:
                self.decoder = batch_decoder(ready[0].session, None if self.worker.adaptive else self.worker.block_size)
            except Exception as e:
                for row in ready:
                    self._fail(row, _server_failure(e))
                return
        # Fresh short prompts are prefilled together (one forward they share), the others alone: a
        # failure fails the requests of its own forward only (the decoder's rows are untouched until
        # a prefill has succeeded).
        step = self.prefill_step_size
        together = [r for r in ready if self.decoder.prefills_together(r.session, len(r.prompt), step)]
        groups = [together] if len(together) > 1 else []
        groups += [[r] for r in ready if len(together) < 2 or r not in together]
        for group in groups:
            self._insert(group)

    def _insert(self, group: list[_Row]) -> None:
        requests = [
            (r.session, mx.array(r.prompt, mx.int32), r.acceptor, r.max_tokens, r.max_block, r.job.request.lookup)
            for r in group
        ]
        for row in group:
            row.stats.begin()
        try:
            firsts = self.decoder.insert_many(
                requests, stop_tokens=self.worker.tokenizer.eos_token_ids, prefill_step_size=self.prefill_step_size
            )
        except Exception as e:
            logging.exception("Prefilling %d request(s) failed", len(group))
            for row in group:  # (a forward several requests shared fails them all: the server's fault)
                self._fail(row, failure(e, row.job.request) if len(group) == 1 else _server_failure(e))
            for orphan in [r.uid for r in self.decoder.rows if r.uid not in self.rows]:  # joined before the fault
                self.decoder.remove(orphan)
            return
        for row, first in zip(group, firsts):
            row.uid = first.uid
            self.rows[first.uid] = row
        for row, first in zip(group, firsts):
            if self.rows.get(row.uid) is row:  # (not failed by a sibling's delivery)
                self._guarded(row, self._start, row, first)

    def _start(self, row: _Row, first) -> None:
        tokenizer = self.worker.tokenizer
        row.stream = RowStream(tokenizer, len(row.prompt))
        row.job.events.put(Started(len(row.prompt), row.cached, row.state))
        self._deliver(row, first)

    def _fits(self, row: _Row, joining: list | None = None) -> bool:
        """Whether the row's caches fit beside the others' in the byte budget (the least recently used
        of what the server keeps are evicted to make room)."""
        worker = self.worker
        new = [row, *(joining or [])]
        wanted = sum(worker.footprint.bytes(len(r.prompt) + max(r.max_tokens, 0)) for r in new)
        self._count_active()
        return worker.budget.make_room(wanted) or not (self.rows or joining)  # (alone, it fit: `prompts`)

    def _count_active(self) -> None:
        self.worker.active.nbytes = sum(r.session.nbytes for r in self.rows.values())

    # -- decoding ---------------------------------------------------------------------------------

    def _step(self) -> None:
        if not self.rows:
            return
        try:
            steps = self.decoder.step()
        except Exception as e:  # the batch's verify: every row in it fails, the loop goes on
            logging.exception("Batched generation failed")
            for row in list(self.rows.values()):
                self._fail(row, _server_failure(e))
            self.decoder = None  # its caches are unsound: a new decoder for the next requests
            return
        width = len(steps)
        for step in steps:
            row = self.rows.get(step.uid)
            if row is not None:
                row.widest = max(row.widest, width)
                self._guarded(row, self._deliver, row, step)

    def _guarded(self, row: _Row, stage, *args) -> None:
        """Run one request's own stage; an exception in it fails that request alone."""
        try:
            stage(*args)
        except Exception as e:
            logging.exception("A request failed while its tokens were handed out")
            if self.decoder is not None and row.uid is not None:
                self.decoder.remove(row.uid)
            self._fail(row, failure(e, row.job.request))

    def _deliver(self, row: _Row, step) -> None:
        """Hand a step's tokens to the row's client; finish the row when it stops."""
        put, req, worker = row.job.events.put, row.job.request, self.worker
        if step.fault is not None:  # its grammar failed: the decoder has let the row go
            self._fail(row, failure(step.fault, req))
            return
        finish = None
        for r in row.stream.responses(step):
            row.stats.add(r)
            put(worker.token_event(r, row.stopper.feed(r.text), req.logprobs, req.top_logprobs))
            if row.stopper.stopped:
                finish = "stop"
                break
            if r.finish_reason:
                finish = r.finish_reason
                break
        if finish is None:
            return
        if step.finish is None:  # a stop sequence: the decoder still has the row
            self.decoder.remove(row.uid)
        tail = row.stopper.flush()
        if tail:
            put(Token(tail, None))
        dflash = dflash_object(row.stats) if worker.draft is not None else {}
        dflash = {**dflash, "batch_rows": row.widest} if dflash else {}
        self._leave(row, Finished(finish, row.stats.tokens, dflash, row.stopper.matched))

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.rows.values() if r.job.cancelled]:
            self.decoder.remove(row.uid)
            self._leave(row, Failed(503, CANCELLED))
            self.worker.count_cancelled()
        for row in [r for r in self.waiting if r.job.cancelled]:
            self.waiting.remove(row)
            self._leave(row, Failed(503, CANCELLED))  # (its prompt chunks so far are kept)
            self.worker.count_cancelled()

    def _leave(self, row: _Row, end) -> None:
        self.rows.pop(row.uid, None)
        row.job.events.put(end)
        self.worker.running(row.job, False)
        self.worker.file_session(row.session)  # (after the reply: writing it to disk never delays the client)
        self._count_active()

    def _fail(self, row: _Row, end: Failed) -> None:
        """End the row's request with `end`; its session is dropped (its caches may be unsound)."""
        self.rows.pop(row.uid, None)
        row.job.events.put(end)
        self.worker.running(row.job, False)
        self._count_active()


def _server_failure(e: Exception) -> Failed:
    """A fault in a forward several requests shared: each one's 500."""
    return Failed(500, f"generation failed: {type(e).__name__}: {e}")
