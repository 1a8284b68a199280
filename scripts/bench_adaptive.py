"""Benchmark the adaptive block size against plain decoding and every fixed block, in one process.

Settings (each skipped with a note when its models are missing):
  demo-gsm8k      the bundled pair on GSM8K prompts (in distribution)
  demo-mtbench    the bundled pair on MT-Bench first turns (off distribution)
  untrained       the bundled target with a randomly initialised drafter of the same shape
  4bit            the bundled target quantized to 4 bits (group 64), the bundled drafter
  synthetic       a pair trained by scripts/train_synthetic.py (--synthetic DIR)

Legs, after one warm-up of each: mlx-lm's `stream_generate` (the baseline),
dflash-mlx with no drafter (the plain path), DFlash adaptive, DFlash at each
fixed block in {2, 3, 4, 5, 6, 8}; and at the engine level (cycles, no
detokenizing) the adaptive policy, the adaptive policy taking the plain
argmax of E(b) / T(b) (`resolution` 0: no preference for the largest block
near the best), fixed block 8, and fixed block 8 through the
engine and drafter of the main branch before adaptive blocks (commit 798f512:
its engine.py, draft/model.py and proposers/dflash.py read with git and
executed against today's package, the drafter given the same weights). A
*unit* is one prompt in one round: every leg runs it, in a new random order
each time, before any leg runs the next. Greedy; every leg's tokens are
checked against the baseline's. Each adaptive leg carries its own drafter
history across its calls (`adaptive_policy(carry=True)`, as greedy
`stream_generate` does), as if it ran in a process of its own: the engine
legs run shallow copies of the drafter (other objects, the same weights).

End-to-end speed = all of a reply's tokens over the time from the call
(prefill included), summed over units; decode speed = the tokens after each
reply's first over the time after it. Judge by end to end on a CPU: there a
step's `mx.async_eval` returns only when most of its graph has run, so the
cycle queued before the first token is handed out is computed before it,
outside the decode window, which flatters large blocks on short replies.

Ratios are of summed speeds, with a 95% bootstrap interval over the units
(timings of these tiny models vary by 10-30% from run to run here). The best
fixed block is cross-fitted: alternate units form two halves and each half
is measured at the block that was fastest on the other half (the maximum of
six noisy legs measured on the same units is biased upwards); the bootstrap
draws units within each half. Where blocks are nearly tied, the cross-fitted
speed is that of a block picked on noisy data, below the truly best one's:
read `adaptive / b8` beside it where b = 8 is the best (the trained pairs).

Each setting also reports every leg's tokens per cycle, its milliseconds per
cycle in the decode window (the caller's per-token work included) and, for
the adaptive legs, how many cycles ran at each block.

For the trained pairs (demo-gsm8k, synthetic) it also reports the engine's
overhead at block 8 end to end: per unit, the reply's prefill plus as many
separately timed drafter (context ingest fused with the draft) and target
verify forwards as it had cycles, at its middle context, measured right after
the reply, over the reply's time (`overhead_at_8`).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_adaptive.py --synthetic /tmp/dflash-synthetic --out report.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import subprocess
import sys
import time
import types
from collections import Counter
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm import stream_generate as mlx_lm_stream_generate

import dflash_mlx
from dflash_mlx.cli.chat_template import render, template_source
from dflash_mlx.datasets import sample
from dflash_mlx.engine import speculative_cycles
from dflash_mlx.generation import encode_prompt, stream_generate
from dflash_mlx.models.block_size import default_block_size
from dflash_mlx.policy import adaptive_policy
from dflash_mlx.policy.calibration import cost_curve
from dflash_mlx.session import make_session
from dflash_mlx.targets.rollback import rollback

FIXED = (2, 3, 4, 5, 6, 8)
MAIN_COMMIT = "798f512"
ROOT = Path(__file__).resolve().parent.parent


def main_module(path: str, name: str, package: str, edit=lambda source: source) -> types.ModuleType:
    """A module of the main branch before adaptive blocks (`path` at MAIN_COMMIT), bound to today's
    package as `package.name` (benchmark only)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{MAIN_COMMIT}:{path}"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    module = types.ModuleType(f"{package}.{name}", f"{path} of the main branch (benchmark only)")
    module.__package__ = package
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(edit(source), f"{MAIN_COMMIT}:{path}", "exec"), module.__dict__)
    return module


