"""Sampling distributions with mlx-lm's semantics, and the lossless acceptance rule.

`distribution` turns logits rows into the probability vectors that
`mlx_lm.sample_utils.make_sampler` samples from (log-softmax, then top-p, min-p
and top-k on the untempered log-probs, using mlx-lm's own filters, then divide
by the temperature and softmax), for target and draft rows alike. `draw`
samples one token from them as mlx-lm's sampler does, in one compiled call
(the key split inside it): without a filter the log-softmax is left out, as a
softmax does not change when its input is shifted.

`rejection_accept` is the speculative-sampling rule of Leviathan et al.: accept
draft i with probability min(1, p_i(d_i) / q_i(d_i)) up to the first rejection,
then emit a sample of norm(max(p - q, 0)) at the rejected row, or of the
target's next row when every draft was accepted. The emitted tokens follow the
target's distribution exactly. It is batched over a leading axis of independent
runs, so tests can check that statistically with many runs at once.

A seeded call draws instead by position (`position_keys`, `draw_at`): the token
at each absolute position is the Gumbel-max of the target's row with noise
keyed by the seed and that position only, and a draft drawn with the same key
is accepted exactly where it equals it. Its text is then that of the seeded
plain path whatever the blocks, drafter or timing (`dflash_mlx.acceptance`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingSettings:
    """mlx-lm's sampling parameters; `temperature == 0` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}.")
        if isinstance(self.top_p, bool) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}.")
        if isinstance(self.min_p, bool) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if not isinstance(self.min_tokens_to_keep, int) or self.min_tokens_to_keep < 1:
            raise ValueError(f"min_tokens_to_keep must be an integer >= 1, got {self.min_tokens_to_keep!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether a filter (top-p, min-p, top-k) is set: they need the log-probabilities."""
        return 0 < self.top_p < 1.0 or self.min_p != 0.0 or self.top_k > 0


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities over the last axis (as mlx-lm computes them)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def filtered_logprobs(logprobs: mx.array, settings: SamplingSettings) -> mx.array:
    """mlx-lm's filter chain, in its order; dropped tokens get -inf."""
    if 0 < settings.top_p < 1.0:
        logprobs = apply_top_p(logprobs, settings.top_p)
    if settings.min_p != 0.0:
        logprobs = apply_min_p(logprobs, settings.min_p, settings.min_tokens_to_keep)
    if settings.top_k > 0:
        if settings.top_k >= logprobs.shape[-1]:
            raise ValueError(f"top_k must be smaller than the vocabulary ({logprobs.shape[-1]}), got {settings.top_k}.")
        logprobs = apply_top_k(logprobs, settings.top_k)
    return logprobs


def _float32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def sampler_logits(logits: mx.array, settings: SamplingSettings) -> mx.array:
    """Rows whose softmax is the distribution mlx-lm's sampler draws from, before the temperature: the
    logits as they are without a filter (a softmax ignores a shift), else the filtered log-probabilities."""
    if settings.greedy:
        raise ValueError("A sampled distribution needs temperature > 0; greedy decoding takes the argmax.")
    if not settings.filters:
        return logits
    return filtered_logprobs(log_softmax(_float32(logits)), settings)


def distribution(logits: mx.array, settings: SamplingSettings) -> mx.array:
    """Probability rows [..., V] that mlx-lm's sampler draws from for these logits."""
    return mx.softmax(_float32(sampler_logits(logits, settings)) * (1.0 / settings.temperature), axis=-1)


@mx.compile
def _categorical(logits: mx.array, scale: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    keys = mx.random.split(key)
    return mx.random.categorical(logits.astype(mx.float32) * scale, axis=-1, key=keys[1]).astype(mx.int32), keys[0]


def draw(logits: mx.array, settings: SamplingSettings, key: mx.array) -> tuple[mx.array, mx.array]:
    """(a token per row of `logits` [..., V] drawn from `distribution(logits, settings)`, the next key):
    mlx-lm's `categorical(logprobs * (1 / T))`, the key split as `mx.random.split(key)` splits it (the
    second half drawn with, the first kept)."""
    return _categorical(sampler_logits(logits, settings), mx.array(1.0 / settings.temperature), key)


_MASK = (1 << 64) - 1  # (a seed is an unsigned 64-bit word: `mx.random.key`'s)


def check_seed(seed) -> int | None:
    """`seed` as an int (NumPy's integers too), or a ValueError naming it unless it is None or an integer in
    [0, 2**64)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= _MASK:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}.")
    return int(seed)


def _mix(x: int) -> int:
    """splitmix64's finaliser (a bijection of 64-bit words)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_keys(seed: int, first: int, count: int) -> mx.array:
    """Random keys [count, 2] of a seeded call's draws at absolute positions first..first+count-1: each a
    hash of the seed and its position alone, so a position's draw is the same in whichever cycle makes it."""
    words = []
    for position in range(first, first + count):
        mixed = _mix(((seed & 0xFFFFFFFF) << 32 | position & 0xFFFFFFFF) ^ (seed >> 32) * 0x9E3779B97F4A7C15)
        words.append((mixed >> 32, mixed & 0xFFFFFFFF))
    return mx.array(words, dtype=mx.uint32)


def row_noise(keys: mx.array, width: int) -> mx.array:
    """Gumbel noise [rows, width], row i drawn with keys[i] (as `mx.random.categorical` draws a [width] row;
    for a [1, width] input it draws other noise: keyed draws go through `draw_keyed` or `draw_at`)."""
    return mx.vmap(lambda key: mx.random.gumbel((width,), key=key))(keys)


@mx.compile
def _gumbel_max(logits: mx.array, scale: mx.array, keys: mx.array) -> mx.array:
    z = logits.astype(mx.float32) * scale
    return mx.argmax(z + row_noise(keys, z.shape[-1]), axis=-1).astype(mx.int32)


def draw_at(logits: mx.array, settings: SamplingSettings, keys: mx.array) -> mx.array:
    """A token per row of `logits` [rows, V] from `distribution(logits, settings)`, row i drawn with keys[i]
    (`position_keys`): the Gumbel-max `mx.random.categorical` computes for a [V] row with that key, in one
    compiled call."""
    return _gumbel_max(sampler_logits(logits, settings), mx.array(1.0 / settings.temperature), keys)


def gumbel_rows(key: mx.array, shape: tuple[int, int]) -> mx.array:
    """Gumbel noise of `shape` [rows, V] for draft rows: row i's from a seeded call's per-row keys, else
    drawn with `key`."""
    return row_noise(key, shape[-1]) if key.ndim == 2 else mx.random.gumbel(shape, key=key)


def draw_keyed(z: mx.array, key: mx.array | None) -> mx.array:
    """A draw from softmax(z) over the last axis of `z` ([V] or [1, V]): the Gumbel-max with the [V] noise
    row `key` gives (`row_noise`), so a draft drawn with a seeded call's key for a position shares the
    target's noise there."""
    return mx.argmax(z + mx.random.gumbel(z.shape[-1:], key=key), axis=-1)


def row_keys(key: mx.array | None, count: int) -> list:
    """One key per draft row: a seeded call's own (`key` [count, 2], keyed by position), or `key` split."""
    if key is None:
        return [None] * count
    if key.ndim == 2:
        return [key[i] for i in range(count)]
    return list(mx.random.split(key, count))


def draw_rows(logits: mx.array, settings: SamplingSettings, key: mx.array) -> mx.array:
    """Draft tokens for rows [count, V]: `draw_at` with a seeded call's per-row keys, else `draw`."""
    return draw_at(logits, settings, key) if key.ndim == 2 else draw(logits, settings, key)[0]


def dense_from_candidates(candidates: mx.array, probs: mx.array, vocab_size: int) -> mx.array:
    """A sparse draft distribution (probabilities on candidate ids) as dense rows."""
    shape = candidates.shape[:-1] + (vocab_size,)
    return mx.put_along_axis(mx.zeros(shape, probs.dtype), candidates, probs, axis=-1)


def rejection_accept(
    drafts: mx.array, target_probs: mx.array, draft_probs: mx.array, key: mx.array
) -> tuple[mx.array, mx.array]:
    """Accept a prefix of `drafts` [R, g] and sample the token that follows it.

    target_probs [R, g+1, V] are the target's processed rows for [anchor, d_1..d_g];
    draft_probs [R, g, V] are the distributions the drafts were sampled from.
    Returns (accepted [R], next token [R]): the emitted tokens are
    d_1..d_accepted followed by the next token.
    """
    runs, g = drafts.shape
    accept_key, sample_key = mx.random.split(key)
    p = mx.take_along_axis(target_probs[:, :g], drafts[..., None], axis=-1)[..., 0]
    q = mx.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    uniform = mx.random.uniform(shape=(runs, g), key=accept_key)
    accepted = mx.sum(mx.cumprod((uniform * q < p).astype(mx.int32), axis=-1), axis=-1)
    # Row `accepted` of p, minus the draft row there (a zero row past the last draft).
    padded_q = mx.concatenate([draft_probs, mx.zeros_like(draft_probs[:, :1])], axis=1)
    index = accepted[:, None, None]
    p_row = mx.take_along_axis(target_probs, index, axis=1)[:, 0]
    q_row = mx.take_along_axis(padded_q, index, axis=1)[:, 0]
    residual = mx.maximum(p_row - q_row, 0)
    total = mx.sum(residual, axis=-1, keepdims=True)
    dist = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p_row)
    token = mx.random.categorical(mx.log(dist), axis=-1, key=sample_key)
    return accepted, token
