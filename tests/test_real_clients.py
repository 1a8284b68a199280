"""The product as users run it, on the bundled demo pair (stored in bfloat16).

- the real ``dflash-mlx serve`` console script in a subprocess, with no
  ``--model`` (the bundled default), driven by the official ``openai`` client
  and by curl: replies equal plain mlx-lm greedy decoding of the same model
  as the server computes it (float32 on a CPU), bad input answered with a 4xx
  naming the field while the server keeps serving;
- a pair loaded on the main thread and generating on another, through the
  library, the mlx-lm plugin and an in-process server, in a fresh process.

Subprocesses are waited on by readiness (the server's "serving ... at URL"
line), never by fixed sleeps, and stopped as a user stops them (SIGINT).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap

import mlx.core as mx
import mlx_lm
import pytest

from dflash_mlx.models.registry import lookup
from helpers.calibrations import write_cheap_blocks_curve
from helpers.servers import ServeProcess
from dflash_mlx.models.dtype import on_cpu

pytestmark = pytest.mark.slow  # real servers and processes

openai = pytest.importorskip("openai")

DEMO_TARGET = lookup("demo").target_path()
QUESTION = "Tom has 3 boxes with 12 apples each. How many apples?"
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def served():
    server = ServeProcess()
    yield server
    assert server.stop() == 0, server.stderr
    assert "stopped" in server.stderr


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def plain():
    """The bundled target as plain mlx-lm loads it, cast as the server computes it."""
    model, tokenizer = mlx_lm.load(DEMO_TARGET)
    if on_cpu():
        model.set_dtype(mx.float32)
    return model, tokenizer


@pytest.fixture
def cheap_blocks(tmp_path, monkeypatch):
    """A calibration cache (for this test's subprocesses) where the plugin's bfloat16 pair drafts:
    measured here, no block beats plain decoding (see helpers.calibrations)."""
    from dflash_mlx import mlx_lm as plugin

    monkeypatch.setenv("DFLASH_MLX_CACHE_DIR", str(tmp_path / "cache"))
    model, _ = plugin.load(DEMO_TARGET)
    return write_cheap_blocks_curve(model, plugin.remembered_draft(model))


def mlx_lm_greedy(plain, ids, max_tokens):
    model, tokenizer = plain
    responses = list(mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens))
    return "".join(r.text for r in responses), responses


def test_serve_defaults_to_the_bundled_pair_and_says_so(served, client):
    assert "bundled demo pair" in served.stderr
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_serve_and_chat_load_the_same_pair_alike(client):
    """One loader: the default pair, the same compute dtype and the same default block size."""
    card = client.models.list().data[0].model_extra
    assert card["dtype"] == ("float32" if on_cpu() else "bfloat16") and card["block_size"] == 8
    assert card["adaptive_block"] is True
    run = subprocess.run(
        [shutil.which("dflash-mlx"), "chat", "-n", "4"], input="/quit\n", capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    assert f"demo (DFlash, adaptive block (at most {card['block_size']}), {card['dtype']})" in " ".join(
        run.stdout.split()
    )


def test_chat_whole_and_streamed_equal_mlx_lm_greedy(client, plain):
    _, tokenizer = plain
    want, responses = mlx_lm_greedy(plain, tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True), 48)
    reply = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=48, temperature=0)
    assert reply.choices[0].message.content == want
    assert reply.choices[0].finish_reason == responses[-1].finish_reason
    assert reply.usage.completion_tokens == len(responses)
    assert reply.model_extra["dflash"]["cycles"] >= 1
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(responses)
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens
    assert sum(1 for c in chunks if c.usage is not None) == 1


def test_text_completion_whole_and_streamed_equal_mlx_lm_greedy(client, plain):
    _, tokenizer = plain
    prompt = "Natalia sold clips to 48 of her friends in April."
    want, _ = mlx_lm_greedy(plain, tokenizer.encode(prompt), 40)
    reply = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0)
    assert reply.choices[0].text == want
    chunks = list(
        client.completions.create(
            model="demo",
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.total_tokens == reply.usage.total_tokens


def _curl(url: str, data: str) -> tuple[int, dict]:
    run = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", "-H", "Content-Type: application/json", "--data-binary", data, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    body, status = run.stdout.rsplit("\n", 1)
    return int(status), json.loads(body)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_malformed_json_through_curl_is_a_400_and_the_server_keeps_serving(served, client):
    status, body = _curl(served.url + "/v1/chat/completions", '{"messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _curl(served.url + "/v1/chat/completions", json.dumps({"messages": MESSAGES, "max_tokens": 4}))
    assert status == 200 and body["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"model": "gpt-4o"}, "model"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "apples " * 3000}]}, "messages"),
    ],
)
def test_bad_requests_are_4xx_naming_the_field(client, kwargs, field):
    request = {"model": "demo", "messages": MESSAGES, "max_tokens": 8, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == field and field in error["message"], error
    ok = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3)  # still serving
    assert ok.usage.completion_tokens == 3


def test_a_prompt_beyond_the_context_names_it(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="demo", prompt="apples " * 3000, max_tokens=8)
    assert caught.value.body["param"] == "prompt" and "context is 2048 tokens" in caught.value.body["message"]


THREADS = """
import json, sys, threading, http.client
import dflash_mlx
from dflash_mlx import mlx_lm as plugin
from dflash_mlx.server import make_server

question = "Tom has 3 boxes with 12 apples each. How many apples?"
out = {}

def in_thread(name, fn):
    def run():
        try:
            out[name] = fn()
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    t = threading.Thread(target=run)
    t.start()
    t.join()

# the library: dflash_mlx.load on the main thread (it casts the bundled pair to float32 on a CPU)
model, tokenizer, draft = dflash_mlx.load("demo")
gen = lambda: dflash_mlx.generate(model, draft, tokenizer, question, max_tokens=30)
in_thread("library", gen)
out["library_main"] = gen()

# the server: the worker thread generates, this thread asks over HTTP
server = make_server(model, tokenizer, draft, port=0, model_id="demo").start()
conn = http.client.HTTPConnection(*server.server_address[:2], timeout=120)
conn.request("POST", "/v1/completions", body=json.dumps({"prompt": question, "max_tokens": 30}))
reply = conn.getresponse()
out["server"] = [reply.status, json.loads(reply.read())]
conn.close()
server.stop()

# the plugin: mlx-lm's loader, the registered drafter remembered
pmodel, ptokenizer = plugin.load(sys.argv[1])
pgen = lambda: [plugin.generate(pmodel, ptokenizer, question, max_tokens=30),
                sum(r.from_draft for r in plugin.stream_generate(pmodel, ptokenizer, question, max_tokens=30))]
in_thread("plugin", pgen)
out["plugin_main"] = pgen()
print(json.dumps(out))
"""


def test_load_on_the_main_thread_generate_on_another(cheap_blocks):
    run = subprocess.run(
        [sys.executable, "-c", THREADS, DEMO_TARGET],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr  # an exit abort (MLX streams of ended threads) fails here too
    out = json.loads(run.stdout)
    assert out["library"] == out["library_main"] and out["library"].strip()
    status, reply = out["server"]
    assert status == 200, reply
    assert reply["choices"][0]["text"] == out["library_main"]
    # the text is the same; the plugin drafts on the cheap-blocks curve (how many: the adaptive choice)
    assert out["plugin"][0] == out["plugin_main"][0] and out["plugin"][1] > 0 and out["plugin_main"][1] > 0


SCRIPT = textwrap.dedent('''
    """An ordinary mlx-lm script, shaped like mlx-lm's examples (generate.py, chat.py)."""
    import json
    import sys

    from mlx_lm import load, stream_generate, generate
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    checkpoint, cache_file = sys.argv[1], sys.argv[2]
    model, tokenizer = load(path_or_hf_repo=checkpoint)

    messages = [{"role": "user", "content": "Tom has 3 boxes with 12 apples each. How many apples?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = generate(model, tokenizer, prompt=prompt, verbose=True, max_tokens=60)

    # A multi-turn chat with a prompt cache, saved and loaded between turns.
    prompt_cache = make_prompt_cache(model)
    turns, drafted = [], 0
    for question in ["Lily has 5 apples and buys 7 more. How many now?", "And if she gives 4 away?"]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        reply = ""
        for response in stream_generate(model, tokenizer, prompt, max_tokens=50, prompt_cache=prompt_cache):
            reply += response.text
            drafted += response.from_draft
        turns.append([reply, prompt_cache[0].offset])
    save_prompt_cache(cache_file, prompt_cache)
    prompt_cache = load_prompt_cache(cache_file)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Now double it."}], add_generation_prompt=True)
    turns.append([generate(model, tokenizer, prompt=prompt, max_tokens=40, prompt_cache=prompt_cache),
                  prompt_cache[0].offset])
    print(json.dumps({"text": text, "turns": turns, "drafted": drafted}), file=sys.stderr)
''')


def test_an_mlx_lm_example_script_runs_dflash_by_its_import_line(tmp_path, cheap_blocks):
    """Unchanged mlx-lm and the switched script: same texts, same cache lengths, same verbose output
    (on a curve where blocks pay, so the switched script drafts)."""
    results = []
    for line in (
        "from mlx_lm import load, stream_generate, generate",
        "from dflash_mlx.mlx_lm import load, stream_generate, generate",
    ):
        script = SCRIPT.replace("from mlx_lm import load, stream_generate, generate", line)
        assert (script != SCRIPT) == line.startswith("from dflash_mlx")
        cache_file = tmp_path / f"cache{len(results)}.safetensors"
        run = subprocess.run(
            [sys.executable, "-c", script, DEMO_TARGET, str(cache_file)],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        assert run.returncode == 0, run.stderr
        assert "falling back" not in run.stderr
        verbose = "\n".join(re.sub(r"\d+\.\d+", "X", ln) for ln in run.stdout.splitlines())
        results.append((json.loads(run.stderr.strip().splitlines()[-1]), verbose))
    (mlx, mlx_verbose), (dflash, dflash_verbose) = results
    assert dflash["text"] == mlx["text"] and dflash["turns"] == mlx["turns"]
    assert dflash_verbose == mlx_verbose and "Generation: " in mlx_verbose
    assert mlx["drafted"] == 0 and dflash["drafted"] > 0


def _command(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """The real console script, on the bundled default, as a user runs it."""
    return subprocess.run(
        [shutil.which("dflash-mlx"), *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def test_generate_command_on_the_bundled_pair_equals_mlx_lm(plain):
    run = _command("generate", QUESTION, "-n", "32", "--json")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    _, tokenizer = plain
    want, _ = mlx_lm_greedy(plain, tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True), 32)
    assert out["model"] == "demo" and out["text"] == want
    assert out["block_size"] == "auto" and out["max_block_size"] == 8 and sum(out["block_sizes"].values()) > 0


def test_bench_models_and_doctor_commands_run_on_the_bundled_pair(tmp_path):
    report = tmp_path / "bench.json"
    run = _command("bench", "--num-prompts", "1", "-n", "16", "-b", "4", "--out", str(report))
    assert run.returncode == 0, run.stderr
    doc = json.loads(report.read_text())
    assert doc["model"] == "demo" and [r["block_size"] for r in doc["runs"]] == [4]
    assert doc["greedy_matches"] is True and doc["environment"]["dtype"] == ("float32" if on_cpu() else "bfloat16")
    run = _command("models")
    assert run.returncode == 0 and "demo" in run.stdout and "qwen3-4b" in run.stdout
    run = _command("doctor", "--selftest", "--num-prompts", "1", "--max-tokens", "12")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "outputs identical" in run.stdout and "OpenBLAS" in run.stdout
