"""Loading what `resolve` chose: the one loader of the library, every command and the server.

The CPU dtype rule, in one place: on MLX's CPU backend (no Metal) every
target is computed in float32 (bfloat16 matmuls have no fast CPU path, and
the bundled demo pair is stored in bfloat16), quantized weights stay as they
are, and the drafter follows the target's activation dtype. The cast is
evaluated at once, so a pair loaded in one thread generates in another (MLX
streams are per thread). On Metal, models keep their stored dtype.
`dflash_mlx.mlx_lm.load` is the one exception: it returns exactly what
``mlx_lm.load`` returns, as mlx-lm scripts expect.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..draft.load import load_draft
from ..draft.model import DFlashDraftModel
from ..targets.adapter import UnsupportedTargetError, target_problem, token_embedding
from ..targets.families import text_model
from .resolve import ModelChoice, choose_model


def on_cpu() -> bool:
    return not mx.metal.is_available()


def as_float32(module: nn.Module | None) -> None:
    """Cast floating-point parameters to float32 (quantized weights stay as they are), evaluated now."""
    if module is not None:
        module.set_dtype(mx.float32)
        mx.eval(module.parameters())


def target_float_dtype(model: nn.Module) -> mx.Dtype | None:
    """The target's activation dtype (its final norm's, else its token embedding's), so the drafter
    computes alike."""
    norm = getattr(getattr(text_model(model), "model", None), "norm", None)
    dtype = getattr(getattr(norm, "weight", None), "dtype", None)
    if dtype is None and (embedding := token_embedding(model)) is not None:
        dtype = getattr(embedding, "scales", embedding.weight).dtype  # (a quantized table's scales)
    return dtype


def dtype_name(dtype: mx.Dtype | None) -> str:
    """'float32', 'bfloat16', ... (how commands and the server report what a model computes in)."""
    return str(dtype).rsplit(".", 1)[-1] if dtype is not None else "unknown"


def load_choice(choice: ModelChoice, *, draft_bits: int | None = None, draft_group_size: int = 64,
                shard: str | None = None, group=None, **mlx_lm_load_kwargs):  # fmt: skip
    """(model, tokenizer, drafter or None) for a choice, by the CPU dtype rule above.

    huggingface_hub shows download progress; extra keyword arguments go to ``mlx_lm.load``.
    `shard="tensor"`: the target tensor-sharded over `group` (`dflash_mlx.sharding.loading`).
    """
    from mlx_lm import load as mlx_lm_load

    from ..sharding.loading import check_shard_mode, load_sharded

    check_shard_mode(shard)
    if shard is not None:
        if mlx_lm_load_kwargs:
            raise ValueError(f"shard='tensor' loads through mlx_lm.utils.sharded_load, which takes none of "
                             f"{', '.join(sorted(mlx_lm_load_kwargs))}.")  # fmt: skip
        return load_sharded(choice, group, draft_bits=draft_bits, draft_group_size=draft_group_size)

    model, tokenizer = mlx_lm_load(choice.target, **mlx_lm_load_kwargs)[:2]
    problem = target_problem(model)
    if problem is not None:
        raise UnsupportedTargetError(f"{choice.label}: {problem}")
    if on_cpu():
        as_float32(model)
    drafter = None
    if choice.draft is not None:
        drafter = load_draft(choice.draft, model, bits=draft_bits, group_size=draft_group_size,
                             dtype=target_float_dtype(model), target_name=choice.label)  # fmt: skip
    return model, tokenizer, drafter


def load(
    target: str | Path,
    draft: str | Path | None = None,
    *,
    draft_bits: int | None = None,
    draft_group_size: int = 64,
    shard: str | None = None,
    group: mx.distributed.Group | None = None,
    **mlx_lm_load_kwargs,
) -> tuple[nn.Module, object, DFlashDraftModel]:
    """Load `(model, tokenizer, draft)`.

    `target` is a local mlx-lm model directory, a Hugging Face repo id or a name
    from models.toml; `draft=None` takes the drafter the registry pairs with the
    target. Extra keyword arguments go to `mlx_lm.load`. On MLX's CPU backend
    the pair computes in float32 (see the module docstring).

    `shard="tensor"` splits the target over `group` (default `mx.distributed.init()`,
    the ranks `mlx.launch` started) with mlx-lm's `sharded_load`; the drafter is
    loaded whole on every rank. Every rank must then run the same calls in
    lockstep (same prompts, same arguments), as with mlx-lm's sharded models;
    only rank 0 should print. `shard="pipeline"` is refused (see
    `dflash_mlx.sharding.loading`).
    """
    choice = choose_model(str(target), None if draft is None else str(draft), api=True)
    return load_choice(choice, draft_bits=draft_bits, draft_group_size=draft_group_size, shard=shard, group=group,
                       **mlx_lm_load_kwargs)  # fmt: skip
