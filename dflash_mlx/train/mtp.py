"""`dflash-mlx train --arch mtp`: training a target's own MTP heads on its own outputs.

The target regenerates the responses to the prompts (`regenerate`, cached, as
for a DFlash drafter), its final hidden states and token embeddings are read
through the adapter (`TargetAdapter(final=True)`, as the proposer reads them),
and stage 0 learns to predict x[t+2] from (h[t], embed(x[t+1])) at every
response position, in one causal pass per sequence (its decoder layer's own
attention over the pairs before, as when drafting): cross-entropy through
the target's output head (or the stage's own), AdamW with warm-up and cosine
decay, gradient clipping. The heads start from the checkpoint's own where it
has them (a fine-tuned target whose heads no longer match), else fresh
(mlx-lm's initialisation of the family's layer). They are written into a copy
of the target checkpoint under the family's names (`mtp.export`) and measured
as they load from it: tokens per cycle at `--block-size` (greedy, the heads
alone: no copy-aware drafting) on the held-out prompts, and the offline top-1
accuracy of stage 0 on the held-out responses.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import mlx.optimizers as optim
from rich.console import Console

from ..draft.load import resolve_model_dir
from ..models.dtype import target_float_dtype
from ..models.resolve import choose_model
from ..mtp.checkpoint import load_mtp_head, new_mtp_head
from ..mtp.export import write_mtp_checkpoint
from ..mtp.head import MTPHead
from ..mtp.scan import has_mtp_weights
from ..proposers.mtp import load_mtp
from ..targets.adapter import TargetAdapter
from ..targets.families import context_length
from ..utils.io import write_json_atomic
from .batches import Sequence, build_sequences
from .data import encode_prompts, read_prompts
from .options import OptionError, TrainOptions
from .regenerate import regenerate_for
from .step import make_optimizer
from .trainer import DTYPES, load_target, split_holdout
from .validate import acceptance_length

DEFAULT_MTP_BLOCK = 3  # the anchor and two chained drafts
FIT_PROMPTS = 8  # training prompts the heads are also measured on (how well they fit their own workload)
DRAFTER_ONLY = (
    "draft_layers",
    "target_layers",
    "mask_token_id",
    "intermediate_size",
    "init",
    "replay",
    "loss_decay",
    "markov_rank",
)


def check_mtp_options(options: TrainOptions) -> None:
    """A drafter's own options (DFlash and DSpark) have no meaning for MTP heads: refused, by flag."""
    for name in DRAFTER_ONLY:
        if getattr(options, name) is not None:
            raise OptionError(f"--{name.replace('_', '-')} is for DFlash and DSpark drafters, not --arch mtp.")
    if options.resume or options.cache_features:
        raise OptionError(
            f"--{'resume' if options.resume else 'cache-features'} is for DFlash and DSpark drafters, not --arch mtp."
        )


def train_mtp(options: TrainOptions, console: Console | None = None) -> dict[str, Any]:
    """Train the target's MTP heads, write them into a copy of its checkpoint at `options.out`; the report."""
    options.check()
    check_mtp_options(options)
    console = console or Console()
    out = Path(options.out)
    work = Path(options.work_dir) if options.work_dir else out / "work"
    records = read_prompts(options.data)
    console.print(f"Loading target [bold]{options.model}[/bold]")
    model, tokenizer = load_target(options.model, options.target_dtype)
    source = resolve_model_dir(choose_model(options.model, use_draft=False).target, "target model")
    block = options.block_size or DEFAULT_MTP_BLOCK
    options = options.resolved(target_context=context_length(model))
    prompts = encode_prompts(tokenizer, records, str(options.data), options.chat_template_kwargs)
    train_prompts, held_prompts = split_holdout(prompts, options.holdout, options.seed)
    responses = regenerate_for(options, model, tokenizer, train_prompts + held_prompts, work, console)
    sequences, dropped = build_sequences(train_prompts, responses[: len(train_prompts)], options.max_length)
    held, _ = build_sequences(held_prompts, responses[len(train_prompts) :], options.max_length)
    if not sequences:
        raise OptionError(f"No usable training sequence in {options.data}: every response is shorter than 2 tokens.")
    mx.random.seed(options.seed)
    finetune = has_mtp_weights(str(source))
    head = load_mtp_head(source, model, target_float_dtype(model)) if finetune else new_mtp_head(model)
    head.set_dtype(target_float_dtype(model) or mx.float32)
    target = TargetAdapter(model, final=True)
    console.print(
        f"Training {'the checkpoint' if finetune else 'new'} {head.family} MTP heads ({len(head.stages)} stage) "
        f"on {len(sequences)} sequences ({dropped} dropped), {len(held)} held out, lr {options.lr:g}"
    )
    losses, seconds = _train(head, target, sequences, options, console)
    write_mtp_checkpoint(source, out, head, model, DTYPES[options.save_dtype])
    console.print(f"MTP heads written into a copy of the target at {out}")
    report: dict[str, Any] = {
        "arch": "mtp",
        "target": options.model,
        "checkpoint": str(out),
        "family": head.family,
        "stages": len(head.stages),
        "fine_tuned": finetune,
        "steps": options.steps,
        "train_sequences": len(sequences),
        "holdout_prompts": len(held_prompts),
        "held_prompt_ids": held_prompts,
        "train_prompt_ids": [list(s.ids[: s.prompt_len]) for s in sequences[: max(len(held), FIT_PROMPTS)]],
        "train_seconds": seconds,
        "loss_first": _mean(losses[:10]),
        "loss_last": _mean(losses[-10:]),
        "block_size": block,
    }
    loaded = load_mtp(out, model, dtype=target_float_dtype(model))  # the heads as the checkpoint holds them
    fit = sequences[: len(report["train_prompt_ids"])]
    for key, measured, what in (("", held, "held-out"), ("train_", fit, "training")):
        top1, validation = _measure(model, loaded, tokenizer, measured, block, options, console)
        report.update({f"{key}top1_accuracy": top1, f"{key}tokens_per_cycle": None, f"{key}validation": validation})
        if validation is not None:
            report[f"{key}tokens_per_cycle"] = validation["mean_acceptance_length"]
        console.print(
            f"{len(measured)} {what} prompts: top-1 accuracy {_shown(top1)}, "
            f"{_shown(report[f'{key}tokens_per_cycle'])} tokens per cycle at block {block}"
        )
    write_json_atomic(out / "training_report.json", report)
    return report


