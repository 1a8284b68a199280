"""What the generation worker hands the HTTP handlers: a `Job` and its events.

A job's events are `Started`, then `Token`s, then `Finished`; or `Failed` at
any point. They hold plain Python only (the worker thread turns everything
MLX computes into numbers and strings before putting them on the queue).
`failure` turns what a request raised into its `Failed` by cause, the one rule
of both worker modes: the client's (4xx naming the field) or the server's (500).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from ..stats import RunStats
from ..structured.constraint import GrammarFault
from .errors import RequestError
from .request import GenerationRequest


# What a failed generation raises (MLX raises RuntimeError / ValueError): answered with a 500.
GENERATION_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, ArithmeticError, MemoryError)


@dataclass
class Started:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the session's caches already held
    initial_state: str = "normal"  # the reply's first channel ("reasoning": the prompt opened a think block)


@dataclass
class Token:
    text: str  # text released by this token ("" while a possible stop sequence is held back)
    token: int | None  # None: held-back text released at the end, no token of its own
    token_text: str = ""
    logprob: float | None = None
    top: list[tuple[int, str, float]] | None = None  # (id, text, logprob), best first


@dataclass
class Finished:
    finish_reason: str
    completion_tokens: int
    dflash: dict = field(default_factory=dict)
    stop_sequence: str | None = None  # the stop sequence that ended the reply (finish_reason "stop")


@dataclass
class Failed:
    status: int
    message: str
    field: str | None = None


class Discard:
    """A follower's events: nobody reads them."""

    def put(self, event) -> None:
        pass


class Job:
    """One request in the worker's queue, what it was prepared into (`prompts.Prepared`, None until
    then) and the events it produces."""

    def __init__(self, request: GenerationRequest, prepared=None):
        self.request = request
        self.prepared = prepared
        self.events: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Cancelled(Exception):
    """Raised inside a generation whose job was cancelled (between prefill chunks)."""


CANCELLED = "the request was cancelled (the client went away or the server is stopping)"


def failure(e: Exception, request: GenerationRequest) -> Failed:
    """The event ending a request that raised `e`, by cause: the client's (a field it sent, a grammar
    that fails mid-output: 4xx naming the field) or the server's (500); the same in every worker mode."""
    if isinstance(e, RequestError):
        return Failed(e.status, str(e), e.field)
    if isinstance(e, GrammarFault) and request.grammar_field:
        field = request.grammar_field
        return Failed(400, f"{field}: the output cannot go on under this format: {e}", field)
    if isinstance(e, Cancelled):
        return Failed(503, CANCELLED)
    return Failed(500, f"generation failed: {type(e).__name__}: {e}")


def dflash_object(stats: RunStats) -> dict:
    """A reply's acceptance statistics (the response's ``dflash`` object)."""
    acceptance = stats.acceptance_length
    return {
        "block_size": "auto" if stats.adaptive and stats.block_size else stats.block_size,
        "max_block_size": stats.block_size,
        "block_sizes": stats.blocks_dict(),
        "cycles": stats.cycles,
        "mean_acceptance_length": round(acceptance, 4) if acceptance is not None else None,
        "drafted_tokens": stats.drafted,
        "acceptance_histogram": list(stats.histogram_dict().values()),  # entry i: cycles of i + 1 tokens
        "tokens_by_source": stats.sources_dict(),  # lookup (copied from the context), the drafter's, target
    }
