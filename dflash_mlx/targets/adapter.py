"""Running an mlx-lm target with hidden-state capture and exact rollback.

`TargetAdapter` runs the target's own layer modules one by one (nothing in
mlx-lm is patched), returning the logits plus the outputs of the decoder layers
the drafter reads, concatenated along the hidden axis. `verify` also returns a
`VerifyRecord` (Gated DeltaNet layers go through `gated_delta` so a verify can
be undone), which `rollback.rollback(cache, record, keep)` consumes to keep the
accepted prefix in every cache. It also lends the drafter the target's
embedding and output head. Family differences live in `families`.

Tensor-sharded targets (mlx-lm's `shard()`, see `dflash_mlx.sharding`) run
as they are: their layers exchange partial sums themselves, so the captured
hidden states are the full residual stream on every rank; the adapter adds
what mlx-lm does outside the layers (gathering a vocabulary-sharded head)
and `group` names the ranks, None when the target is not sharded.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear
from mlx_lm.models.base import gather_last_axis
from mlx_lm.models.cache import make_prompt_cache

from .families import FAMILIES, model_family, text_model
from .gated_delta import gated_delta_forward
from .rollback import VerifyRecord, check_caches


class UnsupportedTargetError(ValueError):
    """The target's model family (or its cache layout) is not supported."""


class TargetAdapter:
    """A target model seen through the interface the engine and drafter need."""

    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = ()):
        family = model_family(model)
        if family not in FAMILIES:
            raise UnsupportedTargetError(
                f"Target model family '{family}' is not supported; supported families: "
                f"{', '.join(sorted(FAMILIES))}."
            )
        self.model = model
        self.family = FAMILIES[family]
        self.family_name = family
        self.text = text_model(model)
        self.inner = self.text.model
        self.layers = self.inner.layers
        if len(getattr(self.inner, "pipeline_layers", self.layers)) != len(self.layers):
            raise UnsupportedTargetError("Pipeline-parallel targets are not supported.")
        self.linear_layers = self.family.linear_layers(self.inner)
        bad = [i for i in layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(
                f"Target layer ids {bad} are out of range for a target with "
                f"{len(self.layers)} layers."
            )
        self.layer_ids = tuple(layer_ids)
        self.group = tensor_group(self.text)
        self._capture_slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(self.layer_ids):
            self._capture_slots.setdefault(layer, []).append(slot)

    @property
    def vocab_size(self) -> int:
        return self.text.args.vocab_size

    def make_cache(self) -> list:
        cache = make_prompt_cache(self.model)
        check_caches(cache, self.family_name, self.linear_layers)
        return cache

    def embed(self, ids: mx.array) -> mx.array:
        """The drafter's input embedding: the table times the target's `embed_scale`
        attribute where mlx-lm defines one (as the upstream MLX reference does)."""
        table = self.inner.embed_tokens
        scale = getattr(table, "embed_scale", getattr(self.inner, "embed_scale", 1.0))
        h = table(ids)
        return h if scale == 1.0 else h * scale

    def head(self, hidden: mx.array) -> mx.array:
        """The raw output head (tied embedding or lm_head), as the drafter uses it."""
        if hasattr(self.text, "lm_head"):
            logits = self.text.lm_head(hidden)
            group = getattr(self.text, "sharding_group", None)  # a vocabulary-sharded head (mlx-lm's qwen3_5)
            return logits if group is None else gather_last_axis(logits, group)
        return self.inner.embed_tokens.as_linear(hidden)

    def forward(self, ids: mx.array, cache: list, logits: bool = True) -> tuple[mx.array | None, mx.array | None]:
        """Run ids [1, L]; return (logits [1, L, V], captured features [1, L, n*H] or None).

        Both are lazy. `logits=False` (a prefill chunk: only the caches and the
        features are needed) returns None for the logits without building the
        head: an unevaluated head is a graph kept alive, then torn down.
        """
        logits, features, _ = self._forward(ids, cache, None, logits)
        return logits, features

    def verify(
        self, ids: mx.array, cache: list, logits: bool = True
    ) -> tuple[mx.array | None, mx.array | None, VerifyRecord]:
        """`forward` (`logits` as there), plus the record `rollback(cache, record, keep)` needs to keep a prefix."""
        return self._forward(ids, cache, VerifyRecord(rows=ids.shape[1]), logits)

    def _forward(self, ids: mx.array, cache: list, record: VerifyRecord | None, head: bool = True):
        captured: list[mx.array | None] = [None] * len(self.layer_ids)

        def on_layer(i: int, h: mx.array) -> None:
            for slot in self._capture_slots.get(i, ()):
                captured[slot] = h

        if self.family.run is not None:
            h = self.family.run(self.inner, ids, cache, on_layer)
        else:
            h = self._run_layers(ids, cache, on_layer, record)
        features = mx.concatenate(captured, axis=-1) if captured else None
        logits = self.family.final_logits(self.text, self.head(self.inner.norm(h))) if head else None
        return logits, features, record

    def _run_layers(self, ids: mx.array, cache: list, on_layer, record: VerifyRecord | None) -> mx.array:
        """The generic stack: embed, per-layer masks, attention or Gated DeltaNet layers."""
        h = self.family.embed(self.inner, ids)
        masks = self.family.masks(self.inner, h, cache)
        for i, (layer, mask, c) in enumerate(zip(self.layers, masks, cache)):
            if i in self.linear_layers:
                records = [] if record is not None else None
                r = gated_delta_forward(layer.linear_attn, layer.input_layernorm(h), mask, c, records)
                if records:
                    record.gdn[i] = records[0]
                h = h + r
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h, mask, c)
            on_layer(i, h)
        return h


def tensor_group(text: nn.Module):
    """The group a tensor-sharded target (mlx-lm's `shard()`) is split over, or None.

    Every family's `shard()` splits the first layer: its sharded linears carry
    the group, and the modules mlx-lm shards in place carry `sharding_group`.
    """
    group = vars(text).get("sharding_group")  # an attribute mlx-lm's shard() sets, not a child
    if group is not None:
        return group
    layers = text.model.layers
    stack = [layers[0]] if len(layers) else []
    pop, push = stack.pop, stack.append
    while stack:  # the layer's modules, walked directly (cheaper than `Module.modules()`)
        module = pop()
        if isinstance(module, _SHARDED):
            return module.group
        group = vars(module).get("sharding_group")
        if group is not None:
            return group
        for value in module.values():
            if isinstance(value, nn.Module):
                push(value)
            elif isinstance(value, (list, tuple)):
                stack.extend(v for v in value if isinstance(v, nn.Module))
    return None


_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)
