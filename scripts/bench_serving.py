"""Batched serving against mlx_lm.server at several concurrencies (issue 16's benchmark).

Starts `dflash-mlx serve` (the bundled pair, batched: ``--decode-concurrency``
32 by default, or the given value), optionally a one-at-a-time
`dflash-mlx serve --decode-concurrency 1`, and `python -m mlx_lm.server` on a
float32 copy of the bundled target (bfloat16 matmuls are slow on a CPU), then
for each concurrency runs `dflash-mlx bench --backend openai` against them
(the same GSM8K prompts, greedy, streamed through the official `openai`
client), `--rounds` times, and prints the median aggregate tok/s, per-request
latency and TTFT of each server with the speedups, as a markdown table. The
reports go to `--out-dir`. Run with the system OpenBLAS preloaded on Linux:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_serving.py --concurrency 1 2 4 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_agent import float32_copy

from dflash_mlx.models.registry import lookup


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(command: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"{proc.args[:3]} exited early; its log:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    sys.exit(f"{url} did not come up within {timeout:.0f} s")


def _bench(url: str, baseline: str, concurrency: int, args, out: Path) -> dict:
    exe = shutil.which("dflash-mlx")
    run = subprocess.run([exe, "bench", "--backend", "openai", "--base-url", url + "/v1", "--baseline-url", baseline,
                          "--concurrency", str(concurrency), "--num-prompts", str(args.num_prompts), "--max-tokens",
                          str(args.max_tokens), "--out", str(out)],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)  # fmt: skip
    if run.returncode != 0:
        sys.exit(f"bench failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return json.loads(out.read_text())["legs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-concurrency", type=int, default=32, help="the batched server's")
    parser.add_argument("--serial", action="store_true", help="also run a one-at-a-time dflash-mlx serve")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    target = float32_copy(lookup("demo").target_path(), out_dir / "target-f32")
    exe = shutil.which("dflash-mlx")
    servers = {"batched": [exe, "serve", "--decode-concurrency", str(args.decode_concurrency)]}
    if args.serial:
        servers["serial"] = [exe, "serve", "--decode-concurrency", "1"]
    ports = {name: _free_port() for name in [*servers, "mlx_lm"]}
    procs = {name: _start([*cmd, "--port", str(ports[name])], out_dir / f"{name}.log") for name, cmd in servers.items()}
    procs["mlx_lm"] = _start([sys.executable, "-m", "mlx_lm.server", "--model", str(target), "--port",
                              str(ports["mlx_lm"])], out_dir / "mlx_lm.log")  # fmt: skip
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    results = []
    try:
        for name, proc in procs.items():
            _wait(urls[name], proc, out_dir / f"{name}.log")
        for c in args.concurrency:
            rows = {name: [] for name in servers}
            for k in range(args.rounds):
                for name in servers:
                    legs = _bench(urls[name], urls["mlx_lm"], c, args, out_dir / f"{name}-c{c}-r{k}.json")
                    rows[name].append(legs)
            for name, runs in rows.items():
                med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
                results.append({
                    "server": name, "concurrency": c,
                    "tps": med(lambda r: r["dflash"]["throughput_tps"]),
                    "baseline_tps": med(lambda r: r["baseline"]["throughput_tps"]),
                    "speedup": med(lambda r: r["dflash"]["throughput_tps"] / r["baseline"]["throughput_tps"]),
                    "latency_p50": med(lambda r: r["dflash"]["latency_s"]["p50"]),
                    "baseline_latency_p50": med(lambda r: r["baseline"]["latency_s"]["p50"]),
                    "ttft_p50": med(lambda r: r["dflash"]["ttft_s"]["p50"]),
                    "baseline_ttft_p50": med(lambda r: r["baseline"]["ttft_s"]["p50"]),
                    "acceptance_length": med(lambda r: r["dflash"]["acceptance_length"] or 0.0),
                    "speedups": [round(r["dflash"]["throughput_tps"] / r["baseline"]["throughput_tps"], 3)
                                 for r in runs],
                })  # fmt: skip
                print(json.dumps(results[-1]), flush=True)
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.num_prompts} GSM8K prompts x {args.max_tokens} tokens, greedy, median of {args.rounds} rounds "
          f"(reports in {out_dir})\n")  # fmt: skip
    print("| server | concurrency | dflash-mlx tok/s | mlx_lm.server tok/s | speedup (rounds) | latency p50 "
          "(dflash / mlx-lm) | TTFT p50 (dflash / mlx-lm) | acceptance length |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        rounds = ", ".join(f"{s:.2f}" for s in r["speedups"])
        print(f"| {r['server']} | {r['concurrency']} | {r['tps']:.1f} | {r['baseline_tps']:.1f} | "
              f"{r['speedup']:.2f}x ({rounds}) | {r['latency_p50']:.2f} s / {r['baseline_latency_p50']:.2f} s | "
              f"{r['ttft_p50']:.2f} s / {r['baseline_ttft_p50']:.2f} s | {r['acceptance_length']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
