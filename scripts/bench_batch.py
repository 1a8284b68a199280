"""Library-level batching: mlx-lm's batch_generate vs DFlash's, at several batch widths, in one process.

On the bundled pair (mlx-lm on the same float32 target), N GSM8K prompts,
greedy: for each width W in --widths, mlx-lm's `batch_generate` with
`completion_batch_size=W` and `dflash_mlx.batch_generate(max_batch=W)` (its
block: --block, default the drafter's), legs alternated, --rounds rounds after a
warm-up; aggregate tok/s = generated tokens (every prompt's) / wall time of the
call, prefill included; the best round is reported. DFlash's texts are
checked against one-by-one `dflash_mlx.generate`.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python3 scripts/bench_batch.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mlx_lm.generate import batch_generate as mlx_lm_batch_generate

import dflash_mlx
from dflash_mlx.cli.chat_template import render
from dflash_mlx.datasets import sample


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    model, tokenizer, draft = dflash_mlx.load("demo")
    texts = [render(tokenizer, [{"role": "user", "content": c[0]}], {}) for c in sample("gsm8k", args.num_prompts)]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    want = [dflash_mlx.generate(model, draft, tokenizer, p, max_tokens=args.max_tokens) for p in prompts]
    report = {"settings": vars(args), "widths": {}}
    for width in [int(w) for w in args.widths.split(",")]:
        legs = {"mlx-lm": [], "dflash": []}
        same = True
        for r in range(args.rounds + 1):
            tic = time.perf_counter()
            ours = dflash_mlx.batch_generate(model, draft, tokenizer, prompts, max_tokens=args.max_tokens,
                                             max_batch=width, block_size=args.block, return_token_ids=True)  # fmt: skip
            ours_s = time.perf_counter() - tic
            tic = time.perf_counter()
            theirs = mlx_lm_batch_generate(model, tokenizer, prompts, max_tokens=args.max_tokens,
                                           completion_batch_size=width, prefill_batch_size=width,
                                           return_token_ids=True)  # fmt: skip
            theirs_s = time.perf_counter() - tic
            same &= ours.texts == want
            if r:  # round 0 warms up
                legs["dflash"].append(sum(len(t) for t in ours.token_ids) / ours_s)
                legs["mlx-lm"].append(sum(len(t) for t in theirs.token_ids) / theirs_s)
        row = {leg: round(max(v), 1) for leg, v in legs.items()}
        row["speedup"] = round(row["dflash"] / row["mlx-lm"], 2)
        row["dflash_texts_equal_one_by_one"] = same
        report["widths"][width] = row
        print(f"width {width}: mlx-lm {row['mlx-lm']} tok/s, dflash {row['dflash']} tok/s ({row['speedup']}x), "
              f"texts equal: {same}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
