"""DFlash 2 drafters: loading, parity with upstream, lossless greedy decoding."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft
from dflash_mlx.draft.dflash2 import DFlash2DraftModel
from dflash_mlx.draft.load import DraftWeightsError
from dflash_mlx.targets.adapter import TargetAdapter
from test_reference_parity import REFERENCE_PREAMBLE, REPO_ID, fake_hub_cache, hub_env, make_inputs
from dflash_mlx.proposers.dflash import proposer_for
from helpers import check_a_seed_fixes_the_text, check_keyed_drafts, check_lossless, load_pair, make_draft2, prompt_ids


@pytest.fixture(scope="module")
def draft2_factory(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts2")
    built = {}

    def get(target_dir, **kw):
        key = (str(target_dir), json.dumps(kw, sort_keys=True))
        if key not in built:
            built[key] = make_draft2(root / f"d{len(built)}", target_dir, target_layer_ids=[1, 2], **kw)
        return built[key]

    return get


def test_loads_the_real_layout(tiny_target, draft2_factory):
    target_dir = tiny_target("qwen3")
    model, _, draft = load_pair(target_dir, draft2_factory(target_dir))
    assert isinstance(draft, DFlash2DraftModel) and draft.config.is_dflash2
    assert draft.config.is_causal is False and all(draft.config.layer_is_sliding(i) for i in range(2))
    assert draft.candidate_selector.predecessor_codebook.weight.shape == (512, draft.config.selector_rank)


def test_v1_config_over_v2_weights_names_the_unexpected_tensors(tiny_target, draft2_factory, tmp_path):
    import shutil

    target_dir = tiny_target("qwen3")
    source = draft2_factory(target_dir)
    copy = tmp_path / "as-v1"
    shutil.copytree(source, copy)
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = ["DFlashDraftModel"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftWeightsError, match=r"unexpected tensors \[.*attention_conv"):
        load_draft(copy)


@pytest.mark.parametrize("block_size", [2, 5, 16])
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_greedy_dflash2_equals_mlx_lm(tiny_target, draft2_factory, family, block_size):
    target_dir = tiny_target(family)
    model, tokenizer, draft = load_pair(target_dir, draft2_factory(target_dir))
    prompt = prompt_ids(40, seed=13)  # longer than the drafter's window of 8
    check_lossless(model, tokenizer, draft, prompt, 120, block_size, logprob_atol=1e-3)


REFERENCE_V2 = (
    REFERENCE_PREAMBLE
    + textwrap.dedent(
        """
    results = {{}}
    for i in range(2):  # cycles before any one-row context update (see the v1 parity test)
        block = mx.array(data[f"block{{i}}"])[None]
        hidden = draft.hidden_states(block, mx.array(data[f"hidden{{i}}"])[None], cache, logits_start=1)
        logits = draft.compute_logits(hidden)
        path, _, _ = draft.candidate_selector.select(hidden, logits, block[:, 0], 0.0)
        results[f"logits{{i}}"] = np.array(logits[0].astype(mx.float32))
        results[f"path{{i}}"] = np.array(path[0])
    np.savez(out, **results)
    """
    )
).format(repo=REPO_ID)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("dflash") is None, reason="upstream dflash==0.1.0 not installed")
def test_parity_with_upstream(tiny_target, draft2_factory, tmp_path):
    target_dir = tiny_target("qwen3")
    draft_dir = draft2_factory(target_dir)
    model, _, draft = load_pair(target_dir, draft_dir)
    cycles = make_inputs(tmp_path / "inputs.npz", 2 * draft.config.hidden_size)
    hub = fake_hub_cache(tmp_path / "hub", REPO_ID, draft_dir)
    subprocess.run(
        [sys.executable, "-c", REFERENCE_V2, str(target_dir), str(tmp_path / "inputs.npz"), str(tmp_path / "r.npz")],
        check=True,
        env=hub_env(hub),
        capture_output=True,
        text=True,
        timeout=300,
    )
    reference = np.load(tmp_path / "r.npz")
    target = TargetAdapter(model, draft.config.target_layer_ids)
    cache = draft.make_cache()
    for i, (ids, hidden) in enumerate(cycles[:2]):
        draft.extend_context(mx.array(hidden)[None], cache)
        h = draft.hidden_states(mx.array(ids)[None], cache, target)[0]
        logits = draft.logits(h, target)
        path, _, _ = draft.candidate_selector.select(h, logits, int(ids[0]))
        diff = float(np.max(np.abs(np.array(logits) - reference[f"logits{i}"])))
        assert diff <= 1e-4, f"cycle {i}: max abs diff {diff}"
        assert np.array(path).tolist() == reference[f"path{i}"].tolist()


def test_sampled_generation_runs_through_the_selector(tiny_target, draft2_factory):
    from dflash_mlx import stream_generate

    target_dir = tiny_target("qwen3")
    model, tokenizer, draft = load_pair(target_dir, draft2_factory(target_dir))
    prompt = prompt_ids(20, seed=14)

    def run(seed):
        return [
            (r.token, r.cycle_tokens)
            for r in stream_generate(
                model, draft, tokenizer, prompt, max_tokens=40, block_size=5, temperature=1.0, seed=seed
            )
        ]

    first = run(3)
    assert first == run(3) and len(first) >= 1
    cycles = [c for _, c in first if c is not None]
    assert sum(cycles) == len(first) - 1
    check_a_seed_fixes_the_text(model, draft, tokenizer, prompt, {"temperature": 1.0})
    assert check_keyed_drafts(model, proposer_for(draft), tokenizer, prompt, {"temperature": 1.0}) > 20


def test_a_dflash2_block_ingests_the_newest_context_rows_in_its_own_forward(tiny_target, draft2_factory):
    target_dir = tiny_target("qwen3")
    model, _, draft = load_pair(target_dir, draft2_factory(target_dir))
    adapter = TargetAdapter(model, tuple(draft.config.target_layer_ids))
    feats = adapter.forward(mx.array([prompt_ids(12, seed=5)]), adapter.make_cache())[1]
    block = mx.array([[17] + [draft.config.mask_token_id] * 4])
    apart, fused = draft.make_cache(), draft.make_cache()
    for cache in (apart, fused):
        draft.extend_context(feats[:, :8], cache)
    draft.extend_context(feats[:, 8:], apart)
    want = np.array(draft.hidden_states(block, apart, adapter))
    got = np.array(draft.hidden_states(block, fused, adapter, feats[:, 8:]))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert [c.end for c in fused] == [c.end for c in apart] == [12, 12]
    np.testing.assert_allclose(np.array(draft.hidden_states(block, fused, adapter)), want, atol=1e-5, rtol=1e-5)
