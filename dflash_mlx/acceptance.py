"""Deciding what a verify commits: greedy or exact speculative sampling.

`Acceptor` owns everything between the target's raw logits and the committed
tokens: mlx-lm style logits processors (each verified row sees the token
history plain decoding would have given it), the processed distributions of
`dflash_mlx.sampling`, the random keys (reproducible from a seed), and the
verdict `[accepted, t_0, ..., t_{b-1}]` where t_0..t_accepted are the tokens
the cycle commits (`next_token` for a row with no drafts: a plain step). Everything
stays on the device; the engine syncs once.

An unseeded sampled call verifies by rejection sampling. A seeded one draws the
token at each position by position (`sampling.draw_at`: noise keyed by the seed
and the position) and accepts a draft exactly where it equals that draw, as
greedy verification does; proposers that draw row by row (`keys_per_row`) get
the same keys, so their drafts are coupled with the target's draws. A seed
therefore fixes the text whatever the blocks, the drafter, the calls before it
or the timing: it is the seeded plain path's (draft=None). Under a grammar (`constraint`, see
`dflash_mlx.structured`) the drafts are asked for through `propose` (chosen on the
host under the grammar: one more sync) and every row is masked after the processors.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from .proposers.base import Proposal
from .sampling import (
    SamplingSettings,
    check_seed,
    distribution,
    draw,
    draw_at,
    draw_rows,
    log_softmax,
    position_keys,
    rejection_accept,
)


def seed_from_mlx() -> int:
    """A seed drawn from MLX's global generator (which `mx.random.seed` makes reproducible)."""
    return int(mx.random.randint(0, 2**31 - 1, ()).item())


