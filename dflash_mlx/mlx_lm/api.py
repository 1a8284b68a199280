"""mlx-lm's API with DFlash underneath: switch a script by changing one import.

`load` takes ``mlx_lm.load``'s parameters and returns exactly what it returns,
remembering the model's DFlash drafter outside the model (`remember_draft` for
a model loaded otherwise). `stream_generate` / `generate` take mlx-lm's
arguments and run DFlash with a DFlash ``draft_model`` or the remembered
drafter; an ordinary draft model, no drafter, or an option DFlash cannot honour
runs ``mlx_lm.stream_generate`` itself (one warning per reason and process);
``kv_bits`` and its options run DFlash on mlx-lm's quantized KV cache. Two
keywords mlx-lm does not have: ``lookup`` (True by default; False: no copy-aware
drafting, `dflash_mlx.policy.adaptive`) and ``suffix_index`` (a
`dflash_mlx.SuffixIndex` shared by the calls given it: spans from what earlier
generations produced), dropped where mlx-lm decodes.
Samplers: `samplers`; mlx-lm's own prompt-cache lists: `cache`;
`make_prompt_cache` with a drafter gives a `DFlashPromptCache` (a `Session`).
What users see: docs/usage.md (the drop-in).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generation_stream
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..acceptance import seed_from_mlx
from ..draft.load import DRAFTERS, load_draft, resolve_model_dir
from ..mtp.scan import has_mtp_weights
from ..proposers.mtp import load_mtp
from ..engine import SUPERSEDED
from ..generation import encode_prompt
from ..generation import stream_generate as dflash_stream_generate
from ..models.dtype import target_float_dtype
from .samplers import UnsupportedSampler, sampler_settings
from ..proposers.base import Proposer
from .cache import list_cache_problem, list_session, opened_on, remember
from ..models.resolve import MTP, entry_for_target
from ..session import Session, make_session
from ..targets.adapter import target_problem
from ..targets.quantized_kv import kv_quantization

# Every keyword mlx_lm.stream_generate passes on to generate_step / speculative_generate_step.
OPTIONS = frozenset(
    {
        "sampler",
        "logits_processors",
        "max_kv_size",
        "prompt_cache",
        "prefill_step_size",
        "kv_bits",
        "kv_group_size",
        "quantized_kv_start",
        "prompt_progress_callback",
        "input_embeddings",
        "num_draft_tokens",
    }
)

_drafters: dict[int, object] = {}  # id(model) -> drafter; entries leave with their model
_warned: set[str] = set()


def remember_draft(model: nn.Module, draft) -> None:
    """Use `draft` (a DFlash drafter, a Proposer or None) for `model` from now on."""
    key = id(model)
    if key not in _drafters:
        weakref.finalize(model, _drafters.pop, key, None)
    _drafters[key] = draft


def remembered_draft(model: nn.Module):
    """The drafter `load` or `remember_draft` recorded for `model`, or None."""
    return _drafters.get(id(model))


def load(
    path_or_hf_repo: str,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    adapter_path: Optional[str] = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: Optional[str] = None,
    trust_remote_code: bool = False,
    *,
    draft: str | Path | None = None,
):
    """``mlx_lm.load`` with the same parameters, remembering the model's DFlash drafter.

    `draft` is a drafter directory or repo id, or "mtp" (the target's own
    multi-token-prediction heads); None takes the one models.toml registers for
    `path_or_hf_repo` (a registry name, a repo id, the bundled pair's directory
    or a local copy named like a registered repo), else the target's MTP heads
    where its checkpoint keeps them. Without any, generation is plain mlx-lm
    decoding (a warning says so).
    """
    target = str(path_or_hf_repo)
    entry = entry_for_target(target)
    if entry is not None and not Path(target).expanduser().exists() and target.lower() == entry.name.lower():
        target = _registered(entry, "target")
    loaded = mlx_lm.load(
        target,
        tokenizer_config=tokenizer_config,
        model_config=model_config,
        adapter_path=adapter_path,
        lazy=lazy,
        return_config=return_config,
        revision=revision,
        trust_remote_code=trust_remote_code,
    )
    model = loaded[0]
    if draft is None and entry is not None:
        draft = _registered(entry, "draft")
    own = None  # the checkpoint directory whose MTP heads draft (draft="mtp", or no drafter registered)
    if draft is None or str(draft).lower() == MTP:
        own = resolve_model_dir(target, "target model")
    if draft is None and not has_mtp_weights(str(own)):
        warnings.warn(
            f"No DFlash drafter is registered for '{path_or_hf_repo}' (models.toml), none was passed "
            "(draft=...) and its checkpoint has no MTP weights: generation falls back to plain mlx-lm decoding.",
            stacklevel=2,
        )
        remember_draft(model, None)
        return loaded
    problem = target_problem(model)
    if problem is not None:
        warnings.warn(f"{problem} Generation falls back to plain mlx-lm decoding.", stacklevel=2)
        remember_draft(model, None)
        return loaded
    if own is not None:
        drafter = load_mtp(own, model, dtype=target_float_dtype(model))
    else:
        drafter = load_draft(draft, model, dtype=target_float_dtype(model), target_name=target)
    remember_draft(model, drafter)
    return loaded


def _registered(entry, field: str) -> str:
    """A registry entry's target or draft location (packaged directories for bundled entries)."""
    return entry.target_path() if field == "target" else entry.draft_path()


