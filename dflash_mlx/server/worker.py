"""The generation worker: one thread owns the model and only decodes the queued requests.

MLX is not thread-safe for concurrent generation, so HTTP handler threads
never touch the model: they prepare a request (`prompts`: its chat template,
tokens, limits and grammar, in their own thread), `submit` it and read the
job's events (`Started`, then `Token`s, then `Finished`; or `Failed` at any
point). Everything MLX computes (tokens, log-probabilities, top entries) is
turned into plain Python in this thread before it is put on a job's queue.

The worker keeps a prompt cache (`prompt_cache.PromptCache`): an LRU of
sessions, one per conversation, so a request whose prompt extends a cached
conversation (its next turn, even after other conversations ran) only
prefills what is new, and a prompt that shares a long prefix with another
(a system prompt, tools) starts from a copy of it. Output is unchanged by
this (the session and server tests check it). Everything the server keeps
counts against one byte budget (`budget.MemoryBudget`, ``--max-batch-bytes``):
a request makes room for its caches (its prompt and ``max_tokens``, at the
`limits.Footprint`) before it runs, evicting the least recently used of the
prompt cache, the stored responses and the compiled grammars. A cancelled job
(its client went away: `handler`) stops between prefill chunks or at its next
token, and its session, holding the prompt and the tokens generated so far, is
filed in the prompt cache like a finished one; `stop` cancels the running
job, fails the queued ones with 503 and ends the thread.

A request's failure stays that request's, answered by its cause
(`events.failure`): a grammar that fails mid-output is a 400 naming the
format field, anything else the server's 500 (its session is dropped, not
filed back), and the next request is served; should the loop itself raise, it
is logged and started again (the requests in it failed with 500), so the
server never answers 503 for good.

With ``decode_concurrency`` > 1 the thread runs `batching.BatchedServing`
instead: up to that many requests decode together as rows of one batch,
each with its own session, stops and cancellation; else (and for a sharded
target or a family the batch cannot run) one request at a time, in order.

With a tensor-sharded target (`group`), rank 0's worker sends each request
it starts to the other ranks, whose `follow()` prepares and serves the same
request the same way (same prompt cache, same stops) and drops the events; a
job is then not cut short when its client goes away (the ranks would part
ways), and `stop` lets the running job finish, then tells the followers to
end. Their prompt caches evict by their own bounds only (the budget counts
them), so the ranks' caches stay alike.
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from ..models.block_size import default_block_size
from ..generation import stream_generate
from ..session import make_session
from ..sharding.group import broadcast
from ..stats import RunStats
from ..batch.ragged_cache import batch_problem
from .batching import BatchedServing
from .budget import Bytes, Counted, MemoryBudget
from .events import (
    CANCELLED,
    GENERATION_ERRORS,
    Cancelled,
    Discard,
    Failed,
    Finished,
    Job,
    Started,
    Token,
    dflash_object,
    failure,
)
from .formats import Grammars
from .limits import Footprint, memory_budget, weight_bytes
from .prompt_cache import DEFAULT_SESSIONS, PromptCache
from .prompts import Prepared, Preparer
from .session_store import SessionStore, identity
from .errors import RequestError
from .request import GenerationRequest
from .stops import StopText


MIN_LOGPROB = -9999.0  # what OpenAI reports for a token that cannot be sampled (JSON has no -Infinity)


class GenerationWorker:
    """`context_length` (tokens, None: unbounded): a longer prompt is refused with 400, and
    generation stops there (finish_reason "length"). `max_batch_bytes` (default: `limits.memory_budget`)
    is the byte budget of everything the server keeps (`budget`): a request whose caches cannot fit even
    alone is refused with 400."""

    def __init__(
        self,
        model,
        tokenizer,
        draft=None,
        *,
        block_size: int | None = None,
        context_length: int | None = None,
        adaptive: bool = True,
        prompt_cache_size: int = DEFAULT_SESSIONS,
        prompt_cache_bytes: int | None = None,
        prompt_cache_dir=None,
        group=None,
        decode_concurrency: int = 1,
        prefill_step_size: int = 2048,
        max_batch_bytes: int | None = None,
        kv: dict | None = None,
    ):
        if group is not None and prompt_cache_dir is not None:
            raise ValueError(
                "prompt_cache_dir: a sharded server keeps its prompt cache in memory only (the "
                "ranks' caches must stay alike)."
            )
        self.group = group if group is not None and group.size() > 1 else None
        self.model, self.tokenizer, self.draft = model, tokenizer, draft
        self.context_length = context_length
        self.block_size = block_size or (default_block_size(model, draft) if draft is not None else 1)
        self.adaptive = adaptive and draft is not None  # up to block_size, unless a request fixes it
        self.budget = MemoryBudget(max_batch_bytes if max_batch_bytes is not None else memory_budget())
        self.weights = weight_bytes(model, draft)
        self.active = Bytes()  # the sessions being generated (set by this worker's thread)
        # structured outputs' grammars, compiled as requests are parsed
        self.grammars = Grammars(tokenizer, budget=self.budget)
        store = SessionStore(prompt_cache_dir, identity(model, draft)) if prompt_cache_dir is not None else None
        self.sessions = PromptCache(
            lambda: make_session(model, draft),
            max_sessions=prompt_cache_size,
            max_bytes=prompt_cache_bytes,
            store=store,
        )
        for name, part in [
            ("weights", Bytes(self.weights)),
            ("active", self.active),
            ("prompt_cache", self.sessions if self.group is None else Counted(self.sessions)),
            ("grammars", self.grammars),
        ]:
            self.budget.register(name, part)
        self.footprint = Footprint.measure(lambda: make_session(model, draft), lookup=draft is not None)
        self.prompts = Preparer(
            tokenizer, context_length, self.budget.total, self.weights, self.footprint, self.grammars
        )
        self.cancelled = 0  # jobs that ended cancelled (`/health`)
        self._jobs: queue.Queue = queue.Queue()
        self._running: set[Job] = set()  # the jobs being generated
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dflash-generation", daemon=True)
        self.batched = None  # the batched loop, when requests decode together
        if decode_concurrency < 1:
            raise ValueError(f"decode_concurrency must be >= 1, got {decode_concurrency}.")
        self.kv = dict(kv or {})  # stream_generate's kv_bits, kv_group_size, quantized_kv_start
        problem = batch_problem(model) or ("a quantized KV cache (kv_bits) is not batched" if self.kv else None)
        if decode_concurrency > 1 and self.group is None and problem:
            logging.warning("Serving one request at a time: %s.", problem)
        if decode_concurrency > 1 and self.group is None and not problem:  # (a sharded server: one at a time)
            self.batched = BatchedServing(self, decode_concurrency, prefill_step_size=prefill_step_size)
        self.decode_concurrency = decode_concurrency if self.batched is not None else 1
        self.budget.enforce()  # (a prompt cache loaded from disk)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def prepare(self, request: GenerationRequest) -> Prepared:
        """The request made ready to generate, in the caller's thread (`prompts`); a `RequestError`
        when it cannot be served."""
        return self.prompts.prepare(request)

    def tokenize(self, request: GenerationRequest) -> list[int]:
        return self.prompts.tokenize(request)

    def submit(self, request: GenerationRequest, prepared: Prepared | None = None) -> Job:
        job = Job(request, prepared)
        with self._lock:
            if self._stopping or not self.alive:
                job.events.put(Failed(503, "the server is shutting down"))
            else:
                self._jobs.put(job)
        return job

    def job_counts(self) -> dict:
        """The requests being generated and queued, and how many ended cancelled (`/health`)."""
        with self._lock:
            return {"running": len(self._running), "queued": self._jobs.qsize(), "cancelled": self.cancelled}

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running job, fail the queued ones, end the thread."""
        with self._lock:
            self._stopping = True
            if self.group is None:
                for job in list(self._running):
                    job.cancel()
            self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                try:
                    self._loop()
                    return
                except Exception:  # a fault outside any one request's stages: fail what is in flight, go on
                    logging.exception("The generation loop failed; failing the requests in it and starting again")
                    message = "generation failed: the server's generation loop was interrupted"
                    if self.batched is not None:
                        self.batched.abort(message)
                    with self._lock:
                        for job in self._running:
                            job.events.put(Failed(500, message))
                        self._running.clear()
        finally:
            mx.clear_streams()  # MLX needs this at the end of a thread that computed, or exit may abort

    def _loop(self) -> None:
        if self.batched is not None:
            self.batched.run()
        while self.batched is None:
            job = self._jobs.get()
            if job is None:
                break
            with self._lock:
                if self._stopping:
                    job.events.put(Failed(503, "the server is shutting down"))
                    continue
                self._running.add(job)
            try:
                if job.cancelled:
                    self.count_cancelled()
                else:
                    self._serve(job)
            finally:
                with self._lock:
                    self._running.discard(job)
        while not self._jobs.empty():  # submitted while stopping
            job = self._jobs.get_nowait()
            if job is not None:
                job.events.put(Failed(503, "the server is shutting down"))
        if self.group is not None:
            broadcast(self.group, b"")  # the followers' end

    def follow(self) -> None:
        """A follower rank's loop (in its main thread): serve what rank 0 starts, until it stops.

        Ctrl-C and SIGTERM are ignored from here on: they stop rank 0, which then ends this loop
        (and a Ctrl-C reaching this rank just after would interrupt its exit); should rank 0 die,
        the next collective fails here.
        """
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        while True:
            order = broadcast(self.group, None)
            if not order:
                break
            job = Job(pickle.loads(order))
            job.events = Discard()
            self._serve(job)

    def _serve(self, job: Job) -> None:
        if self.group is not None and self.group.rank() == 0:
            broadcast(self.group, pickle.dumps(job.request))
        session = responses = None
        end = Failed(500, "generation was interrupted")  # the last event, sent once the generator is closed
        try:
            prepared = job.prepared or self.prepare(job.request)  # (a follower prepares what rank 0 sends)
            session = self.sessions.take(prepared.prompt)
            self._make_room(session, prepared)
            responses, stats = self._generate(job, prepared, session)
            end = self._stream(job, prepared, session, responses, stats)
        except Exception as e:  # this request's failure (by its cause), and the next requests are served
            if not isinstance(e, (*GENERATION_ERRORS, RequestError, Cancelled)):
                logging.exception("Request failed")
            end = failure(e, job.request)
        finally:
            if responses is not None:
                responses.close()  # an early stop: the session undoes its queued verify
            job.events.put(end)
            self.active.nbytes = 0
            if isinstance(end, Failed) and end.message == CANCELLED:
                self.count_cancelled()
            if session is not None and (isinstance(end, Finished) or end.message == CANCELLED):
                self.file_session(session)  # a cancelled job's caches are sound too

    def _make_room(self, session, prepared: Prepared) -> None:
        """Count the request's caches (its prompt and max_tokens) as active, evicting to make room."""
        self.active.nbytes = max(session.nbytes, self.footprint.bytes(len(prepared.prompt) + prepared.max_tokens))
        self.budget.enforce()  # (it fit alone: `prompts`; what is kept makes room for it)

    def _generate(self, job: Job, prepared: Prepared, session):
        """The request's stream of responses (not started) and the statistics it fills."""
        req = job.request
        adaptive = self.adaptive and req.num_draft_tokens is None
        block_size = self.block_size if req.num_draft_tokens is None else req.num_draft_tokens + 1
        blocks = {"block_size": None, "max_block_size": block_size} if adaptive else {"block_size": block_size}

        def cancel_between_chunks(done: int, total: int) -> None:
            if job.cancelled and self.group is None:
                raise Cancelled()

        responses = stream_generate(
            self.model,
            self.draft,
            self.tokenizer,
            prepared.prompt,
            max_tokens=prepared.max_tokens,
            **(blocks if self.draft is not None else {}),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            xtc_probability=req.xtc_probability,
            xtc_threshold=req.xtc_threshold,
            logits_processors=make_logits_processors(**req.processors) or None,
            session=session,
            **self.kv,
            response_format=prepared.grammar,
            lookup=req.lookup,
            prompt_progress_callback=cancel_between_chunks,
        )
        return responses, RunStats(block_size=block_size, adaptive=adaptive)

    def _stream(self, job: Job, prepared: Prepared, session, responses, stats: RunStats) -> Finished | Failed:
        """Hand the responses out as events until the reply ends (or its job is cancelled)."""
        req, put = job.request, job.events.put
        stopper = StopText(req.stop)
        started, count, finish = False, 0, "length"
        for r in responses:
            if job.cancelled and self.group is None:
                return Failed(503, CANCELLED)
            if not started:
                put(Started(len(prepared.prompt), session.reused, prepared.state))
                started = True
            count += 1
            stats.add(r)
            put(self.token_event(r, stopper.feed(r.text), req.logprobs, req.top_logprobs))
            if stopper.stopped:
                finish = "stop"
                break
            if r.finish_reason:
                finish = r.finish_reason
                break
        tail = stopper.flush()
        if tail:
            put(Token(tail, None))
        return Finished(finish, count, dflash_object(stats) if self.draft is not None else {}, stopper.matched)

    def count_cancelled(self) -> None:
        with self._lock:
            self.cancelled += 1

    def file_session(self, session) -> None:
        """Put a finished request's session back in the prompt cache (after its reply: writing it to
        disk never delays the client), within the byte budget; one that cannot be filed is dropped and
        logged."""
        try:
            self.sessions.put(session)
        except Exception:
            logging.exception("Could not keep a conversation in the prompt cache; it is dropped")
        self.budget.enforce()

    def running(self, job: Job, now: bool) -> None:
        """Mark `job` as being generated (`now`) or done: `stop` cancels the running ones."""
        with self._lock:
            (self._running.add if now else self._running.discard)(job)

    def next_job(self, wait: bool) -> Job | None:
        """The next queued job (None: the worker is stopping); raises queue.Empty if not `wait`ing."""
        return self._jobs.get(block=wait)

    @property
    def stopping(self) -> bool:
        return self._stopping

    def token_event(self, r, text: str, logprobs: bool, top_n: int) -> Token:
        """The event of one response (`r`): its released `text`, and its logprobs when asked for."""
        event = Token(text, r.token)
        if not logprobs:
            return event
        row = mx.maximum(r.logprobs.astype(mx.float32), MIN_LOGPROB)  # (a grammar's masked tokens: -inf)
        event.token_text = self._token_text(r.token)
        event.logprob = row[r.token].item()
        if top_n:
            ids = mx.argpartition(-row, kth=top_n - 1)[:top_n]
            values = row[ids].tolist()
            pairs = sorted(zip(ids.tolist(), values), key=lambda p: -p[1])
            event.top = [(i, self._token_text(i), v) for i, v in pairs]
        return event

    def _token_text(self, token: int) -> str:
        """The token's text; a token that is only part of a UTF-8 character gets its vocabulary
        string instead, so distinct tokens keep distinct strings (legacy logprobs key on them)."""
        text = self.tokenizer.decode([token])
        return self.tokenizer.convert_ids_to_tokens(token) if "\ufffd" in text else text
