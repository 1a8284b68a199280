"""The first three tokens of sampled DFlash follow the target's exact distribution.

20,000 runs per setting are batched: one prefill, broadcast to every run; the
real drafter drafts two tokens per run from its own processed distribution q;
the real target verifies them and `rejection_accept` decides; runs that stopped
after one token take one more target step. (The engine's own loop, one run at a
time, is checked the same way on fewer runs in test_sampled_generation.py.)
The expected distribution is enumerated with the target over the supports.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from dflash_mlx import load_draft
from dflash_mlx.sampling import SamplingSettings, dense_from_candidates, distribution, rejection_accept
from dflash_mlx.targets.adapter import TargetAdapter
from helpers import chi_square_p, make_draft2

pytestmark = pytest.mark.slow  # thousands of sampled runs per test

RUNS = 20_000
PROMPT = [17, 301, 45, 222, 9, 140]
SETTINGS = {
    "plain": dict(),
    "top_k": dict(top_k=12),
    "top_p": dict(top_p=0.85),
    "min_p": dict(min_p=0.05),
}
MIN_EXPECTED = 5  # chi-square bins expected fewer times are pooled into one
EPS = MIN_EXPECTED / RUNS  # so only prefixes at least this likely need enumerating


def _flat_target(target_dir):
    """A fresh (uncached: it is edited) load of the target in `target_dir`."""
    model, _ = mlx_lm_load(str(target_dir))
    # A flatter head than the greedy fixtures' (which are tuned for clear margins),
    # so that several tokens are likely at each step and drafts get accepted often.
    model.lm_head.weight = model.lm_head.weight * 0.3
    return model


@pytest.fixture(scope="module")
def pair(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs("qwen3")
    model = _flat_target(target_dir)
    return model, load_draft(draft_dir, model)


@pytest.fixture(scope="module")
def pair2(qwen3_target, tmp_path_factory):
    model = _flat_target(qwen3_target)
    path = make_draft2(tmp_path_factory.mktemp("d2"), qwen3_target, target_layer_ids=[1, 2])
    return model, load_draft(path, model)


def _shared(rows: mx.array, runs: int, room: int = 3) -> mx.array:
    padded = mx.concatenate([rows, mx.zeros(rows.shape[:2] + (room, rows.shape[3]), rows.dtype)], axis=2)
    return mx.broadcast_to(padded, (runs,) + padded.shape[1:])


def dflash_first_three(model, draft, settings, runs, seed, rule=rejection_accept):
    target = TargetAdapter(model, draft.config.target_layer_ids)
    cache = target.make_cache()
    logits, features = target.forward(mx.array(PROMPT)[None], cache)
    for c in cache:  # every run shares the prompt; room for 3 more rows, so no regrowth
        keys, values, offset = c.state
        c.state = (_shared(keys[..., :offset, :], runs), _shared(values[..., :offset, :], runs), offset)
    draft_cache = draft.make_cache()
    draft.extend_context(features, draft_cache)
    for c in draft_cache:
        c.broadcast(runs)
    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)

    p1 = distribution(logits[:, -1], settings)
    t1 = mx.random.categorical(mx.log(mx.broadcast_to(p1, (runs, p1.shape[-1]))), key=k1).astype(mx.int32)
    mask = mx.full((runs, 2), draft.config.mask_token_id, mx.int32)
    block = mx.concatenate([t1[:, None], mask], 1)
    if draft.config.is_dflash2:  # the selector's walk, q on each row's candidates
        hidden = draft.hidden_states(block, draft_cache, target)
        path, candidates, q_rows = draft.candidate_selector.select(
            hidden, draft.logits(hidden, target), t1, settings.temperature, k2
        )
        drafts, q = path, dense_from_candidates(candidates, q_rows, p1.shape[-1])
    else:
        q = distribution(draft(block, draft_cache, target), settings)
        drafts = mx.random.categorical(mx.log(q), axis=-1, key=k2).astype(mx.int32)
    verify, _ = target.forward(mx.concatenate([t1[:, None], drafts], 1), cache)
    accepted, token = rule(drafts, distribution(verify, settings), q, k3)
    t2 = mx.where(accepted >= 1, drafts[:, 0], token)
    t3 = mx.where(accepted >= 2, drafts[:, 1], token)
    for c in cache:  # runs that committed only t2: one plain step from it
        c.trim(2)
    step, _ = target.forward(t2[:, None].astype(mx.int32), cache)
    p3 = distribution(step[:, -1], settings)
    t3 = mx.where(accepted == 0, mx.random.categorical(mx.log(p3), key=k4), t3)
    return np.array(t1), np.array(t2), np.array(t3), np.array(accepted)


def exact_first_three(model, settings) -> dict[tuple, float]:
    """P(t1, t2, t3) by enumeration of every prefix at least EPS likely (the rest is pooled)."""

    def rows(prefixes):
        return np.array(distribution(model(mx.array(prefixes))[:, -1], settings), dtype=np.float64)

    p1 = rows([PROMPT])[0]
    firsts = [int(t) for t in np.nonzero(p1 > EPS)[0]]
    p2 = rows([PROMPT + [t] for t in firsts])
    pairs = [(a, int(b), p1[a] * p2[i, b]) for i, a in enumerate(firsts) for b in np.nonzero(p2[i] > EPS)[0]]
    pairs = [x for x in pairs if x[2] > EPS]
    p3 = rows([PROMPT + [a, b] for a, b, _ in pairs])
    joint = {}
    for i, (a, b, pab) in enumerate(pairs):
        for c in np.nonzero(p3[i] * pab > EPS)[0]:
            joint[(a, b, int(c))] = pab * p3[i, c]
    return joint


def joint_p_value(t1, t2, t3, joint: dict) -> float:
    counts = Counter(zip(t1.tolist(), t2.tolist(), t3.tolist()))
    big = {k: p for k, p in joint.items() if p * RUNS >= MIN_EXPECTED}
    observed = [counts.get(k, 0) for k in big]
    expected = list(big.values())
    rest_observed = RUNS - sum(observed)
    observed.append(rest_observed)
    expected.append(max(1.0 - sum(expected), 1e-12))
    return chi_square_p(np.array(observed), np.array(expected) / sum(expected))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_first_three_tokens_follow_the_target(pair, name, temperature):
    model, draft = pair
    settings = SamplingSettings(temperature=temperature, **SETTINGS[name])
    t1, t2, t3, accepted = dflash_first_three(model, draft, settings, RUNS, seed=1)
    joint = exact_first_three(model, settings)
    assert len([p for p in joint.values() if p * RUNS >= MIN_EXPECTED]) >= 10, "too few categories"
    # Every path of the rule is taken: reject d1, accept d1 only, accept both.
    assert (accepted == 0).mean() > 0.5 and (accepted >= 1).mean() > 0.03 and (accepted == 2).mean() > 0.003
    assert joint_p_value(t1, t2, t3, joint) > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_always_accepting_is_rejected(pair, temperature):
    def always_accept(drafts, target_probs, draft_probs, key):
        runs, g = drafts.shape
        last = mx.random.categorical(mx.log(target_probs[:, -1]), key=key)
        return mx.full((runs,), g, mx.int32), last

    model, draft = pair
    settings = SamplingSettings(temperature=temperature)
    t1, t2, t3, _ = dflash_first_three(model, draft, settings, RUNS, seed=1, rule=always_accept)
    assert joint_p_value(t1, t2, t3, exact_first_three(model, settings)) < 1e-6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_dflash2_first_three_tokens_follow_the_target(pair2, temperature):
    model, draft = pair2
    settings = SamplingSettings(temperature=temperature)
    t1, t2, t3, accepted = dflash_first_three(model, draft, settings, RUNS, seed=2)
    assert (accepted >= 1).mean() > 0.03, "drafts are rarely accepted"
    assert joint_p_value(t1, t2, t3, exact_first_three(model, settings)) > 1e-3
