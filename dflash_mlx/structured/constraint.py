"""One generation's place in a grammar: the masks of a verify's rows and the drafts chosen under them.

A `Constraint` follows the committed tokens with llguidance's matcher
(`commit`). For a cycle it picks the drafts on the host, row by row, from the
drafter's logits of the whole block (one forward, one host sync of its top
candidates): row i is masked with the grammar state after the drafts before
it, its best allowed candidate is taken (greedy drafts: the drafter's masked
argmax; sampled drafts: a Gumbel-max sample of its masked, tempered
distribution, which is then the q the verifier is given), and the matcher
advances along it; where the grammar forces the next bytes
(``compute_ff_tokens``) their first token is the draft (one-hot q). The same
walk gives the masks of the verify's rows (row i: the state after the
committed tokens and drafts[:i]); the matcher is then rolled back to the
committed tokens. A drafter whose row i depends on the draft chosen at row
i - 1 (`draft_stepwise`: DSpark's Markov head) is asked row by row, each row
with the draft before it (one host sync per row), so its q is the
distribution each draft was drawn from. A proposer without the drafter's logits (`draft_logits`)
drafts deterministically and a draft the grammar refuses is replaced.

Masked target rows (-inf outside the grammar) make greedy decoding the
constrained argmax and keep rejection sampling exact (masked p, and q the
distribution the draft was drawn from). EOS is allowed only where the grammar
accepts, and once the grammar is complete only EOS is; an EOS is never fed
to the matcher (the generation ends there; rollback counts stay exact). The
logits may be wider than the tokenizer's vocabulary: the extra ids are
disallowed. A grammar the library fails on at a mask (one of its limits met
mid-output) raises `GrammarFault`: the grammar's error, its generation's alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from ..proposers.base import Proposal
from ..sampling import gumbel_rows, row_keys

CANDIDATES = 16  # drafter candidates per row brought to the host (a row none of them fits costs one more sync)


class GrammarFault(RuntimeError):
    """The grammar library failed on this grammar mid-output (a limit of `grammar.LIMITS` met at a later
    mask): the grammar's fault, its request's alone, never the engine's."""


