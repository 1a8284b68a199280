"""`train_drafter`: a whole DFlash drafter training run, from prompts to a validated drafter.

Steps: read and encode the prompts, hold some out, have the target regenerate
the responses (cached), build a fresh drafter (or resume from the last
checkpoint), train it with AdamW + warmup + cosine decay + gradient clipping on
the weighted block loss (only the drafter's parameters: the target, its
embedding and head are frozen), checkpoint periodically, export the drafter in
the real checkpoint format and measure its mean acceptance length on the
held-out prompts. The run's files live in `<out>/work` (responses cache,
checkpoints, per-step log, optional feature cache); the report goes to
`<out>/training_report.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx import nn
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..draft.load import load_draft
from ..targets.families import text_model
from ..models.loading import target_float_dtype
from ..targets.adapter import TargetAdapter
from .batches import Sequence, build_sequences, step_batch, step_position
from .checkpoint import (
    export_drafter,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
    write_json_atomic,
)
from .data import encode_prompts, read_prompts
from .features import FeatureStore
from .loss import accepted_prefix, block_loss, default_decay, row_weights
from .model_forward import training_logits
from .new_drafter import drafter_config, new_drafter, resolve_mask_token_id
from .options import OptionError, TrainOptions, check_resumable
from .regenerate import regenerate_responses
from .validate import acceptance_length

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def load_target(name: str, dtype: str | None = None):
    """(model, tokenizer) through mlx-lm; errors name --model."""
    from mlx_lm import load

    path = Path(name).expanduser()
    if not path.exists() and (name.count("/") != 1 or name.startswith((".", "/", "~"))):
        raise OptionError(f"--model {name}: no such directory (and not a Hugging Face repo id 'org/name').")
    try:
        model, tokenizer = load(str(path) if path.exists() else name)[:2]
    except Exception as e:  # mlx-lm / huggingface_hub raise many types
        raise OptionError(f"--model {name}: mlx-lm could not load the target ({type(e).__name__}: {e}).") from e
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
    return model, tokenizer


def split_holdout(prompts: list[list[int]], holdout: int, seed: int) -> tuple[list, list]:
    """(training prompts, held-out prompts): a fixed random `holdout` of them held out."""
    if holdout >= len(prompts):
        raise OptionError(
            f"--holdout {holdout} leaves no training prompts (the data file has {len(prompts)})."
        )
    order = np.random.default_rng([seed, 2]).permutation(len(prompts))
    held = sorted(int(i) for i in order[:holdout])
    kept = sorted(int(i) for i in order[holdout:])
    return [prompts[i] for i in kept], [prompts[i] for i in held]


def fingerprint(sequences: list[Sequence]) -> str:
    h = hashlib.sha1()
    for s in sequences:
        h.update(json.dumps([s.prompt_len, s.ids]).encode())
    return h.hexdigest()


def make_optimizer(options: TrainOptions) -> optim.AdamW:
    """AdamW; linear warmup over `warmup` of the steps, then cosine decay to 0."""
    warmup = round(options.warmup * options.steps)
    decay = optim.cosine_decay(options.lr, max(options.steps - warmup, 1))
    schedule = decay
    if warmup > 0:
        schedule = optim.join_schedules([optim.linear_schedule(0.0, options.lr, warmup), decay], [warmup])
    return optim.AdamW(learning_rate=schedule, weight_decay=options.weight_decay)


class StepRunner:
    """One optimisation step on a batch: features, loss, gradients, clipping, update."""

    def __init__(self, drafter, target: TargetAdapter, store: FeatureStore, optimizer, options: TrainOptions):
        self.drafter, self.target, self.store, self.optimizer = drafter, target, store, optimizer
        self.options = options
        self.weights = row_weights(options.block_size, options.loss_decay)
        self.loss_and_grad = nn.value_and_grad(drafter, self._loss)

    def _loss(self, features, block_ids, anchors, targets, valid):
        logits = training_logits(self.drafter, self.target, features, block_ids, anchors)
        loss, blocks = block_loss(logits, targets, valid, self.weights)
        prefix = accepted_prefix(mx.stop_gradient(logits), targets, valid)
        block_valid = valid.any(axis=-1)
        tau = (prefix * block_valid).sum() / mx.maximum(blocks, 1.0)
        return loss, tau

    def __call__(self, step: int, sequences: list[Sequence], mask_id: int, pad_id: int) -> dict[str, float]:
        o = self.options
        indices, batch = step_batch(
            step, sequences, batch_size=o.batch_size, anchors_per_seq=o.anchors_per_seq,
            block_size=o.block_size, mask_id=mask_id, seed=o.seed, pad_id=pad_id,
        )  # fmt: skip
        features = self.store.batch_features(indices, batch, [sequences[i] for i in indices])
        (loss, tau), grads = self.loss_and_grad(features, batch.block_ids, batch.anchors, batch.targets, batch.valid)
        grads, grad_norm = optim.clip_grad_norm(grads, o.grad_clip)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, loss, tau, grad_norm)
        lr = self.optimizer.learning_rate.item()  # the rate this update used
        return {
            "loss": loss.item(),
            "tau": tau.item(),
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "tokens": batch.tokens,
        }


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("step {task.completed}/{task.total}"), BarColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("tau~ {task.fields[tau]}"),
        TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TextColumn("ETA"),
        TimeRemainingColumn(), console=console,
    )  # fmt: skip


def _read_log(path: Path, upto: int) -> list[dict]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def train_drafter(options: TrainOptions, console: Console | None = None) -> dict[str, Any]:
    """Run the whole training described by `options`; return the report (also saved).

    The report's `mean_acceptance_length` is None when `holdout` is 0 or the run
    stopped early (`stop_at`); `stopped_at` is then the step it stopped at.
    """
    options.check()
    console = console or Console()
    out = Path(options.out)
    work = Path(options.work_dir) if options.work_dir else out / "work"
    ckpt_root = work / "checkpoints"
    existing = latest_checkpoint(ckpt_root)
    if options.resume and existing is None:
        raise OptionError(f"--resume: no checkpoint to resume from in {ckpt_root}.")
    if not options.resume and existing is not None:
        raise OptionError(
            f"{ckpt_root} already holds checkpoints (latest {existing.name}): pass --resume to "
            "continue that run, or choose another --out / --work-dir."
        )
    records = read_prompts(options.data)
    console.print(f"Loading target [bold]{options.model}[/bold]")
    model, tokenizer = load_target(options.model, options.target_dtype)
    vocab = text_model(model).args.vocab_size
    mask_id = resolve_mask_token_id(tokenizer, options.mask_token_id, vocab, options.model)
    config = drafter_config(
        model, num_layers=options.draft_layers, block_size=options.block_size, mask_token_id=mask_id,
        target_layer_ids=options.target_layers, intermediate_size=options.intermediate_size,
        dtype=options.save_dtype,
    )  # fmt: skip
    layer_ids = tuple(config["dflash_config"]["target_layer_ids"])
    prompts = encode_prompts(tokenizer, records, str(options.data), options.chat_template_kwargs)
    train_prompts, held_prompts = split_holdout(prompts, options.holdout, options.seed)
    responses = regenerate_responses(
        model, tokenizer, train_prompts, Path(options.responses or work / "responses.jsonl"),
        max_tokens=options.max_tokens, target_name=options.model, batch_size=options.gen_batch_size,
        temperature=options.gen_temperature, seed=options.seed, console=console,
    )  # fmt: skip
    sequences, dropped = build_sequences(train_prompts, responses, options.max_length)
    if not sequences:
        raise OptionError(
            f"No usable training sequence in {options.data}: every response is shorter than 2 "
            f"tokens or the prompts fill --max-length {options.max_length}."
        )
    data_id = fingerprint(sequences)

    mx.random.seed(options.seed)
    drafter = new_drafter(config)
    optimizer = make_optimizer(options)
    start, elapsed_before = 0, 0.0
    if options.resume:
        check_resumable(read_checkpoint_state(existing)["options"], options, str(existing))
        state = load_checkpoint(existing, drafter, optimizer)
        if state.get("data_fingerprint") != data_id:
            raise OptionError(
                f"--resume: the training sequences differ from those of {existing} (data file, "
                "responses cache or tokenizer changed): start a new run in a new --out."
            )
        start, elapsed_before = int(state["step"]), float(state.get("train_seconds", 0.0))
        console.print(f"Resuming from {existing} (step {start})")
    target = TargetAdapter(model, layer_ids)
    store = FeatureStore(target, work / "features" if options.cache_features else None)
    runner = StepRunner(drafter, target, store, optimizer, options)
    pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
    end = min(options.steps, options.stop_at or options.steps)
    log_path = work / "train_log.jsonl"
    history = _read_log(log_path, start)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_log = log_path.with_name(f".{log_path.name}.tmp")
    tmp_log.write_text("".join(json.dumps(r) + "\n" for r in history))  # drop steps past the checkpoint
    os.replace(tmp_log, log_path)

    def checkpoint(step: int, seconds: float) -> None:
        epoch, batch_in_epoch = step_position(step, len(sequences), options.batch_size)
        state = {
            "options": options.to_dict(),
            "draft_config": config,
            "data_fingerprint": data_id,
            "num_sequences": len(sequences),
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "rng": "numpy default_rng([seed, 0, epoch]) orders an epoch, ([seed, 1, step]) draws anchors",
            "train_seconds": seconds,
        }
        save_checkpoint(ckpt_root, step, drafter, optimizer, state, keep=options.keep_checkpoints)

    decay = options.loss_decay or default_decay(options.block_size)
    console.print(
        f"Training a {options.draft_layers}-layer drafter (block {options.block_size}, target layers "
        f"{list(layer_ids)}, mask id {mask_id}, loss decay {decay:g}) "
        f"on {len(sequences)} sequences ({dropped} dropped), {len(held_prompts)} held out"
    )
    tic = time.perf_counter()
    seconds = elapsed_before
    with _progress(console) as progress, open(log_path, "a") as log:
        task = progress.add_task("train", total=options.steps, completed=start, loss="-", tau="-", tps="-")
        recent: list[dict] = []
        for step in range(start, end):
            t0 = time.perf_counter()
            row = runner(step, sequences, mask_id, pad_id)
            dt = time.perf_counter() - t0
            row.update(step=step + 1, seconds=dt)
            log.write(json.dumps(row) + "\n")
            log.flush()
            history.append(row)
            recent = (recent + [row])[-20:]
            loss = sum(r["loss"] for r in recent) / len(recent)
            tau = sum(r["tau"] for r in recent) / len(recent)
            tps = sum(r["tokens"] for r in recent) / max(sum(r["seconds"] for r in recent), 1e-9)
            progress.update(task, advance=1, loss=f"{loss:.3f}", tau=f"{tau:.2f}", tps=f"{tps:.0f}")
            if (step + 1) % options.save_every == 0 and step + 1 < end:
                checkpoint(step + 1, elapsed_before + time.perf_counter() - tic)
        seconds = elapsed_before + time.perf_counter() - tic
    if end > start:
        checkpoint(end, seconds)

    report: dict[str, Any] = {
        "target": options.model,
        "drafter": str(out),
        "steps": end,
        "total_steps": options.steps,
        "block_size": options.block_size,
        "draft_layers": options.draft_layers,
        "target_layer_ids": list(layer_ids),
        "mask_token_id": mask_id,
        "train_sequences": len(sequences),
        "dropped_sequences": dropped,
        "holdout_prompts": len(held_prompts),
        "train_seconds": seconds,
        "loss_first": _mean([r["loss"] for r in history[:10]]),
        "loss_last": _mean([r["loss"] for r in history[-10:]]),
        "stopped_at": None,
        "mean_acceptance_length": None,
        "validation": None,
    }
    if end < options.steps:
        report["stopped_at"] = end
        console.print(f"Stopped at step {end} of {options.steps}; continue with --resume.")
        return report

    export_drafter(out, drafter, config, options.save_dtype)
    if held_prompts:
        loaded = load_draft(out, model, dtype=target_float_dtype(model), target_name=options.model)
        validation = acceptance_length(
            model, loaded, tokenizer, held_prompts, max_tokens=options.val_max_tokens or options.max_tokens,
            block_size=options.block_size, console=console,
        )  # fmt: skip
        tau = validation["mean_acceptance_length"]
        report.update(validation=validation, mean_acceptance_length=tau)
        shown = "n/a (no held-out prompt ran a draft cycle)" if tau is None else f"{tau:.3f}"
        console.print(
            f"Mean acceptance length on {len(held_prompts)} held-out prompts: "
            f"[bold]{shown}[/bold] (block {options.block_size})"
        )
    write_json_atomic(out / "training_report.json", report)
    console.print(f"Drafter written to {out}")
    return report


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
