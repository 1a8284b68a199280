"""`stream_generate` / `generate`: prompts in, mlx-lm `GenerationResponse`s out.

Follows `mlx_lm.stream_generate`'s conventions exactly (string prompts encoded
with its BOS rule, one response per token, an EOS ends the stream as the final
response with finish_reason "stop" and no text, max_tokens ends it with
"length"), and adds `cycle_tokens` and `cycle_block_size`: how many tokens the
draft-verify cycle that produced this token committed and how many rows it
verified, set on the last token of each cycle, and `source`: what proposed the
token ("lookup": copied from the context, "dflash": the drafter, or another
proposer's own name, `proposers.base.source_name`; "suffix": what an earlier
generation produced, from a `suffix_index`; "target": the target's own
pick). The block is adaptive unless the caller fixes it (`dflash_mlx.policy`);
`lookup` (on by default) lets a cycle verify a span copied from the context
instead, and `suffix_index` one that earlier generations produced (`policy.adaptive`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, GenerationResponse, generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .acceptance import Acceptor
from .models.block_size import check_block_size, default_block_size
from .engine import speculative_cycles
from .policy.adaptive import adaptive_policy
from .sampling import SamplingSettings
from .session import Session, check_draft_sampling, check_suffix_index, make_session
from .sharding.lockstep import check_lockstep
from .structured import Grammar
from .targets.quantized_kv import kv_quantization


@dataclass
class DFlashResponse(GenerationResponse):
    """An mlx-lm `GenerationResponse` plus the tokens and the block of the cycle it closes."""

    cycle_tokens: Optional[int] = None
    cycle_block_size: Optional[int] = None
    source: Optional[str] = None  # an accepted draft's source ("lookup", "dflash", ...); "target": the target's


def encode_prompt(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    """Encode like `mlx_lm.stream_generate`: add special tokens unless the text starts with BOS."""
    if isinstance(prompt, mx.array):  # a lazy reshape would cost a host sync when the engine reads the ids
        return prompt if prompt.ndim == 1 else prompt.reshape(-1)
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return mx.array(list(prompt), dtype=mx.int32)


def stream_generate(
    model: nn.Module,
    draft,
    tokenizer,
    prompt,
    *,
    max_tokens: int = 256,
    block_size: int | str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    logits_processors: list | None = None,
    seed: int | None = None,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    max_draft_context: int | None = None,
    draft_sampling: str | None = None,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    session: Session | None = None,
    max_block_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    response_format=None,
    lookup: bool = True,
    suffix_index=None,
) -> Iterator[DFlashResponse]:
    """Generate from `model`, drafting with `draft` (a DFlash drafter, a Proposer or None).

    `draft=None` decodes plainly through the same code path (cycle_tokens stays None).
    `block_size=None` (or "auto") chooses each cycle's block adaptively, up to the
    drafter's block (capped at 5 for <= 4-bit models), plain decoding included:
    argmax of expected tokens over the cycle's cost, calibrated on this machine
    at first use and cached (`dflash_mlx.policy`); an integer fixes the block
    (at most the drafter's own block: a wider one is a ValueError).
    `max_block_size` replaces the drafter's block as the adaptive maximum.
    `temperature > 0` samples exactly from the target's distribution as processed by
    mlx-lm's `make_sampler(temp, top_p, min_p, top_k)` (rejection sampling);
    `logits_processors` are mlx-lm's (e.g. `make_logits_processors`); `seed` makes
    sampled output reproducible. `draft_sampling="argmax"` makes a DFlash drafter
    propose its argmax tokens (one-hot q) instead of samples of q when sampling
    (for this call only; None: the session's choice, by default "sample").
    XTC (`xtc_probability > 0`) has no fixed distribution to verify drafts
    against: it is refused with a drafter and runs mlx-lm's sampler without one.
    `max_draft_context` bounds the committed positions the drafter attends to (its
    sliding layers keep window - 1 anyway): less memory and draft time in long
    conversations, possibly lower acceptance; the output does not change.
    `session` (from `make_session(model, draft)`) keeps the target and drafter
    caches across calls: a prompt that extends the previous prompt and reply
    (a chat's next turn) only prefills what is new. Output is unchanged.
    A tensor-sharded target (`load(..., shard="tensor")`) needs the same call on
    every rank; at the end the ranks check they generated the same tokens
    (`sharding.lockstep.LockstepError` otherwise). `kv_bits`, `kv_group_size` and
    `quantized_kv_start` quantize the target's KV cache as `mlx_lm.generate` does
    (output equal to mlx-lm's with the same settings; not for sliding-window targets);
    without `kv_bits`, a session's own settings (`make_session(..., kv_bits=...)`) apply.
    `response_format` constrains the output to a grammar (`dflash_mlx.structured`): OpenAI's
    ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ...,
    "strict": ...}}``, a pydantic model class, a `structured.Grammar` or llguidance grammar text;
    the drafts are chosen under it too. The output is what plain decoding under the same grammar
    gives (`structured.GrammarLogitsProcessor` in mlx-lm); a format llguidance cannot compile is
    a ValueError.
    `lookup=True` (the default): a cycle may verify, instead of the drafter's block, the tokens that
    followed the longest earlier occurrence of the sequence's end in the prompt or the output (a point
    mass: exact under sampling too), where that is expected to commit more per second (`policy.adaptive`;
    with a drafter, not under a `response_format`). The output does not change.
    `suffix_index` (a `dflash_mlx.SuffixIndex`; None: the session's, if any) keeps what generations
    produced: this one drafts spans from it where an earlier generation produced what followed the
    same tokens (source "suffix"), and records its own tokens. Pass the same object to every call (or
    session) that should share it: an agent loop's calls, its threads. The output does not change.
    """
    if not isinstance(lookup, bool):
        raise ValueError(f"lookup must be True or False, got {lookup!r}.")
    check_suffix_index(suffix_index)
    settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    kv = kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    grammar = Grammar.of(tokenizer, response_format)
    prompt = encode_prompt(tokenizer, prompt)
    if prompt.size == 0:
        raise ValueError("The prompt is empty: at least one token is needed.")
    if session is None:
        session = make_session(
            model, draft, max_draft_context=max_draft_context, draft_sampling=draft_sampling or "sample"
        )
    elif session.model is not model or session.draft is not draft:
        raise ValueError("The session was made with another model or drafter (make_session(model, draft)).")
    elif max_draft_context is not None:
        raise ValueError("Pass max_draft_context to make_session, not with a session.")
    if draft_sampling is not None:
        check_draft_sampling(draft_sampling)
    draft_sampling = draft_sampling or session.draft_sampling  # this call's choice; the session keeps its own
    proposer, target = session.proposer, session.target
    kv = kv or session.kv
    suffix_index = suffix_index if suffix_index is not None else session.suffix_index
    if kv is not None and (problem := kv.problem(session.cache or target.make_cache())):
        raise ValueError(problem + ".")
    if xtc_probability and proposer is not None:
        raise ValueError(
            "XTC sampling (xtc_probability > 0) has no fixed distribution, so drafts cannot be "
            "verified against it: pass draft=None (plain decoding) or drop XTC."
        )
    if not 0 <= xtc_probability <= 1:
        raise ValueError(f"xtc_probability must be in [0, 1], got {xtc_probability!r}.")
    if proposer is not None:  # a block wider than the drafter's is refused before anything is allocated
        check_block_size(max_block_size, proposer, "max_block_size")
        check_block_size(
            block_size if isinstance(block_size, int) else getattr(block_size, "max_block", None), proposer
        )
    if max_block_size is not None and (not isinstance(max_block_size, int) or max_block_size < 1):
        raise ValueError(f"max_block_size must be an integer >= 1, got {max_block_size!r}.")
    acceptor = Acceptor(
        settings,
        prompt,
        logits_processors,
        seed,
        xtc=(xtc_probability, xtc_threshold, sorted(tokenizer.eos_token_ids)) if xtc_probability else None,
        sample_drafts=draft_sampling == "sample",
        constraint=grammar.constraint() if grammar else None,
    )
    if block_size is None or block_size == "auto":
        if proposer is None:  # plain decoding: nothing to choose
            block_size = 1
        else:
            largest = max_block_size or default_block_size(model, draft)
            # every run carries the drafter's acceptance history of its kind from one call to the next and
            # follows this machine's timing: no block choice changes greedy text, an unseeded run's
            # distribution or a seeded run's draws (keyed by position)
            block_size = adaptive_policy(target, proposer, largest, carry=True, kv=kv, sampled=not settings.greedy)
    elif max_block_size is not None:
        raise ValueError("max_block_size is for the adaptive block (block_size=None), not a fixed one.")
    elif isinstance(block_size, str) or (not hasattr(block_size, "choose") and not isinstance(block_size, int)):
        raise ValueError(f"block_size must be an integer >= 1, None or 'auto', got {block_size!r}.")

    responses = _responses(
        session,
        prompt,
        tokenizer,
        max_tokens,
        block_size,
        prefill_step_size,
        prompt_progress_callback,
        acceptor,
        kv,
        lookup,
        suffix_index,
    )
    group = getattr(target, "group", None)
    if group is None or group.size() == 1:
        yield from responses
        return
    tokens = []  # a sharded target: the ranks prove they generated the same tokens
    try:
        for response in responses:
            tokens.append(response.token)
            yield response
    except GeneratorExit:  # closed early: at the same token on every rank, as every rank runs the same calls
        responses.close()
        check_lockstep(group, tokens)
        raise
    check_lockstep(group, tokens)


def _responses(
    session,
    prompt,
    tokenizer,
    max_tokens,
    block_size,
    prefill_step_size,
    prompt_progress,
    acceptor,
    kv=None,
    lookup=False,
    suffix=None,
) -> Iterator[DFlashResponse]:
    """The responses of one generation (`stream_generate` has checked its arguments)."""
    proposer, target = session.proposer, session.target
    model = session.model
    counts_cycles = proposer is not None
    eos = tokenizer.eos_token_ids
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    with wired_limit(model, [generation_stream]):
        tic = time.perf_counter()
        cycles = speculative_cycles(
            target,
            prompt,
            proposer,
            max_tokens=max_tokens,
            block_size=block_size,
            prefill_step_size=prefill_step_size,
            prompt_progress=prompt_progress,
            acceptor=acceptor,
            stop_tokens=eos,
            session=session,
            kv=kv,
            lookup=lookup,
            suffix=suffix,
        )
        n = 0
        with mx.stream(generation_stream):
            for cycle in cycles:
                in_cycle = counts_cycles and not cycle.from_prefill
                if n == 0:
                    prompt_tps = (prompt.size - session.reused) / (time.perf_counter() - tic)
                    tic = time.perf_counter()
                for i, token in enumerate(cycle.tokens):
                    n += 1
                    finish = None
                    if cycle.stopped and i == len(cycle.tokens) - 1:  # the engine cut the cycle at a stop token
                        finish = "stop"
                    else:
                        detokenizer.add_token(token)
                        if n == max_tokens:
                            finish = "length"
                    if finish:
                        detokenizer.finalize()
                    closes_cycle = in_cycle and (finish or i + 1 == len(cycle.tokens))
                    yield DFlashResponse(
                        text=detokenizer.last_segment,
                        token=token,
                        logprobs=cycle.logprobs[i],
                        from_draft=i < cycle.drafted,
                        source=cycle.source if i < cycle.drafted else "target",
                        prompt_tokens=prompt.size,
                        prompt_tps=prompt_tps,
                        generation_tokens=n,
                        generation_tps=n / max(time.perf_counter() - tic, 1e-9),
                        peak_memory=mx.get_peak_memory() / 1e9,
                        finish_reason=finish,
                        cycle_tokens=(i + 1) if closes_cycle else None,
                        cycle_block_size=cycle.block_size if closes_cycle else None,
                    )
                    if finish:
                        return


def generate(model: nn.Module, draft, tokenizer, prompt, **kwargs) -> str:
    """The whole completion as one string (same arguments as `stream_generate`)."""
    return "".join(r.text for r in stream_generate(model, draft, tokenizer, prompt, **kwargs))
