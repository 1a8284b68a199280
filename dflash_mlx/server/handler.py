"""The HTTP handler: routes, request bodies, JSON replies and server-sent events.

POST ``/v1/chat/completions`` and ``/v1/completions`` (also without ``/v1``),
GET ``/v1/models`` and ``/health``. A completion request is validated
(`request.parse_request`: HTTP 400 naming the field), queued on the worker,
and answered once its first token exists, so errors found before generation
starts still get a proper status; a body nested deeper than `MAX_DEPTH` is a
400, and an unexpected error in a handler is that request's 500 (its job is
cancelled), never a dropped connection. Chat replies go through `channels.Channels`
(content, reasoning, tool calls; a streamed tool call is sent once its block
closes, as mlx_lm.server sends it). Streamed replies are SSE ``data:`` lines
ending with ``data: [DONE]``; a client that goes away cancels its job.
"""

from __future__ import annotations

import json
import logging
import queue
import time
from http.server import BaseHTTPRequestHandler

from .channels import Channels, Delta
from .request import RequestError, parse_request
from .responses import Reply, error_body, meta_info, usage
from .events import Failed, Finished, Started, Token

MAX_BODY = 32 * 2**20
MAX_DEPTH = 64  # nesting of a body's arrays and objects (tool schemas need a few levels, nothing needs 64)
ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text",
          "/completions": "text"}  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    server_version = "dflash-mlx"

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
        self._cors()
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        self._send_json(status, error_body(message, param, status))

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
        if length > MAX_BODY:
            raise RequestError(None, f"the request body is larger than {MAX_BODY} bytes", 413)
        too_deep = f"the request body nests arrays and objects more than {MAX_DEPTH} levels deep"
        try:
            body = json.loads(self.rfile.read(length).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(None, f"the request body is not valid JSON: {e}") from None
        except RecursionError:  # the parser's own limit, far deeper than MAX_DEPTH
            raise RequestError(None, too_deep) from None
        if depth(body) > MAX_DEPTH:
            raise RequestError(None, too_deep)
        return body

    def _next_event(self, job):
        while True:
            try:
                return job.events.get(timeout=1.0)
            except queue.Empty:
                if not self.server.worker.alive and job.events.empty():
                    return Failed(503, "the generation thread has stopped")

    # --- routes -------------------------------------------------------------------------------

    def do_OPTIONS(self):
        self.send_response(204)
        self._cors()
        self.end_headers()

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [self.server.model_card()]})
        elif path == "/health":
            alive = self.server.worker.alive
            self._send_json(200 if alive else 503, {"status": "ok" if alive else "unavailable"})
        else:
            self._error(404, f"no such endpoint: GET {self.path}")

    def do_POST(self):
        self._received, self._responded, self._job = time.perf_counter(), False, None
        try:
            self._post()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a fault of this request's own handling: its 500, never the server's end
            logging.exception("Request to %s failed", self.path)
            if not self._responded:
                self._error(500, f"internal error: {type(e).__name__}: {e}")
        finally:
            if self._job is not None:
                self._job.cancel()  # a no-op once it finished; else the worker stops it at its next token

    def _post(self) -> None:
        kind = ROUTES.get(self.path.split("?")[0].rstrip("/"))
        if kind is None:
            self._error(404, f"no such endpoint: POST {self.path}")
            return
        try:
            req = parse_request(kind, self._read_json(), self.server.info)
        except RequestError as e:
            self._error(e.status, str(e), e.field)
            return
        job = self._job = self.server.worker.submit(req)
        first = self._next_event(job)
        if isinstance(first, Failed):
            self._error(first.status, first.message, first.field)
            return
        assert isinstance(first, Started)
        reply = Reply(kind, self.server.model_id)
        channels = None
        if kind == "chat":
            channels = Channels(self.server.worker.tokenizer, req.tools, first.initial_state, streaming=req.stream)
        (self._stream if req.stream else self._whole)(job, req, first, reply, channels)

    def _meta(self, req, reply: Reply, finish_reason: str, use: dict, dflash: dict) -> dict | None:
        if not req.return_meta_info:
            return None
        return meta_info(reply.id, finish_reason, use, dflash, time.perf_counter() - self._received)

    def _whole(self, job, req, started: Started, reply: Reply, channels: Channels | None) -> None:
        parts, tokens = Delta(), []
        while True:
            event = self._next_event(job)
            if isinstance(event, Token):
                parts.add(channels.feed(event.text) if channels else Delta(event.text))
                if event.token is not None:
                    tokens.append(event)
            elif isinstance(event, Finished):
                finish = event.finish_reason
                if channels:
                    parts.add(channels.finish(finish))
                    finish = channels.finish_reason(finish)
                use = usage(started.prompt_tokens, event.completion_tokens, started.cached_tokens)
                self._send_json(200, reply.whole(parts.content, tokens, finish, use, event.dflash,
                                                 reasoning=parts.reasoning, tool_calls=parts.tool_calls,
                                                 meta=self._meta(req, reply, finish, use, event.dflash)))  # fmt: skip
                return
            else:
                self._error(event.status, event.message, event.field)
                return

    def _stream(self, job, req, started: Started, reply: Reply, channels: Channels | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self._cors()
        self.end_headers()
        first, tokens = True, []  # tokens: events whose logprobs are not sent yet (held inside a tool call)
        while True:
            event = self._next_event(job)
            if isinstance(event, Token):
                if event.token is not None:
                    tokens.append(event)
                delta = channels.feed(event.text) if channels else Delta(event.text)
                if channels and channels.in_tool_call:
                    continue
                if delta or first or (req.logprobs and tokens):
                    self._sse(reply.chunk(delta.content, tokens, first=first, reasoning=delta.reasoning,
                                          tool_calls=delta.tool_calls))  # fmt: skip
                    first, tokens = False, []
            elif isinstance(event, Finished):
                finish, delta = event.finish_reason, Delta()
                if channels:
                    delta = channels.finish(finish)
                    finish = channels.finish_reason(finish)
                use = usage(started.prompt_tokens, event.completion_tokens, started.cached_tokens)
                self._sse(reply.chunk(delta.content, tokens, finish, first=first, dflash=event.dflash,
                                      reasoning=delta.reasoning, tool_calls=delta.tool_calls,
                                      meta=self._meta(req, reply, finish, use, event.dflash)))  # fmt: skip
                if req.include_usage:
                    self._sse(reply.usage_chunk(use))
                break
            else:
                self._sse(error_body(event.message, event.field, event.status))
                break
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _sse(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


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
