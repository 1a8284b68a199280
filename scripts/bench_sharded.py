"""What tensor sharding adds to DFlash: mlx-lm's plain decoding vs DFlash, on one process and on 2 ranks.

For each pair (the bundled demo pair on GSM8K prompts; a pair trained by
scripts/train_synthetic.py on its own prompts, with --synthetic DIR) it runs
the same job twice: in one process, and as 2 ring ranks on this machine
(`mlx.launch --backend ring -n 2`, loopback; each rank gets half the cores'
OpenBLAS threads). A job loads the pair (`dflash_mlx.load(..., shard="tensor")`
on 2 ranks), warms every leg up, then alternates the legs prompt by prompt
for --rounds rounds: mlx-lm's own `stream_generate` (plain decoding; sharded
on 2 ranks: mlx-lm's sharded decoding) and DFlash at each --blocks entry.
Decode speed = tokens after each reply's first over the time after it,
summed over prompts and rounds. Greedy; every DFlash reply is checked
against mlx-lm's. The report gives each setup's speedup and their ratio
(2-rank speedup / 1-process speedup: what sharding adds).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_sharded.py --synthetic /tmp/dflash-synthetic --out sharded.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _prompts(tokenizer, job: dict) -> list:
    from dflash_mlx.cli.chat_template import render, template_source
    from dflash_mlx.datasets import sample
    from dflash_mlx.generation import encode_prompt

    if job.get("raw"):
        texts = [json.loads(line)["prompt"] for line in Path(job["raw"]).read_text().splitlines()[: job["n"]]]
    else:
        texts = [c[0] for c in sample("gsm8k", job["n"])]
        if template_source(tokenizer) is not None:
            texts = [render(tokenizer, [{"role": "user", "content": t}], {}) for t in texts]
    return [encode_prompt(tokenizer, t) for t in texts]


def _timed(responses) -> tuple[list[int], float]:
    tokens, first = [], None
    for r in responses:
        if first is None:
            first = time.perf_counter()
        tokens.append(r.token)
    return tokens, time.perf_counter() - first


def rank_job(path: Path) -> int:
    """One rank (or the single process) of a job: legs alternated prompt by prompt; rank 0 writes the result."""
    import mlx.core as mx
    from mlx_lm import stream_generate as mlx_lm_stream

    import dflash_mlx
    from dflash_mlx.sharding.group import world

    job = json.loads(path.read_text())
    group = world()
    sharded = group.size() > 1
    model, tokenizer, draft = dflash_mlx.load(job["target"], job["draft"], shard="tensor" if sharded else None)
    prompts = _prompts(tokenizer, job)
    legs = ["mlx-lm"] + [f"dflash b={b}" for b in job["blocks"]]

    def run(leg: str, prompt):
        if leg == "mlx-lm":
            return _timed(mlx_lm_stream(model, tokenizer, prompt, max_tokens=job["max_tokens"]))
        b = leg.split("=")[1]
        return _timed(dflash_mlx.stream_generate(model, draft, tokenizer, prompt, max_tokens=job["max_tokens"],
                                                 block_size=None if b == "auto" else int(b)))  # fmt: skip

    for leg in legs:  # warm-up (and the adaptive leg's calibration)
        run(leg, prompts[0])
    totals = {leg: [0, 0.0] for leg in legs}
    same = {leg: True for leg in legs}
    for _ in range(job["rounds"]):
        for prompt in prompts:
            reference = None
            for leg in legs:
                tokens, seconds = run(leg, prompt)
                reference = tokens if reference is None else reference
                same[leg] &= tokens == reference
                totals[leg][0] += len(tokens) - 1
                totals[leg][1] += seconds
    if group.rank() == 0:
        result = {"ranks": group.size(), "prompts": len(prompts),
                  "legs": {leg: {"tok_s": round(n / s, 2), "tokens": n, "same_as_mlx_lm": same[leg]}
                           for leg, (n, s) in totals.items()},
                  "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 4)}  # fmt: skip
        Path(job["out"]).write_text(json.dumps(result))
    return 0


def _run(job: dict, ranks: int, work: Path) -> dict:
    job_file = Path(tempfile.mkstemp(suffix=f"-job-{ranks}.json", dir=work)[1])
    out = job_file.with_name(job_file.name.replace("-job-", "-result-"))
    job_file.write_text(json.dumps({**job, "out": str(out)}))
    command = [sys.executable, __file__, "--rank-job", str(job_file)]
    env = dict(os.environ)
    if ranks > 1:
        command = [shutil.which("mlx.launch"), "--backend", "ring", "-n", str(ranks), "--", *command]
        env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    read, write = os.pipe()  # mlx.launch busy-loops on a stdin at end of file
    try:
        done = subprocess.run(command, stdin=read, env=env, capture_output=True, text=True)
    finally:
        os.close(read)
        os.close(write)
    if not out.exists():
        raise SystemExit(f"the {ranks}-rank job failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-job", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--synthetic", type=Path, help="A scripts/train_synthetic.py work directory.")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--blocks", default="auto,8", help="DFlash legs: auto and/or fixed blocks, comma-separated.")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.rank_job is not None:
        return rank_job(args.rank_job)
    if shutil.which("mlx.launch") is None:
        raise SystemExit("mlx.launch is not installed (it comes with mlx)")
    from dflash_mlx.models.resolve import choose_model

    demo = choose_model(None, None)
    pairs = {"demo (gsm8k)": dict(target=str(demo.target), draft=str(demo.draft))}
    if args.synthetic is not None:
        pairs["synthetic"] = dict(target=str(args.synthetic / "target"), draft=str(args.synthetic / "drafter"),
                                  raw=str(args.synthetic / "prompts.jsonl"))  # fmt: skip
    blocks = args.blocks.split(",")
    report = {"settings": vars(args) | {"out": str(args.out), "synthetic": str(args.synthetic)}, "pairs": {}}
    with tempfile.TemporaryDirectory(prefix="dflash-bench-sharded-") as tmp:
        for name, pair in pairs.items():
            job = {**pair, "n": args.num_prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "blocks": blocks}  # fmt: skip
            results = {ranks: _run(job, ranks, Path(tmp)) for ranks in (1, 2)}
            entry = {}
            for ranks, result in results.items():
                base = result["legs"]["mlx-lm"]["tok_s"]
                entry[f"{ranks} rank(s)"] = result | {"speedup": {leg: round(v["tok_s"] / base, 3)
                                                                  for leg, v in result["legs"].items()}}  # fmt: skip
            entry["sharding_multiplies_speedup_by"] = {
                leg: round(entry["2 rank(s)"]["speedup"][leg] / entry["1 rank(s)"]["speedup"][leg], 3)
                for leg in entry["1 rank(s)"]["speedup"] if leg != "mlx-lm"
            }
            report["pairs"][name] = entry
            for ranks in (1, 2):
                legs = entry[f"{ranks} rank(s)"]["legs"]
                cells = "  ".join(f"{leg} {v['tok_s']:.1f} tok/s ({entry[f'{ranks} rank(s)']['speedup'][leg]:.2f}x"
                                  f"{'' if v['same_as_mlx_lm'] else ', DIFFERS'})" for leg, v in legs.items())
                print(f"{name:14s} {ranks} rank(s): {cells}", flush=True)
            gain = entry["sharding_multiplies_speedup_by"]
            print(f"{name:14s} sharding multiplies the speedup by {gain}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
