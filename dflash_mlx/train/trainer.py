"""`train_drafter`: a whole DFlash drafter training run, from prompts to a validated drafter.

Steps: read and encode the prompts (and the `--replay` prompts), hold some of
each out, have the target regenerate the responses (cached), build a fresh
drafter or start from a published one (`--init`, `init_drafter`), or resume
from the last checkpoint, train it with AdamW + warmup + cosine decay +
gradient clipping on the weighted block loss (`step.StepRunner`: only the
drafter's parameters, the loss in chunks of rows at large vocabularies),
checkpoint periodically, export the drafter in the real checkpoint format and
measure its mean acceptance length on the held-out prompts of both sets. The
report also holds the peak memory of the training loop. The run's files live in `<out>/work` (responses cache,
checkpoints, per-step log, optional feature cache); the report goes to
`<out>/training_report.json`.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..draft.load import load_draft
from ..targets.families import context_length, text_model
from ..models.dtype import target_float_dtype
from ..models.loading import load_choice
from ..models.resolve import ModelChoiceError, choose_model
from ..targets.adapter import TargetAdapter, UnsupportedTargetError
from .batches import Sequence, build_sequences, step_position
from .checkpoint import (
    export_drafter,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
    write_json_atomic,
)
from .data import DataError, encode_prompts, read_prompts
from .features import FeatureStore
from .dspark import DSparkStepRunner, dspark_drafter_config, load_init_dspark, new_dspark_drafter
from .init_drafter import init_arch_and_block, load_init_drafter
from .loss import default_decay
from .new_drafter import drafter_config, new_drafter, resolve_mask_token_id
from .options import OptionError, TrainOptions, check_resumable
from .regenerate import regenerate_for
from .step import StepRunner, make_optimizer
from .validate import acceptance_length
from ..utils.io import write_text_atomic

__all__ = ["StepRunner", "make_optimizer", "train_drafter", "load_target", "split_holdout"]

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def load_target(name: str, dtype: str | None = None):
    """(model, tokenizer) through the one loader (`models.loading`): float32 on MLX's CPU
    backend, as stored on Metal, unless --target-dtype says otherwise; errors name --model."""
    try:
        choice = choose_model(name, use_draft=False)
    except (ModelChoiceError, UnsupportedTargetError) as e:
        raise OptionError(str(e)) from e
    try:
        model, tokenizer, _ = load_choice(choice)
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # mlx-lm's and huggingface_hub's
        raise OptionError(f"--model {name}: mlx-lm could not load the target ({type(e).__name__}: {e}).") from e
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
        mx.eval(model.parameters())
    return model, tokenizer


def split_holdout(prompts: list[list[int]], holdout: int, seed: int) -> tuple[list, list]:
    """(training prompts, held-out prompts): a fixed random `holdout` of them held out."""
    if holdout >= len(prompts):
        raise OptionError(f"--holdout {holdout} leaves no training prompts (the data file has {len(prompts)}).")
    order = np.random.default_rng([seed, 2]).permutation(len(prompts))
    held = sorted(int(i) for i in order[:holdout])
    kept = sorted(int(i) for i in order[holdout:])
    return [prompts[i] for i in kept], [prompts[i] for i in held]


def fingerprint(sequences: list[Sequence]) -> str:
    h = hashlib.sha1()
    for s in sequences:
        h.update(json.dumps([s.prompt_len, s.ids]).encode())
    return h.hexdigest()


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("tau~ {task.fields[tau]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )


def _read_log(path: Path, upto: int) -> list[dict]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def read_replay(options: TrainOptions, tokenizer) -> tuple[list, list]:
    """(training, held-out) replay prompts; errors name --replay."""
    if options.replay is None:
        return [], []
    try:
        records = read_prompts(options.replay)
    except DataError as e:
        raise DataError(f"--replay {e}") from e
    prompts = encode_prompts(tokenizer, records, str(options.replay), options.chat_template_kwargs)
    held = min(options.holdout, len(prompts) // 2)
    return split_holdout(prompts, held, options.seed + 1)


def peak_memory() -> dict[str, float]:
    """MLX's peak allocation since the last reset and the process's peak RSS, in GB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    return {"peak_memory_gb": mx.get_peak_memory() / 1e9, "peak_rss_gb": rss_bytes / 1e9}


