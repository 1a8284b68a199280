"""Benchmark the plain path (dflash-mlx with no drafter) against mlx-lm's `stream_generate`, two legs only.

`scripts/bench_adaptive.py` runs thirteen legs per setting, so its plain / mlx-lm
ratio rests on few units and swings by a few percent from run to run; this runs
just the two, alternated in a new random order for every prompt of every round
(after one warm-up of each), so many rounds fit in minutes. Greedy; the plain
path's tokens are checked against mlx-lm's.

Per setting (those of bench_adaptive except `untrained`, whose target is the
demo's): both legs' end-to-end tok/s (all of a reply's tokens over the time
from the call), plain / mlx-lm end to end and in the decode window (after the
first token) with 95% bootstrap intervals over the units, and the median
paired difference of the time to the first token.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_plain.py --rounds 40 --synthetic /tmp/dflash-synthetic --out plain.json
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

from mlx_lm import stream_generate as mlx_lm_stream_generate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adaptive import TITLES, Units, bench_arguments, loaded_settings, timed  # noqa: E402

from dflash_mlx.generation import stream_generate  # noqa: E402

SETTINGS = "demo-gsm8k,demo-mtbench,4bit,synthetic"


def run_setting(name, model, tokenizer, prompts, max_tokens, rounds) -> dict:
    legs = {
        "mlx-lm": lambda p: timed(mlx_lm_stream_generate(model, tokenizer, p, max_tokens=max_tokens)),
        "plain": lambda p: timed(stream_generate(model, None, tokenizer, p, max_tokens=max_tokens)),
    }
    for leg in legs.values():
        leg(prompts[0])
    units, mismatches, order, shuffle = Units(list(legs)), 0, list(legs), random.Random(1).shuffle
    for _ in range(rounds):
        for p in prompts:
            shuffle(order)
            unit = {k: legs[k](p) for k in order}
            mismatches += unit["plain"][0] != unit["mlx-lm"][0]
            units.rows.append({k: (len(v[0]), *v[1:]) for k, v in unit.items()})
    # time to the first token = from the call minus the decode window
    first = [(u["plain"][3] - u["plain"][1]) - (u["mlx-lm"][3] - u["mlx-lm"][1]) for u in units.rows]
    return {"setting": name, "prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens,
            "greedy_mismatches": mismatches, "tokens": sum(u["plain"][0] for u in units.rows),
            "tps": {k: round(units.speed(k), 2) for k in legs},
            "plain_vs_mlx_lm": units.ratio("plain", "mlx-lm"),
            "plain_vs_mlx_lm_decode": units.ratio("plain", "mlx-lm", end_to_end=False),
            "first_token_ms_paired_median": round(1000 * statistics.median(first), 3)}  # fmt: skip


def markdown_table(report: dict) -> str:
    def r(x):
        return f"{x['ratio']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]"

    lines = ["| setting | units | mlx-lm tok/s | plain tok/s | plain / mlx-lm | decode window | first token, ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for st in report["settings"]:
        lines.append(f"| {TITLES.get(st['setting'], st['setting'])} | {st['prompts'] * st['rounds']} "
                     f"| {st['tps']['mlx-lm']:.1f} | {st['tps']['plain']:.1f} | {r(st['plain_vs_mlx_lm'])} "
                     f"| {r(st['plain_vs_mlx_lm_decode'])} | {st['first_token_ms_paired_median']:+.3f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    args = bench_arguments(__doc__.splitlines()[0], SETTINGS, 20).parse_args()
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return
    report = {"settings": []}
    for name, model, tokenizer, _, prompts in loaded_settings(args):
        result = run_setting(name, model, tokenizer, prompts, args.max_tokens, args.rounds)
        report["settings"].append(result)
        print(json.dumps(result), flush=True)
    print(markdown_table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
