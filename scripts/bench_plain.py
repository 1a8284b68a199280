"""Benchmark dflash-mlx legs against mlx-lm's `stream_generate`, a few legs only (by default the plain path).

`scripts/bench_adaptive.py` runs thirteen legs per setting, so a ratio to
mlx-lm rests on few units and swings by a few percent from run to run; this
runs mlx-lm and the legs of `--legs` alone, alternated in a new random order
for every prompt of every round (after two warm-ups of each), so many rounds
fit in minutes. Greedy; every leg's tokens are checked against mlx-lm's.

Legs are bench_adaptive's, by short names: `plain` (dflash-mlx with no
drafter), `adaptive` (the library's default: the setting's drafter, the
adaptive block), `b2` ... `b8` (a fixed block), and at the engine level
`engine-adaptive`, `engine-b8` and `main-b8` (block 8 through the engine of
the main branch before adaptive blocks). The settings are bench_adaptive's;
`untrained` runs the demo target with an untrained copy of its drafter, so
with `--legs adaptive` it measures what a useless drafter costs (the plain
leg there is the same as demo-gsm8k's).

Per setting and leg: end-to-end tok/s (all of a reply's tokens over the time
from the call), leg / mlx-lm end to end and in the decode window (after the
first token) with 95% bootstrap intervals over the units, the median paired
difference of the time to the first token, and the blocks the leg ran; and
each pair of the legs given, end to end (the earlier over the later).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_plain.py --rounds 40 --synthetic /tmp/dflash-synthetic --out plain.json
    LD_PRELOAD=... python3 scripts/bench_plain.py --settings untrained --legs plain,adaptive --rounds 30
    LD_PRELOAD=... python3 scripts/bench_plain.py --settings demo-gsm8k --legs adaptive,b8,engine-adaptive,main-b8
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adaptive import (  # noqa: E402
    FIXED, MAIN_COMMIT, TITLES, Units, bench_arguments, loaded_settings, make_legs,
)  # fmt: skip

from dflash_mlx.models.block_size import default_block_size  # noqa: E402

SETTINGS = "demo-gsm8k,demo-mtbench,4bit,synthetic"
SHORT = {"engine-adaptive": "engine adaptive", "engine-b8": "engine b8", "main-b8": f"engine b8 main@{MAIN_COMMIT}"}
LEGS = ("plain", "adaptive", *(f"b{b}" for b in FIXED), *SHORT)  # bench_adaptive's legs, short names


def leg_names(value: str) -> list[str]:
    names = [n for n in value.split(",") if n]
    unknown = [n for n in names if n not in LEGS]
    if unknown or not names or len(set(names)) != len(names):
        raise SystemExit(f"--legs: expected distinct names among {', '.join(LEGS)}, comma-separated; got {value!r}")
    return names


def run_setting(name, model, tokenizer, draft, prompts, max_tokens, rounds, compared) -> dict:
    made = make_legs(model, tokenizer, draft, max_tokens, default_block_size(model, draft))
    legs = {k: made[SHORT.get(k, k)] for k in ["mlx-lm", *compared]}
    for leg in legs.values():  # an adaptive leg's first call may calibrate; the second is a warm one
        leg(prompts[0])
        leg(prompts[-1])
    units, mismatches, order, shuffle = Units(list(legs)), Counter(), list(legs), random.Random(1).shuffle
    blocks = {k: Counter() for k in compared}
    for _ in range(rounds):
        for p in prompts:
            shuffle(order)
            unit = {k: legs[k](p) for k in order}
            for k in compared:
                mismatches[k] += unit[k][0] != unit["mlx-lm"][0]
                blocks[k].update(unit[k][4])
            units.rows.append({k: (len(v[0]), *v[1:]) for k, v in unit.items()})

    def first_token_ms(leg: str) -> float:  # time to the first token = from the call minus the decode window
        return round(1000 * statistics.median((u[leg][3] - u[leg][1]) - (u["mlx-lm"][3] - u["mlx-lm"][1])
                                              for u in units.rows), 3)  # fmt: skip

    return {"setting": name, "prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens,
            "tokens": sum(u["mlx-lm"][0] for u in units.rows),
            "tps": {k: round(units.speed(k), 2) for k in legs},
            "legs": {k: {"greedy_mismatches": mismatches[k],
                         "vs_mlx_lm": units.ratio(k, "mlx-lm"),
                         "vs_mlx_lm_decode": units.ratio(k, "mlx-lm", end_to_end=False),
                         "first_token_ms_paired_median": first_token_ms(k),
                         "blocks": {str(b): n for b, n in sorted(blocks[k].items())}} for k in compared},
            "pairs": {f"{a} / {b}": units.ratio(a, b)
                      for i, a in enumerate(compared) for b in compared[i + 1 :]}}  # fmt: skip


def _legs(setting: dict) -> dict:
    """A setting's legs; a report of the two-leg version (before --legs) has the plain leg's keys inline."""
    if "legs" in setting:
        return setting["legs"]
    return {"plain": {"vs_mlx_lm": setting["plain_vs_mlx_lm"], "vs_mlx_lm_decode": setting["plain_vs_mlx_lm_decode"],
                      "first_token_ms_paired_median": setting["first_token_ms_paired_median"]}}  # fmt: skip


def markdown_table(report: dict) -> str:
    def r(x):
        return f"{x['ratio']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]"

    lines = ["| setting | leg | units | mlx-lm tok/s | leg tok/s | leg / mlx-lm | decode window | first token, ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for st in report["settings"]:
        for leg, x in _legs(st).items():
            lines.append(f"| {TITLES.get(st['setting'], st['setting'])} | {leg} | {st['prompts'] * st['rounds']} "
                         f"| {st['tps']['mlx-lm']:.1f} | {st['tps'][leg]:.1f} | {r(x['vs_mlx_lm'])} "
                         f"| {r(x['vs_mlx_lm_decode'])} | {x['first_token_ms_paired_median']:+.3f} |")  # fmt: skip
    pairs = [(st, pair, x) for st in report["settings"] for pair, x in st.get("pairs", {}).items()]
    if pairs:
        lines += ["", "| setting | legs | ratio, end to end |", "|---|---|---:|"]
        lines += [f"| {TITLES.get(st['setting'], st['setting'])} | {pair} | {r(x)} |" for st, pair, x in pairs]
    return "\n".join(lines)


def main() -> None:
    ap = bench_arguments(__doc__.splitlines()[0], SETTINGS, 20)
    ap.add_argument("--legs", default="plain", help=f"Legs compared with mlx-lm, comma-separated: {', '.join(LEGS)}.")
    args = ap.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return
    compared = leg_names(args.legs)
    report = {"settings": []}
    for name, model, tokenizer, draft, prompts in loaded_settings(args):
        result = run_setting(name, model, tokenizer, draft, prompts, args.max_tokens, args.rounds, compared)
        report["settings"].append(result)
        print(json.dumps(result), flush=True)
    print(markdown_table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
