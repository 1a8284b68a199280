"""What a request becomes before it is queued: its prompt tokens, its token limit and its grammar.

The decode thread only decodes: a request's chat template, its tokenizing, the
checks against the model's context and the memory budget, and its compiled
grammar are made here, in the request's own thread (the HTTP handler's), and the
job carries them to the worker (`Prepared`). A request that cannot be served
is refused here (a `RequestError`: 400 naming its messages, prompt or
``max_tokens``) before anything is queued:

- an empty prompt, or one that leaves no room in the model's context
  (``max_tokens`` is cut to the context that remains);
- one whose caches could not fit in the memory budget even alone: the
  weights plus the caches of its prompt and ``max_tokens`` generated tokens
  (`limits.Footprint`) must stay under the budget (``--max-batch-bytes``).

A sharded server's followers have no handler: they prepare the requests rank 0
sends them themselves, the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jinja2 import TemplateError

from ..structured import Grammar
from .channels import initial_state
from .errors import RequestError
from .request import GenerationRequest


@dataclass
class Prepared:
    """A request ready to generate."""

    prompt: list[int]
    max_tokens: int  # cut to the context that remains
    grammar: Grammar | None  # compiled (`formats.Grammars`)
    state: str = "normal"  # the reply's first channel (`channels.initial_state`)


class Preparer:
    """Prepares requests for one worker (its tokenizer, context, memory budget and grammars)."""

    def __init__(self, tokenizer, context_length: int | None, budget: int, weights: int, footprint, grammars):
        self.tokenizer, self.context_length = tokenizer, context_length
        self.budget, self.weights, self.footprint, self.grammars = budget, weights, footprint, grammars

    def prepare(self, req: GenerationRequest) -> Prepared:
        """The request's prompt, token limit and grammar; a `RequestError` when it cannot be served."""
        field = "messages" if req.kind == "chat" else "prompt"
        prompt = self.tokenize(req)
        if not prompt:
            raise RequestError(field, "the prompt is empty: at least one token is needed")
        max_tokens = req.max_tokens
        if self.context_length is not None:
            room = self.context_length - len(prompt)
            if room < 1:
                raise RequestError(
                    field,
                    f"the prompt is {len(prompt)} tokens, the model's context is "
                    f"{self.context_length} tokens: leave room for at least one generated token",
                )
            max_tokens = min(max_tokens, room)
        self._check_memory(len(prompt), max_tokens, field)
        grammar = self.grammars.get(req.grammar) if req.grammar else None
        state = initial_state(self.tokenizer, prompt) if req.kind == "chat" else "normal"
        return Prepared(prompt, max_tokens, grammar, state)

    def _check_memory(self, prompt: int, max_tokens: int, field: str) -> None:
        """A 400 when the caches of `prompt` + `max_tokens` tokens cannot fit in the budget even alone."""
        room = self.budget - self.weights
        fits = self.footprint.tokens_within(room)
        if prompt + max_tokens <= fits:
            return
        need = self.footprint.bytes(prompt + max_tokens) / 1e9
        budget = (
            f"this server's memory budget ({self.budget / 1e9:.2f} GB, --max-batch-bytes) leaves "
            f"{max(room, 0) / 1e9:.2f} GB beside the weights"
        )
        if prompt + 1 > fits:
            raise RequestError(
                field,
                f"the caches of a {prompt}-token prompt need about {need:.2f} GB; {budget}: "
                f"room for {fits} tokens in all",
            )
        raise RequestError(
            "max_tokens",
            f"a {prompt}-token prompt and {max_tokens} generated tokens need about "
            f"{need:.2f} GB of caches; {budget}: at most {fits - prompt} tokens after this prompt",
        )

    def tokenize(self, req: GenerationRequest) -> list[int]:
        """The request's prompt tokens; a `RequestError` (400) naming its messages or prompt when the chat
        template or the tokenizer refuses them. (The tokenizer only reads: any thread may call this.)"""
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
