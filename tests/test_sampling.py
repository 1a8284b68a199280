"""Sampling distributions match mlx-lm's sampler; rejection acceptance and draws keyed by position are lossless.

Statistical checks use a chi-square test at p > 0.001 with fixed seeds, and a
deliberately broken rule shows each test has the power to fail.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

from dflash_mlx.acceptance import Acceptor
from dflash_mlx.sampling import (
    SamplingSettings,
    dense_from_candidates,
    distribution,
    draw,
    draw_at,
    draw_keyed,
    filtered_logprobs,
    position_keys,
    rejection_accept,
    sampler_logits,
)
from helpers import check_follows, chi_square_p

V = 24
SETTINGS = {
    "plain": dict(),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.1),
    "all": dict(top_p=0.9, min_p=0.05, top_k=8),
}


def logits_row(seed: int) -> mx.array:
    return mx.random.normal((V,), key=mx.random.key(seed)) * 2.0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_distribution_matches_mlx_lm_sampler(name, temperature):
    settings = SamplingSettings(temperature=temperature, **SETTINGS[name])
    logits = logits_row(1)
    ours = np.array(distribution(logits[None], settings)[0])
    np.testing.assert_allclose(ours.sum(), 1.0, atol=1e-5)
    # Same support as mlx-lm's own filters.
    logprobs = logits - mx.logsumexp(logits)
    kept = np.isfinite(np.array(filtered_logprobs(logprobs[None], settings)[0]))
    assert ((ours > 0) == kept).all()
    # And the same distribution as the sampler mlx-lm users call.
    sampler = make_sampler(temp=temperature, **{k: v for k, v in SETTINGS[name].items()})
    mx.random.seed(7)
    n = 40_000
    draws = np.array(sampler(mx.broadcast_to(logprobs[None], (n, V))))
    assert chi_square_p(np.bincount(draws, minlength=V), ours) > 1e-3


@pytest.mark.parametrize("name", ["plain", "all"])
def test_draw_follows_the_distribution_and_splits_the_key_as_mx_random_split(name):
    """The plain path's one compiled call (no log-softmax without a filter) draws from `distribution`;
    each call hands back the next key, so a seed reproduces the draws."""
    settings = SamplingSettings(temperature=0.7, **SETTINGS[name])
    logits = logits_row(2)
    n = 40_000
    tokens, key = draw(mx.broadcast_to(logits[None], (n, V)), settings, mx.random.key(5))
    want = np.array(distribution(logits[None], settings)[0])
    assert tokens.dtype == mx.int32 and chi_square_p(np.bincount(np.array(tokens), minlength=V), want) > 1e-3
    assert mx.array_equal(key, mx.random.split(mx.random.key(5))[0])
    again, _ = draw(mx.broadcast_to(logits[None], (n, V)), settings, mx.random.key(5))
    assert mx.array_equal(tokens, again)
    if name == "plain":  # (the test can fail: another row's draws, on the same support)
        other = np.array(draw(mx.broadcast_to(logits_row(3)[None], (n, V)), settings, mx.random.key(5))[0])
        assert chi_square_p(np.bincount(other, minlength=V), want) < 1e-3


def one_position_runs(p: np.ndarray, q: np.ndarray, runs: int, seed: int, rule=rejection_accept):
    """First emitted token of `runs` independent one-draft cycles: d ~ q, then the rule."""
    key_d, key_r = mx.random.split(mx.random.key(seed))
    q_rows = mx.broadcast_to(mx.array(q)[None, None], (runs, 1, V))
    drafts = mx.random.categorical(mx.log(q_rows), axis=-1, key=key_d).astype(mx.int32)
    target = mx.broadcast_to(mx.array(np.stack([p, p]))[None], (runs, 2, V))
    accepted, token = rule(drafts, target, q_rows, key_r)
    first = mx.where(accepted > 0, drafts[:, 0], token)
    return np.array(first), np.array(accepted)


def two_dists(seed: int, temperature: float = 1.0):
    settings = SamplingSettings(temperature=temperature)
    p = np.array(distribution(logits_row(seed)[None], settings)[0], dtype=np.float64)
    q = np.array(distribution(logits_row(seed + 100)[None], settings)[0], dtype=np.float64)
    return p / p.sum(), q / q.sum()


@pytest.mark.parametrize("seed", [3, 4])
def test_rejection_sampling_preserves_the_target_distribution(seed):
    p, q = two_dists(seed)
    first, accepted = one_position_runs(p, q, 100_000, seed)
    assert chi_square_p(np.bincount(first, minlength=V), p) > 1e-3
    # Acceptance rate is sum(min(p, q)), above sample-and-match's sum(p * q).
    rate = accepted.mean()
    assert abs(rate - np.minimum(p, q).sum()) < 0.01
    assert rate > (p * q).sum() + 0.05


def test_a_broken_rule_is_detected():
    def always_accept(drafts, target, draft_probs, key):
        return mx.full(drafts.shape[:1], drafts.shape[1], mx.int32), mx.zeros(drafts.shape[:1], mx.int32)

    p, q = two_dists(3)
    first, _ = one_position_runs(p, q, 100_000, 3, rule=always_accept)
    assert chi_square_p(np.bincount(first, minlength=V), p) < 1e-6


def test_three_drafts_emit_the_target_sequence_distribution():
    """Positions beyond the first: the pair (token 1, token 2) follows p1 x p2."""
    runs, g = 200_000, 3
    rows = [two_dists(s) for s in (5, 6, 7)]
    p_rows = np.stack([r[0] for r in rows] + [rows[0][0]])  # [g+1, V]
    q_rows = np.stack([r[1] for r in rows])  # [g, V]
    key_d, key_r = mx.random.split(mx.random.key(11))
    q = mx.broadcast_to(mx.array(q_rows, mx.float32)[None], (runs, g, V))
    drafts = mx.random.categorical(mx.log(q), axis=-1, key=key_d).astype(mx.int32)
    target = mx.broadcast_to(mx.array(p_rows, mx.float32)[None], (runs, g + 1, V))
    accepted, token = rejection_accept(drafts, target, q, key_r)
    accepted, token, drafts = np.array(accepted), np.array(token), np.array(drafts)
    # Runs that got past position 1: their second token follows p_rows[1] (the rows here do
    # not depend on the first token, as a context-free target would).
    second = np.where(accepted >= 2, drafts[:, 1], token)[accepted >= 1]
    assert chi_square_p(np.bincount(second, minlength=V), p_rows[1] / p_rows[1].sum()) > 1e-3


def test_position_keys_depend_on_the_seed_and_the_position_alone():
    for seed in (7, 2**40 + 7, -3):
        keys = np.array(position_keys(seed, 10, 6))
        assert keys.dtype == np.uint32 and keys.shape == (6, 2)
        assert (keys[2:] == np.array(position_keys(seed, 12, 4))).all()  # whichever cycle draws a position
        assert len({tuple(k) for k in keys}) == 6
        assert not (np.array(position_keys(seed + 1, 10, 6)) == keys).all(axis=1).any()


def test_draws_at_positions_are_mlx_categorical_with_each_rows_key():
    rows = mx.stack([logits_row(s) for s in range(4)])
    for settings in (SamplingSettings(temperature=0.7), SamplingSettings(temperature=1.3, top_k=8, top_p=0.9)):
        keys = position_keys(3, 0, 4)
        z = sampler_logits(rows, settings) * (1 / settings.temperature)
        want = [mx.random.categorical(z[i], key=keys[i]).item() for i in range(4)]
        assert draw_at(rows, settings, keys).tolist() == want
        assert draw_at(rows[2:], settings, keys[2:]).tolist() == want[2:]
        assert [draw_keyed(z[i : i + 1], keys[i]).item() for i in range(4)] == want  # a [1, V] row: the same


def keyed_runs(p_rows: np.ndarray, q_rows: np.ndarray, runs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(drafts [runs, g], target draws [runs, g+1], accepted [runs]) of `runs` seeded verifies of rows that do
    not depend on the drafts (a context-free target), each through an `Acceptor` as the engine calls it:
    drafts chosen from q's logits with the positions' keys, then the verdict."""
    g = q_rows.shape[0]
    p_logits, q_logits = mx.array(np.log(p_rows), mx.float32), mx.array(np.log(q_rows), mx.float32)
    drafts, draws, accepted = [], [], []
    for run in range(runs):
        acceptor = Acceptor(SamplingSettings(temperature=1.0), mx.array([1, 2, 3]), seed=run)
        proposal = acceptor.choose_drafts(q_logits, 9)
        verdict = acceptor.verdict(p_logits, proposal.tokens, proposal.probs, 9)
        drafts.append(proposal.tokens)
        draws.append(draw_at(p_logits, SamplingSettings(temperature=1.0), position_keys(run, 10, g + 1)))
        accepted.append(verdict)
    verdicts = np.array(mx.stack(accepted))
    draws = np.array(mx.stack(draws))
    assert (verdicts[:, 1:] == draws).all()  # the verdict's tokens are the positions' draws, whatever the drafts
    return np.array(mx.stack(drafts)), draws, verdicts[:, 0]


