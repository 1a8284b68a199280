"""MTP heads trained by `dflash-mlx train --arch mtp`, and everything that drafts with them, as users run it.

A tiny qwen3_5 (hybrid: Gated DeltaNet and attention layers) whose checkpoint
lost its heads gets new ones trained on its own greedy replies; they are
written into a copy of its checkpoint under the family's names and load from
there as a real checkpoint's do. With them: at least 1.5 tokens per cycle at
block 3 on the greedy text of the prompts they learnt (the report also holds stage 0's offline top-1
accuracy), greedy output equal to mlx-lm's, sampled output that follows the
target's distribution, the server in both worker modes and the chat panel
naming the source "mtp", and the per-generation choice between the heads and
a DFlash drafter of the same target.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import mlx_lm
import numpy as np
import openai
import pytest

import dflash_mlx
from dflash_mlx import make_session, stream_generate
from dflash_mlx.cli.live_panel import sources_text
from dflash_mlx.mtp.checkpoint import NO_MTP
from dflash_mlx.mtp.scan import has_mtp_weights, safetensors_names
from dflash_mlx.policy.adaptive import choose_source, drafter_history
from dflash_mlx.proposers.choice import RatedChoice
from dflash_mlx.proposers.dflash import proposer_for
from dflash_mlx.proposers.mtp import MTPProposer, load_mtp
from dflash_mlx.stats import RunStats
from helpers import assert_same_stream, check_first_two_sampled_tokens, make_draft, reference, without_eos
from helpers.calibrations import forget_curve
from helpers.servers import ServeProcess
from helpers.train_cli import train_ok

pytestmark = pytest.mark.slow  # training runs, servers, subprocesses

WORDS = "the river ran past old mill under stone bridge near market every morning baker opened shop".split()
_RNG = np.random.default_rng(0)
PROMPTS = sorted({" ".join(_RNG.choice(WORDS, size=int(_RNG.integers(3, 8)))) for _ in range(200)})[:60]  # all distinct


@pytest.fixture(scope="module")
def trained(mtp_target, tmp_path_factory):
    """(source target, the trained checkpoint's directory, its training report, ids of prompts it trained on)."""
    source = mtp_target("qwen3_5", with_mtp=False)  # a conversion that dropped the heads
    tmp = tmp_path_factory.mktemp("mtp-train")
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp / "trained"
    train_ok(
        "--arch",
        "mtp",
        "--model",
        source,
        "--data",
        data,
        "--out",
        out,
        "--steps",
        300,
        "--max-tokens",
        40,
        "--batch-size",
        8,
        "--holdout",
        6,
        "--block-size",
        3,
        "--lr",
        "2e-3",
        "--warmup",
        "0.05",
    )
    report = json.loads((out / "training_report.json").read_text())
    return source, out, report, report["train_prompt_ids"]


def test_the_trained_heads_are_a_checkpoints_under_the_familys_names(trained):
    source, out, report, _ = trained
    assert not has_mtp_weights(str(source)) and has_mtp_weights(str(out))
    names = safetensors_names(out)
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"} <= set(names)
    assert any(n.startswith("mtp.layers.0.self_attn.") for n in names)
    mlx_lm.load(str(out))  # mlx-lm still loads the copy (and drops the heads)
    _, _, draft = dflash_mlx.load(str(out))
    assert isinstance(draft, MTPProposer) and report["fine_tuned"] is False


def test_trained_heads_commit_at_least_1_5_tokens_per_cycle_at_block_3(trained):
    """Greedy, the heads alone (no copy-aware drafting), fixed block 3: no timing involved. On the target's greedy
    text for the prompts the heads were trained on: a tiny random target's text is a hash of its context, which a
    few thousand tokens cannot teach, so its held-out numbers (printed) stay near one token per cycle; how heads
    generalise is the benchmark's question, on a target trained on GSM8K (docs/benchmarks.md). The report gives
    stage 0's offline top-1 accuracy beside each."""
    _, out, report, _ = trained
    for key in ("train_", ""):
        print(f"{key or 'held-out '}top-1 {report[key + 'top1_accuracy']:.3f}, tokens per cycle ", end="")
        print(f"{report[key + 'tokens_per_cycle']:.3f}")
    assert report["block_size"] == 3 and report["train_tokens_per_cycle"] >= 1.5
    assert report["train_top1_accuracy"] > 0.5 and 0 <= report["top1_accuracy"] <= 1
    model, tokenizer = mlx_lm.load(str(out))
    mtp = load_mtp(out, model)
    with without_eos(tokenizer) as tok:
        for ids in report["train_prompt_ids"][:3]:
            got = list(stream_generate(model, mtp, tok, ids, max_tokens=40, block_size=3, lookup=False))
            assert_same_stream(got, reference(model, tok, ids, 40))
            assert any(r.source == "mtp" for r in got)
    stats = RunStats()
    for r in got:
        stats.add(r)
    assert "mtp:" in sources_text(stats).plain


def test_sampled_output_follows_the_target_on_the_hybrid_target(trained):
    _, out, _, learnt = trained
    model, tokenizer = mlx_lm.load(str(out))
    mtp = load_mtp(out, model)
    check_first_two_sampled_tokens(model, mtp, tokenizer, learnt[0], {"temperature": 1.0}, runs=600)


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_the_server_drafts_with_the_heads_in_both_worker_modes(trained, concurrency):
    _, out, _, learnt = trained
    model, tokenizer = mlx_lm.load(str(out))
    prompt = tokenizer.decode(learnt[1])
    want = dflash_mlx.generate(model, None, tokenizer, prompt, max_tokens=32)  # plain decoding: mlx-lm's
    server = ServeProcess(
        "--model", str(out), "--decode-concurrency", concurrency, "--lookup", "off", "--block-size", "3"
    )
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            served = client.models.list().data[0]
            assert served.model_extra["draft"] == "mtp"
            reply = client.completions.create(model=served.id, prompt=prompt, max_tokens=32, temperature=0)
    finally:
        server.stop()
    assert reply.choices[0].text == want
    assert reply.model_extra["dflash"]["tokens_by_source"]["mtp"] > 0


def test_the_console_script_drafts_with_the_heads_and_names_a_checkpoint_without_them(trained):
    source, out, _, learnt = trained
    exe = shutil.which("dflash-mlx")
    prompt = mlx_lm.load(str(out))[1].decode(learnt[0])  # one the heads learnt, as it was written (raw)

    def generate(model, *flags):
        command = [exe, "generate", prompt, "--raw", "--model", str(model), "-n", "24", "--json", *flags]
        return subprocess.run(command, capture_output=True, text=True)

    done = generate(source, "--draft", "mtp")
    assert done.returncode == 2 and NO_MTP in " ".join(done.stderr.split())
    runs = [generate(out, "--draft", "mtp", "--lookup", "off", "-b", "3"), generate(out, "--no-dflash")]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    drafted, plain = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert drafted["text"] == plain["text"] and plain["sources"] == {}
    assert drafted["sources"].get("mtp", 0) > 0


def _pin(model, choice, member: int, per_token: float, accepted: int) -> None:
    """Member `member`'s cost curve (written with the calibration's own key, not learning) and its history of
    greedy generations: `accepted` of 3 drafts in each of 40 cycles."""
    from dflash_mlx.policy.calibration import calibration_key, file_for, grid_for
    from dflash_mlx.utils.io import write_json_atomic

    trial = choice.with_active(member)
    widest = min(4, choice.members[member].block_size)
    session = make_session(model, trial)
    key = calibration_key(session.target, trial, widest)
    grid = grid_for(widest)
    seconds = [0.005 * (1 + per_token * (b - 1)) for b in grid]
    doc = {"key": key, "rows": [1], "blocks": grid, "seconds": [seconds], "learns": False, "source": "measured"}
    path = file_for(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, json.loads(json.dumps(doc, default=str)))
    forget_curve(path)
    history = drafter_history(trial.drafter, widest - 1)
    for _ in range(40):
        history.record(widest - 1, accepted)


def test_each_generation_drafts_with_the_source_expected_to_commit_more(trained, tmp_path, calibration_cache):
    """A DFlash drafter registered beside the heads: the policy picks, once per generation, the one whose
    history over its cost curve promises more tokens per second; the output is mlx-lm's either way."""
    _, out, _, learnt = trained
    model, tokenizer = mlx_lm.load(str(out))
    dflash = proposer_for(dflash_mlx.load_draft(make_draft(tmp_path / "draft", out, block_size=4), model))
    choice = RatedChoice([dflash, load_mtp(out, model)])
    _pin(model, choice, 0, per_token=0.05, accepted=0)
    _pin(model, choice, 1, per_token=0.05, accepted=3)
    session = make_session(model, choice)
    assert choose_source(session.target, choice, 4) == 4 and choice.name == "mtp"
    with without_eos(tokenizer) as tok:
        got = list(stream_generate(model, choice, tok, learnt[2], max_tokens=32, session=session, lookup=False))
        assert_same_stream(got, reference(model, tok, learnt[2], 32))
        assert {r.source for r in got} <= {"mtp", "target"} and "mtp" in {r.source for r in got}
        _pin(model, choice, 0, per_token=0.05, accepted=3)
        _pin(model, choice, 1, per_token=0.05, accepted=0)
        got = list(stream_generate(model, choice, tok, learnt[2], max_tokens=32, session=session, lookup=False))
        assert_same_stream(got, reference(model, tok, learnt[2], 32))
    assert choice.name == "dflash"
