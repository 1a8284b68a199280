"""The terminal app on tiny local models: chat, generate, bench, models, doctor.

Commands run through Typer's CliRunner (the app object, no re-exec); one test
drives `dflash-mlx chat` in a real pseudo-terminal with pexpect.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_mlx import generate as dflash_generate
from dflash_mlx.models.chat_template import ReasoningError, reasoning_kwargs
from dflash_mlx.cli import app
from dflash_mlx.models.registry import RegistryEntry, lookup
from dflash_mlx.models.resolve import BlockChoice, ModelChoiceError, choose_block_size, choose_model
from helpers import load_pair

runner = CliRunner()


def invoke(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


@pytest.fixture(scope="module")
def pair_dirs(tiny_pair_dirs):
    """The qwen3 target and its random drafter: the commands take directories."""
    return tiny_pair_dirs("qwen3")


def test_generate_json_has_the_text_and_the_statistics(pair_dirs):
    target, draft = pair_dirs
    r = invoke("generate", "hello there", "--model", target, "--draft", draft, "-n", 24, "--json", "-b", 4)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"text", "tokens", "tps", "acceptance_length", "histogram", "peak_memory_gb"} <= set(out)
    assert list(out["histogram"]) == ["1", "2", "3", "4"]
    assert sum(int(k) * v for k, v in out["histogram"].items()) == out["tokens"] - 1
    model, tokenizer, drafter = load_pair(target, draft)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert out["text"] == dflash_generate(model, None, tokenizer, prompt, max_tokens=24)


def test_generate_lookup_on_and_off(pair_dirs):
    """--lookup off: no token from a lookup span, the same text; a bad value names the flag."""
    target, draft = pair_dirs
    runs = {}
    for flag in ("on", "off"):
        r = invoke(
            "generate",
            "hello there",
            "--model",
            target,
            "--draft",
            draft,
            "-n",
            48,
            "--json",
            "--raw",
            "--lookup",
            flag,
            "-b",  # (a fixed block, which a span fills where one is offered: the adaptive choice follows the load)
            4,
        )
        assert r.exit_code == 0, r.output
        runs[flag] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs["on"]["text"] == runs["off"]["text"]
    assert runs["off"]["sources"]["lookup"] == 0 and sum(runs["off"]["sources"].values()) == runs["off"]["tokens"]
    assert runs["on"]["sources"]["lookup"] > 0  # (this reply repeats itself)
    bad = invoke("generate", "hi", "--model", target, "--draft", draft, "--lookup", "maybe")
    assert bad.exit_code == 2 and "--lookup: expected on or off, got 'maybe'" in bad.stderr


@pytest.mark.slow
def test_the_console_script_takes_lookup_off(pair_dirs):
    target, draft = pair_dirs
    script = shutil.which("dflash-mlx")
    if script is None:
        pytest.skip("the dflash-mlx console script is not installed (pip install -e .)")
    r = subprocess.run(
        [
            script,
            "generate",
            "hello there",
            "--model",
            str(target),
            "--draft",
            str(draft),
            "-n",
            "24",
            "--raw",
            "--lookup",
            "off",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["sources"]["lookup"] == 0 and out["tokens"] == 24


def test_generate_raw_streams_the_plain_continuation(pair_dirs):
    target, draft = pair_dirs
    r = invoke("generate", "hello there", "--model", target, "--draft", draft, "-n", 16, "--raw")
    assert r.exit_code == 0
    model, tokenizer, _ = load_pair(target, draft)
    assert r.stdout.startswith(dflash_generate(model, None, tokenizer, "hello there", max_tokens=16))
    plain = invoke("generate", "hello there", "--model", target, "--no-dflash", "-n", 16, "--raw")
    assert plain.stdout == r.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "qwen3-4bb"], "Did you mean qwen3-4b"),
        (["--model", "someone/unknown-model"], "--draft PATH_OR_REPO"),
        (["--model", "/"], "has no config.json"),
    ],
)
def test_errors_say_what_to_do(args, message):
    r = invoke("generate", "hi", *args)
    assert r.exit_code == 2
    assert message in " ".join(r.stderr.split())


def test_every_registry_family_resolves_without_a_family_whitelist():
    """A registry name resolves to its target and drafter whatever its family (no family is refused up front:
    a target is checked once loaded)."""
    from dflash_mlx.models.registry import registry_entries
    from dflash_mlx.models.resolve import choose_model

    for entry in registry_entries():
        choice = choose_model(entry.name, api=True)
        assert choice.entry is entry and choice.draft == entry.draft_path()


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_seed_out_of_range_is_refused_naming_the_flag(command):
    r = invoke(command, *(["hi"] if command == "generate" else []), "--temperature", "0.7", "--seed", "-5")
    said = " ".join(r.stderr.split())
    assert r.exit_code == 2 and "'--seed': Input should be greater than or equal to 0" in said


def test_reasoning_without_a_template_key_is_refused(pair_dirs):
    target, draft = pair_dirs
    r = invoke("generate", "hi", "--model", target, "--draft", draft, "--reasoning", "high")
    assert r.exit_code == 2
    assert "has none of enable_thinking, reasoning_effort, reasoning_strength" in " ".join(r.stderr.split())


class FakeTokenizer:
    def __init__(self, template):
        self.chat_template = template


def test_reasoning_levels_map_onto_the_template_key():
    thinking = FakeTokenizer("{% if enable_thinking is defined and enable_thinking is false %}{% endif %}")
    assert reasoning_kwargs(thinking, "off") == {"enable_thinking": False}
    assert reasoning_kwargs(thinking, "on") == {"enable_thinking": True}
    with pytest.raises(ReasoningError, match="use on or off"):
        reasoning_kwargs(thinking, "high")
    effort = FakeTokenizer(
        "{% if reasoning_effort == 'low' %}{% elif reasoning_effort == 'high' %}"
        "{% elif reasoning_effort == 'medium' %}{% endif %}"
    )
    assert reasoning_kwargs(effort, "low") == {"reasoning_effort": "low"}
    with pytest.raises(ReasoningError, match="low, medium, high"):
        reasoning_kwargs(effort, "xhigh")
    with pytest.raises(ReasoningError, match="cannot be switched off"):
        reasoning_kwargs(effort, "off")
    gpt_oss = lookup("gpt-oss-20b")
    assert reasoning_kwargs(FakeTokenizer(""), "medium", gpt_oss) == {"reasoning_effort": "medium"}
    glimmer = RegistryEntry(
        "glimmer",
        "a/b",
        "c/d",
        16,
        "dflash2",
        reasoning="reasoning_strength",
        reasoning_values=("low", "medium", "high", "xhigh"),
        reasoning_default="high",
    )
    assert reasoning_kwargs(FakeTokenizer(""), None, glimmer) == {"reasoning_strength": "high"}
    assert reasoning_kwargs(FakeTokenizer(""), "xhigh", glimmer) == {"reasoning_strength": "xhigh"}
    qwen3 = lookup("qwen3-4b")  # the registry default: non-thinking
    assert reasoning_kwargs(thinking, None, qwen3) == {"enable_thinking": False}
    with pytest.raises(ReasoningError, match="expected one of"):
        reasoning_kwargs(thinking, "loud")


def test_block_size_precedence(tiny_pair):
    model, _, drafter = tiny_pair("qwen3", quantize_bits=4, draft_kw=dict(block_size=16))
    entry = RegistryEntry("x", "a/b", "c/d", block_size=8, kind="dflash")
    assert choose_block_size(12, entry, model, drafter) == BlockChoice(12)  # the flag wins, even above the cap
    assert choose_block_size("12", entry, model, drafter) == BlockChoice(12)
    # no flag (or auto): adaptive, at most the registry's 8, capped for 4-bit
    assert choose_block_size(None, entry, model, drafter) == BlockChoice(5, adaptive=True)
    assert choose_block_size("auto", entry, model, drafter) == BlockChoice(5, adaptive=True)
    assert choose_block_size(None, None, model, drafter) == BlockChoice(5, adaptive=True)  # drafter 16, capped
    plain, _, plain_drafter = tiny_pair("qwen3", draft_kw=dict(block_size=16))
    assert choose_block_size(None, entry, plain, plain_drafter) == BlockChoice(8, adaptive=True)
    assert choose_block_size(None, None, plain, plain_drafter) == BlockChoice(16, adaptive=True)
    assert choose_block_size(None, entry, plain, None) == BlockChoice(None)
    for bad in ("0", "-2", "fast", "2.5"):
        with pytest.raises(ModelChoiceError, match="--block-size: expected 'auto' or an integer >= 1"):
            choose_block_size(bad, entry, plain, plain_drafter)


def test_choose_model_takes_names_repo_ids_and_directories(qwen3_target):
    choice = choose_model("qwen3-4b")
    assert (choice.target, choice.draft) == ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16")
    choice = choose_model("mlx-community/Qwen3-4B-4bit")
    assert (choice.target, choice.draft) == ("mlx-community/Qwen3-4B-4bit", "z-lab/Qwen3-4B-DFlash-b16")
    assert choose_model("qwen3-4b", "my/drafter").draft == "my/drafter"
    assert choose_model(str(qwen3_target), use_draft=False).draft is None
    with pytest.raises(ModelChoiceError, match="no drafter is registered"):
        choose_model(str(qwen3_target))


def test_a_local_copy_of_a_registered_target_finds_its_drafter(qwen3_target, tmp_path):
    local = tmp_path / "Qwen3-4B-4bit"
    local.symlink_to(qwen3_target, target_is_directory=True)
    choice = choose_model(str(local))
    assert choice.target == str(local) and choice.draft == "z-lab/Qwen3-4B-DFlash-b16"
    assert choice.entry.name == "qwen3-4b"
    other = tmp_path / "my-model"
    other.symlink_to(qwen3_target, target_is_directory=True)
    assert choose_model(str(other), "some/drafter").entry is None


def test_chat_commands_and_history(pair_dirs):
    target, draft = pair_dirs
    script = (
        "\n".join(
            [
                "/help",
                "hello",
                "/block 3",
                "/temp 0.5",
                "/temp -1",
                "/block x",
                "/block 1000000",
                "/system be brief",
                "and again",
                "/stats",
                "/block auto",
                "once more",
                "/reset",
                "/nonsense",
                "/quit",
            ]
        )
        + "\n"
    )
    r = invoke("chat", "--model", target, "--draft", draft, "-n", 12, input=script)
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    for expected in (
        "/reset",
        "Block size 3.",
        "Temperature 0.5.",
        "/temp: expected a number >= 0",
        "/block: expected auto or an integer from 1 to 16 (the drafter's block), got x",
        "got 1000000",
        "Adaptive block, at most 16.",
        "blocks chosen",
        "mean block",
        "System prompt set.",
        "Conversation cleared.",
        "Unknown command /nonsense",
        "tokens per cycle",
        "mean acceptance",
        "tokens from",
    ):
        assert expected in out, expected
    assert out.count("cached)") == 3
    assert "(0 cached)" in out  # the first turn prefills everything


def test_chat_reuses_the_conversation_prefix(pair_dirs):
    target, draft = pair_dirs
    r = invoke("chat", "--model", target, "--draft", draft, "-n", 8, input="hello\nmore\n/quit\n")
    assert r.exit_code == 0
    cached = [int(part.split("(")[1].split()[0]) for part in r.stdout.split("prompt ")[1:]]
    assert cached[0] == 0 and cached[1] > 10


def test_bench_default_legs_are_adaptive_then_the_drafters_block(pair_dirs, tmp_path):
    target, draft = pair_dirs
    out = tmp_path / "report.json"
    r = invoke("bench", "--model", target, "--draft", draft, "--num-prompts", 1, "--max-tokens", 12, "--out", out)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert [(run["block_size"], run["max_block_size"]) for run in doc["runs"]] == [("auto", 16), (16, 16)]
    adaptive, fixed = doc["runs"]
    assert sum(adaptive["block_sizes"].values()) == sum(adaptive["histogram"].values()) > 0
    assert adaptive["mean_block_size"] is not None and list(fixed["block_sizes"]) <= [str(b) for b in range(1, 17)]
    assert all(run["greedy_matches"] for run in doc["runs"])
    assert "DFlash auto" in r.stdout and "DFlash b=16" in r.stdout and "blocks" in r.stdout
    assert all(sum(run["sources"].values()) == run["dflash_tokens"] and run["lookup"] for run in doc["runs"])


def test_bench_lookup_both_runs_each_leg_with_and_without(pair_dirs, tmp_path):
    target, draft = pair_dirs
    out = tmp_path / "report.json"
    r = invoke(
        "bench",
        "--model",
        target,
        "--draft",
        draft,
        "--num-prompts",
        1,
        "--max-tokens",
        12,
        "-b",
        4,
        "--lookup",
        "both",
        "--out",
        out,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert [(run["block_size"], run["lookup"]) for run in doc["runs"]] == [(4, True), (4, False)]
    assert doc["runs"][1]["sources"]["lookup"] == 0 and all(run["greedy_matches"] for run in doc["runs"])
    assert "lookup off" in r.stdout and "tokens from" in r.stdout
    bad = invoke("bench", "--model", target, "--draft", draft, "--lookup", "sometimes")
    assert bad.exit_code == 2 and "--lookup: expected on, off or both" in bad.stderr


def test_bench_report_is_consistent(pair_dirs, tmp_path):
    target, draft = pair_dirs
    out = tmp_path / "report.json"
    r = invoke(
        "bench",
        "--model",
        target,
        "--draft",
        draft,
        "--num-prompts",
        2,
        "--max-tokens",
        12,
        "-b",
        4,
        "-b",
        2,
        "--baseline",
        "mlx-lm-draft",
        "--draft-model",
        target,
        "--out",
        out,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    for key in (
        "speedup",
        "acceptance_length",
        "baseline_tps",
        "dflash_tps",
        "histogram",
        "per_position_acceptance",
        "prefill_tps",
        "peak_memory_gb",
        "prompts",
        "environment",
        "runs",
    ):
        assert key in doc, key
    assert [run["block_size"] for run in doc["runs"]] == [4, 2]
    for run in doc["runs"]:
        assert run["speedup"] == pytest.approx(run["dflash_tps"] / run["baseline_tps"])
        b = run["block_size"]
        assert list(run["histogram"]) == [str(k) for k in range(1, b + 1)]
        assert len(run["per_position_acceptance"]) == b - 1
        cycles = sum(run["histogram"].values())
        committed = sum(int(k) * v for k, v in run["histogram"].items())
        assert run["dflash_tokens"] == committed + len(run["prompts"])  # + each reply's first token
        assert run["greedy_matches"] and all(p["matches_baseline"] for p in run["prompts"])
        assert len(run["prompts"]) == 2
        accept = [p["acceptance_length"] for p in run["prompts"]]
        assert run["acceptance_length"] == pytest.approx(sum(accept) / 2)
        assert all(0 <= f <= 1 for f in run["per_position_acceptance"]) and cycles > 0
    assert doc["speedup"] == doc["runs"][0]["speedup"]
    assert doc["environment"]["block_size"] == 4 and doc["environment"]["mlx"]
    assert doc["mlx_lm_draft"]["greedy_matches"]
    assert "DFlash b=4" in r.stdout and "mlx-lm (baseline)" in r.stdout


def test_bench_multi_turn_dataset_and_errors(pair_dirs, tmp_path):
    target, draft = pair_dirs
    for dataset, turns in (("mt-bench", 2), ("edit", 3)):
        out = tmp_path / f"{dataset}.json"
        r = invoke(
            "bench",
            "--model",
            target,
            "--draft",
            draft,
            "--dataset",
            dataset,
            "--num-prompts",
            1,
            "--max-tokens",
            6,
            "--out",
            out,
        )
        assert r.exit_code == 0, r.output
        doc = json.loads(out.read_text())
        assert doc["prompts"][0]["turns"] == turns and len(doc["prompts"][0]["text"]) == turns
    bad = invoke("bench", "--model", target, "--draft", draft, "--dataset", "mmlu")
    assert bad.exit_code == 2 and "--dataset: expected one of gsm8k, humaneval, mt-bench, edit" in bad.stderr
    bad = invoke("bench", "--model", target, "--draft", draft, "--baseline", "mlx-lm-draft")
    assert bad.exit_code == 2 and "--draft-model" in bad.stderr


def test_models_and_doctor():
    r = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "qwen3-4b" in r.stdout and "reasoning_effort: low/medium/high" in r.stdout
    r = invoke("doctor")
    assert r.exit_code == 0
    assert "mlx" in r.stdout and "device" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("dflash-mlx") is None, reason="console script not installed")
def test_models_reads_in_an_80_column_terminal():
    """The real console script at COLUMNS=80: no line wider, every name and drafter id whole, the pairs too
    large for one Mac marked."""
    import subprocess

    from dflash_mlx.models.registry import registry_entries

    done = subprocess.run(
        [shutil.which("dflash-mlx"), "models"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, COLUMNS="80"),
    )
    assert done.returncode == 0, done.stderr
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    entries = registry_entries()
    for entry in entries:
        assert entry.name in done.stdout and f"→ {entry.draft}" in done.stdout
    marked = " ".join(done.stdout.split()).count("needs --shard or a quantized target")
    assert marked == sum(e.needs_shard for e in entries) >= 3


@pytest.mark.skipif(shutil.which("dflash-mlx") is None, reason="console script not installed")
def test_chat_in_a_real_terminal(pair_dirs):
    import pexpect

    target, draft = pair_dirs
    env = dict(os.environ, TERM="xterm", COLUMNS="120")
    child = pexpect.spawn(
        shutil.which("dflash-mlx"),
        ["chat", "--model", str(target), "--draft", str(draft), "-n", "-1"],
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 120),
        env=env,
    )
    child.logfile_read = sys.stdout if os.environ.get("DFLASH_TEST_VERBOSE") else None
    child.expect("you>")
    child.sendline("hello")  # this tiny model's reply runs for hundreds of tokens
    child.expect("assistant>")
    child.expect("tokens per cycle")  # the live histogram panel
    child.expect(r"\d+\.\d tok/s · [1-9]\d* tokens")  # tokens are streaming
    child.sendintr()
    child.expect(r"reply interrupted")
    child.expect("you>")
    child.sendline("/block 4")
    child.expect("Block size 4")
    child.sendline("second turn")
    child.expect("tokens per cycle")
    child.sendintr()
    child.expect(r"cached\)")
    child.expect("you>")
    child.sendline("/reset")
    child.expect("Conversation cleared")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert Path(shutil.which("dflash-mlx")).exists()


def test_doctor_selftest_compares_outputs(pair_dirs, monkeypatch):
    target, draft = pair_dirs
    args = ["doctor", "--selftest", "--model", target, "--draft", draft, "--num-prompts", 2, "--max-tokens", 10]
    r = invoke(*args)
    assert r.exit_code == 0 and "outputs identical" in r.stdout and "speedup" in r.stdout
    import dflash_mlx.cli.benchmark as benchmark

    real = benchmark.stream_generate

    def off_by_one(*a, **kw):  # a DFlash that loses its last token: the self-test must catch it
        responses = list(real(*a, **kw))
        yield from responses[:-1]

    monkeypatch.setattr(benchmark, "stream_generate", off_by_one)
    r = invoke(*args)
    assert r.exit_code == 1 and "DIFFERENT" in r.stdout