class DFlashPromptCache:
    """An mlx-lm-style prompt cache for DFlash: target and drafter caches of one conversation.

    ``tokens`` is everything the cache stands for (every earlier prompt and
    generated token, as in an mlx-lm cache); the session below reuses what its
    caches already hold of it.
    """

    def __init__(self, session: Session):
        self.session = session
        self.tokens: list[int] = []

    @property
    def model(self) -> nn.Module:
        return self.session.model

    @property
    def draft(self):
        return self.session.draft


def make_prompt_cache(model: nn.Module, max_kv_size: int | None = None, *, draft_model=None):
    """A prompt cache for `stream_generate(..., prompt_cache=...)` with this model.

    With a DFlash drafter (`draft_model`, else the remembered one) a
    `DFlashPromptCache`; otherwise ``mlx_lm.models.cache.make_prompt_cache``.
    """
    draft = draft_model if draft_model is not None else remembered_draft(model)
    if not _is_dflash(draft):
        return mlx_lm_make_prompt_cache(model, max_kv_size=max_kv_size)
    if max_kv_size is not None:
        raise ValueError(
            "max_kv_size: a DFlash prompt cache cannot be a bounded rotating cache (drafts are verified "
            "and rolled back in it); pass max_kv_size=None, or decode without a drafter."
        )
    return DFlashPromptCache(make_session(model, draft))


def _is_dflash(draft) -> bool:
    return isinstance(draft, (*DRAFTERS, Proposer))


def reset_warnings() -> None:
    """Warn again of fallbacks already warned of (each reason is warned of once per process)."""
    _warned.clear()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"dflash_mlx.mlx_lm: {reason}: falling back to mlx-lm's own decoding.", stacklevel=3)


def _fallback_reason(model, kwargs: dict, stream) -> str | None:
    """Why these options need mlx-lm's decoding, or None if DFlash honours them all."""
    try:
        sampler_settings(kwargs.get("sampler"))
    except UnsupportedSampler as e:
        return str(e)
    for name in ("max_kv_size", "input_embeddings"):
        if kwargs.get(name) is not None:
            return f"{name} is not supported with a DFlash drafter"
    cache = kwargs.get("prompt_cache")
    if cache is not None and not isinstance(cache, DFlashPromptCache):
        problem = list_cache_problem(model, cache)
        if problem:
            return problem
    if stream is not generation_stream:
        return "DFlash runs on mlx-lm's generation stream, not on another stream="
    return None


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt,
    max_tokens: int = 256,
    draft_model=None,
    stream=generation_stream,
    **kwargs,
):
    """``mlx_lm.stream_generate`` with DFlash drafting (see the module docstring)."""
    lookup = kwargs.pop("lookup", True)  # (mlx-lm's signature stays as it is: keywords it lacks, popped)
    suffix_index = kwargs.pop("suffix_index", None)
    unknown = sorted(set(kwargs) - OPTIONS)
    if unknown:
        raise TypeError(
            f"stream_generate() got an unexpected keyword argument {unknown[0]!r} "
            f"(mlx-lm's options: {', '.join(sorted(OPTIONS))})."
        )
    draft = draft_model if draft_model is not None else remembered_draft(model)
    cache = kwargs.get("prompt_cache")
    reason = _fallback_reason(model, kwargs, stream) if _is_dflash(draft) else None
    if not _is_dflash(draft) or reason:
        if isinstance(cache, DFlashPromptCache):
            raise ValueError(
                "prompt_cache: a DFlash prompt cache cannot be used by mlx-lm's decoding"
                + (f" ({reason})" if reason else " (no DFlash drafter)")
                + "; make one with mlx_lm.models.cache.make_prompt_cache(model) instead."
            )
        if reason:
            _warn_once(reason)
        plain_draft = None if _is_dflash(draft_model) else draft_model
        return mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens, draft_model=plain_draft, stream=stream, **kwargs
        )
    return _dflash(model, tokenizer, prompt, max_tokens, draft, lookup=lookup, suffix_index=suffix_index, **kwargs)


