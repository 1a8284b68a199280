"""OpenAI response objects: chat and text completions, whole or as stream chunks, and errors.

Shapes follow OpenAI's API: ``chat.completion`` / ``chat.completion.chunk``
(``message`` / ``delta``, chat-style ``logprobs.content`` entries with
``top_logprobs``) and ``text_completion`` (legacy ``logprobs`` with
``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``), ``usage``
with ``prompt_tokens_details.cached_tokens``, and errors as
``{"error": {"message", "type", "param", "code"}}``. Each reply also carries a
``dflash`` object with its acceptance statistics (`worker.dflash_object`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .worker import Token


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


@dataclass
class Reply:
    """Builds the objects of one reply; `kind` is "chat" or "text"."""

    kind: str
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0  # characters of the reply so far (legacy logprobs' text_offset)

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
            return {"content": [
                {"token": t.token_text, "logprob": t.logprob, "bytes": list(t.token_text.encode()),
                 "top_logprobs": [{"token": s, "logprob": v, "bytes": list(s.encode())} for _, s, v in t.top or []]}
                for t in tokens
            ]}  # fmt: skip
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

    def chunk(self, text: str, tokens: list[Token], finish_reason: str | None = None, *,
              first: bool = False, dflash: dict | None = None) -> dict:  # fmt: skip
        """One stream chunk: new text (and its tokens' logprobs), or the final one with the finish reason."""
        choice = {"index": 0, "logprobs": self.logprobs(tokens), "finish_reason": finish_reason}
        if self.kind == "chat":
            delta = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        out = {**self._object(".chunk"), "choices": [choice]}
        if dflash:
            out["dflash"] = dflash
        return out

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self._object(".chunk"), "choices": [], "usage": usage_}

    def whole(self, text: str, tokens: list[Token], finish_reason: str, usage_: dict, dflash: dict) -> dict:
        """The complete (non-streamed) response."""
        choice = {"index": 0, "logprobs": self.logprobs(tokens), "finish_reason": finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        out = {**self._object(), "choices": [choice], "usage": usage_}
        if dflash:
            out["dflash"] = dflash
        return out
