"""Benchmark the adaptive block size against plain decoding and every fixed block, in one process.

Settings (each skipped with a note when its models are missing):
  demo-gsm8k      the bundled pair on GSM8K prompts (in distribution)
  demo-mtbench    the bundled pair on MT-Bench first turns (off distribution)
  untrained       the bundled target with a randomly initialised drafter of the same shape
  4bit            the bundled target quantized to 4 bits (group 64), the bundled drafter
  synthetic       a pair trained by scripts/train_synthetic.py (--synthetic DIR)

Legs, alternated prompt by prompt (every leg runs prompt i before any runs
prompt i + 1), after one warm-up of each: mlx-lm's `stream_generate` (the
baseline), dflash-mlx with no drafter (the plain path), DFlash adaptive, DFlash
at each fixed block in {2, 3, 4, 5, 6, 8}; and at the engine level (cycles, no
detokenizing) the adaptive policy, fixed block 8, and fixed block 8 through the
engine of the main branch before adaptive blocks (commit 798f512, read with
git, executed against today's package). Decode speed = tokens after each reply's
first over the time after it, summed over prompts; end-to-end speed = all of
a reply's tokens over the time from the call (prefill included), summed over
prompts. The two differ where a step's `mx.async_eval` blocks (MLX on a CPU
waits for most of a large graph before returning): the first cycle after the
prefill is then computed before the first token is handed out, outside the
decode window, which flatters large blocks on short replies. Greedy; every
DFlash leg's tokens are checked against the baseline's.

For the synthetic pair it also reports the per-cycle overhead at block 8:
measured tok/s over the ideal E / (T_draft + T_verify), with E the leg's
tokens per cycle and T the separately timed drafter and target forwards
(median of 30, after the same prompt's prefill).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/bench_adaptive.py --synthetic /tmp/dflash-synthetic --out report.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
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


def old_engine():
    """The main branch's engine module before adaptive blocks, bound to today's package."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{MAIN_COMMIT}:dflash_mlx/engine.py"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    module = types.ModuleType("dflash_mlx._engine_main", "the main branch's engine (benchmark only)")
    module.__package__ = "dflash_mlx"
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{MAIN_COMMIT}:engine.py", "exec"), module.__dict__)
    return module.speculative_cycles


def prompts_for(tokenizer, dataset: str, n: int, raw_file: Path | None = None) -> list[mx.array]:
    if raw_file is not None:
        texts = [json.loads(line)["prompt"] for line in raw_file.read_text().splitlines()[:n]]
    else:
        texts = [c[0] for c in sample(dataset, n)]
        if template_source(tokenizer) is not None:
            texts = [render(tokenizer, [{"role": "user", "content": t}], {}) for t in texts]
    return [encode_prompt(tokenizer, t) for t in texts]


def timed(responses) -> tuple[list[int], float, int, float]:
    """(tokens, decode seconds, cycles, seconds from the call) of one reply (a lazy generator)."""
    tokens, first, cycles, start = [], None, 0, time.perf_counter()
    for r in responses:
        if first is None:
            first = time.perf_counter()
        tokens.append(r.token)
        cycles += getattr(r, "cycle_tokens", None) is not None
    end = time.perf_counter()
    return tokens, end - first, cycles, end - start


def timed_cycles(cycles) -> tuple[list[int], float, int, float]:
    tokens, first, n, start = [], None, 0, time.perf_counter()
    for c in cycles:
        if first is None:
            first = time.perf_counter()
        else:
            n += 1
        tokens += c.tokens
    end = time.perf_counter()
    return tokens, end - first, n, end - start


