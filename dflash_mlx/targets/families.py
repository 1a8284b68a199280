"""What differs between target families, and the few facts read from a family's config.

The adapter runs every target through its own mlx-lm forward (`targets.capture`),
so a family needs an entry in `FAMILIES` only where that forward does not give
what DFlash needs as it is: gemma3n, whose layers pass a stack of AltUp streams
([streams, B, L, H]) of which the drafter reads the active one, and afm7, whose
KV-reuse layers take their positions from the number of keys, so rows of
different lengths cannot share a batch (`dflash_mlx.batch`). A family missing
from the table runs with the defaults. Also here: the target's text
model, context length, and what a family's mlx-lm `shard()` splits across ranks
(`shard_problem`, for `dflash_mlx.sharding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn


def _as_is(h: mx.array) -> mx.array:
    return h


def _active_stream(h: mx.array) -> mx.array:
    return h[0]  # gemma3n's altup_active_idx (0 in every published config)


@dataclass(frozen=True)
class Family:
    """What differs: how layer outputs become the [B, L, H] hidden states the drafter reads; whether rows of
    different lengths can share a batch."""

    capture: Callable[[mx.array], mx.array] = _as_is
    batches: bool = True


DEFAULT_FAMILY = Family()
FAMILIES: dict[str, Family] = {"gemma3n": Family(capture=_active_stream), "afm7": Family(batches=False)}


def model_family(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", "unknown")


def family_of(model: nn.Module) -> Family:
    return FAMILIES.get(model_family(model), DEFAULT_FAMILY)


def text_model(model: nn.Module) -> nn.Module:
    """The module holding `.model` (embedding, layers, norm) and the output head."""
    return getattr(model, "language_model", model)


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm the text model's forward ends with (mlx-lm's `model.norm`), or None."""
    norm = getattr(getattr(text_model(model), "model", None), "norm", None)
    return norm if isinstance(norm, nn.Module) else None


def context_length(model) -> int | None:
    """The target's context in tokens, or None if its config gives none.

    Its config's max_position_embeddings, or what a RoPE scaling extends it to
    (factor x original_max_position_embeddings, as YaRN configs give).
    """
    args = getattr(text_model(model), "args", None)
    lengths = [getattr(args, "max_position_embeddings", None)]
    scaling = getattr(args, "rope_scaling", None)
    if isinstance(scaling, dict):
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and isinstance(original, int):
            lengths.append(int(factor * original))
    lengths = [n for n in lengths if isinstance(n, int) and n > 0]
    return max(lengths) if lengths else None


# Config fields a tensor shard splits across ranks: each must be a multiple of the group size
# (mlx-lm's shard() floors head counts, which would silently compute with the wrong shapes).
SHARDED_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
REPEATS_KV_HEADS = {"qwen3_5", "qwen3_5_moe"}  # their shard() repeats KV heads when there are fewer than ranks


def shard_problem(model: nn.Module, ranks: int) -> str | None:
    """Why `model` cannot be tensor-sharded over `ranks` ranks by mlx-lm, or None."""
    family = model_family(model)
    if not callable(getattr(model, "shard", None)):
        return f"mlx-lm cannot tensor-shard the '{family}' family (its model has no shard())."
    args = getattr(text_model(model), "args", None)
    problems = []
    for name in SHARDED_FIELDS:
        value = getattr(args, name, None)
        if not isinstance(value, int) or value <= 0 or value % ranks == 0:
            continue
        if name == "num_key_value_heads" and family in REPEATS_KV_HEADS and ranks % value == 0:
            continue
        problems.append(f"{name} = {value}")
    if family in REPEATS_KV_HEADS and not getattr(args, "tie_word_embeddings", True):
        vocab = getattr(args, "vocab_size", 0)
        if vocab % ranks:
            problems.append(f"vocab_size = {vocab}")
    if problems:
        return f"{', '.join(problems)} not divisible by the {ranks} ranks of the group."
    return None
