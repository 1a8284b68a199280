"""`batch_generate` / `stream_batch_generate`: many prompts, decoded together with DFlash.

In the spirit of mlx-lm's `batch_generate` (same prompts, `max_tokens` per
prompt or for all, its `BatchResponse` and `BatchStats`), with continuous
batching: up to `max_batch` prompts are in the batch at once and a finished
row's place goes to the next prompt. Each prompt is prefilled alone, then
verified with the others (`engine.BatchDecoder`). Every prompt may bring its
own sampler settings, logits processors, seed and response format
(`row_settings`: each row follows its own grammar); each row's output is
exactly what `stream_generate` gives for it (greedy: token for token;
sampled: the same distribution).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Iterator

import mlx.core as mx
from mlx_lm.generate import BatchResponse
from mlx_lm.generate_utils import BatchStats
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..acceptance import Acceptor
from ..generation import DFlashResponse, encode_prompt
from ..models.block_size import check_block_size, default_block_size
from ..proposers.base import Proposer, fork_for_row
from ..sampling import SamplingSettings
from ..session import make_session
from ..structured import Grammar
from .block_choice import BatchBlockChoice
from .calibration import batch_cost_model
from .engine import BatchDecoder

ROW_KEYS = {"temperature", "top_p", "top_k", "min_p", "seed", "logits_processors", "max_tokens", "response_format"}


def _rows(prompts: list, max_tokens, row_settings, defaults: dict) -> list[dict]:
    n = len(prompts)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    if len(limits) != n:
        raise ValueError(f"max_tokens: {len(limits)} limits for {n} prompts.")
    extra = row_settings or [{}] * n
    if len(extra) != n:
        raise ValueError(f"row_settings: {len(extra)} entries for {n} prompts.")
    rows = []
    for i, (limit, own) in enumerate(zip(limits, extra)):
        unknown = set(own) - ROW_KEYS
        if unknown:
            raise ValueError(f"row_settings[{i}]: unknown keys {sorted(unknown)}; expected some of {sorted(ROW_KEYS)}.")
        row = {**defaults, "max_tokens": limit, **own}
        if row["max_tokens"] == 0:
            raise ValueError(f"max_tokens of prompt {i} must be non-zero (-1: no limit).")
        if row["seed"] is not None and "seed" not in own:
            row["seed"] = defaults["seed"] + i  # distinct, reproducible streams
        rows.append(row)
    return rows


class RowStream:
    """One row's tokens as `DFlashResponse`s: its detokenizer and count (as `stream_generate` gives them)."""

    def __init__(self, tokenizer, prompt_tokens: int):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.eos = tokenizer.eos_token_ids
        self.prompt_tokens, self.count = prompt_tokens, 0

    def responses(self, step) -> Iterator[DFlashResponse]:
        """The responses of one step's `engine.RowTokens` (a stop token's text is not decoded)."""
        detokenizer = self.detokenizer
        for k, token in enumerate(step.tokens):
            self.count += 1
            last = k == len(step.tokens) - 1
            finish = step.finish if last else None
            if finish == "stop" and token in self.eos:
                detokenizer.finalize()
            else:
                detokenizer.add_token(token)
                if finish:
                    detokenizer.finalize()
            closes = last and step.block_size > 0
            yield DFlashResponse(
                text=detokenizer.last_segment,
                token=token,
                logprobs=step.logprobs[k],
                from_draft=k < step.drafted,
                source=step.source if k < step.drafted else "target",
                prompt_tokens=self.prompt_tokens,
                prompt_tps=0.0,
                generation_tokens=self.count,
                generation_tps=0.0,
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                cycle_tokens=len(step.tokens) if closes else None,
                cycle_block_size=step.block_size if closes else None,
            )


def _acceptor(row: dict, prompt: mx.array) -> Acceptor:
    """A row's acceptor: its sampler settings, processors, seed and grammar (`_rows`)."""
    settings = SamplingSettings(
        temperature=row["temperature"], top_p=row["top_p"], top_k=row["top_k"], min_p=row["min_p"]
    )
    constraint = row["grammar"].constraint() if row["grammar"] else None
    return Acceptor(settings, prompt, row["logits_processors"], row["seed"], constraint=constraint)


def row_sessions(model, draft, count: int) -> list:
    """One session per row, each with a proposer of its own: a drafter gets a new proposer per row, a
    `Proposer` object a `fork()` of it (a proposer without one is refused here, before anything runs: one
    object serving every row would draft each row from another's state)."""
    if isinstance(draft, Proposer):
        return [make_session(model, fork_for_row(draft)) for _ in range(count)]
    return [make_session(model, draft) for _ in range(count)]


