"""`--init`: start a training run from a published DFlash (v1) drafter.

The drafter's own config.json (block size, target layer ids, mask token, layer
types / sliding window, RoPE, widths) and weights are kept; only the weights
change during training, and the output is written with that same config (the
block size updated if `--block-size` asks for another), so it stays in the
real checkpoint format. The pair is checked exactly as inference checks it
(`dflash_mlx.load_draft` with the target: hidden size, layer ids, number of
target layers, mask token, vocabulary), naming both models and the field. A
DFlash 2 checkpoint is refused: training supports v1 drafters only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from ..draft.config import DraftConfig, DraftConfigError, parse_draft_config, read_raw_config
from ..draft.dspark_config import is_dspark_config, parse_dspark_config
from ..draft.load import DraftWeightsError, load_draft, resolve_model_dir
from ..draft.model import DFlashDraftModel


class InitDrafterError(ValueError):
    """The --init drafter cannot be read or is not a trainable v1 drafter."""


def init_raw_config(init: str) -> tuple[Path, dict[str, Any]]:
    """(config.json's path, its JSON object) of the --init drafter (a directory or a Hub repo id)."""
    try:
        model_dir = resolve_model_dir(init, what="--init drafter")
    except FileNotFoundError as e:
        raise InitDrafterError(f"--init {init}: {e}") from e
    try:
        return read_raw_config(model_dir)
    except DraftConfigError as e:
        raise InitDrafterError(f"--init {init}: {e}") from e


def init_arch_and_block(init: str) -> tuple[str, int]:
    """The --init drafter's architecture ("dflash" or "dspark") and its block (anchor included)."""
    file, raw = init_raw_config(init)
    if not is_dspark_config(raw):
        return "dflash", read_init_config(init)[2].block_size
    try:
        return "dspark", parse_dspark_config(raw, source=str(file)).max_drafts + 1
    except DraftConfigError as e:
        raise InitDrafterError(f"--init {init}: {e}") from e


def read_init_config(init: str) -> tuple[Path, dict[str, Any], DraftConfig]:
    """(directory, raw config.json, parsed config) of the --init drafter; v1 only."""
    file, raw = init_raw_config(init)
    model_dir = file.parent
    try:
        config = parse_draft_config(raw, source=str(file))
    except DraftConfigError as e:
        raise InitDrafterError(f"--init {init}: {e}") from e
    if config.is_dflash2:
        raise InitDrafterError(
            f"--init {init}: {file} describes a DFlash 2 drafter (architectures {raw.get('architectures')}); "
            "fine-tuning DFlash 2 drafters is not supported yet. --init takes a DFlash v1 "
            "(DFlashDraftModel) checkpoint."
        )
    return model_dir, raw, config


def load_init_drafter(
    init: str, target_model, target_name: str, block_size: int
) -> tuple[DFlashDraftModel, dict[str, Any]]:
    """The --init drafter in float32 (checked against the target) and the config.json to export."""
    model_dir, raw, parsed = read_init_config(init)
    try:
        drafter = load_draft(init, target_model, dtype=mx.float32, target_name=target_name)
    except DraftWeightsError as e:
        raise InitDrafterError(f"--init {init}: {e}") from e
    drafter.source = init
    config = {k: v for k, v in raw.items() if k != "block_size"}
    dflash = dict(raw.get("dflash_config") or {})
    dflash["block_size"] = int(block_size)
    dflash["mask_token_id"] = parsed.mask_token_id
    dflash["target_layer_ids"] = list(parsed.target_layer_ids)
    config["dflash_config"] = dflash
    parse_draft_config(config, source="the fine-tuned drafter's config")  # still valid
    return drafter, config