def make_legs(model, tokenizer, draft, max_tokens, largest):
    eos = tokenizer.eos_token_ids
    main_cycles = old_engine()

    def engine(fn, block):
        def leg(prompt):
            session = make_session(model, draft)
            b = block() if callable(block) else block
            return timed_cycles(fn(session.target, prompt, session.proposer, max_tokens=max_tokens, block_size=b,
                                   stop_tokens=eos, session=session))  # fmt: skip
        return leg

    def policy():
        session = make_session(model, draft)
        return adaptive_policy(session.target, session.proposer, largest, carry=True)  # as stream_generate greedy

    legs = {
        "mlx-lm": lambda p: timed(mlx_lm_stream_generate(model, tokenizer, p, max_tokens=max_tokens)),
        "plain": lambda p: timed(stream_generate(model, None, tokenizer, p, max_tokens=max_tokens)),
        "adaptive": lambda p: timed(stream_generate(model, draft, tokenizer, p, max_tokens=max_tokens,
                                                    max_block_size=largest)),  # fmt: skip
    }
    for b in FIXED:
        legs[f"b{b}"] = lambda p, b=b: timed(stream_generate(model, draft, tokenizer, p, max_tokens=max_tokens,
                                                             block_size=b))  # fmt: skip
    legs["engine adaptive"] = engine(speculative_cycles, policy)
    legs["engine b8"] = engine(speculative_cycles, 8)
    legs[f"engine b8 main@{MAIN_COMMIT}"] = engine(main_cycles, 8)
    return legs


def adaptive_ratios(tps: dict, best_fixed: int) -> dict:
    """The adaptive leg against mlx-lm, the best fixed block and the better of the two."""
    best = tps[f"b{best_fixed}"]
    return {"adaptive_vs_mlx_lm": round(tps["adaptive"] / tps["mlx-lm"], 3),
            "adaptive_vs_best_fixed": round(tps["adaptive"] / best, 3),
            "adaptive_vs_better_of_plain_and_best_fixed": round(tps["adaptive"] / max(tps["mlx-lm"], best), 3)}


def run_setting(name, model, tokenizer, draft, prompts, max_tokens, largest, rounds):
    legs = make_legs(model, tokenizer, draft, max_tokens, largest)
    for leg in legs.values():
        leg(prompts[0][:8] if prompts[0].size > 8 else prompts[0])  # warm-up
    totals = {k: [0, 0.0, 0, 0.0] for k in legs}  # decode tokens, decode seconds, cycles, seconds from the call
    baseline, mismatches = {}, set()
    for _ in range(rounds):
        for i, p in enumerate(prompts):
            for k, leg in legs.items():
                tokens, seconds, cycles, whole = leg(p)
                totals[k][0] += len(tokens) - 1
                totals[k][1] += seconds
                totals[k][2] += cycles
                totals[k][3] += whole
                if k == "mlx-lm":
                    baseline[i] = tokens
                elif tokens != baseline[i]:
                    mismatches.add(k)
    tps = {k: n / s for k, (n, s, _, _) in totals.items()}
    best_fixed = max(FIXED, key=lambda b: tps[f"b{b}"])
    whole = {k: (n + rounds * len(prompts)) / w for k, (n, _, _, w) in totals.items()}  # every token, from the call
    best_whole = max(FIXED, key=lambda b: whole[f"b{b}"])
    out = {
        "setting": name, "prompts": len(prompts), "rounds": rounds, "max_tokens": max_tokens, "max_block": largest,
        "tps": {k: round(v, 2) for k, v in tps.items()},
        "tokens_per_cycle": {k: round(n / c, 3) for k, (n, _, c, _) in totals.items() if c},
        "best_fixed": best_fixed,
        **adaptive_ratios(tps, best_fixed),
        "plain_vs_mlx_lm": round(tps["plain"] / tps["mlx-lm"], 3),
        "engine_adaptive_vs_main_b8": round(tps["engine adaptive"] / tps[f"engine b8 main@{MAIN_COMMIT}"], 3),
        "engine_b8_vs_main_b8": round(tps["engine b8"] / tps[f"engine b8 main@{MAIN_COMMIT}"], 3),
        "end_to_end_tps": {k: round(v, 2) for k, v in whole.items()},
        "end_to_end_best_fixed": best_whole,
        **{f"end_to_end_{k}": v for k, v in adaptive_ratios(whole, best_whole).items()},
        "greedy_mismatches": sorted(mismatches),
    }
    return out