def batch_decoder(session, block_size: int | str | None) -> BatchDecoder:
    """A decoder for rows like `session`: a fixed block, or None / "auto" for the batch's adaptive choice."""
    proposer = session.proposer
    if proposer is None:
        return BatchDecoder(session.target, 1)
    if block_size is None or block_size == "auto":
        largest = default_block_size(session.model, session.draft)
        return BatchDecoder(session.target, largest, BatchBlockChoice(batch_cost_model(session, largest), largest))
    if isinstance(block_size, str):
        raise ValueError(f"block_size must be an integer >= 1, None or 'auto', got {block_size!r}.")
    check_block_size(block_size, proposer)
    return BatchDecoder(session.target, block_size)


def stream_batch_generate(
    model,
    draft,
    tokenizer,
    prompts: list,
    *,
    max_tokens: int | list[int] = 128,
    block_size: int | str | None = None,
    max_batch: int = 8,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    logits_processors: list | None = None,
    row_settings: list[dict] | None = None,
    prefill_step_size: int = 2048,
    response_format=None,
    lookup: bool = True,
    stats: BatchStats | None = None,
) -> Iterator[tuple[int, DFlashResponse]]:
    """Yield (prompt index, response) for every generated token, rows interleaved as they decode.

    `block_size`: the block every step verifies; None (or "auto"): chosen each step for the
    batch (`block_choice`), up to the drafter's block (at most 5 for <= 4-bit models),
    plain batched decoding included; 1 without a drafter. `seed` seeds prompt i with seed + i unless
    its `row_settings` entry gives one. `response_format` (as `stream_generate` takes it) constrains
    every row, or a row's own entry that row. `lookup`: a row's drafting steps verify a span copied from
    its context where it has a match (`engine`). `stats` (an mlx-lm `BatchStats`) is filled in.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}.")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    if any(p.size == 0 for p in encoded):
        raise ValueError("A prompt is empty: at least one token is needed.")
    defaults = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    defaults.update(logits_processors=logits_processors, response_format=response_format)
    rows = _rows(encoded, max_tokens, row_settings, defaults)
    for row in rows:  # compiled once per distinct format, before any prompt runs
        row["grammar"] = Grammar.of(tokenizer, row["response_format"])
    sessions = row_sessions(model, draft, len(encoded))
    decoder = batch_decoder(sessions[0], block_size)
    eos = tokenizer.eos_token_ids
    waiting = deque(range(len(encoded)))
    index, streams = {}, {}
    stats = stats if stats is not None else BatchStats()
    started = time.perf_counter()

    while waiting or decoder.rows:
        joining = []
        while waiting and len(decoder.rows) + len(joining) < max_batch:
            i = waiting.popleft()
            acceptor = _acceptor(rows[i], encoded[i])
            joining.append((i, (sessions[i], encoded[i], acceptor, rows[i]["max_tokens"], None, lookup)))
        if joining:
            tic = time.perf_counter()
            firsts = decoder.insert_many([r for _, r in joining], stop_tokens=eos, prefill_step_size=prefill_step_size)
            stats.prompt_time += time.perf_counter() - tic
            for (i, _), first in zip(joining, firsts):
                stats.prompt_tokens += encoded[i].size
                stats.generation_tokens += len(first.tokens)
                index[first.uid], streams[i] = i, RowStream(tokenizer, encoded[i].size)
                yield from ((i, r) for r in streams[i].responses(first))
        tic = time.perf_counter()
        steps = decoder.step()
        stats.decode_time += time.perf_counter() - tic
        stats.generation_steps += 1 if steps else 0
        for step in steps:
            if step.fault is not None:  # (a row's grammar failed: the library raises it)
                raise step.fault
            stats.generation_tokens += len(step.tokens)
            i = index[step.uid]
            yield from ((i, r) for r in streams[i].responses(step))
    stats.wall_time = time.perf_counter() - started
    stats.peak_memory = mx.get_peak_memory() / 1e9


def batch_generate(
    model,
    draft,
    tokenizer,
    prompts: list,
    *,
    max_tokens: int | list[int] = 128,
    return_token_ids: bool = False,
    verbose: bool = False,
    **kwargs,
) -> BatchResponse:
    """Every prompt's reply as mlx-lm's `BatchResponse` (texts in prompt order; see `stream_batch_generate`)."""
    stats = BatchStats()
    texts = [[] for _ in prompts]
    ids = [[] for _ in prompts]
    for i, r in stream_batch_generate(model, draft, tokenizer, prompts, max_tokens=max_tokens, stats=stats, **kwargs):
        texts[i].append(r.text)
        if r.finish_reason != "stop":
            ids[i].append(r.token)
    if verbose:
        print(
            f"[batch_generate] Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} "
            f"tokens-per-sec; peak memory {stats.peak_memory:.3f} GB"
        )
    return BatchResponse(["".join(t) for t in texts], stats, None, ids if return_token_ids else None)