@pytest.mark.parametrize("seed", [3, 4])
def test_keyed_verdicts_follow_the_target_and_couple_drafts_drawn_with_the_same_keys(seed):
    """A seeded verify commits the target's draws (chi-square per position) and accepts the drafts that equal
    them; drafts drawn with the same keys are accepted at least (1 - TV) / (1 + TV) of the time, far above
    independent samples' sum(p * q)."""
    rows = [two_dists(s) for s in (seed, seed + 10, seed + 20)]
    p_rows = np.stack([r[0] for r in rows])
    q_rows = np.stack([0.7 * p + 0.3 * q for p, q in rows[:2]])  # a drafter close to the target
    drafts, draws, accepted = keyed_runs(p_rows, q_rows, 3000)
    for j in range(3):
        check_follows(draws[:, j].tolist(), p_rows[j])
    match = np.cumprod(drafts == draws[:, :2], axis=1).sum(axis=1)
    assert (accepted == match).all()
    p, q = p_rows[0], q_rows[0]
    tv = 0.5 * np.abs(p - q).sum()
    rate = (drafts[:, 0] == draws[:, 0]).mean()
    assert rate > (1 - tv) / (1 + tv) - 0.03 and rate > (p * q).sum() + 0.2
    check_follows(drafts[:, 0].tolist(), q)  # the drafts still follow q


def test_sparse_draft_rows_become_dense():
    candidates = mx.array([[3, 7, 1]])
    probs = mx.array([[0.5, 0.3, 0.2]])
    dense = np.array(dense_from_candidates(candidates, probs, 10))
    assert dense.shape == (1, 10) and dense[0, 3] == 0.5 and dense[0, 7] == pytest.approx(0.3)
    assert dense.sum() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens_to_keep=0), "min_tokens_to_keep"),
    ],
)
def test_invalid_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingSettings(**kwargs)


def test_top_k_must_be_below_the_vocabulary():
    with pytest.raises(ValueError, match="top_k"):
        distribution(logits_row(1)[None], SamplingSettings(temperature=1.0, top_k=V))
