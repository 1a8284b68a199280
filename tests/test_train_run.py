"""`train` end to end through a Typer app (CliRunner) on the tiny qwen3 target:
loss goes down, the output loads through `load_draft` and decodes losslessly,
`--stop-at` + `--resume` reproduce an uninterrupted run exactly, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import EOS_ID, MASK_ID, load_pair
from mlx.utils import tree_flatten

import dflash_mlx
from dflash_mlx import load_draft
from dflash_mlx.train.data import DataError
from dflash_mlx.train.regenerate import read_cache
from helpers.train_cli import run_train, train_ok

pytestmark = pytest.mark.slow  # training runs


WORDS = [
    "the",
    "river",
    "ran",
    "past",
    "old",
    "mill",
    "under",
    "stone",
    "bridge",
    "near",
    "market",
    "every",
    "morning",
    "baker",
    "opened",
    "shop",
]
PROMPTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(3 + i % 4)) for i in range(36)]
ARGS = [
    "--steps",
    "24",
    "--block-size",
    "4",
    "--draft-layers",
    "2",
    "--max-tokens",
    "20",
    "--batch-size",
    "4",
    "--anchors-per-seq",
    "8",
    "--save-every",
    "8",
    "--holdout",
    "3",
    "--lr",
    "3e-3",
    "--target-layers",
    "1,2",
    "--val-max-tokens",
    "16",
]


def _weights(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("train-data") / "prompts.jsonl"
    lines = [json.dumps({"prompt": p}) for p in PROMPTS[:30]]
    lines += [
        json.dumps({"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "x"}]})
        for p in PROMPTS[30:]
    ]
    path.write_text("\n".join(lines) + "\n\n")
    return path


@pytest.fixture(scope="module")
def runs(qwen3_target, data_file, tmp_path_factory):
    """One uninterrupted run and one stopped at step 16 then resumed."""
    root = tmp_path_factory.mktemp("train-runs")
    common = ["--model", qwen3_target, "--data", data_file, "--responses", root / "responses.jsonl", *ARGS]
    full = train_ok(*common, "--out", root / "full")
    stopped = train_ok(*common, "--out", root / "split", "--stop-at", "16")
    stopped_files = sorted(p.name for p in (root / "split").iterdir())
    checkpoints = sorted(p.name for p in (root / "split" / "work" / "checkpoints").iterdir())
    resumed = train_ok(*common, "--out", root / "split", "--resume")
    return {
        "root": root,
        "full": full,
        "stopped": stopped,
        "resumed": resumed,
        "stopped_files": stopped_files,
        "stopped_checkpoints": checkpoints,
    }


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "work" / "train_log.jsonl").read_text().splitlines()]


def test_loss_decreases_and_report(runs):
    out = runs["root"] / "full"
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 25))
    first, last = np.mean([r["loss"] for r in log[:5]]), np.mean([r["loss"] for r in log[-5:]])
    assert last < 0.7 * first, (first, last)
    assert max(r["grad_norm"] for r in log) > 1.0  # clipping had work to do
    lrs = [r["lr"] for r in log]
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(3e-3, rel=1e-3) and lrs[-1] < 1e-4  # warmup, cosine
    report = json.loads((out / "training_report.json").read_text())
    assert report["steps"] == 24 and report["block_size"] == 4 and report["target_layer_ids"] == [1, 2]
    assert report["holdout_prompts"] == 3 and report["train_sequences"] + report["dropped_sequences"] == 33
    assert report["loss_last"] < report["loss_first"]
    tau = report["mean_acceptance_length"]
    assert 1.0 <= tau <= 4.0 and report["validation"]["prompts"] == 3
    assert f"{tau:.3f}" in runs["full"]


def test_output_is_a_real_checkpoint_that_decodes_losslessly(runs, qwen3_target):
    out = runs["root"] / "full"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2], "block_size": 4}
    saved = _weights(out / "model.safetensors")
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in saved)  # shared, never saved
    model, tokenizer, _ = load_pair(str(qwen3_target))
    draft = load_draft(out, model)
    for key, value in tree_flatten(draft.parameters()):
        np.testing.assert_array_equal(np.array(value), saved[key])
    for prompt in ["the old mill", "every morning the baker", PROMPTS[5]]:
        plain = dflash_mlx.generate(model, None, tokenizer, prompt, max_tokens=24)
        assert dflash_mlx.generate(model, draft, tokenizer, prompt, max_tokens=24) == plain


def test_stop_and_resume_reproduce_the_uninterrupted_run(runs):
    root = runs["root"]
    assert "Stopped at step 16 of 24" in runs["stopped"]
    assert runs["stopped_files"] == ["work"]  # no drafter exported yet
    assert runs["stopped_checkpoints"] == ["step-00000008", "step-00000016"]
    assert "(step 16)" in runs["resumed"]
    assert [r["step"] for r in _log(root / "split")] == list(range(1, 25))
    full, split = _weights(root / "full" / "model.safetensors"), _weights(root / "split" / "model.safetensors")
    assert full.keys() == split.keys()
    for key in full:  # equal only if step, optimizer moments and data position were all restored
        np.testing.assert_allclose(split[key], full[key], atol=1e-6, err_msg=key)
    ckpts = root / "split" / "work" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000016", "step-00000024"]  # keep 2
    opt = mx.load(str(ckpts / "step-00000024" / "optimizer.safetensors"))
    assert opt["step"].item() == 24 and any(k.endswith(".m") for k in opt)


def test_resume_errors(runs, qwen3_target, data_file):
    root = runs["root"]
    common = ["--model", qwen3_target, "--data", data_file, "--responses", root / "responses.jsonl"]
    code, out = run_train(*common, *ARGS, "--out", root / "full")
    assert code == 1 and "already holds checkpoints" in out and "--resume" in out
    code, out = run_train(*common, *ARGS, "--out", root / "none", "--resume")
    assert code == 1 and "no checkpoint to resume from" in out
    code, out = run_train(*common, *ARGS, "--block-size", "5", "--out", root / "full", "--resume")
    assert code == 1 and "--block-size is 5 but the checkpoint" in out


def _copy_target(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = json.loads((dst / name).read_text())
        edit(cfg)
        (dst / name).write_text(json.dumps(cfg))
    return dst


def test_mask_token_from_tokenizer_or_option(qwen3_target, data_file, tmp_path):
    no_mask = _copy_target(qwen3_target, tmp_path / "t", lambda c: c.pop("mask_token", None))
    base = [
        "--data",
        data_file,
        "--steps",
        "2",
        "--block-size",
        "3",
        "--draft-layers",
        "1",
        "--max-tokens",
        "4",
        "--holdout",
        "0",
    ]
    code, out = run_train("--model", no_mask, *base, "--out", tmp_path / "a")
    assert code == 1 and "has no mask token" in out and "--mask-token-id" in out
    train_ok("--model", no_mask, *base, "--out", tmp_path / "b", "--mask-token-id", "4")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 4
    code, out = run_train("--model", no_mask, *base, "--out", tmp_path / "c", "--mask-token-id", "9999")
    assert code == 1 and "--mask-token-id 9999 is outside the vocabulary" in out


@pytest.mark.parametrize(
    "lines, message",
    [
        (['{"prompt": "a"}', "{not json"], ":2: not valid JSON"),
        (['{"prompt": "a"}', '["a"]'], ":2: expected a JSON object"),
        (['{"text": "a"}'], ":1: expected exactly one of the fields 'prompt' and 'messages'"),
        (['{"prompt": "a", "messages": []}'], ":1: expected exactly one of"),
        (['{"prompt": ""}'], ":1: 'prompt' must be a non-empty string"),
        (['{"messages": [{"role": "user"}]}'], ":1: 'messages[0]' must be an object with string fields"),
        (['{"messages": [{"role": "assistant", "content": "hi"}]}'], ":1: 'messages' holds only assistant turns"),
        (["", "  "], "no prompts (the file is empty)"),
    ],
)
def test_data_errors_name_file_and_line(qwen3_target, tmp_path, lines, message):
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    code, out = run_train("--model", qwen3_target, "--data", data, "--out", tmp_path / "o")
    assert code == 1 and str(data) in out and message in out, out


def test_option_and_file_errors(qwen3_target, data_file, tmp_path):
    code, out = run_train("--model", qwen3_target, "--data", tmp_path / "missing.jsonl", "--out", tmp_path / "o")
    assert code == 1 and "missing.jsonl: training data file not found" in out
    code, out = run_train("--model", tmp_path / "nowhere", "--data", data_file, "--out", tmp_path / "o")
    assert code == 1 and "--model" in out and "no such directory" in out
    code, out = run_train("--model", qwen3_target, "--data", data_file, "--out", tmp_path / "o", "--block-size", "1")
    assert code == 1 and "--block-size must be >= 2" in out
    code, out = run_train("--model", qwen3_target, "--data", data_file, "--out", tmp_path / "o", "--holdout", "99")
    assert code == 1 and "--holdout 99 leaves no training prompts" in out
    code, out = run_train(
        "--model", qwen3_target, "--data", data_file, "--out", tmp_path / "o", "--target-layers", "1,9"
    )
    assert code == 1 and "--target-layers [1, 9]" in out and "0..3" in out
    code, out = run_train(
        "--model", qwen3_target, "--data", data_file, "--out", tmp_path / "o", "--chat-template-kwargs", "[1]"
    )
    assert code == 2 and "expected a JSON object" in out


def test_messages_need_a_chat_template(qwen3_target, tmp_path):
    target = _copy_target(qwen3_target, tmp_path / "t", lambda c: c.pop("chat_template", None))
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": "ok"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    code, out = run_train("--model", target, "--data", data, "--out", tmp_path / "o")
    assert code == 1 and f"{data}:2: a 'messages' line needs a chat template" in out


def test_response_cache_tolerates_a_torn_last_line_only(tmp_path):
    path = tmp_path / "responses.jsonl"
    good = json.dumps({"key": "a", "prompt_ids": [1], "response_ids": [5, 6], "finish_reason": "stop"})
    path.write_text(good + "\n" + '{"key": "b", "prompt_ids": [1], "resp')
    assert read_cache(path) == {"a": [5, 6]}
    assert path.read_text() == good + "\n"  # the torn line is gone, appends start clean
    path.write_text('{"key": "b", "prompt_ids"\n' + good + "\n")
    with pytest.raises(DataError, match=r"responses.jsonl:1: not a response cache line"):
        read_cache(path)


def test_regeneration_is_the_targets_greedy_output_and_resumes(qwen3_target, tmp_path):
    from mlx_lm import stream_generate

    from dflash_mlx.train.regenerate import regenerate_responses

    model, tokenizer, _ = load_pair(str(qwen3_target))
    prompts = [tokenizer.encode(p) for p in PROMPTS[:6]] + [tokenizer.encode(PROMPTS[0])]  # one duplicate
    cache = tmp_path / "responses.jsonl"
    kw = {"max_tokens": 12, "target_name": "tiny", "batch_size": 3}
    first = regenerate_responses(model, tokenizer, prompts, cache, **kw)
    assert len(cache.read_text().splitlines()) == 6 and first[6] == first[0]
    for prompt, response in zip(prompts, first):
        plain = [r.token for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=12)]
        assert response == plain  # greedy, and a stop token that ended it is kept
    assert any(r[-1] == EOS_ID for r in first) or all(len(r) == 12 for r in first)

    cache.write_text("".join(cache.read_text().splitlines(keepends=True)[:2]))  # an interrupted run
    again = regenerate_responses(model, tokenizer, prompts, cache, **kw)
    assert again == first and len(cache.read_text().splitlines()) == 6
    stamp = cache.stat().st_mtime_ns
    assert regenerate_responses(model, tokenizer, prompts, cache, **kw) == first
    assert cache.stat().st_mtime_ns == stamp  # nothing left to generate, nothing written
    other = regenerate_responses(model, tokenizer, prompts[:2], cache, **dict(kw, max_tokens=5))
    assert [len(r) <= 5 for r in other] == [True, True] and len(cache.read_text().splitlines()) == 8
