"""Train a DFlash drafter end to end on a tiny target that speaks a synthetic language.

1. A synthetic language of instructions and their deterministic answers, with
   random arguments: `count 17 to 31:` -> ` 17 18 ... 31`, `down 40 to 29:`,
   `evens from 12 to 30:`, `letters from d to m:` -> ` d e f ... m`,
   `repeat red fox jumps 3 times:` -> the phrase three times. Every answer
   ends with the end-of-text token.
2. A byte-level BPE tokenizer trained on it (tests/helpers-style: ChatML
   specials and a dedicated `<|mask|>` token) and a small qwen3-architecture
   target trained on it from scratch (plain next-token loss on random fresh
   examples), saved as an mlx-lm model directory.
3. `dflash_mlx.train.train_drafter` on instruction-only prompts: the target
   regenerates the answers, a drafter is trained with block size 8, and the
   validation pass reports the mean acceptance length on held-out prompts.
4. A check on 16 fresh instructions that DFlash greedy output equals plain
   greedy output, with their mean acceptance length.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python3 scripts/train_synthetic.py --work /tmp/dflash-synthetic

Prints the timings and the mean acceptance length and writes them to
`<work>/synthetic_report.json`. Rerunning reuses the trained target (delete
`<work>` to start over). `scripts/bench.py legs --settings synthetic` and
`sharded --synthetic` benchmark the pair it leaves in `<work>`
(docs/benchmarks.md, docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
WORDS = (
    "red blue green fox cat dog jumps runs sits high low fast slow big small old new "
    "sun moon star tree river stone bird fish cold warm"
).split()
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_LEN = 32  # tokens of the longest example (+ end of text), padded to for a fixed shape
CONFIG = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 384,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}


# ----------------------------------------------------------------- language


def example(rng: np.random.Generator) -> tuple[str, str]:
    """One (instruction, answer) pair; the answer starts with a space."""
    kind = rng.integers(5)
    if kind == 0:
        a = int(rng.integers(0, 80))
        b = a + int(rng.integers(6, 20))
        return f"count {a} to {b}:", "".join(f" {i}" for i in range(a, b + 1))
    if kind == 1:
        a = int(rng.integers(20, 99))
        b = a - int(rng.integers(6, 20))
        return f"down {a} to {b}:", "".join(f" {i}" for i in range(a, b - 1, -1))
    if kind == 2:
        a = 2 * int(rng.integers(0, 35))
        b = a + 2 * int(rng.integers(5, 14))
        return f"evens from {a} to {b}:", "".join(f" {i}" for i in range(a, b + 1, 2))
    if kind == 3:
        a = int(rng.integers(0, 14))
        b = a + int(rng.integers(6, 12))
        return f"letters from {LETTERS[a]} to {LETTERS[b]}:", "".join(f" {c}" for c in LETTERS[a : b + 1])
    phrase = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 5)), replace=False))
    n = int(rng.integers(2, 5))
    return f"repeat {phrase} {n} times:", f" {phrase}" * n


# ------------------------------------------------------------------- target


def build_tokenizer(out: Path, rng: np.random.Generator) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        min_frequency=1,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = ["".join(example(rng)) + "\n" for _ in range(4000)]
    tok.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIALS[0],
        "pad_token": SPECIALS[0],
        "unk_token": None,
        "mask_token": SPECIALS[3],
        "additional_special_tokens": SPECIALS[1:3],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def train_target(out: Path, steps: int, batch: int, seed: int) -> dict:
    """Plain LM training of the qwen3 target on fresh random examples; saves it to `out`."""
    from mlx_lm import load
    from mlx_lm.models.qwen3 import Model, ModelArgs
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tokenizer(tmp, rng)
    tokenizer = load_tokenizer(tmp)
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict(CONFIG))
    schedule = optim.join_schedules(
        [optim.linear_schedule(0.0, 3e-3, 50), optim.cosine_decay(3e-3, steps - 50, 1e-4)], [50]
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(ids, mask):
        logits = model(ids[:, :-1])
        ce = nn.losses.cross_entropy(logits, ids[:, 1:], reduction="none")
        return (ce * mask).sum() / mask.sum()

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)  # fixed shapes: compiled once
    def step_fn(ids, mask):
        loss, grads = loss_and_grad(ids, mask)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    tic, losses = time.perf_counter(), []
    for step in range(steps):
        ids = np.zeros((batch, MAX_LEN), np.int32)
        mask = np.zeros((batch, MAX_LEN - 1), np.float32)
        for i in range(batch):
            prompt, answer = example(rng)
            row = tokenizer.encode(prompt + answer) + [0]
            if len(row) > MAX_LEN:
                raise AssertionError(f"example of {len(row)} tokens > MAX_LEN {MAX_LEN}")
            ids[i, : len(row)] = row
            mask[i, : len(row) - 1] = 1
        loss = step_fn(mx.array(ids), mx.array(mask))
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
        if (step + 1) % 100 == 0:
            print(f"  target step {step + 1}/{steps}: loss {np.mean(losses[-100:]):.4f}", flush=True)
    seconds = time.perf_counter() - tic
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    load(str(out))  # loads through mlx-lm
    return {"steps": steps, "batch": batch, "seconds": seconds, "final_loss": float(np.mean(losses[-50:]))}


def target_accuracy(target_dir: Path, n: int, seed: int) -> float:
    """Fraction of fresh instructions whose greedy answer is exactly right."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(target_dir))
    rng = np.random.default_rng(seed)
    right = 0
    for _ in range(n):
        prompt, answer = example(rng)
        # mlx-lm's detokenizer drops the leading space of the first token.
        right += generate(model, tokenizer, prompt, max_tokens=80).strip() == answer.strip()
    return right / n


