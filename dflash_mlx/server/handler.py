"""The HTTP handler: routes, request bodies, JSON replies and server-sent events.

POST ``/v1/chat/completions`` and ``/v1/completions`` (also without ``/v1``),
GET ``/v1/models`` and ``/health``. A completion request is validated
(`request.parse_request`: HTTP 400 naming the field), queued on the worker,
and answered once its first token exists, so errors found before generation
starts still get a proper status. Chat replies go through `channels.Channels`
(content, reasoning, tool calls; a streamed tool call is sent once its block
closes, as mlx_lm.server sends it). Streamed replies are SSE ``data:`` lines
ending with ``data: [DONE]``; a client that goes away cancels its job.
"""

from __future__ import annotations

import json
import queue
import time
from http.server import BaseHTTPRequestHandler

from .channels import Channels, Delta
from .request import RequestError, parse_request
from .responses import Reply, error_body, meta_info, usage
from .events import Failed, Finished, Started, Token

MAX_BODY = 32 * 2**20
ROUTES = {"/v1/chat/completions": "chat", "/chat/completions": "chat", "/v1/completions": "text",
          "/completions": "text"}  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    server_version = "dflash-mlx"

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        if self.server.log_requests:
            super().log_message(format, *args)

    # --- plumbing -----------------------------------------------------------------------------

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
        length = self.headers.get("Content-Length")
        if length is None:
            self._error(411, "a Content-Length header is required")
            return None
        try:
            length = int(length)
        except ValueError:
            self._error(400, f"invalid Content-Length {length!r}")
            return None
        if length > MAX_BODY:
            self._error(413, f"the request body is larger than {MAX_BODY} bytes")
            return None
        try:
            return json.loads(self.rfile.read(length).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._error(400, f"the request body is not valid JSON: {e}")
            return None

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
        self._received = time.perf_counter()
        kind = ROUTES.get(self.path.split("?")[0].rstrip("/"))
        if kind is None:
            self._error(404, f"no such endpoint: POST {self.path}")
            return
        body = self._read_json()
        if body is None:
            return
        try:
            req = parse_request(kind, body, self.server.info)
        except RequestError as e:
            self._error(e.status, str(e), e.field)
            return
        job = self.server.worker.submit(req)
        first = self._next_event(job)
        if isinstance(first, Failed):
            self._error(first.status, first.message, first.field)
            return
        assert isinstance(first, Started)
        reply = Reply(kind, self.server.model_id)
        channels = None
        if kind == "chat":
            channels = Channels(self.server.worker.tokenizer, req.tools, first.initial_state, streaming=req.stream)
        try:
            (self._stream if req.stream else self._whole)(job, req, first, reply, channels)
        except (BrokenPipeError, ConnectionResetError):
            job.cancel()

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