def _measure(model, mtp, tokenizer, sequences: list[Sequence], block: int, options: TrainOptions, console):
    """(stage 0's offline top-1 accuracy on the sequences' responses, the greedy decoding of their prompts with the
    heads alone at `block`), or (None, None) without sequences."""
    if not sequences:
        return None, None
    top1 = top1_accuracy(mtp.drafter, TargetAdapter(model, final=True), sequences)
    prompts = [list(s.ids[: s.prompt_len]) for s in sequences]
    max_tokens = options.val_max_tokens or options.max_tokens
    validation = acceptance_length(
        model, mtp, tokenizer, prompts, max_tokens=max_tokens, block_size=block, console=console, lookup=False
    )
    return top1, validation


def _features(target: TargetAdapter, ids: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    """(h [1, L, H], embeddings [1, L, H]) of a sequence: the target's final hidden states and token embeddings."""
    _, features = target.forward(mx.array(ids, mx.int32)[None], None, logits=False)
    size = target.hidden_size
    return mx.stop_gradient(features[..., -2 * size : -size]), mx.stop_gradient(features[..., -size:])


def stage_inputs(head: MTPHead, target: TargetAdapter, seq: Sequence):
    """Stage 0's training rows of a sequence: (hidden, next embeddings, labels x[t+2], weights: response labels)."""
    hidden, embeddings = _features(target, seq.ids)
    n = len(seq.ids) - 2
    nexts = embeddings[:, 1 : n + 1]
    if head.layout.masks_first_position:
        nexts = mx.concatenate([mx.zeros_like(nexts[:, :1]), nexts[:, 1:]], axis=1)
    labels = mx.array(seq.ids[2:], mx.int32)[None]
    weights = (mx.arange(2, len(seq.ids)) >= seq.prompt_len).astype(mx.float32)[None]
    return hidden[:, :n], nexts, labels, weights


def _train(head: MTPHead, target: TargetAdapter, sequences: list[Sequence], options: TrainOptions, console):
    optimizer: optim.Optimizer = make_optimizer(options)

    def loss_fn(module, batch):
        total, count = mx.array(0.0), mx.array(0.0)
        for hidden, nexts, labels, weights in batch:
            logits = module.logits(0, module.forward(0, hidden, nexts), target)
            ce = nn.losses.cross_entropy(logits.astype(mx.float32), labels, reduction="none")
            total, count = total + (ce * weights).sum(), count + weights.sum()
        return total / mx.maximum(count, 1.0)

    step_fn = nn.value_and_grad(head, loss_fn)
    order, losses = np.random.default_rng([options.seed, 3]), []
    tic = time.perf_counter()
    for step in range(options.steps):
        picks = order.choice(len(sequences), size=min(options.batch_size, len(sequences)), replace=False)
        batch = [stage_inputs(head, target, sequences[i]) for i in picks]  # (the target's features, per step)
        loss, grads = step_fn(head, batch)
        grads, _ = optim.clip_grad_norm(grads, options.grad_clip)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state, loss)
        losses.append(loss.item())
        if (step + 1) % max(1, options.steps // 10) == 0:
            console.print(f"step {step + 1}/{options.steps} loss {_mean(losses[-20:]):.3f}")
    return losses, time.perf_counter() - tic


def top1_accuracy(head: MTPHead, target: TargetAdapter, sequences: list[Sequence]) -> float | None:
    """How often stage 0's argmax is x[t+2] over the response positions of `sequences` (teacher-forced)."""
    right, total = 0.0, 0.0
    for seq in sequences:
        hidden, nexts, labels, weights = stage_inputs(head, target, seq)
        best = mx.argmax(head.logits(0, head.forward(0, hidden, nexts), target), axis=-1)
        right += ((best == labels) * weights).sum().item()
        total += weights.sum().item()
    return right / total if total else None


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