def lossless_check(target_dir: Path, drafter_dir: Path, n: int, seed: int) -> tuple[int, float]:
    """(prompts whose DFlash greedy output equals plain greedy, their mean acceptance length)."""
    import dflash_mlx
    from mlx_lm import load

    model, tokenizer = load(str(target_dir))
    drafter = dflash_mlx.load_draft(drafter_dir, model)
    rng = np.random.default_rng(seed)
    same, taus = 0, []
    for _ in range(n):
        prompt = example(rng)[0]
        plain = dflash_mlx.generate(model, None, tokenizer, prompt, max_tokens=64)
        responses = list(dflash_mlx.stream_generate(model, drafter, tokenizer, prompt, max_tokens=64))
        same += "".join(r.text for r in responses) == plain
        cycles = [r.cycle_tokens for r in responses if r.cycle_tokens]
        taus.append(sum(cycles) / len(cycles))
    return same, float(np.mean(taus))


# ------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflash-synthetic"))
    parser.add_argument("--target-steps", type=int, default=500)
    parser.add_argument("--target-batch", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=1000, help="instruction prompts for the drafter")
    parser.add_argument("--holdout", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300, help="drafter training steps")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=6e-4, help="drafter peak learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-acceptance", type=float, default=0.0, help="exit 1 below this")
    args = parser.parse_args()

    from dflash_mlx.train import TrainOptions, train_drafter

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    target_dir = work / "target"
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    tic = time.perf_counter()
    if (target_dir / "model.safetensors").is_file():
        print(f"Reusing the target in {target_dir}", flush=True)
        report["target"] = "reused"
    else:
        print(f"Training the target ({args.target_steps} steps)...", flush=True)
        report["target"] = train_target(target_dir, args.target_steps, args.target_batch, args.seed)
    report["target_accuracy"] = target_accuracy(target_dir, 50, args.seed + 1)
    print(f"Target answers {report['target_accuracy']:.0%} of fresh instructions exactly.", flush=True)

    rng = np.random.default_rng(args.seed + 2)
    data = work / "prompts.jsonl"
    tmp = data.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"prompt": example(rng)[0]}) + "\n" for _ in range(args.prompts)))
    os.replace(tmp, data)

    t_draft = time.perf_counter()
    options = TrainOptions(
        model=str(target_dir),
        data=str(data),
        out=str(work / "drafter"),
        steps=args.steps,
        block_size=args.block_size,
        draft_layers=args.draft_layers,
        max_tokens=96,
        lr=args.lr,
        batch_size=16,
        anchors_per_seq=16,
        save_every=max(args.steps // 2, 1),
        seed=args.seed,
        holdout=args.holdout,
        target_layers=[1, 2, 3],
    )
    shutil.rmtree(options.out, ignore_errors=True)
    result = train_drafter(options)
    report["drafter"] = {k: v for k, v in result.items() if k != "validation"}
    report["drafter_seconds"] = time.perf_counter() - t_draft
    report["mean_acceptance_length"] = tau = result["mean_acceptance_length"]
    same, fresh_tau = lossless_check(target_dir, Path(options.out), 16, args.seed + 3)
    report["lossless_prompts"] = f"{same}/16"
    report["fresh_prompts_acceptance_length"] = fresh_tau
    report["total_seconds"] = time.perf_counter() - tic
    tmp = work / "synthetic_report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    os.replace(tmp, work / "synthetic_report.json")
    keys = (
        "target_accuracy",
        "drafter_seconds",
        "total_seconds",
        "mean_acceptance_length",
        "fresh_prompts_acceptance_length",
        "lossless_prompts",
    )
    print(json.dumps({k: report[k] for k in keys}, indent=2))
    if same != 16:
        raise SystemExit("DFlash greedy output differs from plain greedy output")
    if tau is None or not math.isfinite(tau) or tau < args.min_acceptance:
        raise SystemExit(f"mean acceptance length {tau} is below --min-acceptance {args.min_acceptance}")


if __name__ == "__main__":
    main()
