"""Checking that a drafter fits its target before any decoding starts.

A drafter reads fixed layers of one specific target and shares its embedding
and head, so a mismatched pair would fail late or, worse, silently draft
garbage. `check_pair` raises one `PairMismatchError` naming both models, the
field and both values.
"""

from __future__ import annotations

import mlx.nn as nn

from ..targets.adapter import embedding_shape, token_embedding
from ..targets.families import text_model


class PairMismatchError(ValueError):
    """The drafter was made for a different target."""


def _target_facts(target_model: nn.Module) -> dict[str, int]:
    args = getattr(text_model(target_model), "args", None)
    layers = getattr(target_model, "layers", None)
    embedding = token_embedding(target_model)
    vocab, hidden = embedding_shape(embedding) if embedding is not None else (None, None)
    return {
        "hidden_size": hidden or getattr(args, "hidden_size", None),
        "num_layers": len(layers) if layers is not None else getattr(args, "num_hidden_layers", None),
        "vocab_size": getattr(args, "vocab_size", None) or vocab,
    }


def check_pair(draft, target_model: nn.Module, draft_name: str, target_name: str | None = None) -> None:
    config = draft.config
    facts = _target_facts(target_model)
    target_name = target_name or f"the target ({getattr(target_model, 'model_type', 'model')})"
    where = f"Draft '{draft_name}' does not fit target '{target_name}'"

    def fail(field: str, draft_value, target_value, expectation: str) -> None:
        raise PairMismatchError(
            f"{where}: {field} is {draft_value} in the draft but the target has {target_value} ({expectation})."
        )

    if facts["hidden_size"] is not None and config.hidden_size != facts["hidden_size"]:
        fail("hidden_size", config.hidden_size, facts["hidden_size"], "they must be equal")
    n_layers = facts["num_layers"]
    if n_layers is not None:
        beyond = [i for i in config.target_layer_ids if i >= n_layers]
        if beyond:
            fail(
                "dflash_config.target_layer_ids",
                list(config.target_layer_ids),
                f"{n_layers} layers",
                f"ids {beyond} are beyond its last layer {n_layers - 1}",
            )
        if config.num_target_layers is not None and config.num_target_layers != n_layers:
            fail("num_target_layers", config.num_target_layers, n_layers, "they must be equal")
    vocab = facts["vocab_size"]
    if vocab is not None:
        if config.mask_token_id >= vocab:
            fail(
                "dflash_config.mask_token_id",
                config.mask_token_id,
                f"a vocabulary of {vocab}",
                "the mask token must be a target token",
            )
        if config.vocab_size != vocab:
            fail("vocab_size", config.vocab_size, vocab, "they must be equal")
