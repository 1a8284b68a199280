"""The maintainers' benchmarks, one entry point: ``python3 scripts/bench.py LEG [options]``.

  engine   the loop's own overhead: a random float32 qwen3 target (246M parameters), an oracle
           proposer the target accepts at a fixed rate, against the ideal tau x T(1) / T(b) from
           separately timed target forwards, and the plain path against mlx-lm's generate_step;
           every leg once per round, medians over the rounds
  legs     mlx-lm's `stream_generate` against dflash-mlx legs (`plain`: no drafter, `adaptive`:
           the default, `b2` ... `b16`: a fixed block), alternated in a new random order for every
           prompt of every round, ratios with 95% bootstrap intervals over the units, after a fresh
           calibration of each setting; with several fixed blocks, the best one cross-fitted (each
           half of the units measured at the block fastest on the other half); settings below
  serving  `dflash-mlx serve` (batched; one at a time too with --serial) against `mlx_lm.server`
           on a float32 copy of the bundled target, driven by `dflash-mlx bench --backend openai`
  agent    an agent-style conversation (a long system prompt, four turns) through both servers,
           each with its prompt cache and without: time to first token and latency per turn
  repeat   a repeated agent step (the suffix index): 8 GSM8K questions in fresh conversations, then the same under
           another system prompt, streamed to the default `dflash-mlx serve` (batched); the second pass's decode
           speed on a server that served the first against a fresh server, started afresh and alternated every
           round, the text compared
  norepeat nothing to repeat (distinct GSM8K questions, MT-Bench first turns): the default server against one with
           `--suffix-cache-tokens 0`, started afresh and alternated every round, the text compared
  batch    `dflash_mlx.batch_generate` against mlx-lm's `batch_generate` at several batch widths
  sharded  the same job in one process and as 2 ring ranks on this machine (`mlx.launch`)
  load     the adaptive block as the machine's load changes: the curve cached while CPU-bound processes ran,
           then `dflash-mlx bench` quiet (against the fixed block and mlx-lm); and a quiet curve, then load
           during a run of generations, then quiet again, per window of prompts (mlx-lm, plain, the default,
           the largest block); `--scenario loaded-run`: a quiet calibration, then load through a whole run
           (mlx-lm, plain, the default; --runs processes, the median); `--scenario timing`: the cycle cost
           the engine reports against the wall time between cycles and a calibration
  ab       today's code against a new checkout's on the dflash-mlx side of `batch` (each width) or `serving`
           (batched, and one at a time with --serial; each concurrency): `--base DIR` a checkout of today's
           code, `--new DIR` (default: this script's checkout); each round runs both, in separate processes
           (PYTHONPATH the checkout, a calibration cache of its own, filled by a warm-up round not counted), in
           an order alternated over pairs of rounds; per configuration new / base per round, their geometric
           mean and a 95% t-interval; rounds added (--min-rounds .. --max-rounds) until every interval is
           within --half-width; the mlx-lm sides are not run

`legs --response-format F` (json_object, or a JSON Schema / OpenAI response_format, inline or in a file)
runs every leg under that grammar: mlx-lm with `dflash_mlx.structured.GrammarLogitsProcessor`, dflash-mlx
with `response_format=` (the same compiled grammar), each prompt asking for a JSON answer.

`legs` settings (`--settings`, comma-separated): demo-gsm8k and demo-mtbench (the bundled pair on
chat-templated GSM8K / MT-Bench first turns: in and off distribution), untrained (the bundled target
with a random drafter of the same shape), 4bit (the bundled target quantized to 4 bits, group 64),
long (the bundled pair on multi-turn GSM8K conversations of at least 1,600 tokens), synthetic (a pair
`scripts/train_synthetic.py` trained, in --synthetic DIR, on its own prompts). --temperature T > 0
samples (seeded per unit, mlx-lm drawing each position with dflash-mlx's key for it; `--unseeded`: no seed,
as a user's call without one); greedy and seeded runs count every leg's replies that differ from mlx-lm's.

It runs as the `dflash-mlx` command does: on Linux it re-executes itself with the system OpenBLAS
preloaded, on one thread (`dflash_mlx.cli.openblas`; an OPENBLAS_NUM_THREADS already set is kept, e.g.
OPENBLAS_NUM_THREADS=2 for the tables measured on two).
docs/benchmarks.md has each table this prints, with the command that produced it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx

TITLES = {
    "demo-gsm8k": "demo pair, GSM8K",
    "demo-mtbench": "demo pair, MT-Bench",
    "untrained": "untrained drafter",
    "4bit": "4-bit target (blocks <= 5)",
    "long": "demo pair, 1.6k-token prompts",
    "synthetic": "synthetic pair",
}
LONG_PROMPT_TOKENS = 1600
JSON_ASK = "\nAnswer with a JSON object: your reasoning, then the final answer as a number."


# ------------------------------------------------------------------------------------------- engine


def engine(args) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step
    from mlx_lm.models import qwen3

    from dflash_mlx.draft.config import parse_draft_config
    from dflash_mlx.draft.model import DFlashDraftModel
    from dflash_mlx.engine import speculative_cycles
    from dflash_mlx.proposers.oracle import OracleProposer
    from dflash_mlx.targets.adapter import TargetAdapter
    from dflash_mlx.targets.rollback import rollback

    mx.random.seed(0)
    h = args.hidden
    config = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=h,
        num_hidden_layers=args.layers,
        intermediate_size=h * 11 // 4,
        num_attention_heads=h // 64,
        rms_norm_eps=1e-6,
        vocab_size=args.vocab,
        num_key_value_heads=max(1, h // 256),
        max_position_embeddings=8192,
        head_dim=64,
        tie_word_embeddings=False,
        rope_theta=1e6,
    )
    model = qwen3.Model(config)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, args.vocab, (args.prompt_len,), key=mx.random.key(1)).astype(mx.int32)

    def decode_tps(steps):
        """(tokens, tok/s after the first token, cycle sizes) of a generator of tokens or cycles."""
        tokens, sizes, tic = [], [], None
        for step in steps:
            if tic is None:
                tic = time.perf_counter()  # the prefill excluded
            elif hasattr(step, "tokens"):
                sizes.append(len(step.tokens))
            tokens += step.tokens if hasattr(step, "tokens") else [step[0]]
        return tokens, (len(tokens) - 1) / (time.perf_counter() - tic), sizes

    def cycles(proposer, block):
        return speculative_cycles(
            TargetAdapter(model, ()), prompt, proposer, max_tokens=args.max_tokens, block_size=block
        )

    def forward_seconds(rows, context):
        """The median seconds of a target forward of `rows` rows after `context` cached positions."""
        target = TargetAdapter(model, ())
        cache = target.make_cache()
        mx.eval(target.forward(mx.tile(prompt, context // prompt.size + 1)[None, :context], cache)[0])
        times = []
        for _ in range(args.repeats):
            tic = time.perf_counter()
            logits, _, record = target.verify(mx.zeros((1, rows), mx.int32), cache)
            mx.eval(logits)
            times.append(time.perf_counter() - tic)
            rollback(cache, record, keep=0)
        return statistics.median(times)

    decode_tps(generate_step(prompt, model, max_tokens=8))  # warm-up
    context = args.prompt_len + args.max_tokens // 2
    rounds = []  # each round times every leg back to back, so a busy moment of the machine hits one round
    for _ in range(args.rounds):
        reference, plain_tps, _ = decode_tps(generate_step(prompt, model, max_tokens=args.max_tokens))
        ours, ours_plain_tps, _ = decode_tps(cycles(None, 1))
        oracle = OracleProposer(reference, [args.accept], args.vocab, args.block_size)
        drafted, dflash_tps, sizes = decode_tps(cycles(oracle, args.block_size))
        assert ours == reference and drafted == reference, "the engine's output differs from mlx-lm's greedy"
        t1, tb = forward_seconds(1, context), forward_seconds(args.block_size, context)
        tau = sum(sizes) / len(sizes)
        rounds.append(
            {
                "mlx_lm_tps": plain_tps,
                "plain_path_tps": ours_plain_tps,
                "dflash_oracle_tps": dflash_tps,
                "t_forward_1_ms": t1 * 1e3,
                "t_forward_b_ms": tb * 1e3,
                "speedup": dflash_tps / plain_tps,
                "ideal": tau * t1 / tb,
                "ratio": dflash_tps / plain_tps / (tau * t1 / tb),
            }
        )
    result = {
        "params_millions": round(sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6, 1),
        "block_size": args.block_size,
        "tau": round(tau, 3),
        "rounds": args.rounds,
        **{k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]},
        "ratio_per_round": [round(r["ratio"], 3) for r in rounds],
    }  # medians over the rounds
    t1, tb = result["t_forward_1_ms"] / 1e3, result["t_forward_b_ms"] / 1e3
    if args.draft_layers:  # a random drafter of the target's width: the ideal with a real drafter's forward
        layer_ids = [1 + i * (args.layers - 4) // max(args.draft_layers - 1, 1) for i in range(args.draft_layers)]
        draft = DFlashDraftModel(
            parse_draft_config(
                dict(
                    hidden_size=h,
                    num_hidden_layers=args.draft_layers,
                    num_attention_heads=config.num_attention_heads,
                    num_key_value_heads=config.num_key_value_heads,
                    head_dim=64,
                    intermediate_size=config.intermediate_size,
                    vocab_size=args.vocab,
                    rms_norm_eps=1e-6,
                    max_position_embeddings=8192,
                    rope_theta=1e6,
                    dflash_config=dict(mask_token_id=0, target_layer_ids=layer_ids, block_size=args.block_size),
                )
            )
        )
        mx.eval(draft.parameters())
        draft_cache, width = draft.make_cache(), args.draft_layers * h
        draft.extend_context(mx.zeros((1, context, width)), draft_cache)
        target = TargetAdapter(model, tuple(layer_ids))

        times = []
        for _ in range(args.repeats):  # a cycle's context rows ingested, then the block drafted
            features = mx.random.normal((1, round(tau), width))
            mx.eval(features)
            tic = time.perf_counter()
            draft.extend_context(features, draft_cache)
            mx.eval(mx.argmax(draft(mx.zeros((1, args.block_size), mx.int32), draft_cache, target), axis=-1))
            times.append(time.perf_counter() - tic)
        td = statistics.median(times)
        result |= {"t_draft_ms": round(td * 1e3, 2), "ideal_with_drafter": round(tau * t1 / (td + tb), 3)}
    print(json.dumps(result) if args.json else "\n".join(f"{k:>20}: {v}" for k, v in result.items()))


# --------------------------------------------------------------------------------------------- legs


def chat_prompts(tokenizer, conversations, raw: bool = False) -> list[mx.array]:
    """Prompts as token arrays: each a user message (a string) or a list of messages, chat-templated where
    the tokenizer has a template; `raw`: strings encoded as they are."""
    from dflash_mlx.models.chat_template import render, template_source
    from dflash_mlx.generation import encode_prompt

    if raw or template_source(tokenizer) is None:
        return [
            encode_prompt(tokenizer, c if isinstance(c, str) else "\n\n".join(m["content"] for m in c))
            for c in conversations
        ]
    return [
        encode_prompt(tokenizer, render(tokenizer, [{"role": "user", "content": c}] if isinstance(c, str) else c, {}))
        for c in conversations
    ]


def synthetic_prompts(directory: Path, n: int) -> list[str]:
    """The first `n` prompts of a scripts/train_synthetic.py work directory (raw text)."""
    return [json.loads(line)["prompt"] for line in (directory / "prompts.jsonl").read_text().splitlines()[:n]]


def response_format(value: str | None):
    """--response-format: None, json_object, or a JSON Schema / OpenAI response_format (inline or a file)."""
    if value is None:
        return None
    if value == "json_object":
        return {"type": "json_object"}
    parsed = json.loads(value if value.lstrip().startswith("{") else Path(value).read_text())
    if parsed.get("type") in ("json_schema", "json_object", "text"):
        return parsed
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": parsed, "strict": True}}


def load_setting(name: str, demo, args):
    """(model, tokenizer, draft, prompts) of a setting (`demo`: the loaded demo pair), or None with a note."""
    import mlx.nn as nn
    from mlx.utils import tree_map

    import dflash_mlx
    from dflash_mlx.datasets import long_gsm8k_conversations, sample

    model, tokenizer, draft = demo
    n = args.num_prompts
    if name == "synthetic":
        if not (args.synthetic / "drafter" / "config.json").exists():
            print(f"synthetic: skipped ({args.synthetic} has no trained pair: run scripts/train_synthetic.py)")
            return None
        model, tokenizer, draft = dflash_mlx.load(args.synthetic / "target", args.synthetic / "drafter")
        return model, tokenizer, draft, chat_prompts(tokenizer, synthetic_prompts(args.synthetic, n), raw=True)
    if name == "untrained":
        mx.random.seed(7)
        draft = copy.deepcopy(draft)
        draft.update(
            tree_map(lambda p: mx.random.normal(p.shape, p.dtype) * 0.02 if p.ndim > 1 else p, draft.parameters())
        )
        mx.eval(draft.parameters())
    if name == "4bit":
        model = dflash_mlx.load("demo")[0]
        nn.quantize(model, group_size=64, bits=4)
        mx.eval(model.parameters())
    if name == "long":
        conversations = long_gsm8k_conversations(tokenizer, LONG_PROMPT_TOKENS, n)
        return model, tokenizer, draft, chat_prompts(tokenizer, conversations)
    dataset = "mt-bench" if name == "demo-mtbench" else "gsm8k"
    ask = JSON_ASK if args.response_format else ""
    return model, tokenizer, draft, chat_prompts(tokenizer, [c[0] + ask for c in sample(dataset, n)])


def timed(responses) -> tuple:
    """(tokens, decode seconds, cycles, seconds from the call, cycles per block) of one reply (a lazy
    generator: the clock starts when the call starts)."""
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


def parses_as_json(tokenizer, tokens: list[int]) -> bool:
    try:
        json.loads(tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids]))
        return True
    except ValueError:
        return False


def make_legs(
    model,
    tokenizer,
    draft,
    names: list[str],
    max_tokens: int,
    temperature: float,
    response_format=None,
    seeded: bool = True,
) -> dict:
    """mlx-lm's leg and the named dflash-mlx legs, each `leg(prompt, seed)` -> `timed(...)`; `seeded`: the
    seed is passed, and mlx-lm's sampler draws each position with the key a seeded dflash-mlx call draws it
    with (`keyed_sampler`), so every leg's text is the seed's (replies of one length: their end-to-end
    speeds weigh the prefill alike); else every leg runs unseeded."""
    from mlx_lm import stream_generate as mlx_lm_stream_generate
    from mlx_lm.sample_utils import make_sampler

    from dflash_mlx.generation import stream_generate
    from dflash_mlx.structured import Grammar, GrammarLogitsProcessor

    grammar = Grammar.of(tokenizer, response_format)  # compiled once: each call follows it afresh

    def mlx_lm_leg(prompt, seed):
        sampler = make_sampler(temperature)
        if seeded and temperature > 0:
            sampler = keyed_sampler(temperature, seed, prompt.size, max_tokens)
        processors = [GrammarLogitsProcessor(tokenizer, grammar)] if grammar else None
        return timed(
            mlx_lm_stream_generate(
                model,
                tokenizer,
                prompt,
                max_tokens=max_tokens,
                sampler=sampler,
                logits_processors=processors,
            )
        )

    def ours(drafter, block):
        return lambda prompt, seed: timed(
            stream_generate(
                model,
                drafter,
                tokenizer,
                prompt,
                max_tokens=max_tokens,
                block_size=block,
                temperature=temperature,
                seed=seed if seeded else None,
                response_format=grammar,
            )
        )

    legs = {"mlx-lm": mlx_lm_leg}
    for name in names:
        if name == "plain":
            legs[name] = ours(None, None)
        elif name == "adaptive":
            legs[name] = ours(draft, None)
        elif name[:1] == "b" and name[1:].isdigit() and int(name[1:]) >= 1:
            legs[name] = ours(draft, int(name[1:]))
        else:
            raise SystemExit(f"--legs: unknown leg {name!r} (plain, adaptive, b1, b2, ...)")
    return legs


@mx.compile
def _keyed_draw(logprobs: mx.array, scale: mx.array, key: mx.array) -> mx.array:
    from dflash_mlx.sampling import draw_keyed

    return draw_keyed(logprobs * scale, key)


def keyed_sampler(temperature: float, seed: int, prompt_length: int, max_tokens: int):
    """An mlx-lm sampler at `temperature` (mlx-lm's `categorical(logprobs * (1 / T))`: a Gumbel-max, compiled
    once) that draws the token at each position with the noise a seeded dflash-mlx call draws it with
    (`sampling.position_keys`, `draw_keyed`)."""
    from dflash_mlx.sampling import position_keys

    # (mlx-lm's loop draws one step past its last token, queued before it stops)
    keys, drawn = position_keys(seed, prompt_length, max_tokens + 1), iter(range(max_tokens + 1))
    scale = mx.array(1.0 / temperature)
    return lambda logprobs: _keyed_draw(logprobs, scale, keys[next(drawn)])


class Units:
    """Per-unit measurements (one prompt in one round, every leg on it) and ratios of summed speeds, with
    95% bootstrap intervals over the units."""

    def __init__(self, fixed: list[str]):
        self.rows: list[dict] = []  # {leg: (tokens, decode seconds, cycles, seconds from the call)}
        self.fixed = fixed  # the fixed-block legs "best fixed" picks from

    def speed(self, leg: str, units=None, end_to_end: bool = True) -> float:
        units = self.rows if units is None else units
        if leg == "best fixed":
            return self.best_fixed(units, end_to_end)[0]
        if end_to_end:  # every token over the time from the call
            return sum(u[leg][0] for u in units) / sum(u[leg][3] for u in units)
        return sum(u[leg][0] - 1 for u in units) / sum(u[leg][1] for u in units)  # after the first token

    def best_fixed(self, units, end_to_end: bool = True) -> tuple[float, list[str]]:
        """The best fixed block's speed, cross-fitted: each half of the units (alternate units) is measured
        at the block that was fastest on the other half, so the noise that makes one of several blocks look
        fastest does not also inflate the speed it is compared at; and the blocks picked."""
        halves = [units[0::2], units[1::2]]
        if not halves[1]:
            leg = max(self.fixed, key=lambda b: self.speed(b, units, end_to_end))
            return self.speed(leg, units, end_to_end), [leg]
        picks = [max(self.fixed, key=lambda b: self.speed(b, other, end_to_end)) for other in halves[::-1]]
        i = 3 if end_to_end else 1
        tokens = sum(u[b][0] - (not end_to_end) for half, b in zip(halves, picks) for u in half)
        return tokens / sum(u[b][i] for half, b in zip(halves, picks) for u in half), picks

    def ratio(self, leg: str, other: str, end_to_end: bool = True, resamples: int = 2000) -> dict:
        """`leg`'s speed over `other`'s. The bootstrap draws units within each cross-fitting half, so a
        cross-fitted block is still measured on units it was not picked on."""

        def value(units):
            return self.speed(leg, units, end_to_end) / self.speed(other, units, end_to_end)

        rng, n, halves = random.Random(0), len(self.rows), (self.rows[0::2], self.rows[1::2])
        boots = []
        for _ in range(resamples):
            drawn: list = [None] * n
            for start, half in enumerate(halves):
                drawn[start::2] = [half[rng.randrange(len(half))] for _ in half]
            boots.append(value(drawn))
        boots.sort()
        return {
            "ratio": round(value(self.rows), 3),
            "ci95": [round(boots[int(0.025 * resamples)], 3), round(boots[int(0.975 * resamples)], 3)],
        }


def run_setting(name, model, tokenizer, draft, prompts, args) -> dict:
    from dflash_mlx.models.block_size import default_block_size
    from dflash_mlx.policy.calibration import cost_model
    from dflash_mlx.session import make_session

    session = make_session(model, draft)  # calibrated afresh: a curve cached at another time does not decide
    tic = time.perf_counter()
    cost = cost_model(
        session.target, session.proposer, default_block_size(model, draft), sampled=args.temperature > 0, force=True
    )
    calibration = {
        "seconds": round(time.perf_counter() - tic, 3),
        "grid": list(cost.table.blocks),
        "ms": [round(1000 * t, 3) for t in cost.table.line()],
        "instability": cost.notes.get("instability"),
    }
    compared = args.legs.split(",")
    legs = make_legs(
        model,
        tokenizer,
        draft,
        compared,
        args.max_tokens,
        args.temperature,
        args.response_format,
        seeded=not args.unseeded,
    )
    for leg in legs.values():  # two warm-ups of each leg
        leg(prompts[0], 0)
        leg(prompts[-1], 0)
    units = Units([k for k in compared if k[1:].isdigit()])
    mismatches, blocks, parsed = Counter(), {k: Counter() for k in compared}, Counter()
    order, shuffle = list(legs), random.Random(1).shuffle
    same_text = args.temperature == 0 or not args.unseeded  # greedy, or seeded: every leg draws the seed's text
    for r in range(args.rounds):
        for i, p in enumerate(prompts):
            shuffle(order)  # every leg runs prompt i before any runs prompt i + 1, in a new order each time
            unit = {k: legs[k](p, r * len(prompts) + i) for k in order}
            for k in compared:
                mismatches[k] += same_text and unit[k][0] != unit["mlx-lm"][0]
                blocks[k].update(unit[k][4])
            for k in unit if args.response_format else ():
                parsed[k] += parses_as_json(tokenizer, unit[k][0])
            units.rows.append({k: (len(v[0]), *v[1:4]) for k, v in unit.items()})
    speeds = {k: round(units.speed(k), 2) for k in legs}
    lead = "adaptive" if "adaptive" in compared else compared[0]  # each pair: the lead leg over another
    pairs = [(lead, k) for k in compared if k != lead]
    if len(units.fixed) > 1:
        speeds["best fixed"] = round(units.speed("best fixed"), 2)
        pairs.append((lead, "best fixed"))

    def first_token_ms(leg: str) -> float:  # time to the first token: from the call minus the decode window
        return round(
            1000 * statistics.median((u[leg][3] - u[leg][1]) - (u["mlx-lm"][3] - u["mlx-lm"][1]) for u in units.rows), 3
        )

    return {
        "setting": name,
        "prompts": len(prompts),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seeded": args.temperature > 0 and not args.unseeded,
        "response_format": args.response_format,
        "calibration": calibration,
        "tps": speeds,
        "best_fixed_blocks": units.best_fixed(units.rows)[1] if len(units.fixed) > 1 else None,
        "legs": {
            k: {
                "vs_mlx_lm": units.ratio(k, "mlx-lm"),
                "vs_mlx_lm_decode": units.ratio(k, "mlx-lm", end_to_end=False),
                "first_token_ms_paired_median": first_token_ms(k),
                "mismatches": mismatches[k] if same_text else None,
                "blocks": {str(b): n for b, n in sorted(blocks[k].items())},
            }
            for k in compared
        },
        "replies_parsing_as_json": dict(parsed) if args.response_format else None,
        "pairs": {f"{a} / {b}": units.ratio(a, b) for a, b in pairs},
    }


def legs_table(report: dict) -> str:
    def r(x):
        return f"{x['ratio']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]"

    lines = [
        "| setting | leg | units | mlx-lm tok/s | leg tok/s | leg / mlx-lm | decode window | first token, ms "
        "| blocks | mismatches |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for st in report["settings"]:
        title = TITLES.get(st["setting"], st["setting"]) + (f", T = {st['temperature']:g}" if st["temperature"] else "")
        title += ", unseeded" if st["temperature"] and st.get("seeded") is False else ""
        title += ", JSON schema" if st.get("response_format") else ""
        for leg, x in st["legs"].items():
            blocks = " ".join(f"{b}:{n}" for b, n in x["blocks"].items())
            lines.append(
                f"| {title} | {leg} | {st['prompts'] * st['rounds']} | {st['tps']['mlx-lm']:.1f} "
                f"| {st['tps'][leg]:.1f} | {r(x['vs_mlx_lm'])} | {r(x['vs_mlx_lm_decode'])} "
                f"| {x['first_token_ms_paired_median']:+.2f} | {blocks} "
                f"| {'-' if x['mismatches'] is None else x['mismatches']} |"
            )
    lines += ["", "| setting | calibrated T(b) / T(1) at b = | took |", "|---|---|---:|"]
    for st in report["settings"]:
        cal = st["calibration"]
        ratios = ", ".join(f"{b}: {t / cal['ms'][0]:.2f}" for b, t in zip(cal["grid"][1:], cal["ms"][1:]))
        lines.append(f"| {TITLES.get(st['setting'], st['setting'])} | {ratios} | {cal['seconds']:.2f} s |")
    pairs = [(st, pair, x) for st in report["settings"] for pair, x in st["pairs"].items()]
    if pairs:
        lines += ["", "| setting | legs (best fixed: cross-fitted) | ratio, end to end |", "|---|---|---:|"]
        lines += [
            f"| {TITLES.get(st['setting'], st['setting'])} | {pair}"
            f"{' (' + '/'.join(st['best_fixed_blocks']) + ')' if pair.endswith('best fixed') else ''} "
            f"| {r(x)} |"
            for st, pair, x in pairs
        ]
    return "\n".join(lines)


def legs(args) -> None:
    import dflash_mlx

    if args.table:
        print(legs_table(json.loads(args.table.read_text())))
        return
    names = args.settings.split(",")
    unknown = [n for n in names if n not in TITLES]
    if unknown:  # before an hour of measuring the known ones
        raise SystemExit(f"--settings: unknown setting(s) {', '.join(unknown)} (known: {', '.join(TITLES)})")
    demo, report = dflash_mlx.load("demo"), {"settings": []}
    for name in names:
        loaded = load_setting(name, demo, args)
        if loaded is not None:
            report["settings"].append(run_setting(name, *loaded, args))
            print(json.dumps(report["settings"][-1]), flush=True)
    print(legs_table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


# ----------------------------------------------------------------------------------- servers: serving, agent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def float32_copy(dst: Path) -> Path:
    """The bundled target in float32, for mlx_lm.server (bfloat16 matmuls are slow on a CPU)."""
    from dflash_mlx.models.registry import lookup

    src = Path(lookup("demo").target_path())
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = {
        k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in mx.load(str(src / "model.safetensors")).items()
    }
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}, indent=2))
    return dst


class Server:
    """A server subprocess on a free port, ready once its /v1/models answers; stopped with SIGINT."""

    def __init__(self, command: list[str], log: Path, env: dict | None = None, cwd: Path | None = None):
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*command, "--port", str(self.port)],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            # Ctrl-C (SIGINT, `stop`) stops it even when this script runs in the background, where the shell
            # starts it with SIGINT ignored and a child would inherit that
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{command[:3]} exited early; its log:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{command[:3]} did not answer within 300 s")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve_commands(decode_concurrency: int, serial: bool) -> dict[str, list[str]]:
    """The `dflash-mlx serve` commands `serving` compares: batched, and one at a time with `serial`."""
    exe = shutil.which("dflash-mlx")
    commands = {"batched": [exe, "serve", "--decode-concurrency", str(decode_concurrency)]}
    if serial:
        commands["one at a time"] = [exe, "serve", "--decode-concurrency", "1"]
    return commands


def openai_bench(
    url: str, concurrency: int, num_prompts: int, max_tokens: int, out: Path, baseline_url: str | None = None
) -> dict:
    """The legs of one `dflash-mlx bench --backend openai` run against the server at `url` (and the baseline
    server when given): {"dflash": record, "baseline": record}, each with its `throughput_tps`."""
    command = [shutil.which("dflash-mlx"), "bench", "--backend", "openai", "--base-url", url]
    command += ["--baseline-url", baseline_url] if baseline_url else []
    command += ["--concurrency", str(concurrency), "--num-prompts", str(num_prompts)]
    command += ["--max-tokens", str(max_tokens), "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if run.returncode != 0:
        raise SystemExit(f"dflash-mlx bench failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    return json.loads(out.read_text())["legs"]


def serving(args) -> None:
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    commands = serve_commands(args.decode_concurrency, args.serial)
    mlx_lm_command = [sys.executable, "-m", "mlx_lm.server", "--model", str(float32_copy(out_dir / "target-f32"))]
    servers = {}
    results = []
    try:
        for name, command in {**commands, "mlx_lm": mlx_lm_command}.items():
            servers[name] = Server(command, out_dir / f"{name.replace(' ', '-')}.log")
        for c in args.concurrency:
            runs = {name: [] for name in commands}
            for k in range(args.rounds):
                for name in commands:
                    out = out_dir / f"{name.replace(' ', '-')}-c{c}-r{k}.json"
                    legs = openai_bench(
                        servers[name].url, c, args.num_prompts, args.max_tokens, out, servers["mlx_lm"].url
                    )
                    runs[name].append(legs)
            for name, rounds in runs.items():

                def med(f):
                    return statistics.median(f(r) for r in rounds)

                results.append(
                    {
                        "server": name,
                        "concurrency": c,
                        "tps": med(lambda r: r["dflash"]["throughput_tps"]),
                        "baseline_tps": med(lambda r: r["baseline"]["throughput_tps"]),
                        "speedups": [r["dflash"]["throughput_tps"] / r["baseline"]["throughput_tps"] for r in rounds],
                        "latency_p50": med(lambda r: r["dflash"]["latency_s"]["p50"]),
                        "baseline_latency_p50": med(lambda r: r["baseline"]["latency_s"]["p50"]),
                        "ttft_p50": med(lambda r: r["dflash"]["ttft_s"]["p50"]),
                        "baseline_ttft_p50": med(lambda r: r["baseline"]["ttft_s"]["p50"]),
                        "acceptance_length": med(lambda r: r["dflash"]["acceptance_length"] or 0.0),
                    }
                )
                print(json.dumps(results[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    (out_dir / "summary.json").write_text(json.dumps(results, indent=1))
    print(
        f"\n{args.num_prompts} GSM8K prompts x {args.max_tokens} tokens, greedy, median of {args.rounds} rounds "
        f"(reports in {out_dir})\n\n| server | concurrency | dflash-mlx tok/s | mlx_lm.server tok/s | speedup "
        "(rounds) | latency p50 (dflash / mlx-lm) | TTFT p50 (dflash / mlx-lm) | acceptance length |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in results:
        print(
            f"| {r['server']} | {r['concurrency']} | {r['tps']:.1f} | {r['baseline_tps']:.1f} "
            f"| {statistics.median(r['speedups']):.2f}x ({', '.join(f'{s:.2f}' for s in r['speedups'])}) "
            f"| {r['latency_p50']:.2f} s / {r['baseline_latency_p50']:.2f} s "
            f"| {r['ttft_p50']:.2f} s / {r['baseline_ttft_p50']:.2f} s | {r['acceptance_length']:.2f} |"
        )


AGENT_QUESTIONS = [
    "Tom has 3 boxes with 12 apples each. How many apples does he have?",
    "He gives 7 apples to his sister. How many are left?",
    "Then he buys 2 more boxes. How many apples now?",
    "Summarise what happened to Tom's apples in one sentence.",
]
TOOL_NAMES = ["search_files", "read_file", "write_file", "run_tests", "list_directory", "grep"]


def agent_system_prompt(count: int) -> str:
    """`count` tool descriptions as an agent's system prompt lists them (JSON schemas, ~250 tokens each)."""
    tools = []
    for i in range(count):
        name = f"{TOOL_NAMES[i % len(TOOL_NAMES)]}_{i // len(TOOL_NAMES)}"
        parameters = {
            "type": "object",
            "required": ["path"],
            "properties": {
                "path": {"type": "string", "description": "a path relative to the workspace root"},
                "pattern": {"type": "string", "description": "a glob or regular expression"},
                "limit": {"type": "integer", "description": "the most results to return"},
            },
        }
        description = (
            f"{name.replace('_', ' ')} in the workspace; returns the result as text and never changes "
            "files it was not asked to change."
        )
        tools.append(
            {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
        )
    return "You are a careful assistant with these tools:\n" + "\n".join(json.dumps(t) for t in tools)


def converse(url: str, system: str, max_tokens: int) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    client.chat.completions.create(
        model="default_model", max_tokens=4, messages=[{"role": "user", "content": "Hello"}]
    )  # a warm-up
    messages, turns = [{"role": "system", "content": system}], []
    for question in AGENT_QUESTIONS:
        messages.append({"role": "user", "content": question})
        tic, first, text, usage = time.perf_counter(), None, "", None
        for chunk in client.chat.completions.create(
            model="default_model",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            usage = chunk.usage or usage
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
        done = time.perf_counter()
        details = getattr(usage, "prompt_tokens_details", None)
        turns.append(
            {
                "ttft_s": round((first or done) - tic, 3),
                "latency_s": round(done - tic, 3),
                "prompt_tokens": usage.prompt_tokens,
                "cached_tokens": getattr(details, "cached_tokens", None),
                "text": text,
            }
        )
        messages.append({"role": "assistant", "content": text})
    client.close()
    return turns


def agent(args) -> None:
    system = agent_system_prompt(args.tools)
    exe = shutil.which("dflash-mlx")
    report = {"max_tokens": args.max_tokens, "legs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        mlx_lm_server = [sys.executable, "-m", "mlx_lm.server", "--model", str(float32_copy(Path(tmp) / "target"))]
        legs = {
            "dflash-mlx serve, cached": [exe, "serve"],
            "dflash-mlx serve, cold": [exe, "serve", "--prompt-cache-size", "0"],
            "mlx_lm.server, cached": mlx_lm_server,
            "mlx_lm.server, cold": [*mlx_lm_server, "--prompt-cache-size", "0"],
        }
        for name, command in legs.items():  # one server at a time
            server = Server(command, Path(tmp) / "server.log")
            try:
                report["legs"][name] = converse(server.url, system, args.max_tokens)
            finally:
                server.stop()
            print(
                f"{name}: "
                + "  ".join(
                    f"{t['ttft_s']:.2f} / {t['latency_s']:.2f} s (cached {t['cached_tokens']} of {t['prompt_tokens']})"
                    for t in report["legs"][name]
                ),
                flush=True,
            )
    texts = {name: [t["text"] for t in turns] for name, turns in report["legs"].items()}
    report["same_text_everywhere"] = len({json.dumps(t) for t in texts.values()}) == 1
    print("the same replies from every server, cached or cold:", report["same_text_everywhere"])
    print(
        "\n| server | "
        + " | ".join(f"turn {i + 1}" for i in range(len(AGENT_QUESTIONS)))
        + " |\n|---|"
        + "---:|" * len(AGENT_QUESTIONS)
    )
    for name, turns in report["legs"].items():
        print(f"| {name} | " + " | ".join(f"{t['ttft_s']:.2f} / {t['latency_s']:.2f}" for t in turns) + " |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


# ------------------------------------------------------------------------------ suffix: repeat, norepeat

REPEAT_SYSTEMS = (
    "You are a helpful assistant.",
    "You are a patient math tutor: explain every step.",
)


def stream_step(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat completion (an agent step in a fresh conversation): its text, completion
    tokens, seconds after the first token and tokens drafted by the suffix index."""
    first, text, usage, dflash = None, "", None, {}
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        usage = chunk.usage or usage
        dflash = (chunk.model_extra or {}).get("dflash") or dflash
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
    done = time.perf_counter()
    suffix = dflash.get("tokens_by_source", {}).get("suffix", 0)
    return {"text": text, "tokens": usage.completion_tokens, "decode_s": done - (first or done), "suffix": suffix}


def stream_pass(url: str, conversations: list[list[dict]], max_tokens: int, concurrency: int) -> dict:
    """Each conversation as one streamed request (`concurrency` in flight): the replies and the pass's decode
    speed, its tokens after the first over the seconds after the first token, summed over the requests."""
    import openai
    from concurrent.futures import ThreadPoolExecutor

    client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("DFLASH_MLX_API_KEY", "unused"), timeout=900)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(concurrency) as pool:
        steps = list(pool.map(lambda c: stream_step(client, model, c, max_tokens), conversations))
    client.close()
    seconds = sum(s["decode_s"] for s in steps)
    return {
        "tps": sum(s["tokens"] - 1 for s in steps) / seconds if seconds > 0 else 0.0,
        "texts": [s["text"] for s in steps],
        "suffix_tokens": sum(s["suffix"] for s in steps),
        "tokens": sum(s["tokens"] for s in steps),
    }


def gsm8k_chats(count: int, system: str | None = None, skip: int = 0) -> list[list[dict]]:
    from dflash_mlx.datasets import sample

    head = [{"role": "system", "content": system}] if system else []
    return [head + [{"role": "user", "content": c[0]}] for c in sample("gsm8k", skip + count)[skip:]]


def alternated(rounds: int, names: list[str]):
    """(round, the servers' order): the order reversed every other round."""
    for k in range(rounds):
        yield k, names if k % 2 == 0 else names[::-1]


def repeat(args) -> None:
    """The repeated agent step: the second pass (the same questions under another system prompt) on a server
    that served the first pass against a fresh server (which first serves `--control` other questions)."""
    out_dir = Path(tempfile.mkdtemp(prefix="bench-repeat-"))
    first, second = (gsm8k_chats(args.questions, system) for system in REPEAT_SYSTEMS)
    control = gsm8k_chats(args.control, REPEAT_SYSTEMS[0], skip=args.questions) if args.control else []
    command = [shutil.which("dflash-mlx"), "serve", *args.serve_arg]
    rounds = []
    for k, order in alternated(args.rounds, ["served the first pass", "fresh"]):
        result = {}
        for name in order:  # one server at a time, started afresh every round
            server = Server(command, out_dir / f"r{k}-{name.split()[0]}.log")
            try:
                warm_up = first if name != "fresh" else control or [[{"role": "user", "content": "Hello"}]]
                stream_pass(server.url, warm_up, args.max_tokens, args.concurrency)
                result[name] = stream_pass(server.url, second, args.max_tokens, args.concurrency)
            finally:
                server.stop()
        warm, fresh = result["served the first pass"], result["fresh"]
        rounds.append(
            {
                "order": order,
                "speedup": warm["tps"] / fresh["tps"],
                "tps": warm["tps"],
                "fresh_tps": fresh["tps"],
                "suffix_tokens": warm["suffix_tokens"],
                "fresh_suffix_tokens": fresh["suffix_tokens"],
                "same_text": warm["texts"] == fresh["texts"],
            }
        )
        print(json.dumps(rounds[-1]), flush=True)
    report = {
        "questions": args.questions,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "control": args.control,
        "speedup": statistics.median(r["speedup"] for r in rounds),
        "same_text": all(r["same_text"] for r in rounds),
        "rounds": rounds,
    }
    print(
        f"\n{args.questions} GSM8K questions, then the same under another system prompt, {args.max_tokens} tokens, "
        f"streamed ({args.concurrency} at a time), median of {args.rounds} rounds (logs in {out_dir})\n\n"
        "| second pass | decode tok/s | suffix tokens |\n|---|---:|---:|\n"
        f"| on a server that served the first | {statistics.median(r['tps'] for r in rounds):.1f} "
        f"| {statistics.median(r['suffix_tokens'] for r in rounds)} |\n"
        f"| on a fresh server | {statistics.median(r['fresh_tps'] for r in rounds):.1f} "
        f"| {statistics.median(r['fresh_suffix_tokens'] for r in rounds)} |\n\n"
        f"speedup {report['speedup']:.2f}x ({', '.join(format(r['speedup'], '.2f') for r in rounds)}); "
        f"identical text: {report['same_text']}"
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def norepeat(args) -> None:
    """Workloads with nothing to repeat (distinct GSM8K questions, MT-Bench first turns): the default server
    against one with --suffix-cache-tokens 0, started afresh every round, alternated."""
    from dflash_mlx.datasets import sample

    out_dir = Path(tempfile.mkdtemp(prefix="bench-norepeat-"))
    workloads = {
        "gsm8k": gsm8k_chats(args.num_prompts),
        "mt-bench": [[{"role": "user", "content": c[0]}] for c in sample("mt-bench", args.num_prompts)],
    }
    exe = shutil.which("dflash-mlx")
    commands = {
        "suffix": [exe, "serve", *args.serve_arg],
        "off": [exe, "serve", "--suffix-cache-tokens", "0", *args.serve_arg],
    }
    rounds = []
    for k, order in alternated(args.rounds, list(commands)):
        result = {}
        for name in order:
            server = Server(commands[name], out_dir / f"r{k}-{name}.log")
            try:
                stream_pass(server.url, [[{"role": "user", "content": "Hello"}]], 8, 1)  # a warm-up
                result[name] = {
                    w: stream_pass(server.url, c, args.max_tokens, args.concurrency) for w, c in workloads.items()
                }
            finally:
                server.stop()
        rounds.append(
            {
                w: {
                    "ratio": result["suffix"][w]["tps"] / result["off"][w]["tps"],
                    "tps": result["suffix"][w]["tps"],
                    "off_tps": result["off"][w]["tps"],
                    "suffix_tokens": result["suffix"][w]["suffix_tokens"],
                    "same_text": result["suffix"][w]["texts"] == result["off"][w]["texts"],
                }
                for w in workloads
            }
        )
        print(json.dumps({"order": order, **rounds[-1]}), flush=True)
    report = {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "rounds": rounds, "workloads": {}}
    print(
        f"\n{args.num_prompts} prompts each, {args.max_tokens} tokens, streamed ({args.concurrency} at a time), "
        f"median of {args.rounds} rounds (logs in {out_dir})\n\n| workload | default tok/s | --suffix-cache-tokens 0 "
        "tok/s | ratio (rounds) | suffix tokens | identical text |\n|---|---:|---:|---:|---:|---|"
    )
    for w in workloads:
        ratios = [r[w]["ratio"] for r in rounds]
        report["workloads"][w] = {
            "ratio": statistics.median(ratios),
            "same_text": all(r[w]["same_text"] for r in rounds),
        }
        print(
            f"| {w} | {statistics.median(r[w]['tps'] for r in rounds):.1f} "
            f"| {statistics.median(r[w]['off_tps'] for r in rounds):.1f} "
            f"| {statistics.median(ratios):.3f}x ({', '.join(f'{x:.3f}' for x in ratios)}) "
            f"| {statistics.median(r[w]['suffix_tokens'] for r in rounds)} | {report['workloads'][w]['same_text']} |"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


# -------------------------------------------------------------------------------------------- batch


def batch_prompts(tokenizer, n: int) -> list[list[int]]:
    """The batch legs' prompts: the first `n` GSM8K questions, chat-templated, as token ids."""
    from dflash_mlx.datasets import sample

    return [p.tolist() for p in chat_prompts(tokenizer, [c[0] for c in sample("gsm8k", n)])]


def dflash_batch(model, draft, tokenizer, prompts, width: int, max_tokens: int, block: int | None) -> tuple:
    """(tok/s: every generated token over the call's time, the prefill included; the BatchResponse) of one
    `dflash_mlx.batch_generate` call, `width` rows at once."""
    import dflash_mlx

    tic = time.perf_counter()
    out = dflash_mlx.batch_generate(
        model,
        draft,
        tokenizer,
        prompts,
        max_tokens=max_tokens,
        max_batch=width,
        block_size=block,
        return_token_ids=True,
    )
    return sum(map(len, out.token_ids)) / (time.perf_counter() - tic), out


def batch(args) -> None:
    from mlx_lm.generate import batch_generate as mlx_lm_batch_generate

    import dflash_mlx

    model, tokenizer, draft = dflash_mlx.load("demo")
    prompts = batch_prompts(tokenizer, args.num_prompts)
    want = [dflash_mlx.generate(model, draft, tokenizer, p, max_tokens=args.max_tokens) for p in prompts]
    print(
        "| rows at once | mlx-lm batch_generate tok/s | dflash_mlx.batch_generate tok/s | ratio |\n"
        "|---:|---:|---:|---:|"
    )
    for width in args.widths:
        best, same = {"mlx-lm": 0.0, "dflash": 0.0}, True
        for r in range(args.rounds + 1):  # round 0 warms up
            ours_tps, ours = dflash_batch(model, draft, tokenizer, prompts, width, args.max_tokens, args.block)
            tic = time.perf_counter()
            theirs = mlx_lm_batch_generate(
                model,
                tokenizer,
                prompts,
                max_tokens=args.max_tokens,
                completion_batch_size=width,
                prefill_batch_size=width,
                return_token_ids=True,
            )
            theirs_tps = sum(map(len, theirs.token_ids)) / (time.perf_counter() - tic)
            same &= ours.texts == want
            if r:
                best = {"mlx-lm": max(best["mlx-lm"], theirs_tps), "dflash": max(best["dflash"], ours_tps)}
        print(
            f"| {width} | {best['mlx-lm']:.1f} | {best['dflash']:.1f} | {best['dflash'] / best['mlx-lm']:.2f}x"
            f"{'' if same else ' (texts DIFFER from one-by-one generate)'} |",
            flush=True,
        )


# ------------------------------------------------------------------------------------------ sharded


def rank_job(path: Path) -> None:
    """One rank (or the single process) of a sharded job: legs alternated prompt by prompt; rank 0 writes."""
    from mlx_lm import stream_generate as mlx_lm_stream_generate

    import dflash_mlx
    from dflash_mlx.sharding.group import world

    job = json.loads(path.read_text())
    group = world()
    model, tokenizer, draft = dflash_mlx.load(job["target"], job["draft"], shard="tensor" if group.size() > 1 else None)
    if job.get("synthetic"):
        prompts = chat_prompts(tokenizer, synthetic_prompts(Path(job["synthetic"]), job["n"]), raw=True)
    else:
        from dflash_mlx.datasets import sample

        prompts = chat_prompts(tokenizer, [c[0] for c in sample("gsm8k", job["n"])])

    def run(leg: str, prompt):
        if leg == "mlx-lm":
            responses = mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=job["max_tokens"])
        else:
            b = leg.split("=")[1]
            responses = dflash_mlx.stream_generate(
                model,
                draft,
                tokenizer,
                prompt,
                max_tokens=job["max_tokens"],
                block_size=None if b == "auto" else int(b),
            )
        tokens, decode_seconds = timed(responses)[:2]
        return tokens, decode_seconds

    legs = ["mlx-lm"] + [f"dflash b={b}" for b in job["blocks"]]
    for leg in legs:  # warm-up (and the adaptive leg's calibration)
        run(leg, prompts[0])
    totals, same = {leg: [0, 0.0] for leg in legs}, {leg: True for leg in legs}
    for _ in range(job["rounds"]):
        for prompt in prompts:
            reference = None
            for leg in legs:
                tokens, seconds = run(leg, prompt)
                reference = tokens if reference is None else reference
                same[leg] &= tokens == reference
                totals[leg] = [totals[leg][0] + len(tokens) - 1, totals[leg][1] + seconds]
    if group.rank() == 0:
        Path(job["out"]).write_text(
            json.dumps({leg: {"tok_s": n / s, "same_as_mlx_lm": same[leg]} for leg, (n, s) in totals.items()})
        )


def sharded(args) -> None:
    if shutil.which("mlx.launch") is None:
        raise SystemExit("mlx.launch is not installed (it comes with mlx)")
    from dflash_mlx.models.resolve import choose_model

    demo = choose_model(None, None)
    pairs = {"bundled demo, GSM8K": dict(target=str(demo.target), draft=str(demo.draft))}
    if args.synthetic is not None:
        pairs["trained synthetic"] = dict(
            target=str(args.synthetic / "target"), draft=str(args.synthetic / "drafter"), synthetic=str(args.synthetic)
        )
    blocks = args.blocks.split(",")
    names = [f"DFlash {b if b == 'auto' else 'b=' + b} tok/s" for b in blocks]
    print(
        "| pair | setup | mlx-lm tok/s | " + " | ".join(names) + " | speedups |\n"
        "|---|---|---:|" + "---:|" * len(blocks) + "---:|"
    )
    with tempfile.TemporaryDirectory(prefix="dflash-bench-sharded-") as tmp:
        for name, pair in pairs.items():
            for ranks in (1, 2):
                job = Path(tmp) / f"job-{ranks}.json"
                out = job.with_name(f"result-{ranks}.json")
                job.write_text(
                    json.dumps(
                        {
                            **pair,
                            "n": args.num_prompts,
                            "max_tokens": args.max_tokens,
                            "rounds": args.rounds,
                            "blocks": blocks,
                            "out": str(out),
                        }
                    )
                )
                command, env = [sys.executable, __file__, "rank-job", str(job)], dict(os.environ)
                if ranks > 1:
                    command = [shutil.which("mlx.launch"), "--backend", "ring", "-n", str(ranks), "--", *command]
                    env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
                read, write = os.pipe()  # mlx.launch busy-loops on a stdin at end of file
                try:
                    done = subprocess.run(command, stdin=read, env=env, capture_output=True, text=True)
                finally:
                    os.close(read)
                    os.close(write)
                if not out.exists():
                    raise SystemExit(f"the {ranks}-rank job failed:\n{done.stdout}\n{done.stderr}")
                legs = json.loads(out.read_text())
                base = legs["mlx-lm"]["tok_s"]
                cells = " | ".join(
                    f"{v['tok_s']:.1f}{'' if v['same_as_mlx_lm'] else ' (DIFFERS)'}"
                    for k, v in legs.items()
                    if k != "mlx-lm"
                )
                speedups = " / ".join(f"{v['tok_s'] / base:.2f}x" for k, v in legs.items() if k != "mlx-lm")
                print(
                    f"| {name} | {'1 process' if ranks == 1 else f'{ranks} ranks'} | {base:.1f} | {cells} "
                    f"| {speedups} |",
                    flush=True,
                )


# --------------------------------------------------------------------------------------------- load


def busy_processes(count: int) -> list[subprocess.Popen]:
    """`count` CPU-bound processes (another job on the machine's cores), stopped with `stop_busy`."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(count)
    ]


def stop_busy(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        proc.terminate()
    for proc in processes:
        proc.wait()


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def shape_of(cost) -> list[float]:
    """T(b) / T(1) at the grid blocks: of a cost model, the drafter's cost as the loop's cycles scale it over
    plain decoding's; of a list of seconds, as they are."""
    if hasattr(cost, "table"):
        return [1.0] + [round(cost.seconds("drafter", b) / cost.seconds("target", 1), 3) for b in cost.table.blocks[1:]]
    return [round(t / cost[0], 3) for t in cost]


def dflash_command(args: list[str], cache: Path, timeout: float = 1800) -> dict:
    """`dflash-mlx ARGS --json`-like run with the calibration cache in `cache`; its last line of JSON."""
    env = dict(os.environ, DFLASH_MLX_CACHE_DIR=str(cache))
    done = subprocess.run(
        [shutil.which("dflash-mlx"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise SystemExit(f"dflash-mlx {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]) if "--json" in args else {}


def load_calibration(args) -> dict:
    """The cached curve measured while `--busy` CPU-bound processes ran, then `dflash-mlx bench` in the first
    quiet process: the default against the fixed block and mlx-lm (its loop scales the busy curve as its
    cycles show; the file stays what was measured)."""
    from dflash_mlx.models.block_size import default_block_size
    from dflash_mlx.policy import calibration
    from dflash_mlx.policy.cost import CostTable
    from dflash_mlx.session import make_session

    import dflash_mlx

    with tempfile.TemporaryDirectory(prefix="dflash-bench-load-") as tmp:
        cache = Path(tmp) / "cache"
        print(f"calibrating with {args.busy} CPU-bound processes running (load {load_average()})", flush=True)
        hogs = busy_processes(args.busy)
        try:
            time.sleep(2)  # (the load settles)
            busy = dflash_command(["calibrate", "--force", "--json"], cache)
        finally:
            stop_busy(hogs)
        rows = busy["curve"]
        print(
            f"  busy curve T(b)/T(1): {[r['break_even_tokens_per_cycle'] for r in rows]} "
            f"(rounds disagree by {busy['instability']:.0%}; cached: {busy['written']})",
            flush=True,
        )
        if not busy["written"]:  # the scenario is a busy curve in the cache: put the one measured there
            os.environ["DFLASH_MLX_CACHE_DIR"] = str(cache)
            model, _, draft = dflash_mlx.load("demo")
            session = make_session(model, draft)
            key = calibration.calibration_key(session.target, session.proposer, default_block_size(model, draft))
            calibration.write_table(
                key,
                CostTable.curve([r["block"] for r in rows], [r["ms_per_cycle"] / 1000 for r in rows]),
                {"source": "measured", "instability": busy["instability"]},
            )
            print("  (not cached, as its rounds disagree: written to the cache for this scenario)", flush=True)
        time.sleep(args.settle)
        print(f"dflash-mlx bench, the first quiet process (load {load_average()})", flush=True)
        report = Path(tmp) / "bench.json"
        dflash_command(
            [
                "bench",
                "--num-prompts",
                str(args.num_prompts),
                "--max-tokens",
                str(args.max_tokens),
                "--out",
                str(report),
            ],
            cache,
        )
        doc = json.loads(report.read_text())
    auto, fixed = doc["runs"][0], doc["runs"][1]
    result = {
        "load_after": load_average(),
        "busy_shape": [r["break_even_tokens_per_cycle"] for r in rows],
        "auto_tps": auto["dflash_tps"],
        "fixed_tps": fixed["dflash_tps"],
        "mlx_lm_tps": auto["baseline_tps"],
        "auto_blocks": auto["block_sizes"],
        "greedy_matches": auto["greedy_matches"] and fixed["greedy_matches"],
    }
    result["auto_over_fixed"] = round(result["auto_tps"] / result["fixed_tps"], 3)
    result["auto_over_mlx_lm"] = round(result["auto_tps"] / result["mlx_lm_tps"], 3)
    per_prompt = [(p["tps"], q["tps"], p["baseline_tps"]) for p, q in zip(auto["prompts"], fixed["prompts"])]
    print("| prompt | auto tok/s | fixed tok/s | mlx-lm tok/s | auto / fixed |\n|---:|---:|---:|---:|---:|")
    for i, (a, f, m) in enumerate(per_prompt):
        print(f"| {i + 1} | {a:.1f} | {f:.1f} | {m:.1f} | {a / f:.3f} |")
    print(
        f"\nauto / {fixed['block_size']} = {result['auto_over_fixed']} (>= 0.93), auto / mlx-lm = "
        f"{result['auto_over_mlx_lm']}; greedy output equal: {result['greedy_matches']}; load {result['load_after']}",
        flush=True,
    )
    return result


def load_windows(legs: dict, prompts: list, window: int, phases: list[str], busy: int, lead: str = "adaptive"):
    """Legs alternated prompt by prompt (a new order each prompt), per window of `window` prompts, each window
    on a quiet machine or with `busy` CPU-bound processes running through it (`phases`); per window a `Units`
    of its prompts, the lead leg's blocks, greedy mismatches against mlx-lm and the load average."""
    shuffle, hogs, out = random.Random(1).shuffle, [], []
    try:
        for w, phase in enumerate(phases):
            if phase == "busy" and not hogs:
                hogs = busy_processes(busy)
            elif phase == "quiet" and hogs:
                stop_busy(hogs)
                hogs = []
            units, blocks, mismatches = Units([]), Counter(), 0
            for i, prompt in enumerate(prompts[w * window : (w + 1) * window]):
                order = list(legs)
                shuffle(order)
                unit = {k: legs[k](prompt, i) for k in order}
                blocks.update(unit[lead][4])
                mismatches += sum(v[0] != unit["mlx-lm"][0] for v in unit.values())
                units.rows.append({k: (len(v[0]), *v[1:4]) for k, v in unit.items()})
            out.append((phase, units, dict(sorted(blocks.items())), mismatches, load_average()))
    finally:
        stop_busy(hogs)
    return out


def load_run(args) -> dict:
    """A curve measured quiet, then `--busy` CPU-bound processes during a run of generations, then quiet
    again: mlx-lm, the plain path, the default and the largest fixed block alternated prompt by prompt in one
    process, per window of `--window` prompts."""
    from dflash_mlx.datasets import sample
    from dflash_mlx.models.block_size import default_block_size
    from dflash_mlx.policy.calibration import cost_model
    from dflash_mlx.session import make_session

    import dflash_mlx

    os.environ["DFLASH_MLX_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-bench-load-")
    model, tokenizer, draft = dflash_mlx.load("demo")
    session = make_session(model, draft)
    block = default_block_size(model, draft)
    fixed = f"b{block}"
    cost = cost_model(session.target, session.proposer, block, force=True)
    print(f"quiet calibration: T(b)/T(1) {shape_of(cost)} (load {load_average()})", flush=True)
    conversations = [c[0] for c in sample("gsm8k", args.window * sum(args.phases))]
    prompts = chat_prompts(tokenizer, conversations)
    legs = make_legs(model, tokenizer, draft, ["plain", "adaptive", fixed], args.max_tokens, 0.0)
    for leg in legs.values():
        leg(prompts[0], 0)
    phases = ["quiet"] * args.phases[0] + ["busy"] * args.phases[1] + ["quiet"] * args.phases[2]
    print(
        f"| window | machine | load | mlx-lm tok/s | plain tok/s | adaptive tok/s | {fixed} tok/s | adaptive / mlx-lm "
        f"| adaptive / better of mlx-lm and {fixed} | blocks | the drafter's T(b) / plain's |\n"
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|",
        flush=True,
    )
    windows = []
    for w, (phase, units, blocks, mismatches, load) in enumerate(
        load_windows(legs, prompts, args.window, phases, args.busy)
    ):
        tps = {k: units.speed(k) for k in legs}
        better = "mlx-lm" if tps["mlx-lm"] >= tps[fixed] else fixed
        x = {
            "window": w + 1,
            "machine": phase,
            "load": load,
            "tps": tps,
            "adaptive_over_mlx_lm": units.ratio("adaptive", "mlx-lm"),
            "adaptive_over_better": {**units.ratio("adaptive", better), "better": better},
            "blocks": blocks,
            "shape": shape_of(cost),
            "greedy_mismatches": mismatches,
        }
        windows.append(x)
        print(
            f"| {w + 1} | {phase} | {load} | {tps['mlx-lm']:.1f} | {tps['plain']:.1f} | {tps['adaptive']:.1f} "
            f"| {tps[fixed]:.1f} | {interval(x['adaptive_over_mlx_lm'])} | {interval(x['adaptive_over_better'])} "
            f"| {' '.join(f'{b}:{n}' for b, n in blocks.items())} | {x['shape']} |",
            flush=True,
        )
    return {"windows": windows, "changes": cost.changes}


def interval(x: dict) -> str:
    """A ratio with its 95% interval (`Units.ratio`)."""
    return f"{x['ratio']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]"


def load_loaded_run(args) -> dict:
    """The issue's loaded run, `--runs` times, each in a process of its own with a calibration cache of its
    own (`loaded_run_job`): a quiet calibration, then `--busy` CPU-bound processes through a whole run of
    `--num-prompts` GSM8K prompts (warm-ups included), mlx-lm, the plain path and the default alternated
    prompt by prompt; per run each leg's tok/s, default / mlx-lm with its 95% interval, and the median."""
    runs = []
    print(
        "| run | load | mlx-lm tok/s | plain tok/s | default tok/s | default / mlx-lm | plain / mlx-lm "
        "| default's blocks | greedy mismatches |\n|---:|---|---:|---:|---:|---:|---:|---|---:|",
        flush=True,
    )
    for r in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="dflash-bench-loaded-") as tmp:
            job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
            job.write_text(json.dumps({"prompts": args.num_prompts, "max_tokens": args.max_tokens, "busy": args.busy}))
            env = dict(os.environ, DFLASH_MLX_CACHE_DIR=str(Path(tmp) / "cache"))
            done = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "loaded-run-job", str(job), str(out)],
                env=env,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
            )
            if done.returncode != 0 or not out.exists():
                raise SystemExit(f"loaded run {r + 1} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            x = json.loads(out.read_text())
        runs.append(x)
        tps = x["tps"]
        print(
            f"| {r + 1} | {x['load']} | {tps['mlx-lm']:.1f} | {tps['plain']:.1f} | {tps['adaptive']:.1f} "
            f"| {interval(x['adaptive_over_mlx_lm'])} | {interval(x['plain_over_mlx_lm'])} "
            f"| {' '.join(f'{b}:{n}' for b, n in x['blocks'].items())} | {x['greedy_mismatches']} |",
            flush=True,
        )
    median = statistics.median(x["adaptive_over_mlx_lm"]["ratio"] for x in runs)
    print(f"\ndefault / mlx-lm, median of {len(runs)} runs: {median:.3f} (>= 0.85)", flush=True)
    return {"runs": runs, "median_adaptive_over_mlx_lm": median}


def loaded_run_job(job_path: Path, out: Path) -> None:
    """One run of `load --scenario loaded-run`, in a process of its own (the caller's cache directory)."""
    from dflash_mlx.datasets import sample
    from dflash_mlx.models.block_size import default_block_size
    from dflash_mlx.policy.calibration import cost_model
    from dflash_mlx.session import make_session

    import dflash_mlx

    job = json.loads(job_path.read_text())
    model, tokenizer, draft = dflash_mlx.load("demo")
    session = make_session(model, draft)
    cost_model(session.target, session.proposer, default_block_size(model, draft), force=True)  # quiet
    prompts = chat_prompts(tokenizer, [c[0] for c in sample("gsm8k", job["prompts"])])
    legs = make_legs(model, tokenizer, draft, ["plain", "adaptive"], job["max_tokens"], 0.0)
    hogs = busy_processes(job["busy"])
    try:
        time.sleep(2)  # (the load settles)
        for leg in legs.values():  # the warm-ups under the load too: the whole run is a loaded one
            leg(prompts[0], 0)
        ((_, units, blocks, mismatches, load),) = load_windows(legs, prompts, len(prompts), ["busy"], 0)
    finally:
        stop_busy(hogs)
    out.write_text(
        json.dumps(
            {
                "load": load,
                "tps": {k: units.speed(k) for k in legs},
                "adaptive_over_mlx_lm": units.ratio("adaptive", "mlx-lm"),
                "plain_over_mlx_lm": units.ratio("plain", "mlx-lm"),
                "blocks": blocks,
                "greedy_mismatches": mismatches,
            }
        )
    )


def load_timing(args) -> dict:
    """What the engine charges a cycle (its launch, the wait for its verdict, taking it in) against the wall
    time between two cycles (the old measure: it holds the caller's per-token work, here `--consumer-ms`
    of busy work per token), per grid block, against a fresh calibration: stretches of each block in
    turn on GSM8K replies, a stretch's first cycle left out."""
    from dflash_mlx.datasets import sample
    from dflash_mlx.generation import stream_generate
    from dflash_mlx.policy.calibration import cost_model
    from dflash_mlx.session import make_session

    import dflash_mlx

    os.environ["DFLASH_MLX_CACHE_DIR"] = tempfile.mkdtemp(prefix="dflash-bench-load-")
    model, tokenizer, draft = dflash_mlx.load("demo")
    session = make_session(model, draft)
    table = cost_model(session.target, session.proposer, 8, force=True).table
    prompts = chat_prompts(tokenizer, [c[0] for c in sample("gsm8k", args.window)])

    class Stretches:  # the engine's BlockPolicy shape: each grid block for 3 cycles in turn, from `start`
        max_block = 8

        def __init__(self, start: int):
            self.i, self.log = 3 * start, []

        def choose(self, limit):
            self.i += 1
            return min(limit, table.blocks[(self.i - 1) // 3 % len(table.blocks)])

        def observe(self, b, accepted, seconds):
            self.log.append((b, seconds, time.perf_counter()))

    engine, wall = {b: [] for b in table.blocks}, {b: [] for b in table.blocks}
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            policy = Stretches(i)  # (replies end early: each starts at another block)
            for _ in stream_generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens, block_size=policy):
                end = time.perf_counter() + args.consumer_ms / 1000
                while time.perf_counter() < end:  # the caller's per-token work
                    pass
            for (b0, _, t0), (b, seconds, t) in zip(policy.log, policy.log[1:]):
                if b == b0 and seconds is not None:
                    engine[b].append(seconds)
                    wall[b].append(t - t0)
    shapes = {}
    for name, samples in (("engine", engine), ("wall", wall)):
        first = statistics.median(samples[1])
        shapes[name] = [round(statistics.median(samples[b]) / first, 3) if samples[b] else None for b in table.blocks]
    shapes["calibration"] = shape_of(table.line())
    print(f"consumer {args.consumer_ms} ms per token; T(b)/T(1) at b = {list(table.blocks)} (load {load_average()})")
    for name, shape in shapes.items():
        print(f"  {name:>11}: {shape}")
    print(f"  cycles timed per block: {[len(engine[b]) for b in table.blocks]}", flush=True)
    return shapes


def load(args) -> None:
    report = {}
    if args.scenario == "timing":
        report["timing"] = load_timing(args)
    if args.scenario in ("calibration", "both"):
        report["calibration"] = load_calibration(args)
    if args.scenario in ("run", "both"):
        report["run"] = load_run(args)
    if args.scenario == "loaded-run":
        report["loaded_run"] = load_loaded_run(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------- ab

# Student's t, 97.5% quantiles at 1 ... 30 degrees of freedom (past 30: the Cornish-Fisher expansion).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
T975 += (2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
T975 += (2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (a two-sided 95% interval's)."""
    if df < 1:
        raise ValueError("a t quantile needs at least one degree of freedom")
    if df <= len(T975):
        return T975[df - 1]
    z = statistics.NormalDist().inv_cdf(0.975)
    terms = [
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    ]
    return z + sum(g / df**k for k, g in enumerate(terms, 1))


def paired_ratio(base: list[float], new: list[float]) -> dict:
    """new / base over paired rounds (round i's two speeds measured together): the geometric mean of the
    rounds' ratios (exp of the mean log ratio) and a 95% t-interval on the log ratios, exponentiated.
    `half_width`: the interval's larger distance from the estimate on the ratio scale (the upper one);
    infinite with fewer than 2 rounds."""
    if len(base) != len(new) or not base:
        raise ValueError("paired_ratio needs as many base speeds as new ones, at least one")
    logs = [math.log(n / b) for b, n in zip(base, new)]
    mean = statistics.fmean(logs)
    estimate = math.exp(mean)
    if len(logs) < 2:
        return {"rounds": 1, "ratio": estimate, "ci95": None, "half_width": math.inf}
    h = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    low, high = math.exp(mean - h), math.exp(mean + h)
    return {"rounds": len(logs), "ratio": estimate, "ci95": [low, high], "half_width": high - estimate}


def ab_settled(summaries: dict, min_rounds: int, half_width: float) -> bool:
    """The stopping rule: every configuration has at least `min_rounds` rounds and an interval whose
    half-width (`paired_ratio`'s) is at most `half_width`."""
    return all(s["rounds"] >= min_rounds and s["half_width"] <= half_width for s in summaries.values())


def ab_orders(seed: int):
    """Each round's order of the two sides: rounds in pairs, one of each order, which first drawn at random."""
    rng = random.Random(seed)
    while True:
        order = rng.sample(["base", "new"], 2)
        yield order
        yield order[::-1]


def checkout_side(path: Path, cache: Path, cwd: Path) -> tuple[dict, dict]:
    """One side of an A/B: (its checkout, commit and whether its tree differs from it; the environment its
    processes run in): PYTHONPATH the checkout alone (an inherited one could name the other side) and its own
    calibration cache (the two codes' cache keys may differ). Exits unless a process started so imports the
    checkout's dflash_mlx."""
    path = path.resolve()
    if not (path / "dflash_mlx" / "__init__.py").is_file():
        raise SystemExit(f"{path} is not a checkout of dflash-mlx (no dflash_mlx/__init__.py)")
    cache.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(path), DFLASH_MLX_CACHE_DIR=str(cache))
    probe = subprocess.run(
        [sys.executable, "-c", "import dflash_mlx; print(dflash_mlx.__file__)"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    found = Path(probe.stdout.strip()).resolve().parent.parent if probe.returncode == 0 else None
    if found != path:
        raise SystemExit(f"with PYTHONPATH={path}, dflash_mlx is imported from {found or probe.stderr[-1000:]}")

    def git(*command: str) -> str | None:
        done = subprocess.run(["git", "-C", str(path), *command], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "path": str(path),
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
    }, env


def ab_batch_job(job_path: Path, out: Path) -> None:
    """One side of one `ab --leg batch` round, in a process whose dflash_mlx is the side's checkout (of it only
    the public `load` and `batch_generate`): at each width a short warm-up (first calls at that width), then
    the job's prompts through `dflash_batch`; tok/s and a digest of the generated tokens per width."""
    import hashlib

    import dflash_mlx

    job = json.loads(job_path.read_text())
    model, tokenizer, draft = dflash_mlx.load("demo")
    prompts, block = job["prompts"], job["block"]
    result = {"dflash_mlx": str(Path(dflash_mlx.__file__).resolve().parent.parent), "tps": {}, "tokens": {}}
    for width in job["widths"]:
        dflash_batch(model, draft, tokenizer, prompts[:width], width, job["warmup_tokens"], block)
        tps, response = dflash_batch(model, draft, tokenizer, prompts, width, job["max_tokens"], block)
        result["tps"][str(width)] = tps
        result["tokens"][str(width)] = hashlib.sha256(json.dumps(response.token_ids).encode()).hexdigest()[:16]
    out.write_text(json.dumps(result))


AB_WARMUP_TOKENS = 16


def ab_batch_round(args, sides: dict, order: list[str], work: Path, tag: str, prompts: list) -> dict:
    """One round of `ab --leg batch`: a process per side, in `order`, timing every width (`ab_batch_job`);
    {configuration: {side: tok/s, "same_tokens": whether both sides generated the same tokens}}."""
    job = work / "batch-job.json"
    settings = {"widths": args.widths, "max_tokens": args.max_tokens, "block": args.block}
    job.write_text(json.dumps({**settings, "warmup_tokens": AB_WARMUP_TOKENS, "prompts": prompts}))
    reports = {}
    for side in order:
        out = work / f"batch-{tag}-{side}.json"
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "ab-batch-job", str(job), str(out)],
            env=sides[side]["env"],
            cwd=work,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"the {side} side's batch job failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        reports[side] = json.loads(out.read_text())
        if reports[side]["dflash_mlx"] != sides[side]["path"]:
            raise SystemExit(f"the {side} side ran the dflash_mlx of {reports[side]['dflash_mlx']}")
    return {
        f"batch, width {w}": {
            **{side: reports[side]["tps"][str(w)] for side in sides},
            "same_tokens": reports["base"]["tokens"][str(w)] == reports["new"]["tokens"][str(w)],
        }
        for w in args.widths
    }


def ab_serving_round(args, sides: dict, order: list[str], work: Path, tag: str) -> dict:
    """One round of `ab --leg serving`: per server kind, a fresh `dflash-mlx serve` of each side (both up, one
    idle while the other is measured), then at each concurrency `dflash-mlx bench --backend openai` (this
    process's, the same client for both) against each side in `order`; {configuration: {side: the dflash
    leg's throughput_tps}}."""
    result = {}
    for kind, command in serve_commands(args.decode_concurrency, args.serial).items():
        slug, servers = kind.replace(" ", "-"), {}
        try:
            for side in sides:
                log = work / f"serve-{slug}-{tag}-{side}.log"
                servers[side] = Server(command, log, sides[side]["env"], work)
                named = re.search(r"(\S+)/dflash_mlx/demo/", log.read_text())  # its banner names the drafter
                if named and Path(named[1]).resolve() != Path(sides[side]["path"]):
                    raise SystemExit(f"the {side} side's server runs the dflash_mlx of {named[1]} ({log})")
            for c in args.concurrency:
                config = result[f"serving {kind}, concurrency {c}"] = {}
                for side in order:
                    out = work / f"serving-{slug}-c{c}-{tag}-{side}.json"
                    legs = openai_bench(servers[side].url, c, args.num_prompts, args.max_tokens, out)
                    config[side] = legs["dflash"]["throughput_tps"]
        finally:
            for server in servers.values():
                server.stop()
    return result


def ab_summaries(rounds: list[dict]) -> dict:
    """`paired_ratio` of every configuration over the rounds so far."""
    configs = rounds[0]["configurations"]
    return {
        c: paired_ratio(
            [r["configurations"][c]["base"] for r in rounds], [r["configurations"][c]["new"] for r in rounds]
        )
        for c in configs
    }


def ab_table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"| configuration | rounds | base tok/s | new tok/s | new / base | 95% interval | half-width "
        f"| >= {s['threshold']} | half-width <= {s['half_width']} |"
        + (" same tokens |" if report["leg"] == "batch" else ""),
        "|---|---:|---:|---:|---:|---|---:|---|---|" + ("---|" if report["leg"] == "batch" else ""),
    ]
    for name, x in report["configurations"].items():
        low, high = x["ci95"]
        row = (
            f"| {name} | {x['rounds']} | {x['base_tps_median']:.1f} | {x['new_tps_median']:.1f} | {x['ratio']:.3f} "
            f"| [{low:.3f}, {high:.3f}] | ±{x['half_width']:.3f} | {'yes' if x['meets'] else 'NO'} "
            f"| {'yes' if x['precise'] else 'no'} |"
        )
        if report["leg"] == "batch":
            differ = x["rounds_tokens_differ"]
            row += " yes |" if not differ else f" no ({differ} of {x['rounds']} rounds differ) |"
        lines.append(row)
    return "\n".join(lines)


def ab(args) -> None:
    if args.min_rounds < 2 or args.max_rounds < args.min_rounds:
        raise SystemExit("--min-rounds must be at least 2 and --max-rounds at least --min-rounds")
    if args.ab_leg == "batch" and args.serial:
        raise SystemExit("--serial is for --leg serving")
    args.num_prompts = args.num_prompts or (8 if args.ab_leg == "batch" else 16)
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="bench-ab-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    new = args.new or Path(__file__).resolve().parent.parent
    sides, checkouts = {}, {}
    for side, path in (("base", args.base), ("new", new)):
        checkouts[side], env = checkout_side(path, work / f"cache-{side}", work)
        sides[side] = {"path": checkouts[side]["path"], "env": env}
    if sides["base"]["path"] == sides["new"]["path"]:
        print("(base and new are the same checkout: an A/A run, the harness's own noise)")
    if args.ab_leg == "batch":
        import dflash_mlx

        prompts = batch_prompts(dflash_mlx.load("demo")[1], args.num_prompts)

        def measure(order, tag):
            return ab_batch_round(args, sides, order, work, tag, prompts)
    else:

        def measure(order, tag):
            return ab_serving_round(args, sides, order, work, tag)

    for side, c in checkouts.items():
        print(f"{side}: {c['path']} at {c['commit']}{' (with uncommitted changes)' if c['dirty'] else ''}")
    print(f"work directory (logs, reports, each side's calibration cache): {work}", flush=True)
    tic = time.perf_counter()
    measure(["base", "new"], "warmup")  # fills each side's calibration cache; not counted
    warmup = time.perf_counter() - tic
    print(f"warm-up round (not counted): {warmup:.0f} s (load {load_average()})", flush=True)
    rounds, orders = [], ab_orders(args.seed)
    for k in range(1, args.max_rounds + 1):
        order, tic = next(orders), time.perf_counter()
        configurations = measure(order, f"r{k}")
        rounds.append(
            {"order": order, "seconds": round(time.perf_counter() - tic, 1), "configurations": configurations}
        )
        summaries = ab_summaries(rounds)
        widest = max(summaries, key=lambda c: summaries[c]["half_width"])
        print(
            f"round {k} ({order[0]} first, {rounds[-1]['seconds']:.0f} s, load {load_average()}): "
            + "; ".join(f"{c}: {x['new'] / x['base']:.3f}" for c, x in configurations.items())
            + (f"; widest interval ±{summaries[widest]['half_width']:.3f} ({widest})" if k > 1 else ""),
            flush=True,
        )
        if ab_settled(summaries, args.min_rounds, args.half_width):
            break
    report = {
        "leg": args.ab_leg,
        "estimate": "geometric mean of the rounds' new / base; 95% t-interval on the log ratios, exponentiated",
        "settings": {
            k: getattr(args, k)
            for k in ("num_prompts", "max_tokens", "min_rounds", "max_rounds", "half_width", "threshold", "seed")
        }
        | (
            {"widths": args.widths, "block": args.block}
            if args.ab_leg == "batch"
            else {"concurrency": args.concurrency, "serial": args.serial, "decode_concurrency": args.decode_concurrency}
        ),
        "checkouts": checkouts,
        "warmup_seconds": round(warmup, 1),
        "settled": ab_settled(summaries, args.min_rounds, args.half_width),
        "configurations": {},
        "rounds": rounds,
    }
    for c, x in summaries.items():
        report["configurations"][c] = {
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in x.items() if k != "ci95"},
            "ci95": [round(v, 4) for v in x["ci95"]],
            "meets": x["ratio"] >= args.threshold,
            "precise": x["half_width"] <= args.half_width,
            "base_tps_median": round(statistics.median(r["configurations"][c]["base"] for r in rounds), 2),
            "new_tps_median": round(statistics.median(r["configurations"][c]["new"] for r in rounds), 2),
        }
        if args.ab_leg == "batch":
            report["configurations"][c]["rounds_tokens_differ"] = sum(
                not r["configurations"][c]["same_tokens"] for r in rounds
            )
    ok = all(x["meets"] and x["precise"] for x in report["configurations"].values())
    print(
        f"\n{args.ab_leg}: {args.num_prompts} GSM8K prompts x {args.max_tokens} tokens, greedy; new / base per round "
        f"(their geometric mean, a 95% t-interval), {len(rounds)} rounds after a warm-up round; "
        f"{'every interval within' if report['settled'] else 'NOT every interval within'} ±{args.half_width}\n"
    )
    print(ab_table(report))
    print(
        f"\nnew / base >= {args.threshold} with a 95% interval within ±{args.half_width} in every configuration: "
        f"{'yes' if ok else 'NO'} (reports and logs in {work})"
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


# --------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="leg", required=True)

    p = sub.add_parser("engine", help="the loop's overhead with an oracle proposer")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--accept", type=int, default=7, help="drafts the oracle gets accepted per cycle")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every leg; medians are reported")
    p.add_argument("--draft-layers", type=int, default=5, help="also time a random drafter (0: skip)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("legs", help="mlx-lm against dflash-mlx legs, alternated")
    p.add_argument("--settings", default="demo-gsm8k,demo-mtbench,untrained,4bit,long,synthetic")
    p.add_argument(
        "--legs",
        default="plain,adaptive",
        help="plain, adaptive, b1 (the drafter present, never drafting), b2 ... (comma-separated)",
    )
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--unseeded", action="store_true", help="sampled legs without a seed (as a user's call)")
    p.add_argument(
        "--synthetic",
        type=Path,
        default=Path("/tmp/dflash-synthetic"),
        help="a scripts/train_synthetic.py work directory (target/, drafter/, prompts.jsonl)",
    )
    p.add_argument(
        "--response-format",
        type=response_format,
        metavar="json_object|SCHEMA|FILE",
        help="every leg under this grammar (prompts ask for JSON)",
    )
    p.add_argument("--out", type=Path)
    p.add_argument("--table", type=Path, metavar="REPORT", help="print the tables of a saved report and stop")

    p = sub.add_parser("serving", help="dflash-mlx serve against mlx_lm.server")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-concurrency", type=int, default=32, help="the batched server's")
    p.add_argument("--serial", action="store_true", help="also a one-at-a-time dflash-mlx serve")
    p.add_argument("--out-dir", type=Path)

    p = sub.add_parser("agent", help="a conversation through both servers, cached and cold")
    p.add_argument("--tools", type=int, default=6, help="tool descriptions in the system prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", type=Path)

    p = sub.add_parser("repeat", help="a repeated agent step: the suffix index's second pass against a fresh server")
    p.add_argument("--questions", type=int, default=8, help="GSM8K questions per pass")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1, help="requests of a pass in flight")
    p.add_argument("--control", type=int, default=0, help="other GSM8K questions the fresh server serves first")
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for both servers (repeatable)")
    p.add_argument("--out", type=Path)

    p = sub.add_parser("norepeat", help="nothing to repeat: the default server against --suffix-cache-tokens 0")
    p.add_argument("--num-prompts", type=int, default=20, help="prompts per workload (GSM8K, MT-Bench)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    p.add_argument("--serve-arg", action="append", default=[], help="an argument for both servers (repeatable)")
    p.add_argument("--out", type=Path)

    p = sub.add_parser("batch", help="batch_generate against mlx-lm's")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--block", type=int, default=None, help="a fixed block (default: the batch's own choice)")
    p.add_argument("--rounds", type=int, default=3)

    p = sub.add_parser("sharded", help="one process against 2 ring ranks")
    p.add_argument("--synthetic", type=Path, help="a scripts/train_synthetic.py work directory")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--blocks", default="auto,8", help="DFlash legs: auto and/or fixed blocks, comma-separated")

    p = sub.add_parser("load", help="the adaptive block when the machine's load changes (calibration, run)")
    p.add_argument(
        "--scenario",
        choices=["calibration", "run", "both", "loaded-run", "timing"],
        default="both",
        help="calibration: the curve cached under load, then `dflash-mlx bench` quiet; run: a quiet "
        "curve, then load during a run of generations, then quiet again; loaded-run: a quiet calibration, "
        "then load through a whole run (--runs times, each a process); timing: what the engine "
        "charges a cycle against the wall time between cycles and a calibration",
    )
    p.add_argument("--consumer-ms", type=float, default=2.0, help="timing: the caller's busy work per token")
    p.add_argument("--rounds", type=int, default=2, help="timing: rounds over the prompts")
    p.add_argument("--busy", type=int, default=2, help="CPU-bound processes started as the load")
    p.add_argument(
        "--num-prompts", type=int, default=10, help="calibration: `dflash-mlx bench --num-prompts`; loaded-run: prompts"
    )
    p.add_argument("--runs", type=int, default=3, help="loaded-run: runs, each in a process of its own")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--window", type=int, default=10, help="run: prompts per window")
    p.add_argument(
        "--phases",
        type=int,
        nargs=3,
        default=[1, 2, 2],
        metavar=("QUIET", "BUSY", "QUIET"),
        help="run: windows before, during and after the load",
    )
    p.add_argument("--settle", type=float, default=2.0, help="seconds between stopping the load and measuring")
    p.add_argument("--out", type=Path)

    p = sub.add_parser("ab", help="today's code against a new checkout's, alternated, paired ratios (batch, serving)")
    p.add_argument(
        "--base",
        type=Path,
        required=True,
        metavar="DIR",
        help="a checkout of today's code (e.g. `git worktree add --detach /tmp/today main`)",
    )
    p.add_argument(
        "--new", type=Path, metavar="DIR", help="a checkout of the new code (default: the one this script is in)"
    )
    p.add_argument(
        "--leg",
        dest="ab_leg",
        choices=["batch", "serving"],
        required=True,
        help="batch: dflash_mlx.batch_generate at each --widths; serving: dflash-mlx serve at each --concurrency",
    )
    p.add_argument("--num-prompts", type=int, help="GSM8K prompts (default: 8 for batch, 16 for serving)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8], help="batch: rows at once")
    p.add_argument("--block", type=int, default=None, help="batch: a fixed block (default: the batch's own choice)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="serving: requests in flight")
    p.add_argument("--decode-concurrency", type=int, default=32, help="serving: the batched server's")
    p.add_argument(
        "--serial", action="store_true", help="serving: also a one-at-a-time server (--decode-concurrency 1)"
    )
    p.add_argument("--min-rounds", type=int, default=5, help="rounds measured at least (after the warm-up round)")
    p.add_argument("--max-rounds", type=int, default=30, help="rounds measured at most")
    p.add_argument(
        "--half-width",
        type=float,
        default=0.05,
        help="rounds are added until every configuration's 95%% interval of new / base is within this of its estimate",
    )
    p.add_argument("--threshold", type=float, default=0.97, help="the new / base every configuration must reach")
    p.add_argument("--seed", type=int, default=0, help="which side goes first in each pair of rounds")
    p.add_argument(
        "--work-dir", type=Path, help="logs, reports and each side's calibration cache (default: a temp dir)"
    )
    p.add_argument("--out", type=Path, help="the report as JSON")

    p = sub.add_parser("rank-job")  # internal: one rank of `sharded`
    p.add_argument("job", type=Path)

    p = sub.add_parser("ab-batch-job")  # internal: one side of one `ab --leg batch` round
    p.add_argument("job", type=Path)
    p.add_argument("out", type=Path)

    p = sub.add_parser("loaded-run-job")  # internal: one run of `load --scenario loaded-run`
    p.add_argument("job", type=Path)
    p.add_argument("out", type=Path)

    args = ap.parse_args()
    if args.leg == "rank-job":
        rank_job(args.job)
    elif args.leg == "ab-batch-job":
        ab_batch_job(args.job, args.out)
    elif args.leg == "loaded-run-job":
        loaded_run_job(args.job, args.out)
    else:
        {
            "engine": engine,
            "legs": legs,
            "serving": serving,
            "agent": agent,
            "repeat": repeat,
            "norepeat": norepeat,
            "batch": batch,
            "sharded": sharded,
            "load": load,
            "ab": ab,
        }[args.leg](args)


if __name__ == "__main__":
    from dflash_mlx.cli.openblas import maybe_reexec

    maybe_reexec()
    main()