def old_engine():
    """The main branch's engine (`speculative_cycles`), on today's `Acceptor` (whose `first_token` is
    now `next_token`)."""
    return main_module("dflash_mlx/engine.py", "_engine_main", "dflash_mlx",
                       lambda src: src.replace("acceptor.first_token(", "acceptor.next_token(")).speculative_cycles


def old_proposer(draft):
    """A main-branch proposer on a main-branch drafter with `draft`'s weights and config: the whole
    visible context concatenated with the block every cycle, the context ingested on its own."""
    model = main_module("dflash_mlx/draft/model.py", "_model_main", "dflash_mlx.draft")
    proposers = main_module("dflash_mlx/proposers/dflash.py", "_dflash_main", "dflash_mlx.proposers",
                            lambda src: src.replace("from ..draft.model import", "from ..draft._model_main import"))
    if draft.config.is_dflash2:
        raise ValueError("the main-branch drafter leg runs DFlash (v1) drafters only")
    old = model.DFlashDraftModel(draft.config)
    old.update(draft.parameters())
    return proposers.DFlashProposer(old)


def prompts_for(tokenizer, dataset: str, n: int, raw_file: Path | None = None) -> list[mx.array]:
    if raw_file is not None:
        texts = [json.loads(line)["prompt"] for line in raw_file.read_text().splitlines()[:n]]
    else:
        texts = [c[0] for c in sample(dataset, n)]
        if template_source(tokenizer) is not None:
            texts = [render(tokenizer, [{"role": "user", "content": t}], {}) for t in texts]
    return [encode_prompt(tokenizer, t) for t in texts]


def timed(responses) -> tuple[list[int], float, int, float, Counter]:
    """(tokens, decode seconds, cycles, seconds from the call, cycles per block) of one reply (a lazy
    generator)."""
    tokens, first, cycles, blocks, start = [], None, 0, Counter(), time.perf_counter()
    for r in responses:
        if first is None:
            first = time.perf_counter()
        tokens.append(r.token)
        if getattr(r, "cycle_tokens", None) is not None:
            cycles += 1
            blocks[r.cycle_block_size or 1] += 1
    end = time.perf_counter()
    return tokens, end - first, cycles, end - start, blocks


def timed_cycles(cycles) -> tuple[list[int], float, int, float, Counter]:
    tokens, first, n, blocks, start = [], None, 0, Counter(), time.perf_counter()
    for c in cycles:
        if first is None:
            first = time.perf_counter()
        else:
            n += 1
            blocks[c.block_size] += 1
        tokens += c.tokens
    end = time.perf_counter()
    return tokens, end - first, n, end - start, blocks


def make_legs(model, tokenizer, draft, max_tokens, largest):
    eos = tokenizer.eos_token_ids
    main_cycles, main_draft = old_engine(), old_proposer(draft)

    def engine(fn, block, drafter=draft):
        def leg(prompt):  # timed from the session and the policy on, as stream_generate's legs are
            tic = time.perf_counter()
            session = make_session(model, drafter)
            b = block() if callable(block) else block
            tokens, decode, cycles, _, blocks = timed_cycles(fn(session.target, prompt, session.proposer,
                                                                max_tokens=max_tokens, block_size=b,
                                                                stop_tokens=eos, session=session))  # fmt: skip
            return tokens, decode, cycles, time.perf_counter() - tic, blocks
        return leg

    def policy(drafter, resolution=None):
        session = make_session(model, drafter)
        chosen = adaptive_policy(session.target, session.proposer, largest, carry=True)  # as stream_generate greedy
        if resolution is not None:
            chosen.resolution = resolution
        return chosen

    legs = {
        "mlx-lm": lambda p: timed(mlx_lm_stream_generate(model, tokenizer, p, max_tokens=max_tokens)),
        "plain": lambda p: timed(stream_generate(model, None, tokenizer, p, max_tokens=max_tokens)),
        "adaptive": lambda p: timed(stream_generate(model, draft, tokenizer, p, max_tokens=max_tokens,
                                                    max_block_size=largest)),  # fmt: skip
    }
    for b in FIXED:
        legs[f"b{b}"] = lambda p, b=b: timed(stream_generate(model, draft, tokenizer, p, max_tokens=max_tokens,
                                                             block_size=b))  # fmt: skip
    # each adaptive leg its own drafter history (carried across its greedy calls), as in a process of its own:
    # a shallow copy is another drafter object with the same weights
    own, argmax = copy.copy(draft), copy.copy(draft)
    legs["engine adaptive"] = engine(speculative_cycles, lambda: policy(own), own)
    legs["engine adaptive argmax"] = engine(speculative_cycles, lambda: policy(argmax, resolution=0.0), argmax)
    legs["engine b8"] = engine(speculative_cycles, 8)
    legs[f"engine b8 main@{MAIN_COMMIT}"] = engine(main_cycles, 8, main_draft)
    return legs


