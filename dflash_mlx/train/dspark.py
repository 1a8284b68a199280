"""`dflash-mlx train --arch dspark`: DSpark drafters trained in MLX, written in DeepSpec's own layout.

A new drafter is DFlash's backbone (qwen3 layers reading the target's hidden
states) plus DSpark's heads: its own embedding and head, copied from the
target's and frozen, a Markov head (rank `--markov-rank`, its output starting
at zero, so training starts from the backbone's head) and a confidence head.
`--init` starts from a published DSpark drafter in DeepSpec's layout instead.

The objective follows the paper: block row k (k = 0..b-2 of a project block
of b; the anchor's own slot predicts, as DeepSpec's heads do) predicts the
token k + 1 places after the anchor, its logits the head's plus the Markov
bias of the token before it (teacher forcing: the true previous token), under
the DFlash row weights (`loss.row_weights`); the confidence head learns, by
binary cross-entropy on its logit, whether each row's draft would be accepted
given that the drafts before it were (the argmax hits of this step's logits,
not differentiated), from the row's hidden state and the previous token's
Markov embedding (neither receives its gradient). A step keeps at most one
logits chunk (`--loss-chunk-rows`) of rows at once by processing fewer
anchors per group.

The output (config.json with DeepSpec's top-level fields + model.safetensors
with DeepSpec's tensor names) is what `dflash_mlx.load_draft` and the
reference (mlx-dspark) load as a DeepSpec drafter.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn

from ..draft.dspark import DSparkDraftModel
from ..draft.dspark_config import DSparkConfigError, parse_dspark_config
from ..draft.load import DraftWeightsError, load_draft
from ..targets.adapter import TargetAdapter
from .init_drafter import InitDrafterError, init_raw_config
from .loss import accepted_prefix, block_loss
from .model_forward import UnsupportedDrafterError, check_trainable, training_hidden
from .new_drafter import drafter_config
from .step import StepRunner

ARCHITECTURE = "DSparkDraftModel"
DEFAULT_MARKOV_RANK = 256  # DeepSpec's
CONFIDENCE_WEIGHT = 1.0  # the confidence head's binary cross-entropy, next to the drafts' cross-entropy
SHARED = ("embed_tokens", "lm_head")  # copies of the target's: frozen


def dspark_drafter_config(model, *, block_size: int, markov_rank: int | None, **dflash) -> dict[str, Any]:
    """The config.json of a new DSpark drafter (DeepSpec's layout) for `model`: the DFlash drafter's backbone
    settings (`new_drafter.drafter_config`, same options), the project block `block_size` (anchor included:
    the checkpoint's block is one slot less, its anchor slot predicting) and the Markov rank."""
    base = drafter_config(model, block_size=block_size, **dflash)
    nested = base.pop("dflash_config")
    base.pop("tie_word_embeddings", None)
    config = {
        **base,
        "architectures": [ARCHITECTURE],
        "block_size": block_size - 1,
        "mask_token_id": nested["mask_token_id"],
        "target_layer_ids": nested["target_layer_ids"],
        "markov_rank": DEFAULT_MARKOV_RANK if markov_rank is None else int(markov_rank),
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }
    parse_dspark_config(config, source="the new drafter's config")  # validates
    return config


def new_dspark_drafter(config: dict[str, Any], model) -> DSparkDraftModel:
    """A DSpark drafter for `config`: MLX's initialisers (seed mx.random first), the embedding and head copied
    from the target's (frozen), the Markov head's output at zero."""
    drafter = DSparkDraftModel(parse_dspark_config(config, source="the new drafter's config"))
    target = TargetAdapter(model)
    vocab, hidden = drafter.config.vocab_size, drafter.config.hidden_size
    drafter.embed_tokens.weight = target.embed(mx.arange(vocab))
    drafter.lm_head.weight = target.head(mx.eye(hidden))[:, :vocab].T
    if "markov_head" in drafter:
        drafter.markov_head.markov_w2.weight = mx.zeros_like(drafter.markov_head.markov_w2.weight)
    freeze_shared(drafter)
    mx.eval(drafter.parameters())
    return drafter


def freeze_shared(drafter: DSparkDraftModel) -> None:
    """Freeze the embedding and head a drafter holds (copies of its target's; training moves the rest)."""
    for name in SHARED:
        if name in drafter:
            drafter[name].freeze()


def load_init_dspark(init: str, target_model, target_name: str, block_size: int) -> tuple[DSparkDraftModel, dict]:
    """A published DSpark drafter to fine-tune (DeepSpec's layout, float32, checked against the target) and
    the config.json to export (its own, the block changed if `--block-size` asks for another)."""
    _, raw = init_raw_config(init)
    try:
        parsed = parse_dspark_config(raw, source=f"--init {init}")
        drafter = load_draft(init, target_model, dtype=mx.float32, target_name=target_name)
        check_trainable(drafter)
    except (DSparkConfigError, DraftWeightsError, UnsupportedDrafterError) as e:
        raise InitDrafterError(f"--init {init}: {e}") from e
    if parsed.packaging != "deepspec":
        raise InitDrafterError(
            f"--init {init}: a {parsed.packaging}-packaged DSpark drafter; --init --arch dspark takes DeepSpec's "
            "own layout (the drafter's fields at the top level of config.json)."
        )
    drafter.source = init
    config = dict(raw, block_size=int(block_size) - 1)
    parse_dspark_config(config, source="the fine-tuned drafter's config")  # still valid
    freeze_shared(drafter)
    return drafter, config


def dspark_loss(drafter, hooks, features, block_ids, anchors, targets, valid, weights) -> tuple[mx.array, mx.array]:
    """(loss, tau) of packed blocks (see the module docstring). block_ids [B, K * (n + 1)] of project blocks
    [anchor, mask * n]; targets / valid [B, K, n]: the n tokens after each anchor."""
    B, K, n = targets.shape
    slots = block_ids.reshape(B, K, n + 1)[:, :, :n]  # the checkpoint's block: n slots, the anchor's first
    hidden = training_hidden(drafter, hooks, features, slots.reshape(B, K * n), anchors)
    previous = mx.concatenate([slots[:, :, :1], targets[:, :, :-1]], axis=-1)
    logits = drafter.head_logits(hidden, hooks) + drafter.markov_bias(previous)
    loss, blocks = block_loss(logits, targets, valid, weights)
    fixed = mx.stop_gradient(logits)
    hits = (mx.argmax(fixed, axis=-1) == targets) & valid
    if "confidence_head" in drafter:
        loss = loss + CONFIDENCE_WEIGHT * _confidence_loss(drafter, hidden, previous, hits, valid)
    tau = (accepted_prefix(fixed, targets, valid) * valid.any(axis=-1)).sum() / mx.maximum(blocks, 1.0)
    return loss, tau


def _confidence_loss(drafter, hidden, previous, hits, valid) -> mx.array:
    """Binary cross-entropy of the confidence head on rows whose earlier drafts were all accepted."""
    features = mx.stop_gradient(hidden)
    if drafter.confidence_with_markov:
        markov = mx.stop_gradient(drafter.markov_head.markov_w1(previous))
        features = mx.concatenate([features, markov], axis=-1)
    z = drafter.confidence_head(features)
    earlier = mx.cumprod(hits.astype(mx.int32), axis=-1)
    reached = mx.concatenate([mx.ones_like(earlier[..., :1]), earlier[..., :-1]], axis=-1).astype(mx.bool_) & valid
    weight = reached.astype(mx.float32)
    bce = nn.losses.binary_cross_entropy(z, hits.astype(mx.float32), with_logits=True, reduction="none")
    return (bce * weight).sum() / mx.maximum(weight.sum(), 1.0)


class DSparkStepRunner(StepRunner):
    """`StepRunner` with DSpark's objective; its anchors grouped so one group's logits fit one chunk."""

    def _loss(self, features, block_ids, anchors, targets, valid):
        return dspark_loss(self.drafter, self.target, features, block_ids, anchors, targets, valid, self.weights)

    def _group(self, features, block_ids, anchors, targets, valid):
        (loss, tau), grads = self.loss_and_grad(features, block_ids, anchors, targets, valid)
        return loss, tau, grads

    def anchor_group(self, batch: int, anchors: int, context: int) -> int:
        rows = batch * (self.options.block_size - 1)
        return max(1, min(super().anchor_group(batch, anchors, context), self.chunk_rows // max(rows, 1)))