class Acceptor:
    def __init__(
        self,
        settings: SamplingSettings,
        prompt: mx.array,
        logits_processors: list | None = None,
        seed: int | None = None,
        xtc: tuple[float, float, list[int]] | None = None,
        sample_drafts: bool = True,
        constraint=None,
    ):
        """`xtc` = (probability, threshold, special tokens): plain decoding only, through
        mlx-lm's own sampler (XTC has no fixed distribution to verify drafts against).
        `sample_drafts=False`: under sampling, proposers still propose their argmax
        (one-hot q) instead of samples of q (this call's choice, see `draft_settings`).
        `constraint`: a grammar's `structured.constraint.Constraint` the output must follow.
        `seed`: a sampled call's draws keyed by position (see above); None: rejection sampling, its keys
        from a seed drawn from MLX's generator."""
        seed = check_seed(seed)
        self.settings = settings
        self.constraint = constraint
        self.sample_drafts = sample_drafts
        self.processors = list(logits_processors or [])
        self.history = prompt.astype(mx.int32) if self.processors else None
        seeded = seed is not None and not settings.greedy
        if seed is None and not settings.greedy:
            seed = seed_from_mlx()
        self._seed = seed
        self._key = mx.random.key(seed) if seed is not None else None
        self._xtc_sampler = None
        if xtc is not None and not settings.greedy:
            if seed is not None:
                mx.random.seed(seed)  # mlx-lm's sampler draws from the global generator
            s = settings
            self._xtc_sampler = make_sampler(
                s.temperature,
                s.top_p,
                s.min_p,
                s.min_tokens_to_keep,
                s.top_k,
                xtc_probability=xtc[0],
                xtc_threshold=xtc[1],
                xtc_special_tokens=list(xtc[2]),
            )
        self.by_position = seeded and self._xtc_sampler is None  # draws keyed by position (see above)

    @property
    def draft_settings(self) -> SamplingSettings | None:
        """How proposers should sample their drafts (None: greedy, one-hot q)."""
        return None if self.settings.greedy or not self.sample_drafts else self.settings

    @property
    def raw_logits(self) -> bool:
        """`process` leaves the logits as they are (no processors, no grammar): nothing needs the
        committed tokens on the host (a step may be built on a token not yet read)."""
        return not self.processors and self.constraint is None

    def _draft_key(self, position: int, count: int, per_row: bool) -> mx.array | None:
        """The key of drafts after an anchor at `position`: for a seeded call the keys of the positions they
        stand for (`per_row`: a drafter that draws row by row), else the next key."""
        if self.by_position and per_row and self.draft_settings is not None:
            return position_keys(self._seed, position + 1, count)
        return self.next_key()

    def propose(self, proposer, anchor: mx.array, position: int, count: int):
        """`proposer`'s drafts for this call's settings (a `Proposal`), under the grammar if any."""
        per_row = self.constraint is not None or getattr(proposer, "keys_per_row", False)
        key = self._draft_key(position, count, per_row)
        if self.constraint is None:
            return proposer.propose(anchor, position, count, sampling=self.draft_settings, key=key)
        return self.constraint.propose(proposer, anchor, position, count, self.draft_settings, key)

    def choose_drafts(self, logits: mx.array, position: int) -> Proposal:
        """Drafts from a drafter's logits rows [count, V] computed for this call (a batch's rows drafted
        together) after an anchor at `position`: its argmax, samples of q at the draft settings, or chosen
        under the grammar."""
        sampling, key = self.draft_settings, self._draft_key(position, logits.shape[0], True)
        if self.constraint is not None:
            return self.constraint.choose(logits, sampling, key)
        if sampling is None:
            return Proposal(tokens=mx.argmax(logits, axis=-1).astype(mx.int32))
        return Proposal(tokens=draw_rows(logits, sampling, key), probs=distribution(logits, sampling))

    def next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key

    def _draw(self, logits: mx.array) -> mx.array:
        """A token per row of processed `logits` under this call's settings, with the next key (one
        compiled call: mlx-lm's speed)."""
        token, self._key = draw(logits, self.settings, self._key)
        return token

    def process(self, logits: mx.array, drafts: mx.array | None = None) -> mx.array:
        """Apply the processors, then the grammar's masks, to rows [b, V]; row j's history ends with
        drafts[:j]."""
        if self.processors:
            rows = []
            for j in range(logits.shape[0]):
                history = self.history if j == 0 else mx.concatenate([self.history, drafts[:j]])
                row = logits[j : j + 1]
                for processor in self.processors:
                    row = processor(history, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        if self.constraint is not None:
            allowed = self.constraint.masks(logits.shape[0], drafts, logits.shape[-1])
            logits = mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))
        return logits

    def next_token(self, logits: mx.array, position: int) -> mx.array:
        """The next token [1] from a processed row [1, V] computed at `position` (the token drawn stands at
        position + 1), with no drafts to verify (the token after the prompt, a plain decoding step): the
        verdict of a block of 1 without its accepted count."""
        if self.settings.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        if self._xtc_sampler is not None:
            return self._sample_xtc(logits)
        if self.by_position:
            return draw_at(logits, self.settings, position_keys(self._seed, position + 1, 1))
        return self._draw(logits)

    def verdict(self, rows: mx.array, drafts: mx.array | None, draft_probs: mx.array | None, position: int) -> mx.array:
        """[accepted, t_0..t_{b-1}] for processed verify rows [b, V] of [anchor, drafts], the anchor at
        `position`."""
        b = rows.shape[0]
        if self.settings.greedy or self.by_position:
            if self.settings.greedy:
                best = mx.argmax(rows, axis=-1).astype(mx.int32)
            else:
                best = draw_at(rows, self.settings, position_keys(self._seed, position + 1, b))
            if drafts is None or drafts.size == 0:
                return mx.concatenate([mx.zeros((1,), mx.int32), best])
            match = (drafts == best[:-1]).astype(mx.int32)
            accepted = mx.sum(mx.cumprod(match), keepdims=True).astype(mx.int32)
            return mx.concatenate([accepted, best])
        if self._xtc_sampler is not None:
            if drafts is not None and drafts.size:
                raise ValueError("XTC sampling cannot verify drafts (it has no fixed distribution).")
            return mx.concatenate([mx.zeros((1,), mx.int32), self._sample_xtc(rows)])
        if drafts is None or drafts.size == 0:
            return mx.concatenate([mx.zeros((1,), mx.int32), self._draw(rows)])
        target_probs = distribution(rows, self.settings)
        if draft_probs is None:  # a deterministic proposer: its q is one-hot
            draft_probs = mx.zeros((drafts.size, rows.shape[-1]), mx.float32)
            draft_probs = mx.put_along_axis(draft_probs, drafts[:, None], mx.array(1.0), axis=-1)
        accepted, token = rejection_accept(drafts[None], target_probs[None], draft_probs[None], self.next_key())
        slots = mx.arange(b)
        tokens = mx.where(slots == accepted, token, mx.concatenate([drafts, drafts[-1:]]))
        return mx.concatenate([accepted.astype(mx.int32), tokens.astype(mx.int32)])

    def _sample_xtc(self, rows: mx.array) -> mx.array:
        return self._xtc_sampler(log_softmax(rows)).astype(mx.int32)

    def commit(self, tokens: list[int]) -> None:
        if self.history is not None:
            self.history = mx.concatenate([self.history, mx.array(tokens, mx.int32)])
        if self.constraint is not None:
            self.constraint.commit(tokens)
