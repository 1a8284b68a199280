"""Loading what `resolve` chose: the one loader of the library, every command and the server.

Models compute in the dtype `dtype` decides (float32 on MLX's CPU backend);
a tensor-sharded target goes through `sharding.loading`. `dflash_mlx.mlx_lm.load`
is the one exception: it returns exactly what ``mlx_lm.load`` returns, as
mlx-lm scripts expect.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..draft.load import load_draft, resolve_model_dir
from ..sharding.loading import check_shard_mode, load_sharded
from ..targets.adapter import UnsupportedTargetError, target_problem
from .dtype import as_float32, on_cpu, target_float_dtype
from ..mtp.scan import has_mtp_weights
from ..proposers.choice import RatedChoice
from ..proposers.dflash import proposer_for
from ..proposers.mtp import load_mtp
from .resolve import MTP_ALSO, MTP_REQUIRED, ModelChoice, ModelChoiceError, choose_model


def load_choice(
    choice: ModelChoice,
    *,
    draft_bits: int | None = None,
    draft_group_size: int = 64,
    shard: str | None = None,
    group=None,
    **mlx_lm_load_kwargs,
):
    """(model, tokenizer, drafter or None) for a choice, by the CPU dtype rule (`models.dtype`).

    huggingface_hub shows download progress; extra keyword arguments go to ``mlx_lm.load``.
    `shard="tensor"`: the target tensor-sharded over `group` (`dflash_mlx.sharding.loading`).
    """
    from mlx_lm import load as mlx_lm_load

    check_shard_mode(shard)
    if shard is not None:
        if mlx_lm_load_kwargs:
            raise ValueError(
                f"shard='tensor' loads through mlx_lm.utils.sharded_load, which takes none of "
                f"{', '.join(sorted(mlx_lm_load_kwargs))}."
            )
        if choice.mtp == MTP_REQUIRED:
            raise ModelChoiceError(
                f"{choice.label}: a tensor-sharded target drafts with a DFlash drafter; its own MTP heads are not "
                "sharded (pass a drafter, or load it whole)."
            )
        return load_sharded(choice, group, draft_bits=draft_bits, draft_group_size=draft_group_size)

    if choice.mtp == MTP_REQUIRED and draft_bits is not None:
        raise ModelChoiceError(
            f"{choice.label}: draft_bits (--draft-bits) quantizes a DFlash drafter; the target's own MTP heads load as "
            "its checkpoint stores them."
        )
    model, tokenizer = mlx_lm_load(choice.target, **mlx_lm_load_kwargs)[:2]
    problem = target_problem(model)
    if problem is not None:
        raise UnsupportedTargetError(f"{choice.label}: {problem}")
    if on_cpu():
        as_float32(model)
    drafter = None
    if choice.draft is not None:
        drafter = load_draft(
            choice.draft,
            model,
            bits=draft_bits,
            group_size=draft_group_size,
            dtype=target_float_dtype(model),
            target_name=choice.label,
        )
    if choice.mtp is not None:
        drafter = with_mtp(choice, model, drafter)
    return model, tokenizer, drafter


def with_mtp(choice: ModelChoice, model: nn.Module, drafter):
    """The drafter once the target's own MTP heads are read: them alone (asked for, or no drafter registered), or
    beside the registered drafter where the checkpoint has them (`RatedChoice`: chosen per generation)."""
    directory = resolve_model_dir(choice.target, "target model")
    if choice.mtp == MTP_ALSO and not has_mtp_weights(str(directory)):
        return drafter
    mtp = load_mtp(directory, model, dtype=target_float_dtype(model))
    return mtp if drafter is None else RatedChoice([proposer_for(drafter), mtp])


def load(
    target: str | Path,
    draft: str | Path | None = None,
    *,
    draft_bits: int | None = None,
    draft_group_size: int = 64,
    shard: str | None = None,
    group: mx.distributed.Group | None = None,
    **mlx_lm_load_kwargs,
) -> tuple[nn.Module, object, nn.Module | None]:
    """Load `(model, tokenizer, draft)`.

    `target` is a local mlx-lm model directory, a Hugging Face repo id or a name
    from models.toml; `draft=None` takes the drafter the registry pairs with the
    target (where its checkpoint also keeps its own multi-token-prediction heads,
    both: the block policy picks one per generation), else the target's own MTP
    heads where its checkpoint keeps them; `draft="mtp"` asks for those heads
    (`proposers.mtp`). Extra keyword arguments go to `mlx_lm.load`. On MLX's CPU backend
    the pair computes in float32 (`models.dtype`).

    `shard="tensor"` splits the target over `group` (default `mx.distributed.init()`,
    the ranks `mlx.launch` started) with mlx-lm's `sharded_load`; the drafter is
    loaded whole on every rank. Every rank must then run the same calls in
    lockstep (same prompts, same arguments), as with mlx-lm's sharded models;
    only rank 0 should print. `shard="pipeline"` is refused (see
    `dflash_mlx.sharding.loading`).
    """
    choice = choose_model(str(target), None if draft is None else str(draft), api=True)
    return load_choice(
        choice, draft_bits=draft_bits, draft_group_size=draft_group_size, shard=shard, group=group, **mlx_lm_load_kwargs
    )