def forward_times(model, draft, prompt, block: int, kept: int, repeats: int = 30) -> tuple[float, float]:
    """Median seconds of the drafter's work in a cycle (ingesting `kept` context rows, drafting block - 1
    tokens) and of one target verify of `block` rows, each evaluated on its own."""
    session = make_session(model, draft)
    cycles = speculative_cycles(session.target, prompt, session.proposer, max_tokens=-1, block_size=1,
                                session=session)  # fmt: skip
    first = next(cycles)
    cycles.close()
    target, proposer, cache = session.target, session.proposer, session.cache
    anchor, position = mx.array(first.tokens, mx.int32), len(session.tokens)
    drafts_t, verify_t = [], []
    features = None
    for _ in range(repeats + 3):
        tic = time.perf_counter()
        if features is not None:
            proposer.add_context(features[:, :kept])
            mx.eval(proposer.state())
            context = time.perf_counter() - tic
            for c in proposer.cache:
                c.trim(kept)
        tic = time.perf_counter()
        drafts = proposer.propose(anchor, position, block - 1).tokens
        mx.eval(drafts)
        mid = time.perf_counter()
        logits, features, record = target.verify(mx.concatenate([anchor, drafts])[None], cache)
        mx.eval(logits, features)
        done = time.perf_counter()
        rollback(cache, record, keep=0)
        drafts_t.append(mid - tic + (context if len(verify_t) else 0.0))
        verify_t.append(done - mid)
    return statistics.median(drafts_t[3:]), statistics.median(verify_t[3:])


def overhead_at_8(model, tokenizer, draft, prompts, max_tokens) -> dict:
    n = s = c = 0
    for p in prompts:
        tokens, seconds, cycles, _ = timed(stream_generate(model, draft, tokenizer, p, max_tokens=max_tokens,
                                                           block_size=8))  # fmt: skip
        n, s, c = n + len(tokens) - 1, s + seconds, c + cycles
    t_draft, t_verify = forward_times(model, draft, prompts[0], 8, kept=max(1, round(n / c) - 1))
    ideal = (n / c) / (t_draft + t_verify)
    return {"tokens_per_cycle": round(n / c, 3), "tps": round(n / s, 2), "t_draft_ms": round(1000 * t_draft, 3),
            "t_verify_ms": round(1000 * t_verify, 3), "ideal_tps": round(ideal, 2),
            "measured_over_ideal": round((n / s) / ideal, 3)}  # fmt: skip


def untrained_copy(draft):
    mx.random.seed(7)
    fresh = tree_map(lambda p: mx.random.normal(p.shape, p.dtype) * 0.02 if p.ndim > 1 else p, draft.parameters())
    import copy

    other = copy.deepcopy(draft)
    other.update(fresh)
    mx.eval(other.parameters())
    return other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="demo-gsm8k,demo-mtbench,untrained,4bit,synthetic")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--synthetic", type=Path, default=Path("/tmp/dflash-synthetic"),
                    help="A scripts/train_synthetic.py work directory (target/, drafter/, prompts.jsonl).")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    wanted = args.settings.split(",")
    report = {"calibration": {}, "settings": []}
    demo = dflash_mlx.load("demo")
    for name in wanted:
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
            if not (args.synthetic / "drafter" / "config.json").exists():
                print(f"synthetic: skipped ({args.synthetic} has no trained pair; run scripts/train_synthetic.py)")
                continue
            model, tokenizer, draft = dflash_mlx.load(args.synthetic / "target", args.synthetic / "drafter")
            raw = args.synthetic / "prompts.jsonl"
        largest = default_block_size(model, draft)
        session = make_session(model, draft)
        tic = time.perf_counter()
        curve = cost_curve(session.target, session.proposer, largest, force=True)
        report["calibration"][name] = {"seconds": round(time.perf_counter() - tic, 3), "grid": curve.grid,
                                       "ms": [round(1000 * t, 3) for t in curve.seconds]}  # fmt: skip
        prompts = prompts_for(tokenizer, dataset, args.num_prompts, raw)
        result = run_setting(name, model, tokenizer, draft, prompts, args.max_tokens, largest, args.rounds)
        if name == "synthetic":
            result["overhead_b8"] = overhead_at_8(model, tokenizer, draft, prompts, args.max_tokens)
        report["settings"].append(result)
        print(json.dumps(result), flush=True)
    print(json.dumps(report["calibration"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