class Units:
    """Per-unit measurements (one prompt in one round, every leg on it), and ratios of summed speeds
    with bootstrap confidence intervals over the units."""

    def __init__(self, legs: list[str]):
        self.legs = legs
        self.rows: list[dict] = []  # {leg: (tokens, decode seconds, cycles, seconds from the call, blocks)}

    def speed(self, leg: str, units=None, end_to_end: bool = True) -> float:
        units = self.rows if units is None else units
        if end_to_end:  # every token over the time from the call
            return sum(u[leg][0] for u in units) / sum(u[leg][3] for u in units)
        return sum(u[leg][0] - 1 for u in units) / sum(u[leg][1] for u in units)  # after the first token

    def best_fixed(self, units, end_to_end: bool) -> tuple[float, list[int]]:
        """The best fixed block's speed, cross-fitted: each half of the units (alternate units) is
        measured at the block that was fastest on the other half, so the noise that makes one block
        look fastest does not also inflate the speed it is compared at; and the blocks chosen."""
        halves = [units[0::2], units[1::2]]
        if not halves[1]:
            b = max(FIXED, key=lambda b: self.speed(f"b{b}", units, end_to_end))
            return self.speed(f"b{b}", units, end_to_end), [b]
        picks = [max(FIXED, key=lambda b: self.speed(f"b{b}", other, end_to_end)) for other in halves[::-1]]
        tokens = sum(u[f"b{b}"][0] - (not end_to_end) for half, b in zip(halves, picks) for u in half)
        seconds = sum(u[f"b{b}"][3 if end_to_end else 1] for half, b in zip(halves, picks) for u in half)
        return tokens / seconds, picks

    def reference(self, other: str, units, end_to_end: bool) -> float:
        """A leg's speed, or "best fixed" (cross-fitted), or "better" (of mlx-lm and the best fixed)."""
        if other in ("best fixed", "better"):
            best = self.best_fixed(units, end_to_end)[0]
            return best if other == "best fixed" else max(best, self.speed("mlx-lm", units, end_to_end))
        return self.speed(other, units, end_to_end)

    def ratio(self, leg: str, other: str, end_to_end: bool = True, resamples: int = 2000) -> dict:
        """leg's speed over `other`'s (see `reference`), with a 95% bootstrap interval over the units."""

        def value(units):
            return self.speed(leg, units, end_to_end) / self.reference(other, units, end_to_end)

        rng = random.Random(0)
        n, halves = len(self.rows), (self.rows[0::2], self.rows[1::2])

        def resample() -> list:
            """The units drawn again within each half (the halves `best_fixed` splits them into), so a
            cross-fitted block is still measured on units it was not picked on: drawn across halves, copies
            of a unit landed in both, and the interval of the cross-fitted ratio missed its own point
            estimate (1.10 [0.94, 1.03] on the synthetic pair)."""
            drawn: list = [None] * n
            for start, half in enumerate(halves):
                drawn[start::2] = [half[rng.randrange(len(half))] for _ in half]
            return drawn

        boots = sorted(value(resample()) for _ in range(resamples))
        return {"ratio": round(value(self.rows), 3),
                "ci95": [round(boots[int(0.025 * resamples)], 3), round(boots[int(0.975 * resamples)], 3)]}


