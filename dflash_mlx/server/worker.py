"""The generation worker: one thread owns the model and serves the queued requests.

MLX is not thread-safe for concurrent generation, so HTTP handler threads
never touch the model: they `submit` a `GenerationRequest` and read the job's
events (`Started`, then `Token`s, then `Finished`; or `Failed` at any point).
Everything MLX computes (tokens, log-probabilities, top entries) is turned
into plain Python in this thread before it is put on a job's queue.

The worker keeps a prompt cache (`prompt_cache.PromptCache`): an LRU of
sessions, one per conversation, so a request whose prompt extends a cached
conversation (its next turn, even after other conversations ran) only
prefills what is new, and a prompt that shares a long prefix with another
(a system prompt, tools) starts from a copy of it. Output is unchanged by
this (the session and server tests check it). A cancelled job (its client
went away) stops at its next token; `stop` cancels the running job, fails the
queued ones with 503 and ends the thread.

A request's failure stays that request's: an exception while serving it
ends it with a 500 (its session is dropped, not filed back) and the next
request is served; should the loop itself raise, it is logged and started
again (the requests in it failed with 500), so the server never answers 503
for good. A request whose caches could not fit in the memory budget even
alone is refused before it runs (`limits`).

With ``decode_concurrency`` > 1 the thread runs `batching.BatchedServing`
instead: up to that many requests decode together as rows of one batch,
each with its own session, stops and cancellation; else (and for a sharded
target or a family the batch cannot run) one request at a time, in order.

With a tensor-sharded target (`group`), rank 0's worker sends each request
it starts to the other ranks, whose `follow()` serves the same request the
same way (same prompt cache, same stops) and drops the events; a job is then
not cut short when its client goes away (the ranks would part ways), and
`stop` lets the running job finish, then tells the followers to end.
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading

import mlx.core as mx
from jinja2 import TemplateError
from mlx_lm.sample_utils import make_logits_processors

from ..models.block_size import default_block_size
from ..generation import stream_generate
from ..session import make_session
from ..sharding.group import broadcast
from ..stats import RunStats
from ..batch.ragged_cache import batch_problem
from .batching import BatchedServing
from .channels import initial_state
from .events import GENERATION_ERRORS, Discard, Failed, Finished, Job, Started, Token, dflash_object
from .formats import Grammars
from .limits import Footprint, memory_budget, weight_bytes
from .prompt_cache import DEFAULT_SESSIONS, PromptCache
from .session_store import SessionStore, identity
from .errors import RequestError
from .request import GenerationRequest
from .stops import StopText


MIN_LOGPROB = -9999.0  # what OpenAI reports for a token that cannot be sampled (JSON has no -Infinity)


class GenerationWorker:
    """`context_length` (tokens, None: unbounded): a longer prompt is refused with 400, and
    generation stops there (finish_reason "length"). `max_batch_bytes` (default: `limits.memory_budget`)
    bounds weights + caches: a request whose caches cannot fit even alone is refused with 400."""

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
        self.grammars = Grammars(tokenizer)  # structured outputs' grammars, compiled as requests are parsed
        self.context_length = context_length
        self.block_size = block_size or (default_block_size(model, draft) if draft is not None else 1)
        self.adaptive = adaptive and draft is not None  # up to block_size, unless a request fixes it
        store = SessionStore(prompt_cache_dir, identity(model, draft)) if prompt_cache_dir is not None else None
        self.sessions = PromptCache(
            lambda: make_session(model, draft),
            max_sessions=prompt_cache_size,
            max_bytes=prompt_cache_bytes,
            store=store,
        )
        self.budget = max_batch_bytes if max_batch_bytes is not None else memory_budget()
        self.weights = weight_bytes(model, draft)
        self.footprint = Footprint.measure(lambda: make_session(model, draft))
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

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: GenerationRequest) -> Job:
        job = Job(request)
        with self._lock:
            if self._stopping or not self.alive:
                job.events.put(Failed(503, "the server is shutting down"))
            else:
                self._jobs.put(job)
        return job

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
                if not job.cancelled:
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
        req, put = job.request, job.events.put
        adaptive = self.adaptive and req.num_draft_tokens is None
        block_size = self.block_size if req.num_draft_tokens is None else req.num_draft_tokens + 1
        stats = RunStats(block_size=block_size, adaptive=adaptive)
        blocks = {"block_size": None, "max_block_size": block_size} if adaptive else {"block_size": block_size}
        stopper = StopText(req.stop)
        started, count, finish = False, 0, "length"
        session = responses = None
        end = Failed(500, "generation was interrupted")  # the last event, sent once the generator is closed
        try:
            planned = self.prepare(job)
            if planned is None:
                end = None  # (prepare sent its 4xx)
                return
            prompt, max_tokens = planned
            session = self.sessions.take(prompt)
            responses = stream_generate(
                self.model,
                self.draft,
                self.tokenizer,
                prompt,
                max_tokens=max_tokens,
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
                response_format=self.grammars.get(req.grammar) if req.grammar else None,
                lookup=req.lookup,
            )
            for r in responses:
                if job.cancelled and self.group is None:
                    end = Failed(503, "the request was cancelled (the client went away or the server is stopping)")
                    return
                if not started:
                    state = initial_state(self.tokenizer, prompt) if req.kind == "chat" else "normal"
                    put(Started(len(prompt), session.reused, state))
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
            end = Finished(finish, count, dflash_object(stats) if self.draft is not None else {}, stopper.matched)
        except ValueError as e:
            end = Failed(400 if not started else 500, str(e))
        except Exception as e:  # this request's failure: its 500, and the next requests are served
            if not isinstance(e, GENERATION_ERRORS):
                logging.exception("Request failed")
            end = Failed(500, f"generation failed: {type(e).__name__}: {e}")
        finally:
            if responses is not None:
                responses.close()  # an early stop: the session undoes its queued verify
            if end is not None:
                put(end)
            if session is not None and (isinstance(end, Finished) or end.status == 503):
                self.file_session(session)  # a cancelled job's caches are sound too

    def file_session(self, session) -> None:
        """Put a finished request's session back in the prompt cache (after its reply: writing it to
        disk never delays the client); one that cannot be filed is dropped and logged."""
        try:
            self.sessions.put(session)
        except Exception:
            logging.exception("Could not keep a conversation in the prompt cache; it is dropped")

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

    def prepare(self, job: Job) -> tuple[list[int], int] | None:
        """The job's prompt tokens and token limit, or None after putting its 4xx (or its 500)."""
        req, put = job.request, job.events.put
        field = "messages" if req.kind == "chat" else "prompt"
        try:
            prompt = self.tokenize(req)
        except RequestError as e:
            put(Failed(e.status, str(e), e.field))
            return None
        except Exception as e:
            logging.exception("Building a prompt failed")
            put(Failed(500, f"cannot build the prompt: {type(e).__name__}: {e}", field))
            return None
        if not prompt:
            put(Failed(400, f"{field}: the prompt is empty: at least one token is needed", field))
            return None
        max_tokens = req.max_tokens
        if self.context_length is not None:
            room = self.context_length - len(prompt)
            if room < 1:
                put(
                    Failed(
                        400,
                        f"{field}: the prompt is {len(prompt)} tokens, the model's context is "
                        f"{self.context_length} tokens: leave room for at least one generated token",
                        field,
                    )
                )
                return None
            max_tokens = min(max_tokens, room)
        problem = self._memory_problem(len(prompt), max_tokens, field)
        if problem is not None:
            put(problem)
            return None
        return prompt, max_tokens

    def _memory_problem(self, prompt: int, max_tokens: int, field: str) -> Failed | None:
        """A 400 when the caches of `prompt` + `max_tokens` tokens cannot fit in the budget even alone."""
        room = self.budget - self.weights
        fits = self.footprint.tokens_within(room)
        if prompt + max_tokens <= fits:
            return None
        need = self.footprint.bytes(prompt + max_tokens) / 1e9
        budget = (
            f"this server's memory budget ({self.budget / 1e9:.2f} GB, --max-batch-bytes) leaves "
            f"{max(room, 0) / 1e9:.2f} GB beside the weights"
        )
        if prompt + 1 > fits:
            return Failed(
                400,
                f"{field}: the caches of a {prompt}-token prompt need about {need:.2f} GB; {budget}: "
                f"room for {fits} tokens in all",
                field,
            )
        return Failed(
            400,
            f"max_tokens: a {prompt}-token prompt and {max_tokens} generated tokens need about "
            f"{need:.2f} GB of caches; {budget}: at most {fits - prompt} tokens after this prompt",
            "max_tokens",
        )

    def tokenize(self, req: GenerationRequest) -> list[int]:
        """The request's prompt tokens; a `RequestError` (400) naming its messages or prompt when the chat
        template or the tokenizer refuses them. (The tokenizer only reads: handler threads call this too.)"""
        try:
            return self._tokenize(req)
        except (TemplateError, ValueError, TypeError, KeyError) as e:  # the template's or tokenizer's
            field = "messages" if req.kind == "chat" else "prompt"
            raise RequestError(field, f"cannot build the prompt: {e}") from None

    def _tokenize(self, req: GenerationRequest) -> list[int]:
        tokenizer = self.tokenizer
        if req.kind == "text":
            return req.prompt if isinstance(req.prompt, list) else tokenizer.encode(req.prompt)
        if not tokenizer.has_chat_template:
            from mlx_lm.server import convert_chat

            return tokenizer.encode(convert_chat(req.messages, req.role_mapping))
        if req.tools and not tokenizer.has_tool_calling:
            logging.warning(
                "Received tools, but the model's tokenizer has no tool-call markers: its tool calls come back as text."
            )
        text = tokenizer.apply_chat_template(
            req.messages, tools=req.tools, tokenize=False, add_generation_prompt=True, **req.chat_template_kwargs
        )
        return tokenizer.encode(text, add_special_tokens=False)

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
