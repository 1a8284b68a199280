"""Per-family target knowledge: running an mlx-lm model with hidden-state capture.

`TargetAdapter` runs the target's own layer modules one by one (nothing in
mlx-lm is patched), returning the logits plus the outputs of the decoder layers
the drafter reads, concatenated along the hidden axis. It also lends the drafter
the target's embedding and output head, and rolls the cache back after a verify.
Everything that differs between model families lives in `FAMILIES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache


class UnsupportedTargetError(ValueError):
    """The target's model family (or its cache layout) is not supported yet."""


def _dense_masks(inner: nn.Module, h: mx.array, cache: list) -> list:
    """One causal mask shared by every layer (mlx-lm's llama/qwen/mistral stacks)."""
    return [create_attention_mask(h, cache[0])] * len(inner.layers)


def _dense_check(inner: nn.Module) -> str | None:
    if getattr(inner, "swa_idx", None) is not None:
        return "sliding-window attention layers are not supported yet"
    return None


@dataclass(frozen=True)
class Family:
    """How to run one mlx-lm model family layer by layer."""

    masks: Callable[[nn.Module, mx.array, list], list]
    check: Callable[[nn.Module], str | None] = lambda inner: None


FAMILIES: dict[str, Family] = {
    "llama": Family(_dense_masks, _dense_check),
    "mistral": Family(_dense_masks, _dense_check),
    "qwen2": Family(_dense_masks),
    "qwen3": Family(_dense_masks),
    "qwen3_moe": Family(_dense_masks),
}


def model_family(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(model, "model_type", None) or getattr(args, "model_type", "unknown")


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
        self.inner = model.model
        problem = self.family.check(self.inner)
        if problem:
            raise UnsupportedTargetError(f"Target model ({family}): {problem}.")
        self.layers = self.inner.layers
        bad = [i for i in layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(
                f"Target layer ids {bad} are out of range for a target with "
                f"{len(self.layers)} layers."
            )
        self.layer_ids = tuple(layer_ids)
        self._capture_slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(self.layer_ids):
            self._capture_slots.setdefault(layer, []).append(slot)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.model.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def make_cache(self) -> list[Any]:
        cache = make_prompt_cache(self.model)
        unsupported = {type(c).__name__ for c in cache if type(c) is not KVCache}
        if unsupported:
            raise UnsupportedTargetError(
                f"Target model ({self.family_name}) uses cache types {sorted(unsupported)}, "
                "which cannot be rolled back yet (only KVCache is supported)."
            )
        return cache

    def embed(self, ids: mx.array) -> mx.array:
        return self.inner.embed_tokens(ids)

    def head(self, hidden: mx.array) -> mx.array:
        if hasattr(self.model, "lm_head"):
            return self.model.lm_head(hidden)
        return self.inner.embed_tokens.as_linear(hidden)

    def forward(self, ids: mx.array, cache: list) -> tuple[mx.array, mx.array | None]:
        """Run ids [1, L]; return (logits [1, L, V], captured features [1, L, n*H] or None).

        Both are lazy: a caller that only needs the cache and the features never
        pays for the output head.
        """
        h = self.inner.embed_tokens(ids)
        masks = self.family.masks(self.inner, h, cache)
        captured: list[mx.array | None] = [None] * len(self.layer_ids)
        for i, (layer, mask, c) in enumerate(zip(self.layers, masks, cache)):
            h = layer(h, mask, c)
            for slot in self._capture_slots.get(i, ()):
                captured[slot] = h
        features = mx.concatenate(captured, axis=-1) if captured else None
        return self.head(self.inner.norm(h)), features

    @staticmethod
    def rollback(cache: list, n: int) -> None:
        """Drop the last `n` positions from every layer's cache."""
        if n > 0:
            for c in cache:
                c.trim(n)
