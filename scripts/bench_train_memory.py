"""Peak memory (RSS) of `dflash-mlx train` on a tiny target with Qwen's 151,936-token vocabulary.

The target is a random 2-layer hidden-64 qwen3 model whose vocabulary is
151,936 tokens (the size of Qwen3's embedding table and head), so the
drafter's per-row logits are as wide as a real Qwen pair's while the target
itself costs almost nothing: the peak measures the trainer, not the model.
Each run is a separate `dflash-mlx train` process (the real command, with the
defaults except `--steps`, `--holdout 0` and the flags given); its peak RSS is
read from `getrusage(RUSAGE_CHILDREN)` after it exits (the command re-executes
itself once with OpenBLAS preloaded, in the same process, so the number is the
training process's own).

    python3 scripts/bench_train_memory.py --block-size 8 --block-size 16 \\
        --batch-size 8 --batch-size 16 --out /tmp/train-memory.json

Prints one line per (block size, batch size) with the peak RSS in GB and the
`peak_memory_gb` the trainer reports itself (MLX's own peak), if any.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QWEN_VOCAB = 151_936


def build_target(root: Path) -> Path:
    """The tiny 2-layer qwen3 target with a 151,936-token vocabulary (tests/helpers)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import make_target

    target = root / "target"
    if not (target / "model.safetensors").is_file():
        make_target(target, "qwen3", num_layers=2, hidden_size=64, vocab_size=QWEN_VOCAB)
    return target


def write_prompts(path: Path, n: int) -> Path:
    words = "the river ran past old mill under stone bridge near market every morning baker".split()
    lines = [" ".join(words[(i * 5 + j) % len(words)] for j in range(4 + i % 5)) for i in range(n)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    os.replace(tmp, path)
    return path


def run_one(target: Path, data: Path, work: Path, block: int, batch: int, steps: int, extra: list[str]) -> dict:
    """One `dflash-mlx train` in a fresh child (its own getrusage slot via a wrapper process)."""
    out = work / f"drafter-b{block}-bs{batch}"
    cmd = [
        "dflash-mlx", "train", "--model", str(target), "--data", str(data), "--out", str(out),
        "--steps", str(steps), "--block-size", str(block), "--batch-size", str(batch),
        "--holdout", "0", "--responses", str(work / "responses.jsonl"), *extra,
    ]  # fmt: skip
    # A wrapper python per run: RUSAGE_CHILDREN of the wrapper is this run's peak alone.
    wrapper = (
        "import resource, subprocess, sys, json;"
        "rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL);"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss;"
        "print(json.dumps({'rc': rc, 'maxrss': peak}))"
    )
    tic = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["rc"] != 0:
        raise SystemExit(f"dflash-mlx train failed (exit {result['rc']}): {' '.join(cmd)}")
    scale = 1 << 30 if sys.platform == "darwin" else 1 << 20
    report = json.loads((out / "training_report.json").read_text())
    return {
        "block_size": block,
        "batch_size": batch,
        "steps": steps,
        "peak_rss_gb": round(result["maxrss"] / scale, 3),
        "mlx_peak_memory_gb": report.get("peak_memory_gb"),
        "seconds": round(time.perf_counter() - tic, 1),
        "command": " ".join(cmd),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, action="append", help="repeatable; default 8 and 16")
    parser.add_argument("--batch-size", type=int, action="append", help="repeatable; default 8 (the default)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("extra", nargs="*", help="more `dflash-mlx train` flags (after --)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="dflash-train-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    target = build_target(work)
    data = write_prompts(work / "prompts.jsonl", args.prompts)
    rows = []
    for block in args.block_size or [8, 16]:
        for batch in args.batch_size or [8]:
            row = run_one(target, data, work, block, batch, args.steps, args.extra)
            rows.append(row)
            mlx_peak = row["mlx_peak_memory_gb"]
            shown = "n/a" if mlx_peak is None else f"{mlx_peak:.2f} GB"
            print(
                f"block {block:2d}  batch {batch:2d}: peak RSS {row['peak_rss_gb']:.2f} GB "
                f"(MLX peak {shown}), {row['seconds']:.0f} s",
                flush=True,
            )
    if args.out:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps({"vocab_size": QWEN_VOCAB, "runs": rows}, indent=2) + "\n")
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
