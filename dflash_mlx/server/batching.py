"""Serving concurrent requests together: the worker's loop over a `batch.engine.BatchDecoder`.

With ``--decode-concurrency N`` (N > 1) the generation worker runs this loop
instead of serving one request at a time. Up to N requests decode as rows of
one batch: each step drafts every row's block in one drafter forward and
verifies all rows in one target forward (the block chosen for the batch,
plain batched decoding included, unless the server fixes it; a request's
``num_draft_tokens`` caps its own row). Each request keeps what it has when
served alone: its session from the prompt cache (taken when it joins, put
back when it leaves), its sampler settings, processors and seed, its stop
sequences (`stops.StopText`), logprobs and cancellation (a request whose
client went away leaves the batch at the next step). Its output is what it
would be served alone.

Between steps the loop takes new requests off the queue. A prompt longer
than one prefill chunk (``--prefill-step-size``) is prefilled a chunk per
step (at the chunk boundaries the single-request engine uses), so it does
not stall the rows already decoding; fresh short prompts join together in
one padded prefill. A request joins only when its caches fit: the active
rows, the prompt cache and the new row (its prompt plus max_tokens, at the
bytes per token measured so far) must stay under `max_batch_bytes`; else it
waits for a row to leave (the prompt cache is trimmed first). A request
alone always runs.
"""

from __future__ import annotations

import logging
import os
import queue
from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_logits_processors

from ..acceptance import Acceptor
from ..batch.generate import RowStream, batch_decoder
from ..sampling import SamplingSettings
from ..session import Session
from ..stats import RunStats
from .channels import initial_state
from .events import GENERATION_ERRORS, Failed, Finished, Started, Token, dflash_object
from .stops import StopText

CANCELLED = "the request was cancelled (the client went away or the server is stopping)"


def default_batch_bytes() -> int:
    """Three quarters of the device's memory (Metal's recommended working set, else the RAM)."""
    info = mx.device_info()
    size = info.get("max_recommended_working_set_size") or info.get("memory_size")
    if not size:
        try:
            size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            size = 16 << 30
    return int(size) * 3 // 4


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
    uid: int | None = None
    widest: int = 1  # the most rows it shared a step with (itself included)


