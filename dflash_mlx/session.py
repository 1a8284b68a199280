"""Target and drafter state kept across generations (prefix reuse).

A `Session` owns the target's caches, the tokens they hold and the drafter
that feeds on them. Each generation hands it the full prompt (for a chat: the
whole templated history); `begin` keeps the longest prefix the caches already
hold and returns its length, so only the rest is prefilled:

- the prompt extends what the caches hold: nothing to undo;
- it diverges inside the held tokens (a re-rendered reply, an edit): plain KV
  caches are trimmed; ring (sliding-window) and Gated DeltaNet caches cannot
  be trimmed, so they go back to the checkpoint taken at the end of the last
  prompt's prefill, if that point is still a common prefix;
- otherwise the caches start afresh.

The engine keeps the caches honest: they hold the prompt and every committed
token except the last (the next anchor, not yet fed; a generation closed early
keeps its last anchor too), and generation stopped at a stop token keeps
nothing at or after it; after an exception inside a generation (a progress
callback or a logits processor raising) they are cut back or dropped
(`abandon`). The drafter's context follows the same positions
(`Proposer.start(..., reused=n)`). The lookup index of copy-aware drafting
(`lookup_source`) holds the tokens of the last generation (prompt and output): the
next prompt keeps what it shares with them. A session may carry a suffix index
(`suffix_index`, `proposers.suffix`: what generations produced, shared across
sessions, or the conversation's own with `private`), the default of calls that
pass none; `span_sources` gives a generation both span sources. `hold(tokens)` makes the caches hold exactly
some tokens (the mlx-lm plugin leaves mlx-lm's own cache lists that way).
A session may work on a caller's cache list (`cache=`), which it updates in
place and never replaces.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

from .proposers import Proposer, as_proposer
from .proposers.base import reads_features
from .proposers.lookup import LookupIndex, LookupProposer
from .proposers.suffix import SuffixIndex, SuffixProposer
from .targets.adapter import TargetAdapter
from .targets.quantized_kv import KVQuantization, kv_quantization
from .targets.rollback import VerifyRecord, held, rollback, trimmable


@dataclass
class _Checkpoint:
    position: int
    states: list  # per cache: a private copy of its state, or None for trimmable caches


def _copy(state):
    """A copy no later in-place cache update can reach (lists and arrays included)."""
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(x) for x in state)
    return mx.array(state) if isinstance(state, mx.array) else state


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Session:
    """Caches of one conversation with one target (and optionally one drafter).

    `cache` (optional) is a caller's list of per-layer caches, e.g. mlx-lm's
    prompt cache: it is updated in place and never replaced.
    """

    def __init__(
        self,
        target: TargetAdapter,
        proposer: Proposer | None,
        draft=None,
        cache: list | None = None,
        draft_sampling: str = "sample",
        kv: KVQuantization | None = None,
        suffix_index: SuffixIndex | None = None,
    ):
        check_draft_sampling(draft_sampling)
        self.draft_sampling = draft_sampling  # the default of calls that do not choose
        self.kv = kv  # the KV-cache quantization of calls that give none (`targets.quantized_kv`)
        self.target = target
        self.model = target.model
        self.proposer = proposer
        self.draft = draft  # what the proposer was made from (a drafter, a Proposer or None)
        self.cache: list | None = cache
        self._given = cache is not None
        self.tokens: list[int] = []  # what the caches hold, in order
        self._checkpoint: _Checkpoint | None = None
        self._open = None  # settles the generation still open on these caches (`opened`), if any
        self.reused = 0  # prompt tokens the last `begin` kept
        self.prompt_length = 0  # tokens of the last generation's prompt (what the caches held after its prefill)
        self._lookup: LookupIndex | None = None  # the last generation's tokens, indexed (`lookup_source`)
        self._lookup_source: LookupProposer | None = None  # that index as a span source
        self.suffix_index = check_suffix_index(suffix_index)  # the default of calls that pass none
        self._suffix_prompt: list[int] | None = None  # the last prompt recorded in a private suffix index

    def opened(self, settle) -> None:
        """A generation began on these caches; `settle()` makes them hold only what it committed (its
        queued verify undone) and ends it, should anything else use the session before it is closed."""
        self._open = settle

    def closed(self, settle) -> None:
        """The generation `settle` belongs to is over."""
        if self._open == settle:  # (a bound method is a new object at each access: equal, not identical)
            self._open = None

    def _settle(self) -> None:
        """Settle a generation left open (a stream kept after a `break`) before the caches are used."""
        settle, self._open = self._open, None
        if settle is not None:
            settle()

    def reset(self) -> None:
        """Forget everything (the next generation prefills its whole prompt)."""
        self._settle()
        if self._given:
            raise RuntimeError("A session over a caller's cache list cannot drop it.")
        self.cache, self.tokens, self._checkpoint, self.prompt_length = None, [], None, 0

    def begin(self, prompt: list[int]) -> int:
        """Make the caches hold a prefix of `prompt` (never all of it); return its length."""
        self._settle()
        keep = self._keep_prefix(prompt[:-1])
        self._start_proposer(prompt, keep)
        self.reused = keep
        return keep

    def hold(self, tokens: list[int]) -> None:
        """Make the caches (and the drafter's context) hold exactly `tokens`, feeding what they lack."""
        self._settle()
        keep = self._keep_prefix(tokens)
        self._start_proposer(tokens, keep)
        rest = tokens[keep:]
        if rest:
            _, features = self.target.forward(mx.array(rest, mx.int32)[None], self.cache, logits=False)
            feeds = reads_features(self.proposer)
            if feeds:
                self.proposer.add_context(features)
            mx.eval([c.state for c in self.cache if c is not None], self.proposer.state() if feeds else [])
        self.tokens = list(tokens)

    def usable_prefix(self, prompt: list[int]) -> int:
        """How many leading tokens of `prompt` `begin` would keep (nothing changes)."""
        return self._plan(prompt[:-1])[0]

    def _plan(self, wanted: list[int]) -> tuple[int, str | None]:
        """(tokens to keep, how: "extend", "trim", "checkpoint" or None for fresh caches)."""
        if self.cache is None:
            return 0, None
        common = common_prefix(self.tokens, wanted)
        if common == len(self.tokens):
            return common, "extend"
        if (common or self._given) and all(trimmable(c) for c in self.cache):
            return common, "trim"
        if self._checkpoint and 0 < self._checkpoint.position <= common:
            return self._checkpoint.position, "checkpoint"
        return 0, None

    def _keep_prefix(self, wanted: list[int]) -> int:
        """Cut the caches back to the longest prefix of `wanted` they can keep (fresh caches if none)."""
        keep, how = self._plan(wanted)
        if how == "trim":
            for c in self.cache:
                if c is not None:
                    c.trim(len(self.tokens) - keep)
        elif how == "checkpoint":
            self._restore(self._checkpoint)
        if keep == 0 and self.tokens and self._given:
            raise RuntimeError("A caller's cache list cannot be emptied: its caches cannot be trimmed.")
        if keep == 0 and not self._given:
            self.cache = self.target.make_cache()
        if keep == 0:  # (fresh caches: the checkpoint describes others)
            self._checkpoint = None
        self.tokens = list(wanted[:keep])
        return keep

    def _start_proposer(self, prompt: list[int], keep: int) -> None:
        if self.proposer is None:
            return
        if keep:
            self.proposer.start(self.target, mx.array(prompt, mx.int32), reused=keep)
        else:
            self.proposer.start(self.target, mx.array(prompt, mx.int32))

    def prefilled(self, prompt: list[int]) -> None:
        """The whole prompt is in the caches: remember it, checkpoint untrimmable state."""
        self.tokens = list(prompt)
        self.prompt_length = len(prompt)
        if all(trimmable(c) for c in self.cache):
            self._checkpoint = None
            return
        states = [None if trimmable(c) else _copy(c.state) for c in self.cache]
        self._checkpoint = _Checkpoint(len(prompt), states)

    def abandon(self) -> None:
        """A generation raised (a progress callback cancelling, a logits processor, Ctrl-C): the caches
        may hold rows past `tokens` (a prefill chunk, a verify not rolled back). Sliding-window and Gated
        DeltaNet caches go back to the checkpoint (the end of the last prompt prefilled) when `tokens`
        reach it, and plain KV caches are cut back to the tokens kept; otherwise the session starts
        afresh (a caller's cache list keeps what it holds, as mlx-lm leaves its own: its length says so)."""
        caches = [c for c in self.cache or [] if c is not None]
        if all(trimmable(c) for c in caches):
            for c in caches:
                c.trim(max(0, held(c) - len(self.tokens)))
        elif self._checkpoint is not None and self._checkpoint.position <= len(self.tokens):
            self._restore(self._checkpoint)
            self.tokens = self.tokens[: self._checkpoint.position]
        elif not self._given:
            self.reset()

    def lookup_source(self, prompt: list[int]) -> LookupProposer:
        """The span source of a generation's copy-aware drafting, in step with `prompt` (the planner
        commits what the generation adds): the last generation's index, cut back to what it shares with
        `prompt` (trimmed in place; a chat's next turn extends it)."""
        if self._lookup_source is None:
            self._lookup = LookupIndex()
            self._lookup_source = LookupProposer(self._lookup)
        self._lookup_source.start(self.target, prompt)
        return self._lookup_source

    def span_sources(self, prompt: list[int], acceptor, *, lookup: bool, suffix: SuffixIndex | None) -> list:
        """A generation's span sources from `prompt` on (none without a drafter, nor under a grammar): the
        copy index (`lookup`) and the suffix index `suffix`."""
        if self.proposer is None or acceptor.constraint is not None:
            return []
        sources = [self.lookup_source(prompt)] if lookup else []
        if suffix is not None and suffix is self.suffix_index and suffix.private:
            suffix = self._conversation_index(prompt)
        if suffix is not None:
            source = SuffixProposer(suffix)
            source.start(self.target, prompt)
            sources.append(source)
        return sources

    def _conversation_index(self, prompt: list[int]) -> SuffixIndex:
        """The session's private suffix index for a generation from `prompt`: it holds what this conversation
        produced, a conversation being requests each of whose prompts contains the one before (its next
        turn, a retried step); a prompt of another (a session the prompt cache branched for a prompt sharing
        only a prefix) starts an empty one."""
        held = self._suffix_prompt
        if held is not None and prompt[: len(held)] != held:
            self.suffix_index = SuffixIndex(self.suffix_index.max_tokens, private=True)
        self._suffix_prompt = list(prompt)
        return self.suffix_index

    def fed(self, tokens: list[int]) -> None:
        """`tokens` were committed to the caches after the prompt."""
        self.tokens.extend(tokens)

    def keep_anchor_only(self, record: VerifyRecord, anchor: int, features: mx.array | None) -> None:
        """Keep only the first row of a queued verify (`record`): `anchor`, a committed token.

        `features` are that verify's captured rows, so the drafter's context
        keeps following the caches. (Dropping every row instead would fail for
        a single-row update of a full ring cache, which cannot be undone.)
        """
        rollback(self.cache, record, keep=1)
        if features is not None and reads_features(self.proposer):
            self.proposer.add_context(features[:, :1])
        self.tokens.append(anchor)

    @property
    def nbytes(self) -> int:
        """Bytes this session holds: target caches, drafter context, checkpoint (arrays), the lookup index
        of copy-aware drafting and its private suffix index."""
        arrays = [c.state for c in self.cache or [] if c is not None]
        arrays += self.proposer.state() if self.proposer is not None else []
        arrays += self._checkpoint.states if self._checkpoint else []
        index = self._lookup.nbytes if self._lookup is not None else 0
        own = self.suffix_index.nbytes if self.suffix_index is not None and self.suffix_index.private else 0
        return index + own + sum(a.nbytes for _, a in tree_flatten(arrays) if isinstance(a, mx.array))

    def copy(self) -> Session:
        """An independent session holding the same tokens (its own caches, drafter context and
        checkpoint; the proposer must have `fork(context=True)`). A shared suffix index stays shared; a
        private one (a conversation's) is copied: the copy keeps it for a prompt of the same conversation."""
        if self._given:
            raise RuntimeError("A session over a caller's cache list cannot be copied.")
        self._settle()
        proposer = None
        if self.proposer is not None:
            fork = getattr(self.proposer, "fork", None)
            if not callable(fork):
                raise RuntimeError(f"{type(self.proposer).__name__} has no fork(): its context cannot be copied.")
            proposer = fork(context=True)
        suffix = self.suffix_index
        if suffix is not None and suffix.private:
            suffix = suffix.copy()
        other = Session(
            self.target, proposer, self.draft, draft_sampling=self.draft_sampling, kv=self.kv, suffix_index=suffix
        )
        other.cache = copy.deepcopy(self.cache)
        other.tokens, other._checkpoint = list(self.tokens), copy.deepcopy(self._checkpoint)
        other.prompt_length, other._suffix_prompt = self.prompt_length, self._suffix_prompt
        if self._lookup is not None:  # (copied: rebuilding it would cost a pass over every token)
            other._lookup = self._lookup.copy()
            other._lookup_source = LookupProposer(other._lookup)
        return other

    def saved(self) -> dict:
        """What a saved session holds (`session_store`): tokens, target caches, checkpoint, drafter context."""
        self._settle()
        saved_context = getattr(self.proposer, "saved_context", None)
        checkpoint = self._checkpoint
        return {
            "tokens": list(self.tokens),
            "prompt_length": self.prompt_length,
            "cache": self.cache,
            "checkpoint": (checkpoint.position, checkpoint.states) if checkpoint else None,
            "draft": saved_context() if callable(saved_context) else None,
        }

    def restore(self, tokens: list[int], cache: list, checkpoint: tuple | None, draft, prompt_length: int = 0) -> None:
        """Hold a saved session's state (the caches must be this target's)."""
        if self._given:
            raise RuntimeError("A session over a caller's cache list cannot take another.")
        if reads_features(self.proposer):
            if draft is None:
                raise ValueError("the saved session has no drafter context")
            self.proposer.restore_context(self.target, draft)
        self.cache, self.tokens, self.prompt_length = cache, list(tokens), prompt_length
        self._checkpoint = _Checkpoint(*checkpoint) if checkpoint else None

    def _restore(self, checkpoint: _Checkpoint) -> None:
        """Back to `checkpoint`: its copies for the caches that cannot be cut back, the others cut back to
        its position (by what each holds: after an exception they may hold more than `tokens`)."""
        for c, state in zip(self.cache, checkpoint.states):
            if c is None:
                continue
            if state is None:
                c.trim(held(c) - checkpoint.position)
            else:
                c.state = _copy(state)


def adapter_for(model: nn.Module, proposer: Proposer | None) -> TargetAdapter:
    """The target seen with the features `proposer` reads (its layers; the final hidden state)."""
    layer_ids = proposer.layer_ids if proposer is not None else ()
    return TargetAdapter(model, layer_ids, final=bool(getattr(proposer, "reads_final", False)))


def check_suffix_index(index) -> SuffixIndex | None:
    if index is not None and not isinstance(index, SuffixIndex):
        raise ValueError(
            f"suffix_index must be a dflash_mlx.SuffixIndex (or None), got {type(index).__name__}: make one with "
            "SuffixIndex(max_tokens) and pass the same object to every call that should share it."
        )
    return index


def check_draft_sampling(value: str) -> None:
    if value not in ("sample", "argmax"):
        raise ValueError(f"draft_sampling must be 'sample' or 'argmax', got {value!r}.")


def make_session(
    model: nn.Module,
    draft=None,
    *,
    max_draft_context: int | None = None,
    draft_sampling: str = "sample",
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    suffix_index: SuffixIndex | None = None,
) -> Session:
    """A reusable cache for `stream_generate(..., session=...)` with this model and drafter.

    `draft_sampling` and the KV-cache quantization (`kv_bits`, `kv_group_size`,
    `quantized_kv_start`, as `mlx_lm.generate` takes them) are the defaults of calls
    on the session that give none; so is `suffix_index` (a `SuffixIndex`: what earlier
    generations produced drafts what this one produces again, shared with every session
    and call given the same object).
    """
    if max_draft_context is not None and max_draft_context < 1:
        raise ValueError(f"max_draft_context must be >= 1, got {max_draft_context}.")
    check_suffix_index(suffix_index)
    proposer = as_proposer(draft, model, max_draft_context)
    kv = kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
    return Session(
        adapter_for(model, proposer),
        proposer,
        draft,
        draft_sampling=draft_sampling,
        kv=kv,
        suffix_index=suffix_index,
    )
