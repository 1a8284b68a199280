"""Per-call cost of the adaptive block on short replies: `stream_generate` legs alternated in one process.

Legs (greedy, every one committing the same tokens), with B the drafter's
block (8 on the trained pairs; 5 on the 4-bit setting): `block_size=B` twice,
`FixedBlock(B)` passed as a policy object twice, an adaptive policy built
before the call and passed in (`prebuilt adaptive`: the policy's per-cycle
work only), `block_size=B` after building an adaptive policy inside the timed
call (`bB + policy setup`: the setup only), and the adaptive default. Each
round runs every prompt through every leg in a new random order. The
duplicated legs show the noise. A last leg (`timed adaptive`) builds the
adaptive policy right before the call, as the default does inside it, and
times the policy's own host work inside the replies: its setup, its first
`choose`, the later ones and every `observe` (right after a reply or a
cycle's device work, the caches are cold: this is several times what the
same calls cost in a warm loop).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_call_setup.py --synthetic /tmp/dflash-synthetic
    LD_PRELOAD=... python3 scripts/bench_call_setup.py --setting demo-gsm8k --rounds 6

`--setting` takes the pair and prompts of a `scripts/bench_adaptive.py`
setting instead (e.g. the demo pair on GSM8K prompts, chat-templated, with
~11 cycles per reply where the synthetic pair's have ~2).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dflash_mlx  # noqa: E402
from bench_adaptive import TITLES, load_setting  # noqa: E402

from dflash_mlx.generation import stream_generate  # noqa: E402
from dflash_mlx.models.block_size import default_block_size  # noqa: E402
from dflash_mlx.policy import adaptive_policy  # noqa: E402
from dflash_mlx.policy.base import FixedBlock  # noqa: E402
from dflash_mlx.session import make_session  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", default="synthetic", choices=sorted(TITLES),
                    help="The pair and prompts (scripts/bench_adaptive.py's settings).")
    ap.add_argument("--synthetic", type=Path, default=Path("/tmp/dflash-synthetic"),
                    help="A scripts/train_synthetic.py work directory (target/, drafter/, prompts.jsonl).")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    loaded = load_setting(args.setting, dflash_mlx.load("demo"), args.synthetic, args.num_prompts)
    if loaded is None:  # (load_setting said why)
        raise SystemExit(1)
    model, tokenizer, draft, prompts = loaded
    session = make_session(model, draft)
    largest = default_block_size(model, draft)

    def reply(prompt, before=None, **kwargs) -> tuple[float, int]:
        tic, n = time.perf_counter(), 0
        if before is not None:
            before()
        for _ in stream_generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens, **kwargs):
            n += 1
        return time.perf_counter() - tic, n

    def setup():
        return adaptive_policy(session.target, session.proposer, largest, carry=True)

    def prebuilt(prompt):
        return reply(prompt, block_size=setup())

    spent = dict.fromkeys(["setup", "first choose", "later chooses", "observes"], 0.0)  # timed leg, seconds

    class Timed:
        """An adaptive policy whose choose and observe calls are timed (added to this reply's totals)."""

        def __init__(self, policy):
            self.policy, self.max_block, self.chosen = policy, policy.max_block, 0

        def choose(self, limit):
            tic = time.perf_counter()
            b = self.policy.choose(limit)
            spent["later chooses" if self.chosen else "first choose"] += time.perf_counter() - tic
            self.chosen += 1
            return b

        def observe(self, block_size, accepted, seconds):
            tic = time.perf_counter()
            self.policy.observe(block_size, accepted, seconds)
            spent["observes"] += time.perf_counter() - tic

    def timed_adaptive(prompt):
        tic = time.perf_counter()
        policy = setup()
        built = time.perf_counter() - tic
        spent["setup"] += built
        seconds, n = reply(prompt, block_size=Timed(policy))
        return seconds + built, n

    legs = {
        f"b{largest}": lambda p: reply(p, block_size=largest),
        f"b{largest} again": lambda p: reply(p, block_size=largest),
        f"FixedBlock({largest})": lambda p: reply(p, block_size=FixedBlock(largest)),
        f"FixedBlock({largest}) again": lambda p: reply(p, block_size=FixedBlock(largest)),
        "prebuilt adaptive": prebuilt,
        f"b{largest} + policy setup": lambda p: reply(p, before=setup, block_size=largest),
        "adaptive": lambda p: reply(p, max_block_size=largest),
        "timed adaptive": timed_adaptive,
    }
    for p in prompts:  # warm-up
        for leg in legs.values():
            leg(p)
    spent.update(dict.fromkeys(spent, 0.0))  # the warm-up's not counted
    totals = {name: [0.0, 0] for name in legs}
    for _ in range(args.rounds):
        for p in prompts:
            order = list(legs)
            random.shuffle(order)
            for name in order:
                seconds, tokens = legs[name](p)
                totals[name][0] += seconds
                totals[name][1] += tokens
    replies = args.rounds * len(prompts)
    print(f"{replies} replies per leg, {totals['adaptive'][1] / replies:.1f} tokens each on average")
    for name, (seconds, tokens) in totals.items():
        print(f"{name:22s} {tokens / seconds:7.1f} tok/s  {1000 * seconds / replies:6.2f} ms per reply")
    per_reply = {what: 1e6 * seconds / replies for what, seconds in spent.items()}
    reply_us = 1e6 * totals["timed adaptive"][0] / replies
    print("timed adaptive, the policy's host work per reply: "
          + ", ".join(f"{what} {us:.1f} us" for what, us in per_reply.items())
          + f"; in all {sum(per_reply.values()):.1f} us, {100 * sum(per_reply.values()) / reply_us:.2f}% of the reply")


if __name__ == "__main__":
    main()
