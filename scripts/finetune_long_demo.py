"""Fine-tune the bundled demo drafter for long prompts: docs/training.md's worked example of `train --init`.

The demo pair (dflash_mlx/demo) was trained on single GSM8K questions of ~100
tokens; its acceptance falls on long prompts. This script:

1. builds long multi-turn prompts (`messages` lines): earlier GSM8K questions
   with their reference answers as previous turns, then a new question, about
   `--prompt-tokens` tokens in all, from the bundled GSM8K test set
   (questions of the first half for training, the rest never used here), plus
   short single-question prompts (the benchmark's format) as the replay set;
2. measures the demo drafter's mean acceptance length on the prompts the
   trainer will hold out (long and short), exactly as the trainer's closing
   validation measures it;
3. runs `dflash-mlx train --init <demo drafter> --replay short.jsonl
   --max-length 2048 --cache-features ...` (the real command, in a child
   process; the responses cache is kept in `<work>`, so a rerun with
   `--fresh` regenerates nothing);
4. prints before / after for both sets and writes them to `<work>/finetune_long_report.json`.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/finetune_long_demo.py --work /tmp/dflash-long-demo

What it printed on the project's machine: docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "dflash_mlx" / "demo"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return path


def acceptance_before(model, tokenizer, path: Path, holdout: int, seed: int, max_tokens: int) -> dict:
    """The demo drafter's acceptance on the prompts of `path` the trainer holds out."""
    import mlx.core as mx

    from dflash_mlx import load_draft
    from dflash_mlx.train.data import encode_prompts, read_prompts
    from dflash_mlx.train.trainer import split_holdout
    from dflash_mlx.train.validate import acceptance_length

    prompts = encode_prompts(tokenizer, read_prompts(path), str(path))
    held = split_holdout(prompts, holdout, seed)[1]
    draft = load_draft(DEMO / "draft", model, dtype=mx.float32)
    result = acceptance_length(model, draft, tokenizer, held, max_tokens=max_tokens, block_size=8)
    result["prompt_tokens_mean"] = sum(map(len, held)) / len(held)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflash-long-demo"))
    parser.add_argument("--prompt-tokens", type=int, default=1600)
    parser.add_argument("--prompts", type=int, default=112, help="long prompts, --holdout of them held out")
    parser.add_argument("--replay-prompts", type=int, default=96)
    parser.add_argument("--holdout", type=int, default=16)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", help="delete a previous run's drafter first")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm import load

    from dflash_mlx.datasets import GSM8K_FORMAT, long_gsm8k_conversations

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load(str(DEMO / "target"))
    model.set_dtype(mx.float32)  # as `--target-dtype float32` below
    rows = [json.loads(line) for line in (REPO / "dflash_mlx/datasets/gsm8k_test.jsonl").read_text().splitlines()]
    train_rows = rows[: len(rows) // 2]
    conversations = long_gsm8k_conversations(tokenizer, args.prompt_tokens, args.prompts, stop=len(rows) // 2)
    long_file = write_jsonl(work / "long.jsonl", [{"messages": m} for m in conversations])
    short = [
        {"messages": [{"role": "user", "content": GSM8K_FORMAT.format(question=r["question"])}]}
        for r in train_rows[-args.replay_prompts :]
    ]
    short_file = write_jsonl(work / "short.jsonl", short)

    replay_holdout = min(args.holdout, args.replay_prompts // 2)
    before = {
        "long": acceptance_before(model, tokenizer, long_file, args.holdout, args.seed, args.max_tokens),
        "short": acceptance_before(model, tokenizer, short_file, replay_holdout, args.seed + 1, args.max_tokens),
    }
    out = work / "drafter"
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
    cmd = [
        "dflash-mlx",
        "train",
        "--model",
        str(DEMO / "target"),
        "--init",
        str(DEMO / "draft"),
        "--data",
        str(long_file),
        "--replay",
        str(short_file),
        "--out",
        str(out),
        "--max-length",
        "2048",
        "--max-tokens",
        str(args.max_tokens),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--holdout",
        str(args.holdout),
        "--seed",
        str(args.seed),
        "--target-dtype",
        "float32",
        "--save-dtype",
        "bfloat16",
        "--save-every",
        str(args.steps),
        "--responses",
        str(work / "responses.jsonl"),
        "--cache-features",
    ]
    print(" ".join(cmd), flush=True)
    tic = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - tic
    report = json.loads((out / "training_report.json").read_text())
    summary = {
        "command": " ".join(cmd),
        "seconds": seconds,
        "long_prompt_tokens_mean": before["long"]["prompt_tokens_mean"],
        "short_prompt_tokens_mean": before["short"]["prompt_tokens_mean"],
        "long_before": before["long"]["mean_acceptance_length"],
        "long_after": report["mean_acceptance_length"],
        "short_before": before["short"]["mean_acceptance_length"],
        "short_after": report["replay_mean_acceptance_length"],
        "peak_rss_gb": report["peak_rss_gb"],
        "train_seconds": report["train_seconds"],
    }
    tmp = work / "finetune_long_report.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, work / "finetune_long_report.json")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
