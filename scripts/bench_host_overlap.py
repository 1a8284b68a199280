"""Does host work overlap the device's on this machine? Busy-wait per cycle, before or after the next is queued.

Runs the engine at a fixed block on a bench_adaptive setting three ways,
alternated per prompt: as is; with a busy-wait of `--busy` microseconds in
the block policy's `choose` (before the next cycle is queued: on the
critical path); and with the same busy-wait in the consumer, after the loop
has queued the next cycle (where a GPU would run it meanwhile). It prints
the extra time per cycle each way. Where the second costs as much as the
first, host work does not hide under the device's (a CPU "device" shares
the cores), so setup moved under the prefill gains nothing.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_host_overlap.py --setting demo-gsm8k --busy 300
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dflash_mlx  # noqa: E402
from bench_adaptive import load_setting  # noqa: E402

from dflash_mlx.engine import speculative_cycles  # noqa: E402
from dflash_mlx.policy.base import FixedBlock  # noqa: E402
from dflash_mlx.session import make_session  # noqa: E402

WAYS = ("none", "before queueing", "after queueing")


def busy(seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


class SlowChoice(FixedBlock):
    def __init__(self, block: int, seconds: float):
        super().__init__(block)
        self.seconds = seconds

    def choose(self, limit: int) -> int:
        busy(self.seconds)
        return super().choose(limit)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", default="demo-gsm8k", help="A bench_adaptive setting (demo-gsm8k, synthetic, ...).")
    ap.add_argument("--synthetic", type=Path, default=Path("/tmp/dflash-synthetic"))
    ap.add_argument("--busy", type=float, default=300.0, help="Microseconds of busy-wait per cycle.")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    loaded = load_setting(args.setting, dflash_mlx.load("demo"), args.synthetic, 8)
    if loaded is None:
        raise SystemExit(f"--setting {args.setting}: its models are missing")
    model, tokenizer, draft, prompts = loaded
    seconds = args.busy * 1e-6

    def run(way: str, prompt) -> tuple[float, int]:
        session = make_session(model, draft)
        policy = SlowChoice(args.block, seconds) if way == WAYS[1] else FixedBlock(args.block)
        tic, cycles = time.perf_counter(), 0
        loop = speculative_cycles(session.target, prompt, session.proposer, max_tokens=args.max_tokens,
                                  block_size=policy, stop_tokens=tokenizer.eos_token_ids, session=session)
        for _ in loop:
            cycles += 1
            if way == WAYS[2]:
                busy(seconds)
        return time.perf_counter() - tic, cycles

    for prompt in prompts:  # warm-up
        for way in WAYS:
            run(way, prompt)
    totals, cycles = dict.fromkeys(WAYS, 0.0), 0
    for _ in range(args.rounds):
        for prompt in prompts:
            for way in random.sample(WAYS, len(WAYS)):
                spent, n = run(way, prompt)
                totals[way] += spent
            cycles += n
    for way in WAYS[1:]:
        extra = (totals[way] - totals["none"]) / cycles * 1e6
        print(f"busy-wait {args.busy:.0f} us per cycle, {way}: {extra:.1f} us more per cycle ({cycles} cycles)")


if __name__ == "__main__":
    main()
