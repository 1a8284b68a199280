"""What a loaded model is made of: its arrays and its quantized layers, read in one walk.

Every adaptive generation reads these (the block cap, the calibration key),
so they are read by walking the module tree once, directly: mlx's
`parameters()` and `named_modules()` build dictionaries of the whole tree and
cost several times as much, and whether a dtype is floating is asked once per
dtype, not per array (that was half of the walk's time), as a short reply on
a small model notices: 42 against 77 microseconds on the bundled 6-layer target.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class ModelFacts:
    parameters: int  # elements in all arrays
    float_dtypes: tuple[str, ...]  # sorted
    bits: int | None  # the smallest bit width among quantized layers, None if there are none


def read_facts(model: nn.Module) -> ModelFacts:
    """Count the arrays and find the quantized layers of `model` (an mlx Module)."""
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
