"""Tensor-sharded DFlash over MLX's ring backend: 2 ranks on loopback, started by `mlx.launch`.

Each test launches the ranks as a user does (`mlx.launch --backend ring -n 2`):
either `tests/helpers/sharded_rank.py` (the library: `dflash_mlx.load(...,
shard="tensor")`, every rank writing its tokens) or the `dflash-mlx` console
script. Checked: rank 0's greedy output equals single-process mlx-lm greedy
on a dense (qwen3) and a hybrid Gated DeltaNet (qwen3_5) target at several
blocks and the adaptive one, and equals mlx-lm's own sharded decoding (and
on the other families mlx-lm shards: MoE, sliding-window, gpt_oss); the
ranks produce the same tokens, seeded sampling included; ranks made to
diverge are caught; errors are one message on rank 0 with every rank exiting
non-zero and nothing hanging; generate, bench, chat and serve print (and
serve answers) from rank 0 only. Skipped where `mlx.launch` or the ring
backend is unavailable.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from helpers.builders import make_draft, make_target
from helpers.checks import prompt_ids
from helpers.servers import ServeProcess, ShardedServeProcess

pytestmark = pytest.mark.slow  # ranks started with mlx.launch

RANK_SCRIPT = Path(__file__).parent / "helpers" / "sharded_rank.py"
TIMEOUT = 300  # a launch that takes longer hangs
ENV = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}  # two ranks share this machine's cores


@functools.lru_cache(maxsize=1)
def _ring_problem() -> str | None:
    launch = shutil.which("mlx.launch")
    if launch is None:
        return "mlx.launch is not installed"
    probe = "import mlx.core as mx; g = mx.distributed.init(); print(mx.distributed.all_sum(mx.array(1.0)).item())"
    try:
        done = subprocess.run(
            [launch, "--backend", "ring", "-n", "2", sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return "mlx.launch --backend ring -n 2 did not finish in 120 s"
    if done.stdout.split() != ["2.0", "2.0"]:
        return f"the ring backend does not work here: {done.stdout} {done.stderr}"
    return None


@pytest.fixture(autouse=True)
def _needs_ring():
    problem = _ring_problem()
    if problem:
        pytest.skip(f"sharding tests need 2 loopback ranks: {problem}")


def launch(*command: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`mlx.launch --backend ring -n 2 -- COMMAND` with `stdin` typed in (fails the test if it hangs).

    Its stdin stays open until it ends: mlx.launch 0.32 busy-loops on a stdin at end of file.
    """
    read, write = os.pipe()
    os.write(write, stdin.encode())
    try:
        return subprocess.run(
            [shutil.which("mlx.launch"), "--backend", "ring", "-n", "2", "--", *command],
            stdin=read,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=ENV,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the ranks hung: {command}\n{e.stdout}\n{e.stderr}")
    finally:
        os.close(read)
        os.close(write)


def exit_codes(done: subprocess.CompletedProcess) -> dict[int, int]:
    """Each failing rank's exit status, from mlx.launch's warnings (mlx.launch itself exits 0)."""
    return {int(r): int(c) for r, c in re.findall(r"Node with rank (\d) exited with code (-?\d+)", done.stderr)}


def run_ranks(tmp_path: Path, **spec) -> list[dict]:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    path = out / "spec.json"
    path.write_text(json.dumps({**spec, "out": str(out)}))
    done = launch(sys.executable, str(RANK_SCRIPT), str(path))
    results = []
    for rank in range(2):
        file = out / f"rank{rank}.json"
        assert file.exists(), f"rank {rank} wrote nothing:\n{done.stdout}\n{done.stderr}"
        results.append(json.loads(file.read_text()))
    return results


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A dense and a hybrid tiny pair, stored in bfloat16 as real checkpoints are."""
    root = tmp_path_factory.mktemp("sharded-pairs")
    built = {}
    for family in ("qwen3", "qwen3_5"):
        target = make_target(root / f"{family}-target", family, dtype="bfloat16")
        built[family] = (target, make_draft(root / f"{family}-draft", target, dtype="bfloat16", block_size=8))
    return built


def single_process_greedy(target: Path, prompt: list[int], max_tokens: int) -> list[int]:
    from mlx_lm import load, stream_generate

    from dflash_mlx.models.dtype import as_float32, on_cpu

    model, tokenizer = load(str(target))
    if on_cpu():  # the ranks compute in float32 on a CPU, as dflash-mlx does
        as_float32(model)
    return [r.token for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens)]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_sharded_greedy_equals_single_process_mlx_lm(pairs, tmp_path, family):
    target, draft = pairs[family]
    prompt = prompt_ids(12, seed=3)
    n = 24
    want = single_process_greedy(target, prompt, n)
    greedy = [dict(prompt=prompt, max_tokens=n, block_size=b) for b in (1, 3, 8)] + [
        dict(prompt=prompt, max_tokens=n),  # adaptive: the ranks share rank 0's calibration
        dict(prompt=prompt, max_tokens=n, mlx_lm=True),  # mlx-lm's own sharded decoding
    ]
    # a stop token while plain steps are pipelined: the step queued after it is still in flight
    # when the ranks compare their tokens (their collectives must not interleave)
    stop = next(t for k, t in enumerate(want) if k >= 6 and t not in want[:k])
    stopped = [dict(prompt=prompt, max_tokens=n, block_size=1, eos=[stop])]
    sampled = [dict(prompt=prompt, max_tokens=n, block_size=4, temperature=1.0, seed=5, eos=[])] * 2 + [
        dict(prompt=prompt, max_tokens=n, temperature=1.0, top_k=20, eos=[]),  # no seed: the ranks agreed on one
    ]  # (no stop tokens: an unseeded run that sampled one early would end short)
    rank0, rank1 = run_ranks(tmp_path, target=str(target), draft=str(draft), runs=greedy + sampled + stopped)
    assert "error" not in rank0 and "error" not in rank1, (rank0.get("error"), rank1.get("error"))
    assert rank0["size"] == 2
    assert rank0["runs"] == rank1["runs"]  # lockstep: every rank generated the same tokens
    for run, tokens in zip(greedy, rank0["runs"]):
        assert tokens == want, run
    assert rank0["runs"][-1] == want[: want.index(stop) + 1]
    first, again, unseeded = rank0["runs"][len(greedy) : len(greedy) + 3]
    assert first == again  # a seed reproduces a sampled sharded run
    assert len(unseeded) == n and first != want


def test_sharded_greedy_on_every_shardable_family(tmp_path):
    """MoE, sliding-window, attention-sink and hybrid-MoE targets (float32: unquantized MoE needs it on a CPU)."""
    prompt, n = prompt_ids(12, seed=3), 16
    pairs, families = [], ("qwen3_moe", "mistral", "qwen3_5_moe", "llama_sliding", "gpt_oss")
    for family in families:
        target = make_target(tmp_path / f"{family}-target", family)
        draft = make_draft(tmp_path / f"{family}-draft", target, block_size=8)
        pairs.append(
            dict(
                target=str(target),
                draft=str(draft),
                runs=[dict(prompt=prompt, max_tokens=n, block_size=b) for b in (1, 4)],
            )
        )
    rank0, rank1 = run_ranks(tmp_path, pairs=pairs)
    assert "error" not in rank0 and "error" not in rank1, (rank0.get("error"), rank1.get("error"))
    assert rank0["runs"] == rank1["runs"]
    for i, family in enumerate(families):
        want = single_process_greedy(Path(pairs[i]["target"]), prompt, n)
        assert rank0["runs"][2 * i] == rank0["runs"][2 * i + 1] == want, family


def test_diverging_ranks_are_caught(pairs, tmp_path):
    target, draft = pairs["qwen3"]
    # one token per cycle and no stop token, so the ranks' collectives stay aligned (the same number of
    # cycles) while their sampled tokens differ
    run = dict(prompt=prompt_ids(12, seed=4), max_tokens=32, block_size=1, temperature=1.0, eos=[])
    rank0, rank1 = run_ranks(tmp_path, target=str(target), draft=str(draft), runs=[run], reseed_rank=1)
    for result in (rank0, rank1):
        assert result.get("error", {}).get("type") == "LockstepError", result
    assert "rank 1 generated other tokens than rank 0" in rank0["error"]["message"]


def test_ranks_with_different_model_files_are_refused(pairs, tmp_path):
    target, draft = pairs["qwen3"]
    other = tmp_path / "other-copy"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(config))
    rank0, rank1 = run_ranks(tmp_path, targets=[str(target), str(other)], draft=str(draft), runs=[])
    assert rank0["error"]["type"] == rank1["error"]["type"] == "ShardError"
    assert "rank 1's model files differ from rank 0's" in rank0["error"]["message"]


def _one_error(done: subprocess.CompletedProcess, *fragments: str) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr  # one message, from rank 0
    text = " ".join(done.stderr.split())
    for fragment in fragments:
        assert fragment in text, done.stderr
    codes = exit_codes(done)  # every rank exits non-zero (2; or SIGTERM from mlx.launch once the other left)
    assert set(codes) == {0, 1} and all(c in (2, -15) for c in codes.values()), done.stderr
    assert done.stdout == ""
    return text


def test_cli_errors_family_heads_and_layers(tmp_path):
    gemma = make_target(tmp_path / "gemma", "gemma3_text")
    done = launch("dflash-mlx", "generate", "hi", "--shard", "tensor", "--model", str(gemma), "--no-dflash")
    _one_error(done, "cannot tensor-shard the 'gemma3_text' family")

    odd = make_target(
        tmp_path / "odd-heads", "qwen3", hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=16
    )
    done = launch("dflash-mlx", "generate", "hi", "--shard", "tensor", "--model", str(odd), "--no-dflash")
    _one_error(done, "num_attention_heads = 3", "num_key_value_heads = 3", "not divisible by the 2 ranks")

    target = make_target(tmp_path / "target", "qwen3")
    draft = make_draft(tmp_path / "bad-draft", target, target_layer_ids=[1, 7])
    done = launch("dflash-mlx", "generate", "hi", "--shard", "tensor", "--model", str(target), "--draft", str(draft))
    _one_error(done, "7")


def test_pipeline_is_refused_clearly():
    done = subprocess.run(
        ["dflash-mlx", "generate", "hi", "--shard", "pipeline"], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert done.returncode == 2
    assert "--shard pipeline: shard='pipeline' is not supported" in " ".join(done.stderr.split())

    from dflash_mlx import load

    with pytest.raises(ValueError, match="shard='pipeline' is not supported"):
        load("demo", shard="pipeline")


def test_cli_generate_on_the_bundled_pair_prints_once():
    prompt = "Tom has 3 apples and buys 5 more. How many apples does he have?"
    done = launch("dflash-mlx", "generate", prompt, "--shard", "tensor", "-n", "32", "--json")
    assert exit_codes(done) == {}, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout  # rank 0 alone prints
    sharded = json.loads(lines[0])
    alone = subprocess.run(
        ["dflash-mlx", "generate", prompt, "-n", "32", "--json"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=ENV,
    )
    assert alone.returncode == 0, alone.stderr
    assert sharded["text"] == json.loads(alone.stdout)["text"]
    assert sharded["tokens"] == 32 and sharded["acceptance_length"] >= 1


def test_cli_bench_and_chat(tmp_path):
    out = tmp_path / "bench.json"
    done = launch(
        "dflash-mlx",
        "bench",
        "--shard",
        "tensor",
        "--num-prompts",
        "1",
        "--max-tokens",
        "24",
        "-b",
        "4",
        "--out",
        str(out),
    )
    assert exit_codes(done) == {}, done.stderr
    assert done.stdout.count("mlx-lm (baseline)") == 1, done.stdout
    report = json.loads(out.read_text())
    assert report["environment"]["tensor_ranks"] == 2
    assert report["runs"][0]["greedy_matches"] and report["baseline_tps"] > 0

    done = launch("dflash-mlx", "chat", "--shard", "tensor", "-n", "16", stdin="Tom has 3 apples.\n/quit\n")
    assert exit_codes(done) == {}, done.stderr
    assert done.stdout.count("assistant>") == 1, done.stdout


def test_cli_serve_answers_from_rank_0():
    from openai import OpenAI

    messages = [{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many apples does he have?"}]
    server = ShardedServeProcess(env=ENV)
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        whole = client.chat.completions.create(model="demo", messages=messages, max_tokens=32, temperature=0)
        pieces = client.chat.completions.create(
            model="demo", messages=messages, max_tokens=32, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        again = client.chat.completions.create(model="demo", messages=messages, max_tokens=32, temperature=0.8, seed=3)
    finally:
        status = server.stop()
    assert status == 0, server.stderr
    assert exit_codes(subprocess.CompletedProcess([], 0, "", server.stderr)) == {}, server.stderr
    assert "tensor-sharded over 2 ranks" in server.stderr and "stopped" in server.stderr
    assert whole.choices[0].message.content == streamed
    assert whole.model_extra["dflash"]["cycles"] >= 1 and again.choices[0].message.content

    alone = ServeProcess()  # one process, the same console script
    try:
        client = OpenAI(base_url=alone.url + "/v1", api_key="unused")
        want = client.chat.completions.create(model="demo", messages=messages, max_tokens=32, temperature=0)
    finally:
        alone.stop()
    assert whole.choices[0].message.content == want.choices[0].message.content


def test_the_shard_group_is_found_wherever_shard_puts_it():
    """`tensor_group` finds the group on a sharded linear nested in a list, or on a module mlx-lm's
    `shard()` marks with `sharding_group`; an unsharded target has none (one process, no ring)."""
    from mlx.nn.layers.distributed import AllToShardedLinear
    from mlx_lm.models import qwen3

    from dflash_mlx.targets.adapter import tensor_group

    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=64,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_theta=1e4,
        head_dim=16,
        tie_word_embeddings=True,
    )
    group = mx.distributed.init()
    assert tensor_group(qwen3.Model(args)) is None
    model = qwen3.Model(args)
    model.model.layers[0].mlp.sharding_group = group  # what shard() sets on the modules it splits in place
    assert tensor_group(model) is group
    model = qwen3.Model(args)
    mlp = model.model.layers[0].mlp
    mlp.experts = [mlp.up_proj, AllToShardedLinear.from_linear(mlp.gate_proj, group=group)]  # a list of children
    assert tensor_group(model) is group


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_sharded_greedy_with_a_dspark_drafter(pairs, tmp_path, family):
    """A DSpark drafter on a tensor-sharded target: its own head (qwen3), the target's vocabulary-sharded
    head reused (qwen3_5); every rank generates mlx-lm's tokens."""
    from helpers.dspark import make_dspark

    target, _ = pairs[family]
    draft = make_dspark(tmp_path / "dspark", target, target_layer_ids=[1, 2], own_head=family == "qwen3")
    prompt = prompt_ids(12, seed=3)
    want = single_process_greedy(target, prompt, 24)
    runs = [dict(prompt=prompt, max_tokens=24, block_size=b) for b in (3, 8)] + [dict(prompt=prompt, max_tokens=24)]
    rank0, rank1 = run_ranks(tmp_path, target=str(target), draft=str(draft), runs=runs)
    assert "error" not in rank0 and "error" not in rank1, (rank0.get("error"), rank1.get("error"))
    assert rank0["runs"] == rank1["runs"] == [want] * len(runs)
