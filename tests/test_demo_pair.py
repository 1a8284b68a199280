"""The bundled demo pair: loadable offline, lossless on GSM8K, the CLI's default."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.models.chat_template import render
from dflash_mlx.cli import app
from dflash_mlx.datasets import sample
from dflash_mlx.models.registry import lookup

DEMO = Path(dflash_mlx.__file__).parent / "demo"


@pytest.fixture(scope="module")
def demo():
    return dflash_mlx.load("demo")


def test_the_demo_pair_is_bundled_and_small():
    files = [p for p in DEMO.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 40e6
    assert (DEMO / "LICENSE.gsm8k").is_file()
    entry = lookup("demo")
    assert entry.bundled and Path(entry.target_path(), "config.json").is_file()
    weights = mx.load(str(DEMO / "target" / "model.safetensors"))
    assert {v.dtype for v in weights.values()} <= {mx.bfloat16, mx.float16}
    assert mlx_lm_load(str(DEMO / "target"))[0] is not None  # plain mlx-lm loads the target


def test_demo_is_lossless_on_gsm8k(demo):
    model, tokenizer, draft = demo
    if not mx.metal.is_available():
        assert model.model.norm.weight.dtype == mx.float32  # cast for the CPU backend
    accepted = []
    for (question,) in sample("gsm8k", 4):
        prompt = render(tokenizer, [{"role": "user", "content": question}])
        want = [r.token for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=160)]
        got = list(dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=160))
        assert [r.token for r in got] == want
        fixed = list(dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=160, block_size=8))
        assert [r.token for r in fixed] == want
        cycles = [r.cycle_tokens for r in fixed if r.cycle_tokens]  # (the adaptive block's follow the load)
        accepted.append(sum(cycles) / len(cycles))
    assert sum(accepted) / len(accepted) > 2  # a trained drafter, not a random one


def test_commands_default_to_the_demo_pair():
    r = CliRunner().invoke(app, ["generate", "What is 3 + 4?", "-n", "40", "--json"])
    assert r.exit_code == 0, r.output
    assert "bundled demo pair" in r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["model"] == "demo" and out["tokens"] > 0


def test_long_gsm8k_conversations_reach_their_length(demo):
    """The long-context benchmark's prompts (scripts/): earlier questions answered, then a new one."""
    from dflash_mlx.datasets import long_gsm8k_conversations

    tokenizer = demo[1]
    chats = long_gsm8k_conversations(tokenizer, 1600, 2, stop=100)
    assert len(chats) == 2 and chats[0] != chats[1]
    for chat in chats:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert 1600 <= len(tokenizer.encode(text)) < 2048  # within the demo target's context
        assert [m["role"] for m in chat] == ["user", "assistant"] * (len(chat) // 2) + ["user"]
        assert all("\\boxed{" in m["content"] for m in chat if m["role"] == "assistant")


def test_the_edit_workload_repeats_its_context(demo):
    """`--dataset edit`: a question, that question with a number changed, then that one again; with the
    leg's own replies fed back, the demo target's later replies re-emit much of their context."""
    from dflash_mlx.datasets import with_a_number_changed
    from dflash_mlx.proposers.lookup import LookupIndex

    model, tokenizer, _ = demo
    conversation = sample("edit", 1)[0]
    assert len(conversation) == 3 and conversation[1] == conversation[2] == with_a_number_changed(conversation[0])
    assert conversation[1] != conversation[0]
    messages, found = [], 0
    for turn in conversation:
        messages.append({"role": "user", "content": turn})
        prompt = render(tokenizer, messages)
        reply = [r.token for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=64)]
        index = LookupIndex(tokenizer.encode(prompt))
        for token in reply:  # tokens a lookup in the context so far proposes first
            found += index.propose(1) == [token]
            index.extend([token])
        messages.append({"role": "assistant", "content": tokenizer.decode(reply)})
    assert found >= 0.4 * 3 * 64
