"""`dflash-mlx train`: the Typer command around `train_drafter`.

Importing this module has no side effects: the CLI registers the function with
`app.command("train")(train)`. Errors in the data, the options, the target or a
checkpoint are printed as one line naming the file, line or flag, with exit
code 1 (no traceback).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from ..draft.pairing import PairMismatchError
from .checkpoint import CheckpointError
from .data import DataError
from .model_forward import UnsupportedDrafterError
from .new_drafter import DrafterSetupError
from .options import SAVE_DTYPES, OptionError, TrainOptions

USER_ERRORS = (
    OptionError, DataError, DrafterSetupError, CheckpointError, UnsupportedDrafterError, PairMismatchError,
)  # fmt: skip


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


def train(
    model: Annotated[str, typer.Option("--model", help="Target: local mlx-lm model directory or Hugging Face repo id.")],
    data: Annotated[str, typer.Option("--data", help='JSONL prompts: {"prompt": "..."} or {"messages": [...]} per line.')],
    out: Annotated[str, typer.Option("--out", help="Output drafter directory (config.json + model.safetensors).")],
    steps: Annotated[int, typer.Option(help="Optimisation steps.")] = 1000,
    block_size: Annotated[int, typer.Option(help="Block size b (anchor included).")] = 16,
    draft_layers: Annotated[int, typer.Option(help="Drafter layers.")] = 5,
    max_tokens: Annotated[int, typer.Option(help="Response tokens the target regenerates per prompt.")] = 256,
    max_length: Annotated[int, typer.Option(help="Prompt + response tokens kept per sequence.")] = 2048,
    lr: Annotated[float, typer.Option(help="Peak learning rate (AdamW, cosine decay).")] = 6e-4,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 8,
    anchors_per_seq: Annotated[int, typer.Option(help="Random anchors (blocks) per sequence.")] = 32,
    save_every: Annotated[int, typer.Option(help="Checkpoint every N steps.")] = 200,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the last checkpoint.")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the initialisation, data order and anchors.")] = 0,
    holdout: Annotated[int, typer.Option(help="Prompts held out for the validation pass.")] = 16,
    warmup: Annotated[float, typer.Option(help="Warmup fraction of the steps.")] = 0.04,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = 0.01,
    grad_clip: Annotated[float, typer.Option(help="Gradient norm clip.")] = 1.0,
    loss_decay: Annotated[float | None, typer.Option(help="c in w_k = exp(-(k-1)/c); default by block size (7 @16, 5 @10, 4 @8).")] = None,
    target_layers: Annotated[str | None, typer.Option(help="Target layer ids to read, e.g. '1,3' (default: derived).")] = None,
    mask_token_id: Annotated[int | None, typer.Option(help="Mask token id when the tokenizer has no mask token.")] = None,
    intermediate_size: Annotated[int | None, typer.Option(help="Drafter MLP width (default: the target's).")] = None,
    val_max_tokens: Annotated[int | None, typer.Option(help="Tokens per held-out prompt in validation (default: --max-tokens).")] = None,
    gen_batch_size: Annotated[int, typer.Option(help="Batch size of response regeneration.")] = 32,
    gen_temperature: Annotated[float, typer.Option(help="Temperature of response regeneration (0: greedy).")] = 0.0,
    chat_template_kwargs: Annotated[str | None, typer.Option(help='JSON object for the chat template, e.g. \'{"enable_thinking": false}\'.')] = None,
    work_dir: Annotated[str | None, typer.Option(help="Run files (responses, checkpoints, log); default OUT/work.")] = None,
    responses: Annotated[str | None, typer.Option(help="Responses cache JSONL; default WORK_DIR/responses.jsonl.")] = None,
    cache_features: Annotated[bool, typer.Option("--cache-features", help="Keep target features on disk (bfloat16) for later epochs.")] = False,
    save_dtype: Annotated[str, typer.Option(help=f"Dtype of the saved drafter: {', '.join(SAVE_DTYPES)}.")] = "float32",
    target_dtype: Annotated[str | None, typer.Option(help="Cast the target to this dtype (e.g. float32 on a CPU).")] = None,
    keep_checkpoints: Annotated[int, typer.Option(help="Checkpoints kept on disk.")] = 2,
    stop_at: Annotated[int | None, typer.Option(help="Stop at this step with a checkpoint (continue later with --resume).")] = None,
) -> None:
    """Train a DFlash drafter for a target (responses regenerated by the target itself)."""
    options = TrainOptions(
        model=model, data=data, out=out, steps=steps, block_size=block_size, draft_layers=draft_layers,
        max_tokens=max_tokens, max_length=max_length, lr=lr, warmup=warmup, weight_decay=weight_decay,
        grad_clip=grad_clip, loss_decay=loss_decay, batch_size=batch_size, anchors_per_seq=anchors_per_seq,
        save_every=save_every, keep_checkpoints=keep_checkpoints, seed=seed, holdout=holdout,
        val_max_tokens=val_max_tokens, target_layers=_int_list(target_layers, "--target-layers"),
        mask_token_id=mask_token_id, intermediate_size=intermediate_size, gen_batch_size=gen_batch_size,
        gen_temperature=gen_temperature,
        chat_template_kwargs=_json_object(chat_template_kwargs, "--chat-template-kwargs"),
        work_dir=work_dir, responses=responses, cache_features=cache_features, save_dtype=save_dtype,
        target_dtype=target_dtype, resume=resume, stop_at=stop_at,
    )  # fmt: skip
    console = Console()
    from .trainer import train_drafter  # heavy imports only when the command runs

    try:
        train_drafter(options, console=console)
    except USER_ERRORS as e:
        console.print(f"[red]Error:[/red] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(1)