def library_error(matcher) -> str:
    """The matcher's error, without the marker llguidance adds when errors are not verbose."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


def expand(words: np.ndarray, width: int) -> mx.array:
    """Bit rows [n, W] (int32, llguidance's layout) as boolean rows [n, width] (False past the vocabulary)."""
    bits = (mx.array(words.view(np.uint32))[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    bits = bits.reshape(words.shape[0], -1).astype(mx.bool_)
    if bits.shape[1] >= width:
        return bits[:, :width]
    return mx.concatenate([bits, mx.zeros((bits.shape[0], width - bits.shape[1]), mx.bool_)], axis=1)


def masked(logits: mx.array, allowed: mx.array) -> mx.array:
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))


class Constraint:
    def __init__(self, matcher, eos: frozenset[int], vocab_size: int):
        self.matcher, self.eos, self.vocab_size = matcher, eos, vocab_size
        self.words = (vocab_size + 31) // 32
        self.held: list[int] = []  # the tokens taken (through the first EOS: nothing after it is)
        self._eos_only = np.zeros(self.words, np.int32)
        for t in eos:
            self._eos_only.view(np.uint32)[t >> 5] |= np.uint32(1 << (t & 31))
        self._walk: tuple[list[int], np.ndarray] | None = None  # the last walk's drafts and bit rows

    # -- the committed tokens -------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        """An EOS was taken."""
        return bool(self.held) and self.held[-1] in self.eos

    def commit(self, tokens: list[int]) -> None:
        """Take committed tokens (each must follow the grammar)."""
        taken = self._take(tokens)
        if taken < len(tokens) and not self.ended:
            raise self._refusal(tokens[taken])

    def _refusal(self, token: int) -> Exception:
        """Why the matcher refused a committed token (every one was chosen under this constraint's masks): the
        library's failure, the grammar's fault, when it is in error or refused a token its own mask allows (a
        limit met while consuming it, which `try_consume_tokens` does not record); the engine's error when the
        mask refuses the token too."""
        if not self.matcher.is_error():
            row = self._fill(np.empty((1, self.words), np.int32), 0, False)  # (a GrammarFault if this fails)
            if not self.allows(row, token):
                return RuntimeError(f"token {token} does not follow the grammar (its mask refuses it)")
        reason = library_error(self.matcher) or "the grammar library refused a token its mask allows"
        return GrammarFault(f"token {token} does not follow the grammar: {reason}")

    def follow(self, tokens: list[int]) -> None:
        """Hold the longest prefix of `tokens` that follows the grammar (a history that may step back
        or carry refused drafts: `processor`)."""
        common = 0
        for a, b in zip(self.held, tokens):
            if a != b:
                break
            common += 1
        fed = len(self.held) - self.ended  # (an EOS is never fed to the matcher)
        self.matcher.rollback(max(0, fed - common))
        del self.held[common:]
        self._take(tokens[common:])

    def _take(self, tokens: list[int]) -> int:
        """Feed tokens until one is refused (or an EOS ends the output); returns how many were taken."""
        self._walk = None
        for i, t in enumerate(tokens):
            if self.ended:
                return i
            if t in self.eos:
                if not self.matcher.is_accepting():
                    return i
            elif self.matcher.try_consume_tokens([t]) != 1:
                return i
            self.held.append(t)
        return len(tokens)

    def _fill(self, out: np.ndarray, row: int, ended: bool) -> np.ndarray:
        """The bit row of the matcher's state (`ended`: after an EOS) into out[row]."""
        if ended:
            out[row] = self._eos_only
        else:
            fill_next_token_bitmask(self.matcher, out, row)
            if self.matcher.is_error():
                raise GrammarFault(f"the grammar library (llguidance) failed: {library_error(self.matcher)}")
        return out[row]

    @staticmethod
    def allows(words: np.ndarray, token: int) -> bool:
        return token < 32 * words.size and bool((int(words[token >> 5]) >> (token & 31)) & 1)

    # -- a cycle's rows -------------------------------------------------------------------------

    def masks(self, rows: int, drafts: mx.array | None, width: int) -> mx.array:
        """Allowed tokens [rows, width] of a verify of the anchor and `drafts` (row i: after drafts[:i])."""
        ids = [] if drafts is None else drafts.tolist()
        if self._walk is not None and self._walk[0] == ids:
            return expand(self._walk[1], width)
        words = np.empty((rows, self.words), np.int32)
        consumed, ended = 0, self.ended
        for i in range(rows):
            row = self._fill(words, i, ended)
            if i < len(ids):
                if not self.allows(row, ids[i]):  # a refused draft is never accepted, so the rows after
                    words[i + 1 :] = row  # it may be judged under any non-empty mask
                    break
                ended = ended or ids[i] in self.eos
                if not ended:
                    self.matcher.consume_token(ids[i])
                    consumed += 1
        self.matcher.rollback(consumed)
        self._walk = (ids, words)
        return expand(words, width)

    def forced_block(self, limit: int) -> int:
        """The block that drafts the whole run of tokens the grammar forces next (at most `limit`)."""
        return min(limit, 1 + (0 if self.ended else len(self.matcher.compute_ff_tokens())))

    def propose(self, proposer, anchor: mx.array, position: int, count: int, sampling, key) -> Proposal:
        """`count` drafts after the anchor that the grammar allows (see the module docstring); a block
        the grammar forces whole needs no drafter."""
        forced = [] if self.ended else self.matcher.compute_ff_tokens()
        if len(forced) >= count:
            return self._walk_rows(count, lambda i, words, _: forced[i] if self.allows(words, forced[i]) else None)
        stepwise = getattr(proposer, "draft_stepwise", None)
        if stepwise is not None:
            row = stepwise(anchor, position, count)
            return self.choose_stepwise(row, int(anchor.item()), count, sampling, key)
        draft_logits = getattr(proposer, "draft_logits", None)
        if draft_logits is not None:
            return self.choose(draft_logits(anchor, position, count), sampling, key)
        proposed = proposer.propose(anchor, position, count, sampling=None).tokens.tolist()
        return self._walk_rows(count, lambda i, words, _: proposed[i] if self.allows(words, proposed[i]) else None)

    def choose(self, logits: mx.array, sampling, key) -> Proposal:
        """The drafts for a drafter's logits rows [count, V] (sampled at `sampling`'s temperature, or
        greedy for None) and, when sampled, the distributions q they were drawn from."""
        count, width = logits.shape
        z = logits.astype(mx.float32)
        if sampling is not None:
            z = z / sampling.temperature + gumbel_rows(key, z.shape)
        ranked = _ranked(z)
        forced: list[int] = []
        proposal = self._walk_rows(count, lambda i, words, _: self._best(z[i], ranked[i], words), forced)
        return proposal if sampling is None else self._with_q(proposal, logits, sampling, forced)

    def choose_stepwise(self, row, anchor: int, count: int, sampling, key) -> Proposal:
        """The drafts for a drafter whose row i depends on the draft chosen at row i - 1 (`row(i, previous)`,
        `proposers.base`): each row's logits asked with the token before it, its draft chosen as `choose`
        chooses; when sampled, q is each row's distribution given the draft before it."""
        keys = row_keys(None if sampling is None else key, count)
        rows: dict[int, mx.array] = {}

        def pick(i: int, words: np.ndarray, previous: int | None) -> int:
            logits = rows[i] = row(i, anchor if previous is None else previous).astype(mx.float32)
            z = (
                logits
                if sampling is None
                else logits / sampling.temperature + mx.random.gumbel(logits.shape, key=keys[i])
            )
            return self._best(z, _ranked(z[None])[0], words)

        forced: list[int] = []
        proposal = self._walk_rows(count, pick, forced)
        if sampling is None or not rows:  # (every row forced: every q one-hot)
            return proposal
        width = next(iter(rows.values())).shape[-1]
        logits = mx.stack([rows.get(i, mx.zeros((width,), mx.float32)) for i in range(count)])
        return self._with_q(proposal, logits, sampling, forced)

    def _best(self, z: mx.array, ranked: list[int], words: np.ndarray) -> int:
        """The best allowed token of a row of scores `z`: its first allowed candidate, else the argmax over
        the allowed tokens."""
        best = next((t for t in ranked if self.allows(words, t)), None)
        if best is None:  # none of the candidates: the argmax over the allowed tokens
            best = mx.argmax(masked(z, expand(words[None], z.shape[-1])[0])).item()
        return best

    def _with_q(self, proposal: Proposal, logits: mx.array, sampling, forced: list[int]) -> Proposal:
        """`proposal` with the distributions its drafts were drawn from: each row's masked, tempered softmax,
        one-hot where the grammar forced the draft."""
        count, width = logits.shape
        allowed = expand(self._walk[1][:count], width)
        q = mx.softmax(masked(logits.astype(mx.float32) / sampling.temperature, allowed), axis=-1)
        if forced:  # a forced row's draft is deterministic: its q is one-hot
            rows = mx.zeros((count, 1), mx.bool_)
            rows[mx.array(forced)] = True
            q = mx.where(rows, (mx.arange(width)[None] == proposal.tokens[:, None]).astype(q.dtype), q)
        return Proposal(tokens=proposal.tokens, probs=q)

    def _walk_rows(self, count: int, pick, forced: list | None = None) -> Proposal:
        """Walk `count` rows: a forced token, else `pick(i, words, previous draft or None)` (None: the first
        allowed token); remember the drafts and the bit rows of the verify (count + 1 rows); roll the
        matcher back."""
        words = np.empty((count + 1, self.words), np.int32)
        drafts, consumed, ended = [], 0, self.ended
        for i in range(count):
            row = self._fill(words, i, ended)
            ff = [min(self.eos)] if ended or self.matcher.is_stopped() else self.matcher.compute_ff_tokens()
            if ff:
                token = ff[0]
                if forced is not None:
                    forced.append(i)
            else:
                token = pick(i, row, drafts[-1] if drafts else None)
                if token is None:
                    token = int(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0])
            drafts.append(token)
            ended = ended or token in self.eos
            if not ended:
                self.matcher.consume_token(token)
                consumed += 1
        self._fill(words, count, ended)
        self.matcher.rollback(consumed)
        self._walk = (drafts, words)
        return Proposal(tokens=mx.array(drafts, mx.int32))


def _ranked(z: mx.array) -> list[list[int]]:
    """Each row's CANDIDATES best ids of scores [rows, V], best first (one host sync)."""
    k = min(CANDIDATES, z.shape[-1])
    top = mx.argpartition(-z, k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(z, top, axis=-1)
    mx.eval(top, values)
    return np.take_along_axis(np.array(top), np.argsort(-np.array(values), axis=1), axis=1).tolist()
