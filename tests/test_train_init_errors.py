"""`train --init` defaults and the clear errors of issue 19: a DFlash 2 checkpoint, a
drafter made for another target, --max-length beyond the target's context, an empty
--replay file, drafter-shape flags combined with --init."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import helpers as tm

from dflash_mlx import load_draft
from dflash_mlx.train.options import FINETUNE_LR, FINETUNE_WARMUP
from helpers.train_cli import run_train

pytestmark = pytest.mark.slow  # training runs


WORDS = "the river ran past old mill under stone bridge near market every morning baker".split()
QUICK = ["--steps", "2", "--max-tokens", "6", "--batch-size", "2", "--anchors-per-seq", "2", "--holdout", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("init-data") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": " ".join(WORDS[i : i + 4])}) + "\n" for i in range(8)))
    return path


def test_init_keeps_the_drafters_config_and_uses_finetuning_defaults(qwen3_target, qwen3_draft, data, tmp_path):
    code, out = run_train(
        "--model", qwen3_target, "--data", data, "--out", tmp_path / "o", "--init", qwen3_draft, *QUICK
    )
    assert code == 0, out
    report = json.loads((tmp_path / "o" / "training_report.json").read_text())
    assert report["lr"] == FINETUNE_LR and report["warmup"] == FINETUNE_WARMUP and report["init"] == str(qwen3_draft)
    assert report["block_size"] == 16 and report["target_layer_ids"] == [1, 2] and report["draft_layers"] == 2
    assert f"from {qwen3_draft}" in out and "Peak memory of the training loop" in out
    assert report["peak_rss_gb"] > 0 and report["peak_memory_gb"] > 0 and report["max_memory_gb"] is None
    before = json.loads((qwen3_draft / "config.json").read_text())
    after = json.loads((tmp_path / "o" / "config.json").read_text())
    assert after["dflash_config"] == before["dflash_config"] and after["num_hidden_layers"] == 2
    model, _, _ = tm.load_pair(str(qwen3_target))
    load_draft(tmp_path / "o", model)
    code, out = run_train(
        "--model",
        qwen3_target,
        "--data",
        data,
        "--out",
        tmp_path / "p",
        "--init",
        qwen3_draft,
        *QUICK,
        "--block-size",
        "4",
        "--lr",
        "1e-3",
    )
    assert code == 0, out
    report = json.loads((tmp_path / "p" / "training_report.json").read_text())
    assert report["lr"] == 1e-3 and report["block_size"] == 4
    assert json.loads((tmp_path / "p" / "config.json").read_text())["dflash_config"]["block_size"] == 4


def test_init_refuses_dflash2_and_drafters_of_another_target(qwen3_target, tiny_target, data, tmp_path):
    v2 = tm.make_draft2(tmp_path / "v2", qwen3_target, target_layer_ids=[1, 2])
    code, out = run_train("--model", qwen3_target, "--data", data, "--out", tmp_path / "o", "--init", v2, *QUICK)
    assert code == 1 and f"--init {v2}" in out and "DFlash 2" in out and "not supported yet" in out, out
    other = tiny_target("qwen3", hidden_size=32)
    foreign = tm.make_draft(tmp_path / "foreign", other, target_layer_ids=[1, 2])
    code, out = run_train("--model", qwen3_target, "--data", data, "--out", tmp_path / "o", "--init", foreign, *QUICK)
    assert code == 1 and f"Draft '{foreign}' does not fit target '{qwen3_target}'" in out, out
    assert "hidden_size is 32 in the draft but the target has 64" in out
    code, out = run_train(
        "--model", qwen3_target, "--data", data, "--out", tmp_path / "o", "--init", tmp_path / "none", *QUICK
    )
    assert code == 1 and "--init" in out and "neither an existing directory" in out, out


def test_flag_errors(qwen3_target, qwen3_draft, data, tmp_path):
    base = ["--model", qwen3_target, "--data", data, "--out", tmp_path / "o", *QUICK]
    code, out = run_train(*base, "--max-length", "5000")
    assert code == 1 and "--max-length 5000 is beyond the context of target" in out
    assert "max_position_embeddings 4096" in out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, out = run_train(*base, "--replay", empty)
    assert code == 1 and f"--replay {empty}: no prompts (the file is empty)" in out, out
    code, out = run_train(*base, "--replay", tmp_path / "missing.jsonl")
    assert code == 1 and "--replay" in out and "not found" in out
    code, out = run_train(*base, "--init", qwen3_draft, "--draft-layers", "3")
    assert code == 1 and "--draft-layers cannot be combined with --init" in out
    code, out = run_train(*base, "--replay-ratio", "1.5")
    assert code == 1 and "--replay-ratio" in out
    code, out = run_train(*base, "--replay", data, "--batch-size", "1")
    assert code == 1 and "--replay needs --batch-size >= 2" in out
    code, out = run_train(*base, "--max-memory-gb", "0.0001")
    assert code == 1 and "--max-memory-gb 0.0001: the first training step peaked at" in out
    assert "lower --batch-size (now 2) or --anchors-per-seq (now 2)" in out
    code, out = run_train(*base, "--max-memory-gb", "-1")
    assert code == 1 and "--max-memory-gb must be a positive number" in out


def test_init_with_replay_resumes_exactly(qwen3_target, qwen3_draft, data, tmp_path):
    import mlx.core as mx
    import numpy as np

    replay = tmp_path / "replay.jsonl"
    replay.write_text("".join(json.dumps({"prompt": " ".join(WORDS[-i - 3 :])}) + "\n" for i in range(6)))
    common = [
        "--model",
        qwen3_target,
        "--data",
        data,
        "--init",
        qwen3_draft,
        "--replay",
        replay,
        "--responses",
        tmp_path / "responses.jsonl",
        "--steps",
        "6",
        "--max-tokens",
        "6",
        "--batch-size",
        "4",
        "--anchors-per-seq",
        "2",
        "--holdout",
        "2",
        "--save-every",
        "3",
        "--block-size",
        "4",
    ]
    for args in (["--out", tmp_path / "full"], ["--out", tmp_path / "split", "--stop-at", "3"]):
        code, out = run_train(*common, *args)
        assert code == 0, out
    code, out = run_train(*common, "--out", tmp_path / "split", "--resume")
    assert code == 0 and "(step 3)" in out, out
    code, out = run_train(*common, "--out", tmp_path / "split", "--resume", "--replay-ratio", "0.5")
    assert code == 1 and "--replay-ratio is 0.5 but the checkpoint" in out
    full, split = (mx.load(str(tmp_path / d / "model.safetensors")) for d in ("full", "split"))
    for key in full:
        np.testing.assert_allclose(np.array(split[key]), np.array(full[key]), atol=1e-6, err_msg=key)
    report = json.loads((tmp_path / "full" / "training_report.json").read_text())
    assert report["replay_per_batch"] == 1 and report["replay_train_sequences"] == 4  # 6 prompts, 2 held out
    log = [json.loads(line) for line in (tmp_path / "full" / "work" / "train_log.jsonl").read_text().splitlines()]
    assert [r["replay_sequences"] for r in log] == [1] * 6
    assert report["replay_mean_acceptance_length"] is not None and report["mean_acceptance_length"] is not None


def test_init_from_a_flat_schema_sliding_drafter(qwen3_target, data, tmp_path):
    init = tm.make_draft(
        tmp_path / "sliding",
        qwen3_target,
        target_layer_ids=[1, 2],
        block_size=5,
        schema="flat",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
    )
    code, out = run_train("--model", qwen3_target, "--data", data, "--out", tmp_path / "o", "--init", init, *QUICK)
    assert code == 0, out
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert "block_size" not in config and config["dflash_config"]["block_size"] == 5  # moved, not duplicated
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 4
    model, _, _ = tm.load_pair(str(qwen3_target))
    draft = load_draft(tmp_path / "o", model)
    assert draft.config.block_size == 5 and draft.config.layer_is_sliding(0)
