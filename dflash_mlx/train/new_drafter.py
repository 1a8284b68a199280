"""A fresh drafter for a target: its config.json (real checkpoint format) and the model.

The drafter's width must be the target's hidden size (it reads the target's
hidden states and uses its embedding and head); heads, head dim, MLP width,
norm eps, vocabulary and RoPE theta default to the target's. `target_layer_ids`
default to upstream's derivation for the number of draft layers
(`derive_target_layer_ids`). The mask token comes from the tokenizer's mask
token, or an explicit id when it has none.
"""

from __future__ import annotations

import numbers
from typing import Any

from mlx import nn

from ..draft.config import V1_ARCHITECTURE, derive_target_layer_ids, parse_draft_config
from ..draft.model import DFlashDraftModel
from ..targets.families import text_model


class DrafterSetupError(ValueError):
    """The drafter cannot be built for this target with these options."""


def target_facts(model: nn.Module) -> dict[str, Any]:
    """What a drafter copies from the target's (text) model arguments."""
    text = text_model(model)
    args = text.args
    hidden = args.hidden_size
    heads = args.num_attention_heads
    theta = getattr(args, "rope_theta", None)
    rope = getattr(args, "rope_parameters", None)
    if not isinstance(theta, numbers.Real) and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    return {
        "hidden_size": hidden,
        "num_target_layers": len(model.layers),
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(args, "num_key_value_heads", None) or heads,
        "head_dim": getattr(args, "head_dim", None) or hidden // heads,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": float(getattr(args, "rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(getattr(args, "max_position_embeddings", None) or 32768),
        "rope_theta": float(theta) if isinstance(theta, numbers.Real) else 10000.0,
        "tie_word_embeddings": bool(getattr(args, "tie_word_embeddings", False)),
    }


def resolve_mask_token_id(tokenizer, explicit: int | None, vocab_size: int, target_name: str) -> int:
    """The explicit id, else the tokenizer's mask token; an error if neither exists."""
    mask_id = explicit if explicit is not None else getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise DrafterSetupError(
            f"The tokenizer of target '{target_name}' has no mask token (mask_token): pass "
            "--mask-token-id with the id of a token the target never needs to generate "
            "(e.g. a reserved special token)."
        )
    if not 0 <= int(mask_id) < vocab_size:
        raise DrafterSetupError(
            f"--mask-token-id {mask_id} is outside the vocabulary of target '{target_name}' (vocab_size {vocab_size})."
        )
    return int(mask_id)


def drafter_config(
    model: nn.Module,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    intermediate_size: int | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The config.json dict of a v1 drafter for `model` (spec section 2)."""
    facts = target_facts(model)
    n_target = facts.pop("num_target_layers")
    if num_layers < 1:
        raise DrafterSetupError(f"--draft-layers must be >= 1, got {num_layers}.")
    if target_layer_ids is None:
        target_layer_ids = list(derive_target_layer_ids(num_layers, n_target))
    bad = [i for i in target_layer_ids if not 0 <= i < n_target]
    if bad or not target_layer_ids:
        raise DrafterSetupError(
            f"--target-layers {target_layer_ids}: ids must be in 0..{n_target - 1} (the target has {n_target} layers)."
        )
    config = {
        "architectures": [V1_ARCHITECTURE],
        "model_type": "qwen3",
        **facts,
        "num_hidden_layers": num_layers,
        "num_target_layers": n_target,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "dflash_config": {
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": [int(i) for i in target_layer_ids],
            "block_size": int(block_size),
        },
    }
    if intermediate_size is not None:
        config["intermediate_size"] = int(intermediate_size)
    parse_draft_config(config, source="the new drafter's config")  # validates
    return config


def new_drafter(config: dict[str, Any]) -> DFlashDraftModel:
    """A randomly initialised drafter (MLX's default initialisers; seed mx.random first)."""
    return DFlashDraftModel(parse_draft_config(config, source="the new drafter's config"))
