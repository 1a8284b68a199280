"""Build the bundled demo target: a small qwen3-architecture model trained from
scratch on GSM8K train (chat-formatted), with its own byte-level BPE tokenizer.

Steps (each resumable; run them in order):

    python3 scripts/build_demo_target.py tokenizer --work /tmp/demo
    python3 scripts/build_demo_target.py train --work /tmp/demo --epochs 5
    python3 scripts/build_demo_target.py export --work /tmp/demo --out dflash_mlx/demo/target

`train` saves a checkpoint (weights, optimizer state, step) every
`--save-every` steps and continues from the last one when rerun. On Linux run
it with the system OpenBLAS preloaded (docs/usage.md), float32 throughout; the
exported model is stored in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

DATA = Path(
    os.environ.get("GSM8K_TRAIN") or Path(__file__).resolve().parents[2] / "shared" / "datasets" / "gsm8k_train.jsonl"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONFIG = dict(
    model_type="qwen3",
    hidden_size=256,
    num_hidden_layers=6,
    intermediate_size=768,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    vocab_size=4096,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=2,
)
# `--family mimo`: the same size in MiMo's architecture (qwen2-style layers), whose checkpoints keep multi-token-
# prediction heads (`dflash-mlx train --arch mtp` trains them; the MTP benchmark, scripts/build_mtp_bench.sh)
FAMILIES = {
    "qwen3": CONFIG,
    "mimo": {
        **{k: v for k, v in CONFIG.items() if k != "head_dim"},
        "model_type": "mimo",
        "num_nextn_predict_layers": 1,
    },
}


def clean_answer(answer: str) -> str:
    """GSM8K answer -> step-by-step text ending in a boxed result."""
    body, _, final = answer.rpartition("####")
    body = re.sub(r"<<[^>]*>>", "", body).strip()
    return f"{body}\nThe final answer is \\boxed{{{final.strip()}}}."


def conversations(path: Path = DATA) -> list[str]:
    texts = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        texts.append(
            f"<|im_start|>user\n{row['question']}{GSM8K_SUFFIX}<|im_end|>\n"
            f"<|im_start|>assistant\n{clean_answer(row['answer'])}<|im_end|>\n"
        )
    return texts


def build_tokenizer(work: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(conversations(), trainer)
    out = work / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        add_bos_token=False,
        add_eos_token=False,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=CONFIG["max_position_embeddings"],
    )
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert ids["<|im_end|>"] == CONFIG["eos_token_id"], ids
    print(f"tokenizer: {tok.get_vocab_size()} tokens, specials {ids} -> {out}")


def token_stream(work: Path):
    import numpy as np
    from tokenizers import Tokenizer

    cache = work / "tokens.npy"
    if cache.exists():
        return np.load(cache)
    tok = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    texts = conversations()
    random.Random(0).shuffle(texts)
    ids = np.concatenate([np.array(e.ids, np.int32) for e in tok.encode_batch(texts)])
    np.save(cache, ids)
    return ids


def train(
    work: Path, epochs: float, seq_len: int, batch: int, lr: float, save_every: int, family: str = "qwen3"
) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten
    import importlib

    ids = token_stream(work)
    n_seq = (len(ids) - 1) // seq_len
    steps_per_epoch = n_seq // batch
    total = int(epochs * steps_per_epoch)
    print(f"{len(ids)} tokens, {n_seq} sequences of {seq_len}, {steps_per_epoch} steps/epoch, {total} steps")

    mx.random.seed(0)
    arch = importlib.import_module(f"mlx_lm.models.{family}")
    model = arch.Model(arch.ModelArgs.from_dict(FAMILIES[family]))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"parameters: {n_params / 1e6:.2f}M")
    warmup = max(1, int(0.03 * total))
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-7, lr, warmup), optim.cosine_decay(lr, total - warmup, lr * 0.05)],
        [warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.1)
    ckpt = work / "ckpt"
    step = 0
    if (ckpt / "state.json").exists():
        step = json.loads((ckpt / "state.json").read_text())["step"]
        model.load_weights(str(ckpt / "model.safetensors"))
        opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
        print(f"resumed at step {step}")

    def loss_fn(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def train_step(x, y):
        loss, grads = grad_fn(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    train_step = mx.compile(train_step, inputs=state, outputs=state)
    data = ids[: n_seq * seq_len + 1]
    tic, seen, avg = time.perf_counter(), 0, None
    while step < total:
        epoch, k = divmod(step, steps_per_epoch)
        order = np.random.default_rng(epoch).permutation(n_seq)[k * batch : (k + 1) * batch]
        rows = np.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in order])
        loss = train_step(mx.array(rows[:, :-1]), mx.array(rows[:, 1:]))
        mx.eval(state, loss)
        step += 1
        seen += batch * seq_len
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 25 == 0 or step == total:
            dt = time.perf_counter() - tic
            print(
                f"step {step}/{total} epoch {step / steps_per_epoch:.2f} loss {avg:.3f} "
                f"lr {opt.learning_rate.item():.2e} {seen / dt:.0f} tok/s",
                flush=True,
            )
        if step % save_every == 0 or step == total:
            save_checkpoint(model, opt, step, ckpt)


def save_checkpoint(model, opt, step: int, ckpt: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tmp = ckpt.with_name(ckpt.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    if ckpt.exists():
        old = ckpt.with_name(ckpt.name + ".old")
        os.rename(ckpt, old)
        os.rename(tmp, ckpt)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        os.rename(tmp, ckpt)


def export(work: Path, out: Path, family: str = "qwen3") -> None:
    import shutil

    import mlx.core as mx

    weights = mx.load(str(work / "ckpt" / "model.safetensors"))
    weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(dict(FAMILIES[family], torch_dtype="bfloat16"), indent=2) + "\n")
    for f in (work / "tokenizer").iterdir():
        shutil.copy(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    print(f"exported -> {out}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["tokenizer", "train", "export"])
    p.add_argument("--work", type=Path, required=True, help="working directory (checkpoints)")
    p.add_argument("--out", type=Path, help="export: the model directory to write")
    p.add_argument("--epochs", type=float, default=5.0)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3", help="the target's architecture")
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.step == "tokenizer":
        build_tokenizer(a.work)
    elif a.step == "train":
        train(a.work, a.epochs, a.seq_len, a.batch_size, a.lr, a.save_every, a.family)
    else:
        if a.out is None:
            sys.exit("export needs --out DIR")
        export(a.work, a.out, a.family)


if __name__ == "__main__":
    main()
