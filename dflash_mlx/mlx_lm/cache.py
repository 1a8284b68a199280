"""mlx-lm's own prompt caches (lists of per-layer caches) running DFlash.

A list made by ``mlx_lm.models.cache.make_prompt_cache(model)`` (or
``load_prompt_cache``) passed as ``prompt_cache=`` to
`dflash_mlx.mlx_lm.stream_generate` is filled in place with exactly what
mlx-lm would leave in it: everything it held before, the call's prompt and
every token the call yielded (EOS included), so ``save_prompt_cache``,
``load_prompt_cache``, ``trim_prompt_cache`` and mlx-lm's own decoding keep
working on it.

The DFlash drafter's context for a list lives here, beside it: keyed by the
list's identity and dropped when the list's first cache object is collected
(lists cannot be weakly referenced). A list this module has not seen (loaded
from disk, filled by mlx-lm) is continued with an empty drafter context for
what it already holds: acceptance may dip, the output never changes. The
tokens of such a list are unknown and never needed (each call only appends),
so placeholders stand for them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import mlx.nn as nn

from ..proposers import Proposer, as_proposer
from ..targets.rollback import UnsupportedCacheError, check_caches, held
from ..session import Session, adapter_for
from ..targets.adapter import TargetAdapter, UnsupportedTargetError

UNKNOWN_TOKEN = 0  # stands for a token a list held before DFlash saw it


@dataclass
class _Binding:
    first: weakref.ref  # the list's first cache object: the list is still the one we saw
    draft: object  # what the proposer was made from
    proposer: Proposer | None
    tokens: list[int]  # what the list held after the last DFlash call on it
    open: Callable[[], None] | None = None  # settles a DFlash stream on the list that is still open


_bindings: dict[int, _Binding] = {}  # id(list) -> binding


def held_length(cache: list) -> int | None:
    """How many tokens an mlx-lm cache list holds (its attention caches' offset), or None."""
    return next((n for n in map(held, cache) if n is not None), None)


def list_cache_problem(model: nn.Module, cache) -> str | None:
    """Why DFlash cannot run on this mlx-lm cache list (mlx-lm's decoding must), or None."""
    if not cache:
        return "prompt_cache is an empty list"
    try:
        target = TargetAdapter(model)
        check_caches(cache, target.family_name)
    except (UnsupportedCacheError, UnsupportedTargetError) as e:
        return f"prompt_cache: {e}"
    expected = len(target.make_cache())
    if len(cache) != expected:
        return f"prompt_cache holds {len(cache)} layer caches, this model makes {expected}"
    if held_length(cache) is None:
        return "prompt_cache has no attention cache that says how many tokens it holds"
    return None


_ANY_DRAFT = object()


def _binding(cache: list, draft=_ANY_DRAFT) -> _Binding | None:
    """The list's binding while its first cache is the one bound (and, if given, for `draft`)."""
    bound = _bindings.get(id(cache))
    if bound is None or bound.first() is not cache[0] or (draft is not _ANY_DRAFT and bound.draft is not draft):
        return None
    return bound


def list_session(model: nn.Module, draft, cache: list) -> Session:
    """A session over the caller's `cache` list (never replaced), with its drafter context; a stream on
    the list left open is settled first (the list then holds what mlx-lm's would)."""
    earlier = _binding(cache)  # (whatever drafter its stream used)
    if earlier is not None and earlier.open is not None:
        settle, earlier.open = earlier.open, None
        settle()
    bound = _binding(cache, draft)
    held = held_length(cache)
    if bound is None:
        proposer = as_proposer(draft, model)
        bound = _Binding(weakref.ref(cache[0]), draft, proposer, [])
        key = id(cache)
        _bindings[key] = bound
        weakref.finalize(cache[0], _forget, key, bound)
    tokens = bound.tokens[:held] if len(bound.tokens) >= held else [UNKNOWN_TOKEN] * held
    proposer = bound.proposer
    session = Session(adapter_for(model, proposer), proposer, draft, cache=cache)
    session.tokens = tokens
    return session


def opened_on(cache: list, draft, settle: Callable[[], None]) -> None:
    """A DFlash stream on the list began; `settle()` leaves the list as mlx-lm would and ends it."""
    bound = _binding(cache, draft)
    if bound is not None:
        bound.open = settle


def remember(cache: list, session: Session) -> None:
    """Record what the list holds after a DFlash call on it (its drafter context is the session's); caches
    the call replaced in the list (quantized, as mlx-lm's kv_bits does) keep it bound."""
    bound = _bindings.get(id(cache))
    if bound is None or bound.draft is not session.draft or session.cache is not cache:
        return
    if bound.first() is not cache[0]:
        bound.first = weakref.ref(cache[0])
        weakref.finalize(cache[0], _forget, id(cache), bound)
    bound.tokens = list(session.tokens)
    bound.open = None


def _forget(key: int, bound: _Binding) -> None:
    if _bindings.get(key) is bound and bound.first() is None:
        del _bindings[key]
