"""What a loaded model is made of: its arrays and its quantized layers, read once per model.

Every adaptive generation reads these (the block cap, the calibration key).
The first read walks the module tree directly (cheaper than mlx's
`parameters()`) and records every link it followed: container, key, child.
Later reads return the same facts while every link still holds (checked
over weak references; the tree itself is not kept alive), so a model changed
in place (`nn.quantize`, `set_dtype`, LoRA layers) is walked again while an
unchanged one costs a check. `model_facts` is the JSON-able description that
calibration keys and prompt-cache files record.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from itertools import repeat
from operator import call, getitem, is_

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class ModelFacts:
    parameters: int  # elements in all arrays
    float_dtypes: tuple[str, ...]  # sorted
    bits: int | None  # the smallest bit width among quantized layers, None if there are none


@dataclass
class _Links:
    """Every link the walk followed, as flat lists the check maps over."""

    containers: list  # per container (dict or list): a callable returning it (a weak reference where possible)
    lengths: list[int]  # per container: its length then
    parents: list[int]  # per link: the index of its container
    keys: list  # per link: the key (dict) or index (list) in the container
    children: list  # per link: a callable returning the child then (dead weak references return None)


_known: dict[int, tuple[ModelFacts, _Links]] = {}  # id(model) -> its facts and links, while the model lives
_known_lock = threading.Lock()


def read_facts(model: nn.Module) -> ModelFacts:
    """Count the arrays and find the quantized layers of `model` (an mlx Module)."""
    key = id(model)
    known = _known.get(key)
    if known is not None and _unchanged(known[1]):
        return known[0]
    facts, links = _walk(model)
    with _known_lock:
        if key not in _known:
            weakref.finalize(model, _known.pop, key, None)
        _known[key] = (facts, links)
    return facts


def model_config(model):
    """A model's config object (mlx-lm models keep theirs as `args`), or None."""
    return getattr(model, "config", None) or getattr(model, "args", None)


def model_facts(model) -> dict:
    """What identifies a model's computation (type, size, dtypes, quantization, shape), as JSON-able data:
    the calibration key's and the prompt-cache files' description of a model."""
    if not isinstance(model, nn.Module):
        return {"type": type(model).__name__}
    facts = read_facts(model)
    config = model_config(model)
    shape = {
        k: getattr(config, k, None)
        for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "block_size", "intermediate_size")
    }
    return {
        "type": type(model).__name__,
        "parameters": facts.parameters,
        "float_dtypes": list(facts.float_dtypes),
        "bits": facts.bits,
        **shape,
    }


def _getter(node):
    try:
        return weakref.ref(node)
    except TypeError:  # lists, plain dicts, numbers, None: held
        return repeat(node).__next__


def _unchanged(links: _Links) -> bool:
    containers = list(map(call, links.containers))
    if any(map(is_, containers, repeat(None))) or list(map(len, containers)) != links.lengths:
        return False
    try:
        now = list(map(getitem, map(containers.__getitem__, links.parents), links.keys))
    except (KeyError, IndexError):
        return False
    return all(map(is_, now, map(call, links.children)))


def _walk(model: nn.Module) -> tuple[ModelFacts, _Links]:
    size, dtypes, bits = 0, set(), []
    links = _Links([], [], [], [], [])
    stack: list = [model]
    pop, push = stack.pop, stack.append
    while stack:
        node = pop()
        if isinstance(node, mx.array):
            size += node.size
            dtypes.add(node.dtype)  # (which are floating is asked once per dtype, below)
            continue
        if isinstance(node, dict):
            # mlx's quantized layers, and mlx-lm's (e.g. QuantizedSwitchLinear for MoE experts): plain
            # attributes bits and group_size (read from __dict__: a Module's failing getattr is slow)
            own = getattr(node, "__dict__", None)
            if own and "bits" in own and "group_size" in own:
                bits.append(own["bits"])
            entries = node.items()
        elif isinstance(node, (list, tuple)):
            entries = enumerate(node)
        else:
            continue
        index = len(links.containers)
        links.containers.append(_getter(node))
        links.lengths.append(len(node))
        for k, child in entries:
            links.parents.append(index)
            links.keys.append(k)
            links.children.append(_getter(child))
            push(child)
    floats = tuple(sorted(str(d) for d in dtypes if mx.issubdtype(d, mx.floating)))
    return ModelFacts(size, floats, min(bits) if bits else None), links
