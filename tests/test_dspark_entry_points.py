"""A DSpark drafter everywhere a DFlash drafter runs, as users run it, with its source named "dspark".

A DSpark directory passed as the drafter (library `load(target, draft)`,
`--draft`): `dflash-mlx generate --json` (the console script) and the chat
panel; `stream_generate`, `make_session` across turns, `batch_generate` /
`stream_batch_generate` (rows drafting one by one), the mlx-lm drop-in
(`dflash_mlx.mlx_lm`, a script with only its import line changed), and the
server in both worker modes through the official `openai` client
(`tokens_by_source`). Every output equals mlx-lm's greedy one. The drafter's
Markov head predicts the target's greedy continuations of these prompts
(helpers.dspark.make_markov_dspark), so its drafts are accepted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx import batch_generate, make_session, stream_batch_generate, stream_generate
from dflash_mlx.cli import app
from helpers import TINY_VOCAB, load_pair, prompt_ids, reference, without_eos
from helpers.dspark import make_markov_dspark, successor_table
from helpers.servers import ServeProcess

pytestmark = pytest.mark.slow  # console scripts, servers, a drop-in script

openai = pytest.importorskip("openai")

HELLO = [{"role": "user", "content": "hello"}]
TOKENS = 32
PROMPTS = [prompt_ids(n, seed=80 + n) for n in (4, 8, 13)]


@pytest.fixture(scope="module")
def dspark(qwen3_target, tmp_path_factory):
    """(target dir, DSpark dir, model, tokenizer, loaded pair) with a Markov head fitted to these prompts."""
    model, tokenizer, _ = load_pair(qwen3_target)
    chat = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True)
    served = [tokenizer.encode(tokenizer.decode(p), add_special_tokens=False) for p in PROMPTS]  # as text
    table = successor_table(model, tokenizer, PROMPTS + served + [chat], 64, TINY_VOCAB)
    draft_dir = make_markov_dspark(
        tmp_path_factory.mktemp("dspark") / "d", qwen3_target, table, target_layer_ids=[1, 2]
    )
    loaded = dflash_mlx.load(qwen3_target, draft_dir)
    return qwen3_target, draft_dir, model, tokenizer, loaded


def greedy(model, tokenizer, prompt, n=TOKENS) -> list[int]:
    with without_eos(tokenizer) as tok:
        return [r.token for r in reference(model, tok, prompt, n)]


def test_generate_json_and_the_chat_panel_name_the_dspark_source(dspark):
    target, draft, model, tokenizer, _ = dspark
    exe = shutil.which("dflash-mlx")
    assert exe, "the dflash-mlx console script is not installed (pip install -e '.[test]')"
    args = [exe, "generate", "hello", "--model", str(target), "--draft", str(draft), "-n", "24", "--json", "-b", "8"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["sources"].get("dspark", 0) > 0, out["sources"]
    prompt = tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    assert out["text"] == dflash_mlx.generate(model, None, tokenizer, prompt, max_tokens=24)
    chat = CliRunner().invoke(
        app, ["chat", "--model", str(target), "--draft", str(draft), "-n", "24"], input="hello\n/quit\n"
    )
    assert chat.exit_code == 0, chat.output
    assert "dspark" in chat.stdout and "tokens from" in chat.stdout


def test_the_library_entry_points(dspark):
    target, draft, model, tokenizer, (loaded_model, _, drafter) = dspark
    with without_eos(tokenizer) as tok:
        for prompt in PROMPTS:
            got = list(stream_generate(loaded_model, drafter, tok, prompt, max_tokens=TOKENS, block_size=8))
            assert [r.token for r in got] == greedy(model, tokenizer, prompt)
            assert {r.source for r in got if r.from_draft} >= {"dspark"}
        session = make_session(loaded_model, drafter)
        first = [
            r.token for r in stream_generate(loaded_model, drafter, tok, PROMPTS[0], max_tokens=8, session=session)
        ]
        turn = PROMPTS[0] + first + PROMPTS[1]
        got = [r.token for r in stream_generate(loaded_model, drafter, tok, turn, max_tokens=TOKENS, session=session)]
        assert session.reused > 0 and got == greedy(model, tokenizer, turn)
        batch = batch_generate(
            loaded_model, drafter, tok, PROMPTS, max_tokens=TOKENS, block_size=8, return_token_ids=True
        )
        assert batch.token_ids == [greedy(model, tokenizer, p) for p in PROMPTS]
        rows: dict[int, list] = {}
        for i, r in stream_batch_generate(
            loaded_model, drafter, tok, PROMPTS, max_tokens=TOKENS, max_batch=2, block_size=8
        ):
            rows.setdefault(i, []).append(r)
        assert [[r.token for r in rows[i]] for i in range(len(PROMPTS))] == [
            greedy(model, tokenizer, p) for p in PROMPTS
        ]
        assert any(r.source == "dspark" and r.from_draft for row in rows.values() for r in row)


def test_an_mlx_lm_script_with_only_its_import_changed(dspark, tmp_path):
    target, draft, model, tokenizer, _ = dspark
    script = textwrap.dedent(
        f"""
        from dflash_mlx.mlx_lm import load, generate  # was: from mlx_lm import load, generate
        model, tokenizer = load({str(target)!r}, draft={str(draft)!r})
        print(generate(model, tokenizer, prompt={PROMPTS[2]!r}, max_tokens={TOKENS}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr
    from mlx_lm import generate as mlx_lm_generate

    assert done.stdout.strip() == mlx_lm_generate(model, tokenizer, prompt=PROMPTS[2], max_tokens=TOKENS).strip()


@pytest.mark.parametrize("concurrency", ["1", "4"])
def test_the_server_in_both_worker_modes(dspark, concurrency):
    target, draft, model, tokenizer, _ = dspark
    server = ServeProcess("--model", str(target), "--draft", str(draft), "--decode-concurrency", concurrency)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            for prompt in PROMPTS[:2]:
                text = tokenizer.decode(prompt)
                reply = client.completions.create(  # a fixed block: the timing-driven default may run plain here
                    model="default_model",
                    prompt=text,
                    max_tokens=TOKENS,
                    temperature=0.0,
                    extra_body={"num_draft_tokens": 7},
                )
                stats = reply.model_extra["dflash"]
                assert reply.choices[0].text == dflash_mlx.generate(model, None, tokenizer, text, max_tokens=TOKENS)
                assert stats["tokens_by_source"].get("dspark", 0) > 0, stats
    finally:
        assert server.stop() == 0, server.stderr
