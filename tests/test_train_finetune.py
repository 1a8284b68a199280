"""`train --init` (fine-tuning a published drafter) and `--replay` on a target that speaks two kinds of text.

The target is a tiny qwen3 model built by hand to be a first-order Markov
chain: attention and MLP outputs are zero, so every layer passes the token's
embedding through, and the head maps each token to its successor (the chains'
tokens have orthogonal embeddings, so the successor's logit is 16 and every
other logit 0). Kind A (prompts opened by the marker `<|im_start|>`) walks one cycle
of 32 tokens, kind B (marker `<|im_end|>`) another, disjoint cycle; prompt
words of each kind enter their own cycle. A drafter trained on A has never
seen B's tokens, so it drafts B poorly; fine-tuning it on B with A replayed
must beat training from scratch on B for the same number of steps, and keep
most of its acceptance on A. Every drafter written decodes losslessly.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import helpers as tm

import dflash_mlx
from dflash_mlx import load_draft
from dflash_mlx.train.validate import acceptance_length
from helpers.train_cli import train_ok

pytestmark = pytest.mark.slow  # training runs


CYCLE, PROMPTS_PER_KIND, GAIN, HIDDEN = 32, 40, 16.0, 160
MARKERS = {"A": "<|im_start|>", "B": "<|im_end|>"}
SCRATCH = ["--target-layers", "0,1", "--draft-layers", "2"]
COMMON = [
    "--block-size",
    "4",
    "--max-tokens",
    "24",
    "--batch-size",
    "8",
    "--anchors-per-seq",
    "8",
    "--holdout",
    "8",
    "--val-max-tokens",
    "24",
    "--save-every",
    "1000",
]


def roundtrip_tokens(tokenizer) -> list[int]:
    """Ids t that a prompt `<marker> + decode(t)` encodes back to [marker id, t]."""
    found = []
    for t in range(len(tm.SPECIAL_TOKENS), tm.TINY_VOCAB):
        text = tokenizer.decode([t])
        if all(tokenizer.encode(m + text, add_special_tokens=False)[1:] == [t] for m in MARKERS.values()):
            found.append(t)
    return found


def make_markov_target(out_dir: Path) -> tuple[Path, dict[str, list[str]]]:
    """The two-kind Markov target and its prompts {"A": [...], "B": [...]}."""
    from mlx_lm import load

    tm.make_target(out_dir, "qwen3", num_layers=2, hidden_size=HIDDEN, seed=7)
    tokenizer = load(str(out_dir))[1]
    words = roundtrip_tokens(tokenizer)
    rng = np.random.default_rng(3)
    order = [int(t) for t in rng.permutation(words)]
    prompt_ids = {"A": order[:PROMPTS_PER_KIND], "B": order[PROMPTS_PER_KIND : 2 * PROMPTS_PER_KIND]}
    used = set(order[: 2 * PROMPTS_PER_KIND]) | set(range(len(tm.SPECIAL_TOKENS)))
    free = [int(t) for t in rng.permutation([t for t in range(tm.TINY_VOCAB) if t not in used])]
    cycles = {"A": free[:CYCLE], "B": free[CYCLE : 2 * CYCLE]}
    successor = {}
    for kind, cycle in cycles.items():
        successor.update({cycle[i]: cycle[(i + 1) % CYCLE] for i in range(CYCLE)})
        successor.update({p: cycle[(i * 13) % CYCLE] for i, p in enumerate(prompt_ids[kind])})
        successor[tokenizer.encode(MARKERS[kind], add_special_tokens=False)[0]] = cycle[0]

    weights = dict(mx.load(str(out_dir / "model.safetensors")))
    embed = rng.standard_normal((tm.TINY_VOCAB, HIDDEN)).astype(np.float32)
    keys = sorted(successor)  # orthogonal embeddings (rms 1) for every token the chains use
    embed[keys] = np.linalg.qr(rng.standard_normal((HIDDEN, len(keys))))[0].T * np.sqrt(HIDDEN)
    head = np.zeros((tm.TINY_VOCAB, HIDDEN), np.float32)
    for x, y in successor.items():  # logit of succ(x) = GAIN, of every other token 0
        head[y] += GAIN / HIDDEN * embed[x]
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])  # each layer passes its input through
        elif name.endswith("norm.weight") and not name.startswith("model.layers"):
            weights[name] = mx.ones_like(weights[name])
    weights["model.embed_tokens.weight"] = mx.array(embed)
    weights["lm_head.weight"] = mx.array(head)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    prompts = {k: [MARKERS[k] + tokenizer.decode([p]) for p in ids] for k, ids in prompt_ids.items()}
    return out_dir, prompts


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def two_kinds(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-kinds")
    target, prompts = make_markov_target(root / "target")
    files = {k: write_prompts(root / f"{k}.jsonl", v) for k, v in prompts.items()}
    return {"root": root, "target": target, "prompts": prompts, "files": files}


def held_acceptance(target: Path, drafter: Path, prompts: list[str]) -> float:
    model, tokenizer, _ = tm.load_pair(str(target))
    draft = load_draft(drafter, model)
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    return acceptance_length(model, draft, tokenizer, ids, max_tokens=24, block_size=4)["mean_acceptance_length"]


def assert_lossless(target: Path, drafter: Path, prompts: list[str]) -> None:
    model, tokenizer, _ = tm.load_pair(str(target))
    draft = load_draft(drafter, model)
    for prompt in prompts:
        plain = dflash_mlx.generate(model, None, tokenizer, prompt, max_tokens=24)
        assert dflash_mlx.generate(model, draft, tokenizer, prompt, max_tokens=24) == plain, prompt


def test_the_target_speaks_two_disjoint_chains(two_kinds):
    from mlx_lm import load

    model, tokenizer = load(str(two_kinds["target"]))
    outputs = {}
    for kind, prompts in two_kinds["prompts"].items():
        ids, gaps = tm.greedy_with_margins(model, tokenizer.encode(prompts[0], add_special_tokens=False), 40)
        assert gaps.min() > 3.0  # clear margins: lossless comparisons are exact
        assert len(set(ids)) == CYCLE and ids[CYCLE:] == ids[: 40 - CYCLE]  # a cycle of 32 tokens
        outputs[kind] = set(ids)
    assert not outputs["A"] & outputs["B"]


FINETUNE_STEPS = 20


@pytest.fixture(scope="module")
def runs(two_kinds):
    """A drafter trained on A; then N steps on B from scratch, from it, and from it with A replayed."""
    root, target, files = two_kinds["root"], two_kinds["target"], two_kinds["files"]
    common = ["--model", target, "--responses", root / "responses.jsonl", *COMMON]
    train_ok(*common, "--data", files["A"], "--out", root / "on-A", "--steps", "150", "--lr", "3e-3", *SCRATCH)
    steps = ["--data", files["B"], "--steps", str(FINETUNE_STEPS), "--lr", "3e-3"]
    train_ok(*common, *steps, "--out", root / "scratch-B", *SCRATCH)
    train_ok(*common, *steps, "--out", root / "init-B", "--init", root / "on-A")
    output = train_ok(*common, *steps, "--out", root / "replay-B", "--init", root / "on-A", "--replay", files["A"])
    return {"root": root, "replay_output": output}


def held_out(prompts: list[str], seed: int) -> list[str]:
    """The prompts the trainer holds out of a file (`--holdout 8`, seed 0; replay files use seed + 1)."""
    from dflash_mlx.train.trainer import split_holdout

    return split_holdout(prompts, 8, seed)[1]


def report(out: Path) -> dict:
    return json.loads((out / "training_report.json").read_text())


def test_init_on_b_beats_scratch_and_replay_keeps_a(two_kinds, runs):
    root, target, prompts = runs["root"], two_kinds["target"], two_kinds["prompts"]
    on_a, scratch, init, replay = (report(root / d) for d in ("on-A", "scratch-B", "init-B", "replay-B"))
    held_a, held_b = held_out(prompts["A"], 1), held_out(prompts["B"], 0)  # replay's and B's held-out prompts
    a_before, b_before = (held_acceptance(target, root / "on-A", p) for p in (held_a, held_b))
    a_after_init = held_acceptance(target, root / "init-B", held_a)
    print(
        f"\nacceptance (block 4) of the A-drafter: A {a_before:.2f}, B {b_before:.2f}; after {FINETUNE_STEPS} steps "
        f"on B: from scratch B {scratch['mean_acceptance_length']:.2f}; --init B {init['mean_acceptance_length']:.2f}"
        f" (A {a_after_init:.2f}); --init --replay B {replay['mean_acceptance_length']:.2f} "
        f"(A {replay['replay_mean_acceptance_length']:.2f})"
    )
    assert on_a["mean_acceptance_length"] > 2.8 and a_before > 2.8  # block 4: at most 4
    assert b_before < 1.3  # B's tokens were never seen
    assert init["init"] == str(root / "on-A") and scratch["init"] is None
    assert init["mean_acceptance_length"] > scratch["mean_acceptance_length"] + 0.3
    assert replay["mean_acceptance_length"] > scratch["mean_acceptance_length"] + 0.15
    assert replay["replay_per_batch"] == 2 and replay["replay_holdout_prompts"] == 8  # --replay-ratio 0.25 of 8
    assert replay["replay_mean_acceptance_length"] > 0.8 * a_before  # most of A kept
    assert replay["replay_mean_acceptance_length"] > a_after_init  # ... thanks to the replay
    assert "held-out replay prompts" in runs["replay_output"]


def test_init_output_is_the_published_format_and_lossless(two_kinds, runs):
    root, target, prompts = runs["root"], two_kinds["target"], two_kinds["prompts"]
    before, after = (json.loads((root / d / "config.json").read_text()) for d in ("on-A", "init-B"))
    assert after["architectures"] == ["DFlashDraftModel"] and after["dflash_config"] == before["dflash_config"]
    assert {k: v for k, v in after.items() if k != "torch_dtype"} == {
        k: v for k, v in before.items() if k != "torch_dtype"
    }
    saved = mx.load(str(root / "init-B" / "model.safetensors"))
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in saved)
    for name in ("on-A", "scratch-B", "init-B", "replay-B"):
        assert_lossless(target, root / name, prompts["A"][:3] + prompts["B"][:3])


def long_prompts(prompts: list[str], marker: str, words: int, seed: int = 5) -> list[str]:
    """Each prompt with `words` filler words between its marker and its last token (~2 tokens a word)."""
    vocab = "the river ran past the old mill and under the stone bridge near the market every morning".split()
    rng = np.random.default_rng(seed)
    return [marker + " ".join(rng.choice(vocab, words)) + "\n" + p[len(marker) :] for p in prompts]


def test_long_context_finetuning(two_kinds, runs):
    """The A-drafter (trained on 2-token prompts) drafts poorly after a 300-token prompt;
    fine-tuning it with --max-length on long prompts fixes that and keeps short prompts."""
    root, target = runs["root"], two_kinds["target"]
    longs = long_prompts(two_kinds["prompts"]["A"], MARKERS["A"], 150)
    model, tokenizer, _ = tm.load_pair(str(target))
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in longs]
    assert min(lengths) > 250
    data = write_prompts(root / "A-long.jsonl", longs)
    short_held, long_held = held_out(two_kinds["prompts"]["A"], 0), held_out(longs, 0)
    before_long, before_short = (held_acceptance(target, root / "on-A", p) for p in (long_held, short_held))
    train_ok(
        "--model",
        target,
        "--responses",
        root / "responses.jsonl",
        *COMMON,
        "--data",
        data,
        "--out",
        root / "long",
        "--init",
        root / "on-A",
        "--steps",
        "12",
        "--lr",
        "1e-3",
        "--max-length",
        "1024",
        "--feature-chunk",
        "128",
        "--cache-features",
    )
    after = report(root / "long")
    after_short = held_acceptance(target, root / "long", short_held)
    print(
        f"\nA at ~{min(lengths)}-token prompts: {before_long:.2f} -> {after['mean_acceptance_length']:.2f} after "
        f"12 steps with --max-length 1024; at short prompts {before_short:.2f} -> {after_short:.2f}"
    )
    assert after["max_length"] == 1024 and after["dropped_sequences"] == 0
    assert before_long < 1.8 and before_short > 2.8
    assert after["mean_acceptance_length"] > before_long + 0.8
    assert after_short > 0.85 * before_short
    assert_lossless(target, root / "long", long_held[:2])