class BatchedServing:
    """The batched loop of one `worker.GenerationWorker` (its queue, prompt cache and events)."""

    def __init__(self, worker, concurrency: int, *, prefill_step_size: int = 2048, max_bytes: int | None = None):
        if concurrency < 1:
            raise ValueError(f"decode_concurrency must be >= 1, got {concurrency}.")
        self.worker, self.concurrency, self.prefill_step_size = worker, concurrency, prefill_step_size
        self.max_bytes = max_bytes if max_bytes is not None else default_batch_bytes()
        self.weights = sum(a.nbytes for _, a in tree_flatten(worker.model.parameters()))
        if worker.draft is not None and hasattr(worker.draft, "parameters"):
            self.weights += sum(a.nbytes for _, a in tree_flatten(worker.draft.parameters()))
        self.decoder = None
        self.rows: dict[int, _Row] = {}  # uid -> row in the decoder
        self.waiting: list[_Row] = []  # admitted, not yet in the decoder (prefilling or waiting for room)
        self.bytes_per_token: float | None = None

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

    def _admit(self, job) -> None:
        worker = self.worker
        if worker.stopping:
            job.events.put(Failed(503, "the server is shutting down"))
            return
        worker.running(job, True)
        planned = worker.prepare(job)
        if planned is None:
            worker.running(job, False)
            return
        prompt, max_tokens = planned
        req = job.request
        max_block = None if req.num_draft_tokens is None else req.num_draft_tokens + 1
        adaptive = worker.adaptive and max_block is None
        block = max_block or worker.block_size
        settings = SamplingSettings(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p)
        xtc = (req.xtc_probability, req.xtc_threshold, sorted(worker.tokenizer.eos_token_ids))
        acceptor = Acceptor(settings, mx.array(prompt, mx.int32), make_logits_processors(**req.processors) or None,
                            req.seed, xtc=xtc if req.xtc_probability else None)  # fmt: skip
        session = worker.sessions.take(prompt)
        self.waiting.append(_Row(job, prompt, session, acceptor, max_tokens, max_block,
                                 RunStats(block_size=block, adaptive=adaptive), StopText(req.stop),
                                 cached=session.usable_prefix(prompt)))  # fmt: skip

    # -- joining ----------------------------------------------------------------------------------

    def _prefill_chunk(self) -> None:
        """One chunk of the first waiting prompt that needs more than one (only while others decode)."""
        if not self.rows:
            return
        for row in self.waiting:
            if self._needs_chunks(row):
                if not self._fits(row):
                    return
                held = row.session.usable_prefix(row.prompt)
                try:
                    row.session.hold(row.prompt[: held + self.prefill_step_size])
                except GENERATION_ERRORS as e:
                    self._fail(row, f"generation failed: {type(e).__name__}: {e}")
                    self.waiting.remove(row)
                return

    def _needs_chunks(self, row: _Row) -> bool:
        """Whether the rest of the row's prompt takes more than one prefill chunk (as the engine
        prefills: all but the last token in chunks, then the last)."""
        return len(row.prompt) - row.session.usable_prefix(row.prompt) - 1 > self.prefill_step_size

    def _join(self) -> None:
        ready = []
        for row in list(self.waiting):
            if (self.rows and self._needs_chunks(row)) or not self._fits(row, ready):
                continue
            ready.append(row)
            self.waiting.remove(row)
        if not ready:
            return
        if self.decoder is None:
            self.decoder = batch_decoder(ready[0].session, None if self.worker.adaptive else self.worker.block_size)
        requests = [(r.session, mx.array(r.prompt, mx.int32), r.acceptor, r.max_tokens, r.max_block) for r in ready]
        for row in ready:
            row.stats.begin()
        try:
            firsts = self.decoder.insert_many(requests, stop_tokens=self.worker.tokenizer.eos_token_ids,
                                              prefill_step_size=self.prefill_step_size)  # fmt: skip
        except GENERATION_ERRORS as e:
            for row in ready:
                self._fail(row, f"generation failed: {type(e).__name__}: {e}")
            self._reset()
            return
        for row, first in zip(ready, firsts):
            row.uid, row.stream = first.uid, RowStream(self.worker.tokenizer, len(row.prompt))
            state = initial_state(self.worker.tokenizer, row.prompt) if row.job.request.kind == "chat" else "normal"
            row.job.events.put(Started(len(row.prompt), row.cached, state))
            self.rows[first.uid] = row
            self._deliver(row, first)
        self._learn_row_bytes()

    def _fits(self, row: _Row, joining: list | None = None) -> bool:
        """Whether the row's caches fit beside the others' (always, when it would be alone)."""
        if (not self.rows and not joining) or self.bytes_per_token is None:
            return True
        new = [row, *(joining or [])]
        wanted = sum(self.bytes_per_token * (len(r.prompt) + max(r.max_tokens, 0)) for r in new)
        active = sum(r.session.nbytes for r in self.rows.values())
        if self.weights + active + self.worker.sessions.nbytes + wanted <= self.max_bytes:
            return True
        self.worker.sessions.trim_to(max(0, self.max_bytes - self.weights - active - wanted))
        return self.weights + active + self.worker.sessions.nbytes + wanted <= self.max_bytes

    def _learn_row_bytes(self) -> None:
        sizes = [(r.session.nbytes, len(r.session.tokens)) for r in self.rows.values() if r.session.tokens]
        if sizes:
            self.bytes_per_token = max(n / max(t, 1) for n, t in sizes)

    # -- decoding ---------------------------------------------------------------------------------

    def _step(self) -> None:
        if not self.rows:
            return
        try:
            steps = self.decoder.step()
        except GENERATION_ERRORS as e:
            logging.exception("Batched generation failed")
            for row in list(self.rows.values()):
                self._fail(row, f"generation failed: {type(e).__name__}: {e}")
            self._reset()
            return
        width = len(steps)
        for step in steps:
            row = self.rows.get(step.uid)
            if row is not None:
                row.widest = max(row.widest, width)
                self._deliver(row, step)

    def _deliver(self, row: _Row, step) -> None:
        """Hand a step's tokens to the row's client; finish the row when it stops."""
        put, req, worker = row.job.events.put, row.job.request, self.worker
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
        self._leave(row, Finished(finish, row.stats.tokens, {**dflash, "batch_rows": row.widest} if dflash else {}))

    def _drop_cancelled(self) -> None:
        for row in [r for r in self.rows.values() if r.job.cancelled]:
            self.decoder.remove(row.uid)
            self._leave(row, Failed(503, CANCELLED))
        for row in [r for r in self.waiting if r.job.cancelled]:
            self.waiting.remove(row)
            row.job.events.put(Failed(503, CANCELLED))
            self.worker.running(row.job, False)

    def _leave(self, row: _Row, end) -> None:
        self.rows.pop(row.uid, None)
        row.job.events.put(end)
        self.worker.running(row.job, False)
        self.worker.sessions.put(row.session)  # (after the reply: writing it to disk never delays the client)

    def _fail(self, row: _Row, message: str) -> None:
        self.rows.pop(row.uid, None)
        row.job.events.put(Failed(500, message))
        self.worker.running(row.job, False)

    def _reset(self) -> None:
        """After a failed step: the batch's caches are unsound, start a new decoder."""
        for row in list(self.rows.values()):
            self._fail(row, "generation failed: the batch was interrupted")
        self.decoder = None
