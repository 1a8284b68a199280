"""`load`: a target (path, repo id or registry name) plus its drafter, ready to decode."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .draft.load import load_draft
from .draft.model import DFlashDraftModel
from .families import FAMILIES, text_model
from .resolve import as_float32, on_cpu
from .target import UnsupportedTargetError


def load(
    target: str | Path,
    draft: str | Path | None = None,
    *,
    draft_bits: int | None = None,
    draft_group_size: int = 64,
    **mlx_lm_load_kwargs,
) -> tuple[nn.Module, object, DFlashDraftModel]:
    """Load `(model, tokenizer, draft)`.

    `target` is a local mlx-lm model directory, a Hugging Face repo id or a name
    from models.toml; `draft=None` takes the drafter the registry pairs with the
    target. Extra keyword arguments go to `mlx_lm.load`. The bundled `demo` pair
    is cast to float32 on MLX's CPU backend.
    """
    from mlx_lm import load as mlx_lm_load

    from .resolve import entry_for_target

    entry = entry_for_target(target)
    target_id = str(target)
    if entry is not None and entry.family is not None and entry.family not in FAMILIES:
        raise UnsupportedTargetError(
            f"{target}: the registry lists {entry.name} (family {entry.family}), which this version of "
            f"dflash-mlx cannot run yet; supported families: {', '.join(sorted(FAMILIES))}."
        )
    if entry is not None and not Path(target_id).expanduser().exists():
        if entry.bundled:
            target_id = entry.target_path()
        elif target_id.lower() == entry.name.lower():
            target_id = entry.target
    if draft is None:
        if entry is None:
            raise ValueError(
                f"No drafter is registered for target '{target}' in models.toml: pass "
                "draft=<path or repo id of a DFlash drafter>."
            )
        draft = entry.draft_path()
    model, tokenizer = mlx_lm_load(target_id, **mlx_lm_load_kwargs)[:2]
    if entry is not None and entry.bundled and on_cpu():
        as_float32(model)  # the bundled pair is stored in bfloat16; CPUs compute float32 faster
    drafter = load_draft(
        draft, model, bits=draft_bits, group_size=draft_group_size,
        dtype=target_float_dtype(model), target_name=target_id,
    )
    return model, tokenizer, drafter


def target_float_dtype(model: nn.Module) -> mx.Dtype | None:
    """The target's activation dtype (its final norm's), so the drafter computes alike."""
    norm = getattr(getattr(text_model(model), "model", None), "norm", None)
    return getattr(getattr(norm, "weight", None), "dtype", None)
