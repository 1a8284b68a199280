"""The HTTP handler: routes, request bodies, the API key, and replies whole or as server-sent events.

Three dialects over one request model (`dialect`): OpenAI's chat and text
completions (`openai_chat`: POST ``/v1/chat/completions``, ``/v1/completions``),
Anthropic's Messages API (`anthropic`: ``/v1/messages``,
``/v1/messages/count_tokens``) and OpenAI's Responses API
(`openai_responses`: ``/v1/responses``), each also without ``/v1``; GET
``/v1/models`` and ``/health``. With an API key (``--api-key``) every route but
``/health`` wants it as ``x-api-key`` or ``Authorization: Bearer``: else a 401.
A request is validated (a 400 naming the field, in its dialect's error shape),
prepared in this thread (`prompts`: template, tokens, limits, grammar; the
decode thread only decodes), queued on the worker, and answered once its first
token exists, so errors found before generation starts still get a proper
status. A body larger than `limits.body_limit` (what a prompt filling the
model's context can take) is a 413 sent before the body is read (what the
client still sends is read and dropped, so it gets the 413); one nested deeper
than `MAX_DEPTH` is a 400, and an unexpected error in a handler is that
request's 500 (its job is cancelled), never a dropped connection. Chat
replies go through `channels.Channels` (content, reasoning, tool calls: a tool
call is released once its block closes, as mlx_lm.server sends it). Streamed
replies are SSE (``event:`` lines where the dialect names its events). A
client that goes away cancels its job, streamed or not: while it waits, its
socket is checked every `POLL` seconds (a peer that closed, or half-closed,
its connection reads as ended), and a failed write ends it too. ``/health``
shows the byte budget's use (`budget`), the requests running, queued and
cancelled, and the body limit.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import socket
import time
from http.server import BaseHTTPRequestHandler

from .anthropic import CountTokens, Messages
from .channels import Channels, Delta
from .dialect import Outcome
from .errors import RequestError
from .events import Failed, Finished, Started, Token
from .openai_chat import Completion, TextCompletion, error_body
from .openai_responses import Responses

POLL = 0.25  # seconds between checks that a waiting client is still there
DRAIN_SECONDS = 10.0  # how long a refused body the client goes on sending is read and dropped
MAX_DEPTH = 64  # nesting of a body's arrays and objects (tool schemas need a few levels, nothing needs 64)
ROUTES = {
    "/chat/completions": Completion,
    "/completions": TextCompletion,
    "/messages": Messages,
    "/messages/count_tokens": CountTokens,
    "/responses": Responses,
}
ROUTES.update({"/v1" + path: dialect for path, dialect in list(ROUTES.items())})


class Handler(BaseHTTPRequestHandler):
    server_version = "dflash-mlx"
    _unread = 0  # bytes of a refused body still to read and drop (`_drain`)

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        if self.server.log_requests:
            super().log_message(format, *args)

    # --- plumbing -----------------------------------------------------------------------------

    def send_response(self, code, message=None):
        self._responded = True
        super().send_response(code, message)

    def _cors(self) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self._unread:
            self.send_header("Connection", "close")
        self._cors()
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        """Whether the request carries the server's API key (always, when it has none)."""
        key = self.server.api_key
        if key is None:
            return True
        given = self.headers.get("x-api-key")
        bearer = self.headers.get("Authorization", "")
        if given is None and bearer[:7].lower() == "bearer ":
            given = bearer[7:].strip()
        return given is not None and hmac.compare_digest(given.encode(), key.encode())

    def _read_json(self):
        """The body, parsed; a `RequestError` (411, 413 or 400) when it cannot be."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(None, "a Content-Length header is required", 411)
        try:
            length = int(length)
        except ValueError:
            raise RequestError(None, f"invalid Content-Length {length!r}") from None
        if length < 0:
            raise RequestError(None, f"invalid Content-Length {length}")
        limit = self.server.info.max_body
        if limit is not None and length > limit:
            self._unread, self.close_connection = length, True
            context = self.server.info.context_length
            why = f"a prompt filling the model's {context}-token context" if context else "the memory budget"
            raise RequestError(
                None, f"the request body is {length} bytes; this server reads at most {limit} ({why})", 413
            )
        too_deep = f"the request body nests arrays and objects more than {MAX_DEPTH} levels deep"
        try:
            body = json.loads(self.rfile.read(length).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(None, f"the request body is not valid JSON: {e}") from None
        except RecursionError:  # the parser's own limit, far deeper than MAX_DEPTH
            raise RequestError(None, too_deep) from None
        if depth(body) > MAX_DEPTH:
            raise RequestError(None, too_deep)
        if not isinstance(body, dict):
            raise RequestError(None, "the request body must be a JSON object")
        return body

    def _drain(self) -> None:
        """Read and drop the refused body the client is still sending (for at most DRAIN_SECONDS), so it reads
        the refusal rather than a reset connection."""
        deadline = time.monotonic() + DRAIN_SECONDS
        try:
            self.connection.settimeout(DRAIN_SECONDS)
            while self._unread > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(self._unread, 1 << 16))
                if not chunk:
                    break
                self._unread -= len(chunk)
        except OSError:
            pass

    def _next_event(self, job):
        """The job's next event; a client that went away meanwhile cancels the job (ConnectionAbortedError)."""
        while True:
            if time.monotonic() >= self._check_at:
                self._check_at = time.monotonic() + POLL
                if client_gone(self.connection):
                    job.cancel()
                    raise ConnectionAbortedError("the client went away")
            try:
                return job.events.get(timeout=POLL)
            except queue.Empty:
                if not self.server.worker.alive and job.events.empty():
                    return Failed(503, "the generation thread has stopped")

    def _open_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self._cors()
        self.end_headers()

    def _send_events(self, events) -> None:
        if events:
            self.wfile.write(b"".join(sse(name, data) for name, data in events))
            self.wfile.flush()

    # --- routes -------------------------------------------------------------------------------

    def do_OPTIONS(self):
        self.send_response(204)
        self._cors()
        self.end_headers()

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path == "/health":
            self._send_json(*self.server.health())
        elif not self._authorized():
            self._send_json(401, error_body(UNAUTHORIZED, None, 401))
        elif path == "/v1/models":
            card = self.server.model_card()  # OpenAI's list, with Anthropic's paging fields
            self._send_json(
                200,
                {"object": "list", "data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]},
            )
        else:
            self._send_json(404, error_body(f"no such endpoint: GET {self.path}", None, 404))

    def do_POST(self):
        self._received, self._responded, self._job = time.perf_counter(), False, None
        self._check_at, self._unread = time.monotonic() + POLL, 0
        dialect = ROUTES.get(self.path.split("?")[0].rstrip("/"))
        try:
            self._post(dialect)
        except ConnectionError:  # the client went away (a failed write, a closed socket): its job is cancelled
            pass
        except Exception as e:  # a fault of this request's own handling: its 500, never the server's end
            logging.exception("Request to %s failed", self.path)
            if not self._responded:
                self._send_json(500, (dialect or Completion).error(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            if self._job is not None:
                self._job.cancel()  # a no-op once it finished; else the worker stops it at its next token

    def _post(self, dialect) -> None:
        if dialect is None:  # (in Anthropic's shape under its paths)
            shape = Messages if self.path.split("?")[0].startswith(("/v1/messages", "/messages")) else Completion
            self._send_json(404, shape.error(404, f"no such endpoint: POST {self.path}"))
            return
        if not self._authorized():
            self._send_json(401, dialect.error(401, UNAUTHORIZED))
            return
        try:
            exchange = dialect.parse(self._read_json(), self.server)
            answer = exchange.answer(self.server)
            prepared = self.server.worker.prepare(exchange.request) if answer is None else None
        except RequestError as e:
            self._send_json(e.status, dialect.error(e.status, str(e), e.field))
            self._drain()
            return
        if answer is not None:
            self._send_json(200, answer)
            return
        req = exchange.request
        job = self._job = self.server.worker.submit(req, prepared)
        first = self._next_event(job)
        if isinstance(first, Failed):
            self._send_json(first.status, exchange.error(first.status, first.message, first.field))
            return
        assert isinstance(first, Started)
        channels = None
        if req.kind == "chat":
            channels = Channels(self.server.worker.tokenizer, req.tools, first.initial_state, streaming=req.stream)
        if req.stream:
            self._open_stream()
            self._send_events(exchange.start(first))
        self._reply(job, exchange, first, channels)

    def _reply(self, job, exchange, started: Started, channels: Channels | None) -> None:
        """Read the job's events into the exchange: its stream events as they come, or its whole reply."""
        stream = exchange.request.stream
        while True:
            event = self._next_event(job)
            if isinstance(event, Token):
                delta = channels.feed(event.text) if channels else Delta(event.text)
                events = exchange.feed(delta, event, holding=channels is not None and channels.in_tool_call)
            elif isinstance(event, Finished):
                delta = channels.finish(event.finish_reason) if channels else Delta()
                outcome = Outcome(
                    event.finish_reason,
                    started.prompt_tokens,
                    started.cached_tokens,
                    event.completion_tokens,
                    event.dflash,
                    event.stop_sequence,
                    channels is not None and channels.made_tool_call,
                    time.perf_counter() - self._received,
                )
                events = exchange.finish(delta, outcome)
                if not stream:
                    self._send_json(200, exchange.whole(outcome))
                    return
            elif not stream:
                self._send_json(event.status, exchange.error(event.status, event.message, event.field))
                return
            else:
                events = exchange.fail(event)
            if stream:
                self._send_events(events)
            if not isinstance(event, Token):
                break
        self.wfile.write(exchange.done)
        self.wfile.flush()


UNAUTHORIZED = "a valid API key is required (the x-api-key header or Authorization: Bearer)"


def sse(name: str | None, data: dict) -> bytes:
    """One server-sent event (an ``event:`` line when it has a name)."""
    head = f"event: {name}\n" if name else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def client_gone(sock) -> bool:
    """Whether the peer has closed (or reset) the connection: it is readable and a peek reads nothing."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def depth(value) -> int:
    """How deeply a parsed JSON value nests arrays and objects (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:  # deeper is refused anyway: no need to walk it
                stack.extend((c, level + 1) for c in children)
    return deepest