def run_setting(name, model, tokenizer, draft, prompts, max_tokens, largest, rounds):
    legs = make_legs(model, tokenizer, draft, max_tokens, largest)
    for leg in legs.values():
        leg(prompts[0])  # warm-up (a whole prompt: a truncated one makes the drafter look useless to its history)
    units, baseline, mismatches = Units(list(legs)), {}, set()
    order, shuffle = list(legs), random.Random(1).shuffle
    for _ in range(rounds):
        for i, p in enumerate(prompts):
            shuffle(order)  # every leg runs prompt i before any runs prompt i + 1, in a new order each time
            unit = {k: legs[k](p) for k in order}
            baseline.setdefault(i, unit["mlx-lm"][0])
            mismatches.update(k for k, v in unit.items() if v[0] != baseline[i])
            units.rows.append({k: (len(v[0]), *v[1:]) for k, v in unit.items()})
    main = f"engine b8 main@{MAIN_COMMIT}"
    out = {"setting": name, "prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens, "max_block": largest,
           "greedy_mismatches": sorted(mismatches)}  # fmt: skip
    for label, e2e in (("end_to_end", True), ("decode", False)):
        best, picks = units.best_fixed(units.rows, e2e)
        out[label] = {
            "tps": {k: round(units.speed(k, end_to_end=e2e), 2) for k in legs},
            "best_fixed_tps": round(best, 2), "best_fixed_blocks": picks,
            "adaptive_vs_mlx_lm": units.ratio("adaptive", "mlx-lm", e2e),
            "adaptive_vs_best_fixed": units.ratio("adaptive", "best fixed", e2e),
            "adaptive_vs_b8": units.ratio("adaptive", "b8", e2e),
            "plain_vs_mlx_lm": units.ratio("plain", "mlx-lm", e2e),
            "engine_adaptive_vs_main_b8": units.ratio("engine adaptive", main, e2e),
            "engine_b8_vs_main_b8": units.ratio("engine b8", main, e2e),
            "engine_adaptive_vs_argmax": units.ratio("engine adaptive", "engine adaptive argmax", e2e),
            "adaptive_vs_better_of_mlx_lm_and_best_fixed": units.ratio("adaptive", "better", e2e),
        }  # fmt: skip
    out["tokens_per_cycle"] = {k: round(sum(u[k][0] - 1 for u in units.rows) / c, 3) for k in legs
                               if (c := sum(u[k][2] for u in units.rows))}  # fmt: skip
    # milliseconds per cycle in the decode window (the caller's per-token work included), and the blocks run
    out["cycle_ms"] = {k: round(1000 * sum(u[k][1] for u in units.rows) / c, 3) for k in legs
                       if (c := sum(u[k][2] for u in units.rows))}  # fmt: skip
    out["blocks"] = {k: dict(sorted(sum((u[k][4] for u in units.rows), Counter()).items()))
                     for k in ("adaptive", "engine adaptive", "engine adaptive argmax")}  # fmt: skip
    return out


def forward_times(model, draft, prompt, block: int, kept: int, repeats: int) -> list[float]:
    """Seconds of `repeats` cycles' forwards, each evaluated on its own: the drafter's forward (ingesting
    `kept` context rows while drafting block - 1 tokens, as the loop does) plus one target verify of
    `block` rows, after the prompt (after 3 untimed ones)."""
    session = make_session(model, draft)
    cycles = speculative_cycles(session.target, prompt, session.proposer, max_tokens=-1, block_size=1,
                                session=session)  # fmt: skip
    first = next(cycles)
    cycles.close()
    target, proposer, cache = session.target, session.proposer, session.cache
    anchor, position = mx.array(first.tokens, mx.int32), len(session.tokens)
    times, features = [], None
    for _ in range(repeats + 3):
        tic = time.perf_counter()
        if features is not None:  # ingested by the block's forward, as in the loop
            proposer.add_context(features[:, :kept])
        drafts = proposer.propose(anchor, proposer.context_end, block - 1).tokens
        mx.eval(drafts)
        logits, features, record = target.verify(mx.concatenate([anchor, drafts])[None], cache)
        mx.eval(logits, features)
        times.append(time.perf_counter() - tic)
        rollback(cache, record, keep=0)
        for c in proposer.cache:
            c.trim(c.end - position)
    return times[3:]


