"""Acceptance of sampled DFlash v1 drafts: sampling from q vs proposing argmax (one-hot q).

Both modes are exact (the output follows the target's distribution); they
differ in how many drafted tokens the target accepts per cycle. Runs the
bundled demo pair (or --model/--draft) on GSM8K prompts at each temperature.

    python3 scripts/bench_draft_sampling.py --num-prompts 10 --temperature 1.0 --temperature 0.7
"""

from __future__ import annotations

import argparse

from dflash_mlx import load, stream_generate
from dflash_mlx.cli.chat_template import render
from dflash_mlx.datasets import sample


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--draft")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, action="append")
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args()
    model, tokenizer, draft = load(a.model, a.draft)
    prompts = [render(tokenizer, [{"role": "user", "content": q}]) for (q,) in sample("gsm8k", a.num_prompts)]
    for temperature in a.temperature or [1.0]:
        for mode in ("sample", "argmax"):
            tokens = cycles = 0
            for seed in range(a.seeds):
                for prompt in prompts:
                    for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=a.max_tokens,
                                             temperature=temperature, seed=seed, draft_sampling=mode):  # fmt: skip
                        if r.cycle_tokens:
                            tokens, cycles = tokens + r.cycle_tokens, cycles + 1
            print(f"T={temperature:g} draft_sampling={mode}: {tokens / cycles:.2f} tokens/cycle over {cycles} cycles")


if __name__ == "__main__":
    main()
