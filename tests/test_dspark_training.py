"""`dflash-mlx train --arch dspark` on the tiny qwen3 target, through Typer's CliRunner.

A new DSpark drafter and a fine-tuned published one (`--init`, DeepSpec's
layout) are written in DeepSpec's own layout: the reference (mlx-dspark)
loads them and drafts exactly what we draft; the loss goes down, the Markov
and confidence heads learn, the embedding and head (the target's copies) stay
frozen; the output decodes losslessly. Options that make no sense are refused
naming the flag.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.targets.adapter import TargetAdapter
from helpers import load_pair, reference, without_eos
from helpers.dspark import make_dspark
from helpers.dspark_reference import check_drafts_match_the_reference
from helpers.train_cli import run_train, train_ok

pytestmark = pytest.mark.slow  # training runs

WORDS = "the river ran past old mill under stone bridge near market every morning baker opened shop".split()
PROMPTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 4)) for i in range(24)]
COMMON = [
    *("--steps", 16, "--block-size", 5, "--max-tokens", 16, "--batch-size", 4, "--anchors-per-seq", 6),
    *("--save-every", 8, "--holdout", 2, "--lr", "3e-3", "--val-max-tokens", 12),
]
ARGS = [*COMMON, "--draft-layers", 2, "--target-layers", "1,2"]  # a new drafter


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dspark-data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def trained(qwen3_target, data_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dspark-trained") / "out"
    output = train_ok(
        "--arch", "dspark", "--markov-rank", 8, "--model", qwen3_target, "--data", data_file, "--out", out, *ARGS
    )
    assert "dspark drafter" in output
    return out


def _weights(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}


def test_a_new_drafter_is_written_in_deepspecs_layout_and_the_reference_drafts_it_identically(trained, qwen3_target):
    config = json.loads((trained / "config.json").read_text())
    assert config["block_size"] == 4 and config["target_layer_ids"] == [1, 2] and config["markov_rank"] == 8
    assert "dflash_config" not in config and "logits_start" not in config  # the anchor's slot predicts
    weights = _weights(trained)
    assert {
        "embed_tokens.weight",
        "lm_head.weight",
        "markov_head.markov_w1.weight",
        "confidence_head.proj.weight",
    } <= set(weights)
    model, _, _ = load_pair(qwen3_target)
    for seed in (0, 1):
        check_drafts_match_the_reference(model, trained, sequence_seed=seed)


def test_the_heads_learn_and_the_targets_copies_stay_frozen(trained, qwen3_target):
    report = json.loads((trained / "training_report.json").read_text())
    assert report["arch"] == "dspark" and report["loss_last"] < report["loss_first"]
    weights = _weights(trained)
    assert np.abs(weights["markov_head.markov_w2.weight"]).max() > 0  # started at zero
    model, _, _ = load_pair(qwen3_target)
    target = TargetAdapter(model)
    np.testing.assert_array_equal(
        weights["embed_tokens.weight"], np.array(target.embed(mx.arange(weights["embed_tokens.weight"].shape[0])))
    )
    hidden = weights["lm_head.weight"].shape[1]
    np.testing.assert_allclose(weights["lm_head.weight"], np.array(target.head(mx.eye(hidden))).T, atol=1e-6)


def test_the_trained_drafter_decodes_losslessly(trained, qwen3_target):
    model, tokenizer, _ = load_pair(qwen3_target)
    draft = load_draft(trained, model)
    prompt = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    with without_eos(tokenizer) as tok:
        want = [r.token for r in reference(model, tok, prompt, 40)]
        got = list(stream_generate(model, draft, tok, prompt, max_tokens=40, block_size=5))
    assert [r.token for r in got] == want
    assert any(r.source == "dspark" and r.from_draft for r in got)


def test_init_fine_tunes_a_published_deepspec_head(qwen3_target, data_file, tmp_path):
    published = make_dspark(tmp_path / "published", qwen3_target, target_layer_ids=[1, 2], block_size=4, markov_rank=8)
    out = tmp_path / "tuned"
    train_ok("--init", published, "--model", qwen3_target, "--data", data_file, "--out", out, *COMMON)
    config = json.loads((out / "config.json").read_text())
    assert config == {**json.loads((published / "config.json").read_text()), "block_size": 4, "torch_dtype": "float32"}
    before, after = _weights(published), _weights(out)
    assert set(before) == set(after)
    assert not np.allclose(before["layers.0.mlp.up_proj.weight"], after["layers.0.mlp.up_proj.weight"])
    np.testing.assert_array_equal(before["lm_head.weight"], after["lm_head.weight"])  # frozen
    model, _, _ = load_pair(qwen3_target)
    check_drafts_match_the_reference(model, out)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--arch", "eagle"], "--arch must be one of dflash, dspark"),
        (["--markov-rank", 4], "--markov-rank"),
        (["--arch", "dspark", "--markov-rank", -1], "--markov-rank must be an integer >= 0"),
    ],
)
def test_bad_options_are_refused_naming_the_flag(args, match, qwen3_target, data_file, tmp_path):
    code, output = run_train("--model", qwen3_target, "--data", data_file, "--out", tmp_path / "o", *args)
    assert code == 1 and match in " ".join(output.split()), output


def test_init_refuses_what_it_cannot_train(qwen3_target, data_file, tmp_path):
    speculators = make_dspark(tmp_path / "spec", qwen3_target, packaging="speculators", target_layer_ids=[1, 2])
    code, output = run_train(
        "--init", speculators, "--model", qwen3_target, "--data", data_file, "--out", tmp_path / "o"
    )
    assert code == 1 and "DeepSpec" in output, output
    gemma = make_dspark(tmp_path / "gemma", qwen3_target, backbone="gemma4", target_layer_ids=[1, 2])
    code, output = run_train("--init", gemma, "--model", qwen3_target, "--data", data_file, "--out", tmp_path / "o2")
    assert code == 1 and "gemma4 backbone" in output, output
    code, output = run_train(
        "--init", gemma, "--arch", "dflash", "--model", qwen3_target, "--data", data_file, "--out", tmp_path / "o3"
    )
    assert code == 1 and "is a dspark drafter" in output, output
