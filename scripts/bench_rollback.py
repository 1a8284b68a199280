"""Time Gated DeltaNet rollback against the verify it undoes.

Builds a random float32 qwen3_5 (hybrid) target in memory, prefills a prompt,
then repeatedly: verifies a block of b rows (recording what rollback needs),
rolls back to `keep` rows, and times both. Reports the median times and the
rollback/verify ratio, for a tiny and a mid-size model by default.

On Linux, preload the system OpenBLAS (see README) for realistic CPU numbers.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models import qwen3_5

from dflash_mlx.targets.adapter import TargetAdapter
from dflash_mlx.targets.rollback import rollback

SIZES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_key_head_dim=16,
                 linear_num_value_heads=4, linear_value_head_dim=16, vocab_size=512),
    "mid": dict(hidden_size=1024, num_hidden_layers=16, intermediate_size=3072, num_attention_heads=8,
                num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_key_head_dim=128,
                linear_num_value_heads=16, linear_value_head_dim=64, vocab_size=32000),
}  # fmt: skip


def build(size: str) -> qwen3_5.Model:
    text = dict(
        model_type="qwen3_5_text", rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
        full_attention_interval=4, tie_word_embeddings=False, max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25),
        **SIZES[size],
    )  # fmt: skip
    mx.random.seed(0)
    model = qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def measure(model, block: int, keep: int, prompt_len: int, repeats: int) -> dict:
    target = TargetAdapter(model)
    vocab = target.vocab_size
    cache = target.make_cache()
    prompt = mx.random.randint(0, vocab, (1, prompt_len), key=mx.random.key(1))
    mx.eval(target.forward(prompt, cache)[0], [c.state for c in cache])
    block_ids = mx.random.randint(0, vocab, (1, block), key=mx.random.key(2))
    verify, rollbacks = [], []
    for _ in range(repeats):
        tic = time.perf_counter()
        logits, _, record = target.verify(block_ids, cache)
        mx.eval(logits, [c.state for c in cache])
        verify.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        rollback(cache, record, keep)
        mx.eval([c.state for c in cache])
        rollbacks.append(time.perf_counter() - tic)  # the context grows by `keep` per repeat
    verify.sort()
    rollbacks.sort()
    v, r = verify[len(verify) // 2], rollbacks[len(rollbacks) // 2]
    return {"verify_ms": round(v * 1e3, 3), "rollback_ms": round(r * 1e3, 3), "ratio": round(r / v, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["tiny", "mid"], choices=sorted(SIZES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--keep", type=int, default=4, help="rows kept (accepted drafts + 1)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    for size in args.sizes:
        result = measure(build(size), args.block_size, args.keep, args.prompt_len, args.repeats)
        print(json.dumps({"size": size, "block_size": args.block_size, "keep": args.keep, **result}))


if __name__ == "__main__":
    main()
