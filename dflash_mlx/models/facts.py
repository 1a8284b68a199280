"""What a loaded model is made of: its arrays and its quantized layers, read in one walk.

Every adaptive generation reads these (the block cap, the calibration key),
so they are read by walking the module tree once, directly: mlx's
`parameters()` and `named_modules()` build dictionaries of the whole tree and
cost several times as much, and whether a dtype is floating is asked once per
dtype, not per array (that was half of the walk's time), as a short reply on
a small model notices: 42 against 77 microseconds on the bundled 6-layer target.
Right after a generation (caches cold) a walk of the synthetic pair's 4-layer
target takes ~65 microseconds, so a generation's setup, which asks for the
block cap and then for the calibration key, reads each model once
(`facts_read_once`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class ModelFacts:
    parameters: int  # elements in all arrays
    float_dtypes: tuple[str, ...]  # sorted
    bits: int | None  # the smallest bit width among quantized layers, None if there are none


_read_once: ContextVar[dict | None] = ContextVar("dflash_mlx_facts_read_once", default=None)


@contextmanager
def facts_read_once():
    """Within the block each model's facts are read once (a generation's setup: the models do not
    change in between, and they outlive the block, so no id is reused)."""
    token = _read_once.set({})
    try:
        yield
    finally:
        _read_once.reset(token)


def read_facts(model: nn.Module) -> ModelFacts:
    """Count the arrays and find the quantized layers of `model` (an mlx Module)."""
    memo = _read_once.get()
    if memo is None:
        return _walk(model)
    facts = memo.get(id(model))
    if facts is None:
        facts = memo[id(model)] = _walk(model)
    return facts


def _walk(model: nn.Module) -> ModelFacts:
    size, dtypes, bits = 0, set(), []
    stack: list = [model]
    pop, extend = stack.pop, stack.extend
    while stack:
        node = pop()
        if isinstance(node, mx.array):
            size += node.size
            dtypes.add(node.dtype)  # (which are floating is asked once per dtype, below)
        elif isinstance(node, dict):
            # mlx's quantized layers, and mlx-lm's (e.g. QuantizedSwitchLinear for MoE experts): plain
            # attributes bits and group_size (read from __dict__: a Module's failing getattr is slow)
            own = getattr(node, "__dict__", None)
            if own and "bits" in own and "group_size" in own:
                bits.append(own["bits"])
            extend(node.values())
        elif isinstance(node, (list, tuple)):
            extend(node)
    floats = tuple(sorted(str(d) for d in dtypes if mx.issubdtype(d, mx.floating)))
    return ModelFacts(size, floats, min(bits) if bits else None)