def overhead_at_8(model, draft, prompts, max_tokens, eos, rounds: int = 3) -> dict:
    """The engine's speed at fixed block 8 against the ideal from separately timed forwards, end to end.

    Per unit (a prompt in a round, measured back to back so the machine's drift hits both alike): the
    engine's reply, its prefill (the engine run to its first token, and the drafter's ingestion of the
    prompt), and as many separately timed cycles of forwards as the reply had, at its middle context
    (the prompt and the first half of the reply: a cycle's cost grows with its context). Ideal =
    prefill + the sum of those cycles (a sum, not a median: the reply pays the machine's hiccups too).
    Ratio of summed times, with a 95% bootstrap interval over the units.
    """
    def engine(p, limit, session=None):
        session = session or make_session(model, draft)
        return timed_cycles(speculative_cycles(session.target, p, session.proposer, max_tokens=limit,
                                               block_size=8, stop_tokens=eos, session=session))  # fmt: skip

    def prefill(p):
        """The engine to its first token, plus the drafter's ingestion of the prompt (the prefill leaves
        it lazy and the reply's first cycle runs it; the timed cycles ingest `kept` rows each)."""
        session = make_session(model, draft)
        tic = time.perf_counter()
        engine(p, 1, session)
        mx.eval(session.proposer.state())  # (the rows ingested, not the last one the first cycle fuses)
        return time.perf_counter() - tic

    units = Units(["measured", "ideal"])
    for p in prompts:
        engine(p, max_tokens)  # warm-up
    for _ in range(rounds):
        for p in prompts:
            tokens, _, c, seconds, _ = engine(p, max_tokens)
            n = len(tokens)
            prefill_seconds = prefill(p)
            middle = mx.concatenate([p, mx.array(tokens[: n // 2], p.dtype)])
            kept = max(1, round((n - 1) / max(c, 1)) - 1)
            ideal = prefill_seconds + sum(forward_times(model, draft, middle, 8, kept=kept, repeats=c))
            units.rows.append({"measured": (n, 0.0, c, seconds, None), "ideal": (n, 0.0, c, ideal, None)})
    tokens = sum(u["measured"][0] - 1 for u in units.rows)
    cycles = sum(u["measured"][2] for u in units.rows)
    return {"tokens_per_cycle": round(tokens / cycles, 3),
            "measured_seconds": round(sum(u["measured"][3] for u in units.rows), 3),
            "ideal_seconds": round(sum(u["ideal"][3] for u in units.rows), 3),
            "ideal_over_measured": units.ratio("measured", "ideal")}  # fmt: skip


def untrained_copy(draft):
    mx.random.seed(7)
    fresh = tree_map(lambda p: mx.random.normal(p.shape, p.dtype) * 0.02 if p.ndim > 1 else p, draft.parameters())
    import copy

    other = copy.deepcopy(draft)
    other.update(fresh)
    mx.eval(other.parameters())
    return other


def loaded_settings(args):
    """(name, model, tokenizer, draft, prompts) of each setting in `args.settings` whose models exist."""
    names = args.settings.split(",")
    unknown = [n for n in names if n not in TITLES]
    if unknown:  # before an hour of measuring the known ones
        raise SystemExit(f"--settings: unknown setting(s) {', '.join(unknown)} (known: {', '.join(TITLES)})")
    demo = dflash_mlx.load("demo")
    for name in names:
        loaded = load_setting(name, demo, args.synthetic, args.num_prompts)
        if loaded is not None:
            yield (name, *loaded)


def load_setting(name: str, demo, synthetic: Path, num_prompts: int):
    """(model, tokenizer, draft, prompts) of a setting (`demo`: the loaded demo pair), or None with a note
    when its models are missing."""
    model, tokenizer, draft = demo
    dataset, raw = "gsm8k", None
    if name == "demo-mtbench":
        dataset = "mt-bench"
    elif name == "untrained":
        draft = untrained_copy(draft)
    elif name == "4bit":
        model = dflash_mlx.load("demo")[0]
        nn.quantize(model, group_size=64, bits=4)
        mx.eval(model.parameters())
    elif name == "synthetic":
        if not (synthetic / "drafter" / "config.json").exists():
            print(f"synthetic: skipped ({synthetic} has no trained pair; run scripts/train_synthetic.py)")
            return None
        model, tokenizer, draft = dflash_mlx.load(synthetic / "target", synthetic / "drafter")
        raw = synthetic / "prompts.jsonl"
    return model, tokenizer, draft, prompts_for(tokenizer, dataset, num_prompts, raw)


TITLES = {"demo-gsm8k": "demo pair, GSM8K", "demo-mtbench": "demo pair, MT-Bench", "untrained": "untrained drafter",
          "4bit": "4-bit target (blocks <= 5)", "synthetic": "synthetic pair"}  # fmt: skip


def markdown_table(report: dict, label: str = "end_to_end") -> str:
    """The README's table of a report: speeds and ratios (95% intervals) of one kind."""

    def r(x):
        return f"{x['ratio']:.2f} [{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}]"

    lines = ["| setting | mlx-lm tok/s | plain path | best fixed (blocks) | adaptive | adaptive / mlx-lm | "
             "adaptive / best fixed | adaptive / better of mlx-lm and best fixed | adaptive / b8 | "
             "engine adaptive / main b8 | engine b8 / main b8 | plain / mlx-lm |",
             "|---|" + "---:|" * 11]  # fmt: skip
    for st in report["settings"]:
        d, title = st[label], TITLES.get(st["setting"], st["setting"])
        blocks = "/".join(f"b{b}" for b in d["best_fixed_blocks"])
        lines.append(f"| {title} | {d['tps']['mlx-lm']:.1f} | {d['tps']['plain']:.1f} "
                     f"| {d['best_fixed_tps']:.1f} ({blocks}) | {d['tps']['adaptive']:.1f} "
                     f"| {r(d['adaptive_vs_mlx_lm'])} | {r(d['adaptive_vs_best_fixed'])} "
                     f"| {r(d['adaptive_vs_better_of_mlx_lm_and_best_fixed'])} | {r(d['adaptive_vs_b8'])} "
                     f"| {r(d['engine_adaptive_vs_main_b8'])} | {r(d['engine_b8_vs_main_b8'])} "
                     f"| {r(d['plain_vs_mlx_lm'])} |")  # fmt: skip
    return "\n".join(lines)


def bench_arguments(description: str, settings: str, rounds: int) -> argparse.ArgumentParser:
    """The flags this benchmark shares with scripts/bench_plain.py."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--settings", default=settings)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--synthetic", type=Path, default=Path("/tmp/dflash-synthetic"),
                    help="A scripts/train_synthetic.py work directory (target/, drafter/, prompts.jsonl).")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--table", type=Path, metavar="REPORT", help="Print the tables of a saved report and stop.")
    return ap


def main() -> None:
    args = bench_arguments(__doc__.splitlines()[0], "demo-gsm8k,demo-mtbench,untrained,4bit,synthetic", 1).parse_args()
    if args.table:
        report = json.loads(args.table.read_text())
        print(markdown_table(report), "", markdown_table(report, "decode"), sep="\n")
        return
    report = {"calibration": {}, "settings": []}
    for name, model, tokenizer, draft, prompts in loaded_settings(args):
        largest = default_block_size(model, draft)
        session = make_session(model, draft)
        tic = time.perf_counter()
        curve = cost_curve(session.target, session.proposer, largest, force=True)
        report["calibration"][name] = {"seconds": round(time.perf_counter() - tic, 3), "grid": curve.grid,
                                       "ms": [round(1000 * t, 3) for t in curve.seconds]}  # fmt: skip
        result = run_setting(name, model, tokenizer, draft, prompts, args.max_tokens, largest, args.rounds)
        if name in ("synthetic", "demo-gsm8k"):  # the trained pairs
            result["overhead_b8"] = overhead_at_8(model, draft, prompts, args.max_tokens, tokenizer.eos_token_ids)
        report["settings"].append(result)
        print(json.dumps(result), flush=True)
    print(json.dumps(report["calibration"]))
    print(markdown_table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