def check_memory(options: TrainOptions) -> None:
    """After the first step: stop if MLX's peak went beyond --max-memory-gb."""
    peak = mx.get_peak_memory() / 1e9
    if peak > options.max_memory_gb:
        raise OptionError(
            f"--max-memory-gb {options.max_memory_gb:g}: the first training step peaked at {peak:.2f} GB (MLX); "
            f"lower --batch-size (now {options.batch_size}) or --anchors-per-seq (now {options.anchors_per_seq}), "
            "or allow more memory."
        )


def train_drafter(options: TrainOptions, console: Console | None = None) -> dict[str, Any]:
    """Run the whole training described by `options`; return the report (also saved).

    The report's `mean_acceptance_length` (and `replay_mean_acceptance_length`
    with `--replay`) is None when `holdout` is 0 or the run stopped early
    (`stop_at`); `stopped_at` is then the step it stopped at.
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
    init_arch, init_block = init_arch_and_block(options.init) if options.init else (None, None)
    if init_arch is not None and options.arch not in (None, init_arch):
        raise OptionError(f"--arch {options.arch}: the --init drafter {options.init} is a {init_arch} drafter.")
    records = read_prompts(options.data)
    console.print(f"Loading target [bold]{options.model}[/bold]")
    model, tokenizer = load_target(options.model, options.target_dtype)
    context = context_length(model)
    if options.max_length is not None and context is not None and options.max_length > context:
        raise OptionError(
            f"--max-length {options.max_length} is beyond the context of target '{options.model}' "
            f"(max_position_embeddings {context} in its config.json)."
        )
    options = options.resolved(init_block_size=init_block, target_context=context, init_arch=init_arch)
    dspark = options.arch == "dspark"
    vocab = text_model(model).args.vocab_size
    if options.init:
        load_init = load_init_dspark if dspark else load_init_drafter
        drafter, config = load_init(options.init, model, options.model, options.block_size)
        mask_id = drafter.config.mask_token_id
        draft_layers = drafter.config.num_hidden_layers
    else:
        mask_id = resolve_mask_token_id(tokenizer, options.mask_token_id, vocab, options.model)
        new_config = partial(dspark_drafter_config, markov_rank=options.markov_rank) if dspark else drafter_config
        config = new_config(
            model,
            num_layers=options.draft_layers,
            block_size=options.block_size,
            mask_token_id=mask_id,
            target_layer_ids=options.target_layers,
            intermediate_size=options.intermediate_size,
            dtype=options.save_dtype,
        )
        draft_layers = options.draft_layers
    layer_ids = tuple(config["target_layer_ids"] if dspark else config["dflash_config"]["target_layer_ids"])
    prompts = encode_prompts(tokenizer, records, str(options.data), options.chat_template_kwargs)
    train_prompts, held_prompts = split_holdout(prompts, options.holdout, options.seed)
    replay_train, replay_held = read_replay(options, tokenizer)
    responses = regenerate_for(options, model, tokenizer, train_prompts + replay_train, work, console)
    sequences, dropped = build_sequences(train_prompts, responses[: len(train_prompts)], options.max_length)
    replay_seqs, replay_dropped = build_sequences(replay_train, responses[len(train_prompts) :], options.max_length)
    if not sequences:
        raise OptionError(
            f"No usable training sequence in {options.data}: every response is shorter than 2 "
            f"tokens or the prompts fill --max-length {options.max_length}."
        )
    if options.replay and not replay_seqs:
        raise OptionError(
            f"--replay {options.replay}: no usable sequence (responses shorter than 2 tokens or "
            f"prompts filling --max-length {options.max_length})."
        )
    sequences = sequences + replay_seqs
    data_id = fingerprint(sequences)

    mx.random.seed(options.seed)
    if not options.init:
        drafter = new_dspark_drafter(config, model) if dspark else new_drafter(config)
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
    store = FeatureStore(target, work / "features" if options.cache_features else None, options.feature_chunk)
    runner = (DSparkStepRunner if dspark else StepRunner)(
        drafter, target, store, optimizer, options, num_replay=len(replay_seqs)
    )
    pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
    end = min(options.steps, options.stop_at or options.steps)
    log_path = work / "train_log.jsonl"
    history = _read_log(log_path, start)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(log_path, "".join(json.dumps(r) + "\n" for r in history))  # drop steps past the checkpoint

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
    start_from = f"from {options.init}" if options.init else "from scratch"
    replay_note = f", {len(replay_seqs)} replay sequences ({runner.replay_per_batch} per batch)" if replay_seqs else ""
    console.print(
        f"Training a {draft_layers}-layer {options.arch} drafter {start_from} (block {options.block_size}, "
        f"target layers {list(layer_ids)}, mask id {mask_id}, loss decay {decay:g}, lr {options.lr:g}, warmup "
        f"{options.warmup:g}) on {len(sequences) - len(replay_seqs)} sequences ({dropped} dropped){replay_note}, "
        f"{len(held_prompts)} held out"
    )
    mx.reset_peak_memory()
    tic = time.perf_counter()
    seconds = elapsed_before
    with _progress(console) as progress, open(log_path, "a") as log:
        task = progress.add_task("train", total=options.steps, completed=start, loss="-", tau="-", tps="-")
        recent: list[dict] = []
        for step in range(start, end):
            t0 = time.perf_counter()
            row = runner(step, sequences, mask_id, pad_id)
            if step == start and options.max_memory_gb is not None:
                check_memory(options)
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
    memory = peak_memory()
    if end > start:
        checkpoint(end, seconds)

    report: dict[str, Any] = {
        "target": options.model,
        "drafter": str(out),
        "init": options.init,
        "arch": options.arch,
        "steps": end,
        "total_steps": options.steps,
        "block_size": options.block_size,
        "draft_layers": draft_layers,
        "target_layer_ids": list(layer_ids),
        "mask_token_id": mask_id,
        "lr": options.lr,
        "warmup": options.warmup,
        "max_length": options.max_length,
        "loss_chunk_rows": runner.chunk_rows,
        "max_memory_gb": options.max_memory_gb,
        "train_sequences": len(sequences) - len(replay_seqs),
        "dropped_sequences": dropped,
        "holdout_prompts": len(held_prompts),
        "replay": options.replay,
        "replay_train_sequences": len(replay_seqs),
        "replay_dropped_sequences": replay_dropped,
        "replay_holdout_prompts": len(replay_held),
        "replay_per_batch": runner.replay_per_batch,
        "train_seconds": seconds,
        **memory,
        "loss_first": _mean([r["loss"] for r in history[:10]]),
        "loss_last": _mean([r["loss"] for r in history[-10:]]),
        "stopped_at": None,
        "mean_acceptance_length": None,
        "validation": None,
        "replay_mean_acceptance_length": None,
        "replay_validation": None,
    }
    console.print(
        f"Peak memory of the training loop: {memory['peak_memory_gb']:.2f} GB (MLX), "
        f"process peak RSS {memory['peak_rss_gb']:.2f} GB"
    )
    if end < options.steps:
        report["stopped_at"] = end
        console.print(f"Stopped at step {end} of {options.steps}; continue with --resume.")
        return report

    export_drafter(out, drafter, config, options.save_dtype)
    if held_prompts or replay_held:
        loaded = load_draft(out, model, dtype=target_float_dtype(model), target_name=options.model)
    for key, held, what in (("", held_prompts, "held-out"), ("replay_", replay_held, "held-out replay")):
        if not held:
            continue
        validation = acceptance_length(
            model,
            loaded,
            tokenizer,
            held,
            max_tokens=options.val_max_tokens or options.max_tokens,
            block_size=options.block_size,
            console=console,
        )
        tau = validation["mean_acceptance_length"]
        report.update({f"{key}validation": validation, f"{key}mean_acceptance_length": tau})
        shown = "n/a (no held-out prompt ran a draft cycle)" if tau is None else f"{tau:.3f}"
        console.print(
            f"Mean acceptance length on {len(held)} {what} prompts: [bold]{shown}[/bold] (block {options.block_size})"
        )
    write_json_atomic(out / "training_report.json", report)
    console.print(f"Drafter written to {out}")
    return report


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
