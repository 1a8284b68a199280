"""The OpenAI chat and text completions dialect: its replies, whole or as stream chunks, and errors.

Its requests are the server's own request model (`request.parse_request`);
`Completion` (``/v1/chat/completions``) and `TextCompletion`
(``/v1/completions``) turn the reply back into these objects.

Shapes follow OpenAI's API: ``chat.completion`` / ``chat.completion.chunk``
(``message`` / ``delta``, chat-style ``logprobs.content`` entries with
``top_logprobs``) and ``text_completion`` (legacy ``logprobs`` with
``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), ``usage``
with ``prompt_tokens_details.cached_tokens``, and errors as
``{"error": {"message", "type", "param", "code"}}``. Chat messages and deltas
carry what `channels.Channels` split off: ``content`` (null in a whole
message without text, as mlx_lm.server sends it), ``reasoning`` (mlx_lm.server's
name) and the same text as ``reasoning_content`` (vLLM's and SGLang's), and
``tool_calls`` (``function_call``, the first call, when the request used the
legacy ``functions``). Each reply also carries a ``dflash`` object with its
acceptance statistics (`worker.dflash_object`), and on request SGLang's
``meta_info`` (`meta_info`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .channels import Delta
from .dialect import Exchange, Outcome
from .events import Token
from .request import parse_request


def error_body(message: str, param: str | None = None, status: int = 400) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def meta_info(reply_id: str, finish_reason: str, use: dict, dflash: dict, seconds: float) -> dict:
    """SGLang's ``meta_info`` (``"return_meta_info": true``): token counts, and the speculative
    statistics when a drafter ran (verify forwards, mean tokens committed per verify)."""
    out = {
        "id": reply_id,
        "finish_reason": {"type": finish_reason},
        "prompt_tokens": use["prompt_tokens"],
        "completion_tokens": use["completion_tokens"],
        "cached_tokens": use["prompt_tokens_details"]["cached_tokens"],
        "e2e_latency": round(seconds, 6),
    }
    if dflash:
        out["spec_verify_ct"] = dflash["cycles"]
        out["spec_accept_length"] = dflash["mean_acceptance_length"] or 0.0
    return out


def _channels(message: dict, reasoning: str, tool_calls: list | None, legacy: bool = False) -> dict:
    if reasoning:
        message["reasoning"] = message["reasoning_content"] = reasoning
    if tool_calls and legacy:  # the request's legacy ``functions``: one call, as ``function_call``
        message["function_call"] = {k: tool_calls[0]["function"][k] for k in ("name", "arguments")}
    elif tool_calls:
        message["tool_calls"] = tool_calls
    return message


@dataclass
class Reply:
    """Builds the objects of one reply; `kind` is "chat" or "text"."""

    kind: str
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0  # characters of the reply so far (legacy logprobs' text_offset)
    legacy_functions: bool = False  # the request's legacy ``functions``: a call is a ``function_call``

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"

    def _object(self, suffix: str = "") -> dict:
        name = ("chat.completion" + suffix) if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": name, "created": self.created, "model": self.model}

    def logprobs(self, tokens: list[Token]) -> dict | None:
        """The ``logprobs`` of a choice for these token events (None when none were asked for)."""
        tokens = [t for t in tokens if t.logprob is not None]
        if not tokens:
            return None
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": t.token_text,
                        "logprob": t.logprob,
                        "bytes": list(t.token_text.encode()),
                        "top_logprobs": [
                            {"token": s, "logprob": v, "bytes": list(s.encode())} for _, s, v in t.top or []
                        ],
                    }
                    for t in tokens
                ]
            }
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t.token_text)
        return {
            "tokens": [t.token_text for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{s: v for _, s, v in t.top} if t.top is not None else None for t in tokens],
            "text_offset": offsets,
        }

    def chunk(
        self,
        text: str,
        tokens: list[Token],
        finish_reason: str | None = None,
        *,
        first: bool = False,
        dflash: dict | None = None,
        reasoning: str = "",
        tool_calls: list | None = None,
        meta: dict | None = None,
    ) -> dict:
        """One stream chunk: new text, reasoning or tool calls (and its tokens' logprobs), or the
        final one with the finish reason."""
        choice = {"index": 0, "logprobs": self.logprobs(tokens), "finish_reason": finish_reason}
        if self.kind == "chat":
            delta = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = _channels(delta, reasoning, tool_calls, self.legacy_functions)
        else:
            choice["text"] = text
        out = {**self._object(".chunk"), "choices": [choice]}
        if dflash:
            out["dflash"] = dflash
        if meta:
            out["meta_info"] = meta
        return out

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self._object(".chunk"), "choices": [], "usage": usage_}

    def whole(
        self,
        text: str,
        tokens: list[Token],
        finish_reason: str,
        usage_: dict,
        dflash: dict,
        *,
        reasoning: str = "",
        tool_calls: list | None = None,
        meta: dict | None = None,
    ) -> dict:
        """The complete (non-streamed) response."""
        choice = {"index": 0, "logprobs": self.logprobs(tokens), "finish_reason": finish_reason}
        if self.kind == "chat":
            choice["message"] = _channels(
                {"role": "assistant", "content": text or None}, reasoning, tool_calls, self.legacy_functions
            )
        else:
            choice["text"] = text
        out = {**self._object(), "choices": [choice], "usage": usage_}
        if dflash:
            out["dflash"] = dflash
        if meta:
            out["meta_info"] = meta
        return out


class Completion(Exchange):
    """A /v1/chat/completions request (`TextCompletion`: /v1/completions). A streamed reply holds the
    logprobs of a tool call's tokens until the call is sent, as mlx_lm.server does, and ends with
    ``data: [DONE]``."""

    kind = "chat"
    done = b"data: [DONE]\n\n"

    @staticmethod
    def error(status: int, message: str, field: str | None = None) -> dict:
        return error_body(message, field, status)

    def __init__(self, request, model: str):
        super().__init__(request, model)
        self.reply = Reply(request.kind, model, legacy_functions=request.legacy_functions)
        self.parts, self.tokens = Delta(), []  # tokens: events whose logprobs are not sent yet
        self.first = True

    @classmethod
    def parse(cls, body, server, key: int | None = None) -> Completion:
        return cls(parse_request(cls.kind, body, server.info), server.model_id)

    def feed(self, delta: Delta, token: Token, holding: bool) -> list:
        if token.token is not None:
            self.tokens.append(token)
        if not self.request.stream:
            self.parts.add(delta)
            return []
        if holding or not (delta or self.first or (self.request.logprobs and self.tokens)):
            return []
        chunk = self.reply.chunk(
            delta.content, self.tokens, first=self.first, reasoning=delta.reasoning, tool_calls=delta.tool_calls
        )
        self.first, self.tokens = False, []
        return [(None, chunk)]

    def finish(self, delta: Delta, outcome: Outcome) -> list:
        if not self.request.stream:
            self.parts.add(delta)
            return []
        use = self._usage(outcome)
        events = [
            (
                None,
                self.reply.chunk(
                    delta.content,
                    self.tokens,
                    self._reason(outcome),
                    first=self.first,
                    dflash=outcome.dflash,
                    reasoning=delta.reasoning,
                    tool_calls=delta.tool_calls,
                    meta=self._meta(outcome, use),
                ),
            )
        ]
        if self.request.include_usage:
            events.append((None, self.reply.usage_chunk(use)))
        return events

    def whole(self, outcome: Outcome) -> dict:
        use = self._usage(outcome)
        return self.reply.whole(
            self.parts.content,
            self.tokens,
            self._reason(outcome),
            use,
            outcome.dflash,
            reasoning=self.parts.reasoning,
            tool_calls=self.parts.tool_calls,
            meta=self._meta(outcome, use),
        )

    def _reason(self, outcome: Outcome) -> str:
        legacy = self.request.legacy_functions and outcome.reason == "tool_calls"
        return "function_call" if legacy else outcome.reason

    @staticmethod
    def _usage(outcome: Outcome) -> dict:
        return usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)

    def _meta(self, outcome: Outcome, use: dict) -> dict | None:
        if not self.request.return_meta_info:
            return None
        return meta_info(self.reply.id, outcome.reason, use, outcome.dflash, outcome.seconds)


class TextCompletion(Completion):
    kind = "text"
