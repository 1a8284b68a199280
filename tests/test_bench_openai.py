"""`dflash-mlx bench --backend openai` against real servers, as a user runs it.

`dflash-mlx serve` (the bundled pair) and `mlx_lm.server` (the bundled target)
run on free ports; the console script benchmarks them at concurrency 1 and 2
with ``--baseline-url``; the JSON report's keys are all there and agree with
each other. An unreachable URL, a model the server does not serve and a
request the server refuses (HTTP 400) end with one clear message naming the
URL, exit status 2 and no report file.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from dflash_mlx.models.registry import lookup
from helpers.servers import MlxLmServer, ServeProcess, free_port

pytestmark = pytest.mark.slow  # real servers

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def servers():
    ours = ServeProcess()
    try:
        theirs = MlxLmServer(lookup("demo").target_path())
    except BaseException:
        ours.stop()
        raise
    yield ours.url, theirs.url
    theirs.stop()  # mlx_lm.server 0.32 may abort on SIGINT
    assert ours.stop() == 0, ours.stderr


def bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    exe = shutil.which("dflash-mlx")
    return subprocess.run(
        [exe, "bench", "--backend", "openai", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("concurrency", [1, 2])
def test_bench_against_dflash_serve_and_mlx_lm_server(servers, tmp_path, concurrency):
    ours, theirs = servers
    out = tmp_path / "report.json"
    run = bench(
        "--base-url",
        ours + "/v1",
        "--baseline-url",
        theirs,
        "--concurrency",
        str(concurrency),
        "--num-prompts",
        "3",
        "--max-tokens",
        "16",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(out.read_text())
    assert doc["backend"] == "openai" and doc["concurrency"] == concurrency and doc["num_prompts"] == 3
    legs = doc["legs"]
    for name in ("dflash", "baseline"):
        leg = legs[name]
        assert leg["concurrency"] == concurrency and leg["requests"] == 3
        assert leg["output_tokens"] > 0
        assert leg["throughput_tps"] == pytest.approx(leg["output_tokens"] / leg["wall_s"], rel=1e-3)
        for key in ("latency_s", "ttft_s"):
            assert set(leg[key]) == {"mean", "p50", "p90"} and 0 < leg[key]["p50"] <= leg[key]["p90"]
        assert set(leg["decode_tps"]) == {"mean", "p50"} and leg["decode_tps"]["mean"] > 0
        assert leg["ttft_s"]["mean"] <= leg["latency_s"]["mean"]
    assert legs["dflash"]["acceptance_source"] == "dflash" and 1.0 <= legs["dflash"]["acceptance_length"] <= 16
    assert legs["baseline"]["acceptance_length"] is None  # mlx_lm.server reports none
    speedup = legs["dflash"]["throughput_tps"] / legs["baseline"]["throughput_tps"]
    assert doc["speedup"] == legs["dflash"]["speedup"] == pytest.approx(speedup, rel=1e-3)
    servers_seen = doc["environment"]["servers"]
    assert servers_seen["dflash"]["owned_by"] == "dflash-mlx" and "id" in servers_seen["baseline"]
    # mlx_lm.server 0.32 answers /v1/models with an empty body when there is no Hugging Face cache:
    # the bench warns and names "default_model"
    assert servers_seen["baseline"]["id"] is not None or "did not answer with a model list" in run.stderr
    assert "tok/s" in run.stdout and "speedup" in run.stdout


def test_a_second_turn_is_fed_the_servers_own_reply(servers, tmp_path):
    ours, _ = servers
    out = tmp_path / "mt.json"
    run = bench("--base-url", ours, "-d", "mt-bench", "--num-prompts", "1", "--max-tokens", "8", "--out", str(out))
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["legs"]["dflash"]["requests"] == 2 and "baseline" not in doc["legs"] and doc["speedup"] is None


@pytest.mark.parametrize(
    "args, says",
    [
        (["--base-url", f"http://127.0.0.1:{free_port()}"], "cannot connect"),
        (["--model", "not-served"], "does not serve the model 'not-served'"),
        (["--top-k", "100000"], "answered HTTP 400: top_k"),
    ],
)
def test_errors_name_the_url_and_write_no_report(servers, tmp_path, args, says):
    ours, _ = servers
    out = tmp_path / "report.json"
    base = [] if "--base-url" in args else ["--base-url", ours]
    run = bench(*base, *args, "--num-prompts", "1", "--max-tokens", "4", "--out", str(out), timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    message = " ".join(run.stderr.split())
    assert says in message and "http://127.0.0.1:" in message
    assert not out.exists()


def test_a_server_that_never_answers_times_out_clearly(tmp_path):
    import socket

    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        out = tmp_path / "report.json"
        run = bench("--base-url", url, "--timeout-s", "1", "--num-prompts", "1", "--out", str(out), timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{url}: no answer within the timeout" in " ".join(run.stderr.split()) and not out.exists()
