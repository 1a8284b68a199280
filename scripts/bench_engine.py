"""Measure the engine's overhead against the ideal speculative speedup.

Builds a random float32 qwen3 target in memory (about 240M parameters by
default), then in one process:
  1. plain greedy decoding with mlx-lm's generate_step (the baseline tok/s),
  2. the same through dflash_mlx with no drafter (our plain path),
  3. DFlash with an OracleProposer at a fixed acceptance pattern,
  4. separately timed target forwards of 1 and b rows at the same context,
  5. (optionally) a random DFlash drafter's forward, for the ideal with a real drafter,
and reports measured speedup / ideal speedup, where
ideal = tau * T(1) / (T_draft + T_verify(b)) and T_draft = 0 for the oracle.

On Linux, run with the system OpenBLAS preloaded (see README), e.g.
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
      python scripts/bench_engine.py
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen3

from dflash_mlx.engine import speculative_cycles
from dflash_mlx.proposers.oracle import OracleProposer
from dflash_mlx.targets.adapter import TargetAdapter
from dflash_mlx.targets.rollback import rollback


def build_target(hidden: int, layers: int, vocab: int, seed: int) -> qwen3.Model:
    mx.random.seed(seed)
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=hidden * 11 // 4, num_attention_heads=hidden // 64,
        rms_norm_eps=1e-6, vocab_size=vocab, num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=8192, head_dim=64, tie_word_embeddings=False, rope_theta=1e6,
    )
    model = qwen3.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def count_params(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def time_plain_mlx_lm(model, prompt, max_tokens) -> tuple[list[int], float]:
    tokens, tic = [], None
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        if tic is None:
            tic = time.perf_counter()  # prefill excluded
        tokens.append(token)
    return tokens, (len(tokens) - 1) / (time.perf_counter() - tic)


def time_engine(model, prompt, proposer, max_tokens, block_size) -> tuple[list[int], float, list[int]]:
    target = TargetAdapter(model, ())
    tokens, sizes, tic = [], [], None
    for cycle in speculative_cycles(target, prompt, proposer, max_tokens=max_tokens, block_size=block_size):
        if tic is None:
            tic = time.perf_counter()
        else:
            sizes.append(len(cycle.tokens))
        tokens += cycle.tokens
    return tokens, (len(tokens) - 1) / (time.perf_counter() - tic), sizes


def time_forward(model, prompt, rows: int, context: int, repeats: int) -> float:
    """Seconds per target forward of `rows` rows after `context` cached positions."""
    target = TargetAdapter(model, ())
    cache = target.make_cache()
    ids = mx.array(prompt.tolist() * (context // prompt.size + 1))[:context]
    logits, _ = target.forward(ids[None], cache)
    mx.eval(logits)
    step = mx.zeros((1, rows), dtype=mx.int32)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        logits, _, record = target.verify(step, cache)
        mx.eval(logits)
        times.append(time.perf_counter() - tic)
        rollback(cache, record, keep=0)
    times.sort()
    return times[len(times) // 2]


def time_draft(model, layers: int, block: int, new_context: int, context: int, repeats: int) -> float:
    """Seconds per DFlash draft (context ingest + block forward) of a random drafter."""
    from dflash_mlx.draft.config import parse_draft_config
    from dflash_mlx.draft.model import DFlashDraftModel

    a = model.args
    ids = [1 + i * (a.num_hidden_layers - 4) // max(layers - 1, 1) for i in range(layers)]
    config = parse_draft_config(dict(
        hidden_size=a.hidden_size, num_hidden_layers=layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim,
        intermediate_size=a.intermediate_size, vocab_size=a.vocab_size, rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=8192, rope_theta=a.rope_theta,
        dflash_config=dict(mask_token_id=0, target_layer_ids=ids, block_size=block),
    ))
    draft = DFlashDraftModel(config)
    mx.eval(draft.parameters())
    target = TargetAdapter(model, config.target_layer_ids)
    cache = draft.make_cache()
    width = layers * a.hidden_size
    draft.extend_context(mx.zeros((1, context, width)), cache)
    block_ids = mx.zeros((1, block), dtype=mx.int32)
    times = []
    for _ in range(repeats):
        features = mx.random.normal((1, new_context, width))
        mx.eval(features)
        tic = time.perf_counter()
        draft.extend_context(features, cache)
        mx.eval(mx.argmax(draft(block_ids, cache, target), axis=-1))
        times.append(time.perf_counter() - tic)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--accept", type=int, default=7, help="drafts accepted per cycle (tau = accept + 1)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--draft-layers", type=int, default=5, help="also time a random drafter (0: skip)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()

    model = build_target(args.hidden, args.layers, args.vocab, seed=0)
    prompt = mx.random.randint(0, args.vocab, (args.prompt_len,), key=mx.random.key(1)).astype(mx.int32)
    # Warm up both paths once.
    time_plain_mlx_lm(model, prompt, 8)
    reference, plain_tps = time_plain_mlx_lm(model, prompt, args.max_tokens)
    ours, ours_plain_tps, _ = time_engine(model, prompt, None, args.max_tokens, 1)
    oracle = OracleProposer(reference, [args.accept], args.vocab, args.block_size)
    drafted, dflash_tps, sizes = time_engine(model, prompt, oracle, args.max_tokens, args.block_size)
    assert ours == reference and drafted == reference, "engine output differs from mlx-lm greedy"

    context = args.prompt_len + args.max_tokens // 2
    t1 = time_forward(model, prompt, 1, context, args.repeats)
    tb = time_forward(model, prompt, args.block_size, context, args.repeats)
    tau = sum(sizes) / len(sizes)
    ideal = tau * t1 / tb
    measured = dflash_tps / plain_tps
    result = {
        "params_millions": round(count_params(model) / 1e6, 1),
        "block_size": args.block_size,
        "tau": round(tau, 3),
        "plain_mlx_lm_tps": round(plain_tps, 2),
        "plain_dflash_mlx_tps": round(ours_plain_tps, 2),
        "dflash_oracle_tps": round(dflash_tps, 2),
        "t_forward_1_ms": round(t1 * 1e3, 2),
        f"t_forward_{args.block_size}_ms": round(tb * 1e3, 2),
        "measured_speedup": round(measured, 3),
        "ideal_speedup": round(ideal, 3),
        "overhead_ratio": round(measured / ideal, 3),
    }
    if args.draft_layers:
        td = time_draft(model, args.draft_layers, args.block_size, round(tau), context, args.repeats)
        result["t_draft_ms"] = round(td * 1e3, 2)
        result["ideal_speedup_with_drafter"] = round(tau * t1 / (td + tb), 3)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")


if __name__ == "__main__":
    main()
