"""A view of the target whose own forward hands over the hidden states the drafter reads.

`layer_view(model, replacements)` is a shallow copy of the model along the
path to its layer list(s) (the modules `model.layers` comes from), in which
some layers are replaced: by a `Tap`, which calls the real layer and hands
its output to a callback, or by a shallow copy of the layer whose Gated
DeltaNet module records what a rollback needs (`gated_delta.Recording`).
`modules` replaces child modules the same way (the final norm, tapped for a
proposer that reads the final hidden state). Calling the view runs the target's own mlx-lm forward (its embedding,
masks, caches, norms and logit transforms) on the same weights; the user's
model, its modules and lists are never changed, nothing in mlx-lm is
assigned to, and every adapter has its own view. A `Tap` delegates attribute
reads to its layer, so mask builders reading `layer.use_sliding` or
`layer.is_linear` see the real values.
"""

from __future__ import annotations

import copy
from typing import Callable

import mlx.nn as nn


class Tap:
    """Calls `layer` and hands `(index, output)` to `seen`; reads anything else from the layer."""

    __slots__ = ("layer", "index", "seen")

    def __init__(self, layer, index: int, seen: Callable):
        self.layer, self.index, self.seen = layer, index, seen

    def __call__(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        self.seen(self.index, out)
        return out

    def __getattr__(self, name: str):
        return getattr(self.layer, name)


class LayerListError(ValueError):
    """The target's layers could not be found where its forward reads them."""


def layer_view(
    model: nn.Module, replacements: dict[int, object], modules: dict[int, object] | None = None
) -> nn.Module:
    """A shallow copy of `model` whose forward calls `replacements[i]` instead of `model.layers[i]`, and
    `modules[id(m)]` instead of its child module m."""
    layers = list(model.layers)
    wanted = {id(layers[i]): replacement for i, replacement in replacements.items()}
    children = dict(modules or {})
    found: set[int] = set()
    view = _rebuilt(model, wanted, children, found, set())
    if not set(wanted) <= found:
        missing = sorted(i for i in replacements if id(layers[i]) not in found)
        raise LayerListError(f"layers {missing} of model.layers are not held in a list of its modules")
    if not set(children) <= found:
        raise LayerListError("a module to tap is not a child of the model's modules")
    return view


def _rebuilt(module: nn.Module, wanted: dict, children: dict, found: set, seen: set) -> nn.Module | None:
    """A copy of `module` with the wanted layers (in lists) and children replaced below it, or None if none
    is below it."""
    if id(module) in seen:
        return None
    seen.add(id(module))
    changed = {}
    for key, value in module.items():
        if isinstance(value, list) and any(id(v) in wanted for v in value):
            found.update(id(v) for v in value if id(v) in wanted)
            changed[key] = [wanted.get(id(v), v) for v in value]
        elif id(value) in children:
            found.add(id(value))
            changed[key] = children[id(value)]
        elif isinstance(value, nn.Module):
            sub = _rebuilt(value, wanted, children, found, seen)
            if sub is not None:
                changed[key] = sub
    if not changed:
        return None
    clone = copy.copy(module)
    for key, value in changed.items():
        clone[key] = value
    return clone


def with_child(layer: nn.Module, name: str, child) -> nn.Module:
    """A shallow copy of `layer` whose child `name` is `child`."""
    clone = copy.copy(layer)
    clone[name] = child
    return clone
