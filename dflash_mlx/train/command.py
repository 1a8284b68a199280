"""`dflash-mlx train`: the Typer command around `train_drafter`.

Importing this module has no side effects: the CLI registers the function with
`app.command("train")(train)`. Errors in the data, the options, the target or a
checkpoint are printed as one line naming the file, line or flag, with exit
code 1 (no traceback).
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..draft.pairing import PairMismatchError
from ..mtp.scan import MTPWeightsError
from .checkpoint import CheckpointError
from .data import DataError
from .init_drafter import InitDrafterError
from .model_forward import UnsupportedDrafterError
from .new_drafter import DrafterSetupError
from .options import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DRAFT_LAYERS,
    DEFAULT_MAX_LENGTH,
    FINETUNE_LR,
    FINETUNE_WARMUP,
    SAVE_DTYPES,
    SCRATCH_LR,
    SCRATCH_WARMUP,
    OptionError,
    TrainOptions,
)

USER_ERRORS = (
    OptionError,
    MTPWeightsError,
    DataError,
    DrafterSetupError,
    CheckpointError,
    UnsupportedDrafterError,
    PairMismatchError,
    InitDrafterError,
)


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}", param_hint=flag)


def _json_object(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not valid JSON ({e.msg})", param_hint=flag)
    if not isinstance(value, dict):
        raise typer.BadParameter("expected a JSON object", param_hint=flag)
    return value


# Defaults are TrainOptions', so the command and the Python API agree.
DEFAULT = {f.name: f.default for f in fields(TrainOptions)}
HELP = {
    "model": "Target: local mlx-lm model directory or Hugging Face repo id.",
    "data": 'JSONL prompts: {"prompt": "..."} or {"messages": [...]} per line.',
    "out": "Output drafter directory (config.json + model.safetensors).",
    "steps": "Optimisation steps.",
    "block_size": f"Block size b (anchor included); default the --init drafter's, else {DEFAULT_BLOCK_SIZE}.",
    "draft_layers": f"Drafter layers (default {DEFAULT_DRAFT_LAYERS}; not with --init).",
    "max_tokens": "Response tokens the target regenerates per prompt.",
    "max_length": f"Prompt + response tokens kept per sequence, up to the target's context "
    f"(default: the context, at most {DEFAULT_MAX_LENGTH}).",
    "lr": f"Peak learning rate (AdamW, cosine decay); default {SCRATCH_LR:g}, or {FINETUNE_LR:g} with --init.",
    "batch_size": "Sequences per step.",
    "anchors_per_seq": "Random anchors (blocks) per sequence.",
    "save_every": "Checkpoint every N steps.",
    "resume": "Continue from the last checkpoint.",
    "seed": "Seed of the initialisation, data order and anchors.",
    "holdout": "Prompts held out for the validation pass.",
    "warmup": f"Warmup fraction of the steps; default {SCRATCH_WARMUP:g}, or {FINETUNE_WARMUP:g} with --init.",
    "weight_decay": "AdamW weight decay.",
    "grad_clip": "Gradient norm clip.",
    "loss_decay": "c in w_k = exp(-(k-1)/c); default by block size (7 @16, 5 @10, 4 @8).",
    "target_layers": "Target layer ids to read, e.g. '1,3' (default: derived).",
    "mask_token_id": "Mask token id when the tokenizer has no mask token.",
    "intermediate_size": "Drafter MLP width (default: the target's).",
    "val_max_tokens": "Tokens per held-out prompt in validation (default: --max-tokens).",
    "gen_batch_size": "Batch size of response regeneration.",
    "gen_temperature": "Temperature of response regeneration (0: greedy).",
    "chat_template_kwargs": "JSON object for the chat template, e.g. '{\"enable_thinking\": false}'.",
    "work_dir": "Run files (responses, checkpoints, log); default OUT/work.",
    "responses": "Responses cache JSONL; default WORK_DIR/responses.jsonl.",
    "cache_features": "Keep target features on disk (bfloat16) for later epochs.",
    "save_dtype": f"Dtype of the saved drafter: {', '.join(SAVE_DTYPES)}.",
    "target_dtype": "Cast the target to this dtype (default: float32 on a CPU, as stored on Metal).",
    "keep_checkpoints": "Checkpoints kept on disk.",
    "stop_at": "Stop at this step with a checkpoint (continue later with --resume).",
    "init": "Fine-tune this DFlash v1 drafter (directory or Hub repo id): its config and weights, "
    "checked against --model; the optimizer starts fresh.",
    "replay": "JSONL prompts of the original domain mixed into every batch (forgetting control); "
    "held-out acceptance is reported on both sets.",
    "replay_ratio": "Fraction of each batch taken from --replay.",
    "loss_chunk_rows": "Block rows per logits chunk of the loss (default: ~128 MB of logits per chunk).",
    "feature_chunk": "Target tokens per forward when computing features of long sequences.",
    "anchor_chunk": "Anchors per sequence in one drafter forward/backward (default: ~1 GB of attention).",
    "markov_rank": "Rank of a new DSpark drafter's Markov head (default 256).",
    "max_memory_gb": "Size the loss chunks and anchor groups for this much memory, and stop after the first "
    "step if MLX's peak exceeds it.",
    "arch": "What to train: dflash (a DFlash drafter, OUT its directory), dspark (a DSpark drafter in DeepSpec's "
    "layout: a Markov and a confidence head) or mtp (the target's own multi-token-prediction heads, OUT a copy of "
    "the target checkpoint holding them under the family's names); default the --init drafter's, else dflash.",
}


def train(
    model: Annotated[str, typer.Option("--model", help=HELP["model"])],
    data: Annotated[str, typer.Option("--data", help=HELP["data"])],
    out: Annotated[str, typer.Option("--out", help=HELP["out"])],
    steps: Annotated[int, typer.Option(help=HELP["steps"])] = DEFAULT["steps"],
    block_size: Annotated[int | None, typer.Option(help=HELP["block_size"])] = DEFAULT["block_size"],
    draft_layers: Annotated[int | None, typer.Option(help=HELP["draft_layers"])] = DEFAULT["draft_layers"],
    max_tokens: Annotated[int, typer.Option(help=HELP["max_tokens"])] = DEFAULT["max_tokens"],
    max_length: Annotated[int | None, typer.Option(help=HELP["max_length"])] = DEFAULT["max_length"],
    lr: Annotated[float | None, typer.Option(help=HELP["lr"])] = DEFAULT["lr"],
    batch_size: Annotated[int, typer.Option(help=HELP["batch_size"])] = DEFAULT["batch_size"],
    anchors_per_seq: Annotated[int, typer.Option(help=HELP["anchors_per_seq"])] = DEFAULT["anchors_per_seq"],
    save_every: Annotated[int, typer.Option(help=HELP["save_every"])] = DEFAULT["save_every"],
    resume: Annotated[bool, typer.Option("--resume", help=HELP["resume"])] = DEFAULT["resume"],
    seed: Annotated[int, typer.Option(help=HELP["seed"])] = DEFAULT["seed"],
    holdout: Annotated[int, typer.Option(help=HELP["holdout"])] = DEFAULT["holdout"],
    warmup: Annotated[float | None, typer.Option(help=HELP["warmup"])] = DEFAULT["warmup"],
    weight_decay: Annotated[float, typer.Option(help=HELP["weight_decay"])] = DEFAULT["weight_decay"],
    grad_clip: Annotated[float, typer.Option(help=HELP["grad_clip"])] = DEFAULT["grad_clip"],
    loss_decay: Annotated[float | None, typer.Option(help=HELP["loss_decay"])] = DEFAULT["loss_decay"],
    target_layers: Annotated[str | None, typer.Option(help=HELP["target_layers"])] = DEFAULT["target_layers"],
    mask_token_id: Annotated[int | None, typer.Option(help=HELP["mask_token_id"])] = DEFAULT["mask_token_id"],
    intermediate_size: Annotated[int | None, typer.Option(help=HELP["intermediate_size"])] = DEFAULT[
        "intermediate_size"
    ],
    val_max_tokens: Annotated[int | None, typer.Option(help=HELP["val_max_tokens"])] = DEFAULT["val_max_tokens"],
    gen_batch_size: Annotated[int, typer.Option(help=HELP["gen_batch_size"])] = DEFAULT["gen_batch_size"],
    gen_temperature: Annotated[float, typer.Option(help=HELP["gen_temperature"])] = DEFAULT["gen_temperature"],
    chat_template_kwargs: Annotated[str | None, typer.Option(help=HELP["chat_template_kwargs"])] = DEFAULT[
        "chat_template_kwargs"
    ],
    work_dir: Annotated[str | None, typer.Option(help=HELP["work_dir"])] = DEFAULT["work_dir"],
    responses: Annotated[str | None, typer.Option(help=HELP["responses"])] = DEFAULT["responses"],
    cache_features: Annotated[bool, typer.Option("--cache-features", help=HELP["cache_features"])] = DEFAULT[
        "cache_features"
    ],
    save_dtype: Annotated[str, typer.Option(help=HELP["save_dtype"])] = DEFAULT["save_dtype"],
    target_dtype: Annotated[str | None, typer.Option(help=HELP["target_dtype"])] = DEFAULT["target_dtype"],
    keep_checkpoints: Annotated[int, typer.Option(help=HELP["keep_checkpoints"])] = DEFAULT["keep_checkpoints"],
    stop_at: Annotated[int | None, typer.Option(help=HELP["stop_at"])] = DEFAULT["stop_at"],
    init: Annotated[str | None, typer.Option("--init", help=HELP["init"])] = DEFAULT["init"],
    replay: Annotated[str | None, typer.Option("--replay", help=HELP["replay"])] = DEFAULT["replay"],
    replay_ratio: Annotated[float, typer.Option(help=HELP["replay_ratio"])] = DEFAULT["replay_ratio"],
    loss_chunk_rows: Annotated[int | None, typer.Option(help=HELP["loss_chunk_rows"])] = DEFAULT["loss_chunk_rows"],
    feature_chunk: Annotated[int, typer.Option(help=HELP["feature_chunk"])] = DEFAULT["feature_chunk"],
    anchor_chunk: Annotated[int | None, typer.Option(help=HELP["anchor_chunk"])] = DEFAULT["anchor_chunk"],
    max_memory_gb: Annotated[float | None, typer.Option(help=HELP["max_memory_gb"])] = DEFAULT["max_memory_gb"],
    arch: Annotated[str | None, typer.Option("--arch", help=HELP["arch"])] = DEFAULT["arch"],
    markov_rank: Annotated[int | None, typer.Option(help=HELP["markov_rank"])] = DEFAULT["markov_rank"],
) -> None:
    """Train a DFlash or DSpark drafter, or the target's own MTP heads, for a target (responses regenerated by
    the target itself)."""
    options = TrainOptions(
        model=model,
        data=data,
        out=out,
        steps=steps,
        block_size=block_size,
        draft_layers=draft_layers,
        max_tokens=max_tokens,
        max_length=max_length,
        lr=lr,
        warmup=warmup,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        loss_decay=loss_decay,
        batch_size=batch_size,
        anchors_per_seq=anchors_per_seq,
        save_every=save_every,
        keep_checkpoints=keep_checkpoints,
        seed=seed,
        holdout=holdout,
        val_max_tokens=val_max_tokens,
        target_layers=_int_list(target_layers, "--target-layers"),
        mask_token_id=mask_token_id,
        intermediate_size=intermediate_size,
        gen_batch_size=gen_batch_size,
        gen_temperature=gen_temperature,
        chat_template_kwargs=_json_object(chat_template_kwargs, "--chat-template-kwargs"),
        work_dir=work_dir,
        responses=responses,
        cache_features=cache_features,
        save_dtype=save_dtype,
        target_dtype=target_dtype,
        resume=resume,
        stop_at=stop_at,
        init=init,
        replay=replay,
        replay_ratio=replay_ratio,
        loss_chunk_rows=loss_chunk_rows,
        feature_chunk=feature_chunk,
        anchor_chunk=anchor_chunk,
        max_memory_gb=max_memory_gb,
        arch=arch,
        markov_rank=markov_rank,
    )
    console = Console()
    from .trainer import train_drafter  # heavy imports only when the command runs

    run = train_drafter
    if arch == "mtp":
        from .mtp import train_mtp as run
    try:
        run(options, console=console)
    except USER_ERRORS as e:
        console.print(f"[red]Error:[/red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(1)