def _dflash(
    model,
    tokenizer,
    prompt,
    max_tokens,
    draft,
    *,
    sampler=None,
    logits_processors=None,
    prompt_cache=None,
    prefill_step_size=2048,
    prompt_progress_callback=None,
    num_draft_tokens=None,
    kv_bits=None,
    kv_group_size=64,
    quantized_kv_start=DEFAULT_QUANTIZED_KV_START,
    lookup=True,
    suffix_index=None,
    **_unused_none,
):
    # _unused_none holds max_kv_size and input_embeddings, both None here.
    settings = sampler_settings(sampler)
    if num_draft_tokens is not None and (
        isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 0
    ):
        raise ValueError(f"num_draft_tokens must be an integer >= 0, got {num_draft_tokens!r}.")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = encode_prompt(tokenizer, prompt).tolist()
    session, earlier = None, []
    if isinstance(prompt_cache, DFlashPromptCache):
        if prompt_cache.model is not model or prompt_cache.draft is not draft:
            raise ValueError(
                "prompt_cache: this DFlash prompt cache was made for another model or drafter "
                "(make_prompt_cache(model, draft_model=...))."
            )
        session, earlier = prompt_cache.session, list(prompt_cache.tokens)
    elif prompt_cache is not None:  # mlx-lm's list (checked by _fallback_reason)
        session = list_session(model, draft, prompt_cache)
        earlier = list(session.tokens)
    if prompt_progress_callback is not None and earlier:
        # mlx-lm counts this call's prompt tokens only (from 0), not the cached ones
        prompt_progress_callback = _counting_from(prompt_progress_callback, len(earlier))
    if logits_processors and earlier:
        # mlx-lm's processors see the tokens of this call only, not the cached ones.
        logits_processors = [_skipping(p, len(earlier)) for p in logits_processors]
    # mlx-lm's sampling draws from MLX's global generator, which a script seeds for reproducible output:
    # the seed is taken from it here, so the run counts as seeded (its draws keyed by position)
    seed = None if settings.greedy else seed_from_mlx()
    responses = dflash_stream_generate(
        model,
        draft,
        tokenizer,
        earlier + ids,
        max_tokens=max_tokens,
        seed=seed,
        block_size=None if num_draft_tokens is None else num_draft_tokens + 1,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        logits_processors=logits_processors,
        prefill_step_size=prefill_step_size,
        prompt_progress_callback=prompt_progress_callback,
        session=session,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
        lookup=lookup,
        suffix_index=suffix_index,
    )
    kv = kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    return _relabelled(responses, len(ids), prompt_cache, session, earlier + ids, kv)


def _counting_from(callback, n: int):
    def progress_of_this_prompt(done: int, total: int) -> None:
        callback(max(done - n, 0), total - n)

    return progress_of_this_prompt


def _skipping(processor, n: int):
    def processor_without_cached_tokens(tokens: mx.array, logits: mx.array) -> mx.array:
        return processor(tokens[n:], logits)

    return processor_without_cached_tokens


def _relabelled(responses, prompt_tokens: int, cache, session: Session | None, held: list[int], kv=None):
    """Report this call's prompt length (as mlx-lm does with a cache) and keep the cache's tokens.

    `held` grows to everything an mlx-lm cache would hold after the call: the
    earlier tokens, the prompt and every token yielded so far. An mlx-lm cache
    list is then made to hold exactly that (the engine leaves the last token
    unfed), as mlx-lm's own decoding would leave it (`kv`: quantized as mlx-lm's last
    step leaves it).
    """
    earlier = len(held) - prompt_tokens
    yielded = settled = False

    def settle() -> None:
        """Leave the list as mlx-lm would (at the end, or when the list is used again while this stream
        is open: `cache.list_session`)."""
        nonlocal settled
        if settled:
            return
        settled = True
        responses.close()  # an early stop: the session undoes a queued verify now
        if isinstance(cache, list):
            # Nothing yielded (an error before the first token): leave the list as it was, if it can be.
            wanted = held if yielded else held[:earlier]
            with mx.stream(generation_stream):
                if session.tokens != wanted and (yielded or len(session.tokens) >= earlier):
                    session.hold(wanted)
                if kv is not None and yielded:
                    kv.convert(cache)
            remember(cache, session)

    if isinstance(cache, list):
        opened_on(cache, session.draft, settle)
    try:
        for r in responses:
            if cache is not None:
                if isinstance(cache, DFlashPromptCache):
                    cache.tokens = held  # every prompt token and every token yielded so far
                held.append(r.token)
            yielded = True
            yield dataclasses.replace(r, prompt_tokens=prompt_tokens)
            if settled:
                raise RuntimeError(SUPERSEDED)
    finally:
        settle()


def generate(model: nn.Module, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """``mlx_lm.generate``: the whole text, printed with timings when `verbose`."""
    return consume(stream_generate(model, tokenizer, prompt, **kwargs), verbose)


def consume(responses, verbose: bool, observe=None) -> str:
    """Collect the text as ``mlx_lm.generate`` does, printing what it prints when `verbose`
    (the text between ``==========`` lines, then the timings); `observe` sees each response."""
    if verbose:
        print("=" * 10)
    text, response = "", None
    for response in responses:
        if observe is not None:
            observe(response)
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if len(text) == 0:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
